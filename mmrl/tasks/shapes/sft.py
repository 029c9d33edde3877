"""The ``shapes`` SFT data source: ground-truth images rendered from a shapes prompt set."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.data.sources import DataSourceConfig, RenderedPrompts
from mmrl.registry import DATA_SOURCES
from mmrl.tasks.shapes.world import Scene, parse_prompt, render_scene


@dataclass
class ShapesConfig(DataSourceConfig):
    type: str = option("shapes", "data source (mmrl list data)")
    path: str | None = option(None, "a shapes prompt set (.jsonl written by `python -m mmrl.tasks.shapes.world`): each record's metadata scene, else its parsed prompt")
    images_per_prompt: int = option(64, "seeded renderings of each record, drawn once when the run starts (the layouts, colours and backgrounds vary)", ge=1)
    resolution: int | None = option(None, "side of the rendered images in pixels (null = the policy's resolution)", ge=4)
    render_seed: int = option(0, "seed of the renderings (not the run seed: every run trains on the same images)", ge=0)


@DATA_SOURCES.register("shapes", config=ShapesConfig)
class Shapes(RenderedPrompts):
    """Ground-truth images of the shapes world rendered from a prompt set: supervised
    pretraining of an image generator that the ``shapes_geneval`` verifier then scores."""

    what = "shapes renderer"

    def renderer(self, record):
        spec = record.metadata.get("scene")
        scene = Scene.from_dict(spec) if spec is not None else parse_prompt(str(record.prompt))
        return lambda size, seed: render_scene(scene, size, seed=seed)
