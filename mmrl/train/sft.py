"""Data sources for supervised fine-tuning (``algo.type: sft``), chosen by ``data.type``.

A data source yields batches; the policy scores them with ``policy.sft_loss(batch)``. The
trainer knows nothing else about them. Every source draws its step's batch with replacement,
seeded by (run seed, step), over all processes at once, and each process takes its slice of
it: one process and N train on the same samples.

- ``demonstrations``: episodes recorded by ``mmrl collect``; every time step is one sample
  (observation, the next C actions, their mask), C = the policy's action chunk.
- ``completions``: (prompt, completion) text pairs from a JSONL or CSV file or a saved
  ``datasets`` directory; a batch is ``{"prompt": [...], "completion": [...]}``. A record with
  images (``image_field``) gives an :class:`~mmrl.data.prompts.ImagePrompt` as its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from mmrl.config import Component, option
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError
from mmrl.registry import DATA_SOURCES

_SFT_STREAM = 1 << 40  # group index reserved for the draws of a step's SFT batch


@dataclass
class DataSourceConfig(Component):
    """``data``: where ``algo.type: sft`` takes its batches (``mmrl list data``)."""

    type: str = option("demonstrations", "data source (mmrl list data)")
    path: str | None = option(None, "where the data lives (a directory or file; see the source's type)")
    batch_size: int = option(64, "samples per optimizer step (over all processes)", ge=1)


class DataSource:
    """Samples held as a dict of equally long tensors / lists; ``batch`` draws from them."""

    samples: dict[str, Any]

    def __init__(self, cfg: DataSourceConfig, seed: int, world: int, rank: int):
        if cfg.path is None:
            raise ConfigError("data.path", None, f"algo.type sft needs data: the {cfg.type} source reads data.path")
        if cfg.batch_size % world:
            raise ConfigError("data.batch_size", cfg.batch_size, f"must be divisible by the number of processes ({world})")
        self.config, self.seed, self.world, self.rank = cfg, seed, world, rank

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.samples.values())))

    def batch(self, step: int, device) -> dict[str, Any]:
        """This process's share of step ``step``'s batch of ``data.batch_size`` samples."""
        gen = torch.Generator().manual_seed(group_seed(self.seed, step, _SFT_STREAM))
        idx = torch.randint(self.num_samples, (self.config.batch_size,), generator=gen).chunk(self.world)[self.rank]
        return {k: ([v[i] for i in idx.tolist()] if isinstance(v, list) else v[idx].to(device)) for k, v in self.samples.items()}


@dataclass
class DemonstrationsConfig(DataSourceConfig):
    path: str | None = option(None, "directory of demonstrations written by `mmrl collect`")
    max_episodes_per_task: int | None = option(None, "use only the first N demonstrations of each task (few-shot SFT)", ge=1)


@DATA_SOURCES.register("demonstrations", config=DemonstrationsConfig)
class Demonstrations(DataSource):
    """Recorded episodes: one sample per time step (observation, next C actions, mask)."""

    def __init__(self, cfg: DemonstrationsConfig, policy, seed: int, world: int, rank: int):
        from mmrl.demos import chunk_samples, read_demos

        super().__init__(cfg, seed, world, rank)
        episodes = read_demos(cfg.path)
        if cfg.max_episodes_per_task is not None:
            per_task: dict[str, int] = {}
            kept = []
            for ep in episodes:
                per_task[ep.task] = per_task.get(ep.task, 0) + 1
                if per_task[ep.task] <= cfg.max_episodes_per_task:
                    kept.append(ep)
            episodes = kept
        if not episodes:
            raise ConfigError("data.path", cfg.path, "holds no demonstrations")
        chunk = int(getattr(policy.config, "action_chunk", 1) or 1)
        samples = chunk_samples(episodes, chunk)
        self.samples = {k: (v if isinstance(v, list) else torch.as_tensor(np.asarray(v))) for k, v in samples.items()}
        self.info = {"episodes": len(episodes), "samples": self.num_samples}


@dataclass
class CompletionsConfig(DataSourceConfig):
    type: str = option("completions", "data source (mmrl list data)")
    path: str | None = option(None, "a .jsonl or .csv file, or a directory saved by datasets' save_to_disk")
    prompt_field: str = option("prompt", "field holding each record's prompt")
    completion_field: str = option("completion", "field holding the completion to learn")
    image_field: str | None = option("image", "field holding the path of the prompt's image or a list of paths, relative to the file's folder (null = no images)")


@DATA_SOURCES.register("completions", config=CompletionsConfig)
class Completions(DataSource):
    """(prompt, completion) text pairs: supervised fine-tuning of a text policy."""

    def __init__(self, cfg: CompletionsConfig, policy, seed: int, world: int, rank: int):
        from mmrl.data.prompts import PromptDataConfig, prompt_input, read_records

        super().__init__(cfg, seed, world, rank)
        source = PromptDataConfig(train=cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.completion_field, image_field=cfg.image_field, prompt_kind="text")
        records = read_records(source, "train", "data")
        missing = [r.record_id for r in records if r.answer is None]
        if missing:
            raise ConfigError("data.completion_field", cfg.completion_field, f"missing in {len(missing)} records (first: record {missing[0]})")
        self.samples = {"prompt": [prompt_input(replace(r, prompt=str(r.prompt))) for r in records], "completion": [str(r.answer) for r in records]}
        self.info = {"samples": self.num_samples}
