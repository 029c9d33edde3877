"""``text_render_colour``: is the text drawn in the ink colour its prompt asks for?

The ``ocr`` reward reads the letters and is blind to their colour, so a policy trained on it
alone is free to trade the asked colour for legibility. This verifier watches for that (as a
weight-0 monitor beside ``ocr``, reported per evaluation as ``reward/text_render_colour``), or
rewards the colour outright.

Per image (``rollout.info["images"]``, uint8 [B, H, W, 3] RGB):

1. the background's luminance is the image's median luminance (Rec. 601 luma; the text
   covers well under half of the pixels);
2. ink pixels are those at least ``min_contrast`` darker than it;
3. the ink's colour is the median RGB of the darkest ``ink_fraction`` of those (the cores of
   the strokes, not their anti-aliased rims blended with the background);
4. the score is 1 when that colour is nearer (Euclidean, in RGB) to the prompt's colour of
   :data:`~mmrl.tasks.text_render.world.COLOURS` than to any other of them, else 0 (and 0
   when no pixel is dark enough to be ink).

The prompt's colour is the record's ``metadata["colour"]`` (the prompt sets written by
``python -m mmrl.tasks.text_render.world``), else parsed from the prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.images import rollout_images
from mmrl.tasks.text_render.world import COLOURS, parse_prompt

_LUMA = np.array([0.299, 0.587, 0.114])


@dataclass
class TextRenderColourConfig(RewardConfig):
    """1 when an image's text is drawn in its prompt's ink colour (nearest of the world's four), else 0."""

    type: str = option("text_render_colour", "registered name of this component (see `mmrl list`)")
    min_contrast: float = option(40.0, "a pixel is ink when its luminance is at least this much below the image's median (0-255 scale)", gt=0, le=255)
    ink_fraction: float = option(0.5, "the ink's colour is the median RGB of this darkest fraction of the ink pixels", gt=0, le=1)


def ink_colour(image: np.ndarray, min_contrast: float = 40.0, ink_fraction: float = 0.5) -> np.ndarray | None:
    """The median RGB (float [3]) of the darkest ``ink_fraction`` of the pixels at least
    ``min_contrast`` darker than the image's median luminance; None when there are none."""
    pixels = image.reshape(-1, 3).astype(np.float64)
    luma = pixels @ _LUMA
    ink = luma <= np.median(luma) - min_contrast
    if not ink.any():
        return None
    order = np.argsort(luma[ink])
    core = pixels[ink][order[: max(1, int(round(ink_fraction * len(order))))]]
    return np.median(core, axis=0)


def nearest_colour(rgb: np.ndarray) -> str:
    """The name in :data:`COLOURS` nearest to ``rgb`` (Euclidean in RGB)."""
    names = list(COLOURS)
    distances = [float(np.linalg.norm(rgb - np.asarray(COLOURS[name], dtype=np.float64))) for name in names]
    return names[int(np.argmin(distances))]


def _asked_colour(rollout: Rollout, i: int) -> str:
    metadata = rollout.info["metadata"][i] if rollout.info.get("metadata") else {}
    if metadata.get("colour") in COLOURS:
        return metadata["colour"]
    try:
        return parse_prompt(str(rollout.info["prompt"][i]))[1]
    except ValueError as e:
        record = int(rollout.info["record_id"][i]) if "record_id" in rollout.info else i
        raise ConfigError("rewards", "text_render_colour", f"record {record} names no ink colour of {list(COLOURS)}: {e}") from None


@REWARDS.register("text_render_colour", config=TextRenderColourConfig)
def text_render_colour(rollout: Rollout, cfg: TextRenderColourConfig) -> Tensor:
    """r_i = [the ink colour of image i is nearest to its prompt's colour]."""
    images = rollout_images(rollout, "text_render_colour")
    if "prompt" not in rollout.info:
        raise ConfigError("rewards", "text_render_colour", "reads each sample's prompt record; use it with sampler.type: prompt and the text_render prompt sets")
    scores = []
    for i, image in enumerate(images):
        rgb = ink_colour(image, cfg.min_contrast, cfg.ink_fraction)
        scores.append(float(rgb is not None and nearest_colour(rgb) == _asked_colour(rollout, i)))
    return torch.tensor(scores, dtype=torch.float32)
