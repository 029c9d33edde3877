"""The ``text_render`` SFT data source: ground-truth images of the words a text-rendering prompt
set asks for, rendered with OpenCV (:func:`~mmrl.tasks.text_render.world.render_word`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmrl.config import option
from mmrl.data.sources import DataSource, DataSourceConfig, policy_resolution
from mmrl.errors import ConfigError
from mmrl.registry import DATA_SOURCES
from mmrl.tasks.text_render.world import COLOURS, parse_prompt, render_word


@dataclass
class TextRenderConfig(DataSourceConfig):
    type: str = option("text_render", "data source (mmrl list data)")
    path: str | None = option(None, "a text-rendering prompt set (.jsonl written by `python -m mmrl.tasks.text_render.world`): each record's metadata text and colour, else its parsed prompt")
    images_per_prompt: int = option(32, "seeded renderings of each record, drawn once when the run starts (fonts, scales, positions, ink and background colours vary)", ge=1)
    resolution: int | None = option(None, "side of the rendered images in pixels (null = the policy's resolution)", ge=8)
    render_seed: int = option(0, "seed of the renderings (not the run seed: every run trains on the same images)", ge=0)


@DATA_SOURCES.register("text_render", config=TextRenderConfig)
class TextRender(DataSource):
    """Ground-truth renderings of a text-rendering prompt set: supervised pretraining of an image
    generator that the ``ocr`` reward then scores. A batch is ``{"images": uint8 [B, H, W, 3],
    "prompt": [...]}``, what image generators' ``sft_loss`` takes."""

    def __init__(self, cfg: TextRenderConfig, policy, seed: int, world: int, rank: int):
        from mmrl.data.prompts import PromptDataConfig, read_records

        super().__init__(cfg, seed, world, rank)
        records = read_records(PromptDataConfig(train=cfg.path, prompt_kind="text", image_field=None), "train", "data")
        if not records:
            raise ConfigError("data.path", cfg.path, "holds no records")
        size = cfg.resolution
        policy_size = policy_resolution(policy, "data.resolution", cfg.resolution)
        if size is None:
            if policy_size is None:
                raise ConfigError("data.resolution", None, f"policy {type(policy).__name__} has no resolution; set one")
            if policy_size[0] != policy_size[1]:
                raise ConfigError("data.resolution", None, f"the text renderer draws square images; the policy generates {policy_size}")
            size = policy_size[0]
        elif policy_size is not None and policy_size != (size, size):
            raise ConfigError("data.resolution", size, f"the policy generates {policy_size[0]}x{policy_size[1]} images")
        n = cfg.images_per_prompt
        images = np.empty((len(records) * n, size, size, 3), dtype=np.uint8)
        prompts: list[str] = []
        for i, r in enumerate(records):
            meta = r.metadata or {}
            try:
                word, colour = (str(meta["text"]), str(meta["colour"])) if "text" in meta and "colour" in meta else parse_prompt(str(r.prompt))
            except ValueError as e:
                raise ConfigError("data.path", cfg.path, f"record {r.record_id}: {e}") from None
            if colour not in COLOURS:
                raise ConfigError("data.path", cfg.path, f"record {r.record_id}: colour {colour!r} is not one of {list(COLOURS)}")
            for k in range(n):
                # one seed per (render_seed, record, copy), within numpy's 32-bit seeds
                images[i * n + k] = render_word(word, colour, size, seed=(cfg.render_seed * 1_000_003 + i * n + k) % 2**32)
            prompts.extend([str(r.prompt)] * n)
        self.samples = {"images": torch.from_numpy(images), "prompt": prompts}
        self.info = {"prompts": len(records), "samples": self.num_samples}
