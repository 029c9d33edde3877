"""The ``text_render`` SFT data source: ground-truth images of the words a text-rendering prompt
set asks for, rendered with OpenCV (:func:`~mmrl.tasks.text_render.world.render_word`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.data.sources import DataSourceConfig, RenderedPrompts
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
class TextRender(RenderedPrompts):
    """Ground-truth renderings of a text-rendering prompt set: supervised pretraining of an image
    generator that the ``ocr`` reward then scores."""

    what = "text renderer"

    def renderer(self, record):
        meta = record.metadata or {}
        word, colour = (str(meta["text"]), str(meta["colour"])) if "text" in meta and "colour" in meta else parse_prompt(str(record.prompt))
        if colour not in COLOURS:
            raise ValueError(f"colour {colour!r} is not one of {list(COLOURS)}")
        return lambda size, seed: render_word(word, colour, size, seed=seed)
