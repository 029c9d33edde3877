"""``shapes_geneval``: a GenEval-style verifier of images of the shapes world.

The prompt's scene (:mod:`mmrl.tasks.shapes.world`) comes from the record's ``metadata["scene"]``
when the record has one (the prompt sets written by ``python -m mmrl.tasks.shapes.world`` do), else
from parsing the prompt text. The image (``rollout.info["images"]``, uint8 [B, H, W, 3] RGB)
is read by :func:`detect_shapes`:

1. object pixels: chroma = max(R, G, B) − min(R, G, B) ≥ ``min_chroma`` (grey backgrounds
   have chroma ≈ 0, and blending a colour with grey keeps its hue);
2. each object pixel takes the palette colour nearest its HSV hue, and every colour's
   4-connected components of at least ``min_area`` × H × W pixels are objects;
3. an object's shape is the one whose smallest enclosing outline it fills best: the area
   inside its sub-pixel outline over the area of the minimum enclosing circle, rotated
   rectangle and triangle of that outline (:func:`shape_fills`; 1 for its own outline, while
   a circle fills its rectangle π/4, a square its circle 2/π, a triangle its rectangle 1/2).
   Below ``min_fill`` for all three it is an unrecognised object, which still counts.

Criteria (:func:`check_criteria`), each true or false:

- ``count``: the number of objects of each shape equals the prompt's, and there are no
  others;
- ``colour``: the objects are exactly the prompt's (colour, shape) multiset;
- ``position`` (prompts with a relation): every object of group 0 lies on the relation's side
  of every object of group 1: along the relation's axis their bounding-box centres are
  apart by at least ``position_margin`` × the mean of the two boxes' extents on that axis.

``mode: strict`` gives 1 if every criterion holds (the image satisfies the whole prompt),
else 0; ``mode: partial`` the fraction that hold; ``mode: objects`` the fraction of objects
that match: the overlap of the detected and the prompted (colour, shape) multisets over the
larger of the two counts (three triangles asked, two triangles and a square drawn: 2/3),
averaged with the position criterion when the prompt has a relation. ``objects`` is 1
exactly when ``strict`` is, and between 0 and 1 it tells a nearly right image from a wrong
one, so a group whose images are all wrong still ranks them.

Measured with ``benchmarks/shapes_verifier.py`` (strict mode, default options, 2,000
rendered scenes per size evenly over the four categories, seeds 0 and 1): ground truth
accepted 2000/2000 at 32×32 and 2000/2000 at 64×64 for both seeds; images of deliberately
wrong scenes (one object more, one fewer, another colour or shape for one group, the opposite
relation) accepted 0 of 8,500 per size and seed. With Gaussian pixel noise (std 8 / 16) on
the ground truth: 0.9995 / 0.980 at 32×32, 1.000 / 0.9995 at 64×64. About 1 ms per image.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.tasks.shapes.world import COLOURS, SHAPES, Scene, parse_prompt
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.images import opencv, rollout_images

UNRECOGNISED = "unrecognised"


@dataclass(frozen=True)
class Detection:
    """An object found in an image: palette colour, shape (or ``UNRECOGNISED``), pixel area
    and axis-aligned bounding box (x, y, width, height)."""

    colour: str
    shape: str
    area: int
    box: tuple[int, int, int, int]

    @property
    def centre(self) -> tuple[float, float]:
        x, y, w, h = self.box
        return (x + w / 2, y + h / 2)


def _hue_labels() -> np.ndarray:
    """Palette index of each OpenCV hue (0–179, 2° per unit): the colour of nearest hue."""
    hues = np.arange(180) * 2.0
    centres = np.array(list(COLOURS.values()))
    distance = np.abs((hues[:, None] - centres[None, :] + 180.0) % 360.0 - 180.0)
    return distance.argmin(1).astype(np.uint8)


_HUE_LABELS = _hue_labels()
_COLOUR_NAMES = list(COLOURS)
_UPSAMPLE = 4


def shape_fills(coverage: np.ndarray, level: float, cv2) -> dict[str, float]:
    """How well one object fills the minimum enclosing circle, rotated rectangle and triangle
    of its outline: A / (π r²), A / (w h), A / A_triangle, each 1 for its own shape.

    ``coverage`` is the object's chroma around it (0 elsewhere) and ``level`` its interior
    chroma. The outline is the half-coverage edge (chroma = level / 2) on the coverage
    upsampled ×4 bilinearly: anti-aliased rims then give sub-pixel outlines, where pixel
    outlines of a 10-pixel circle look like an octagon and fill their square almost as well.
    """
    upsampled = cv2.resize(coverage, None, fx=_UPSAMPLE, fy=_UPSAMPLE, interpolation=cv2.INTER_LINEAR)
    contours, _ = cv2.findContours((upsampled >= level / 2).astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    if not contours:
        return {shape: 0.0 for shape in SHAPES}
    contour = max(contours, key=cv2.contourArea)
    area = cv2.contourArea(contour)
    _, radius = cv2.minEnclosingCircle(contour)
    (_, _), (w, h), _ = cv2.minAreaRect(contour)
    # OpenCV's minimum enclosing triangle is sometimes far from minimal (a 22-pixel triangle
    # filled 0.69 of it); the one around the hull simplified by half a unit of the ×4 outline
    # does not fail on the same hulls, so the smaller of the two is taken
    hull = cv2.convexHull(contour)
    triangle_area = min(cv2.minEnclosingTriangle(hull)[0], cv2.minEnclosingTriangle(cv2.approxPolyDP(hull, 0.5, True))[0])
    return {
        "circle": area / max(math.pi * radius**2, 1e-9),
        "square": area / max(w * h, 1e-9),
        "triangle": area / max(triangle_area, 1e-9),
    }


def detect_shapes(image: np.ndarray, *, min_chroma: int, min_area: float, min_fill: float) -> list[Detection]:
    """The coloured objects of an RGB uint8 image [H, W, 3] (see the module docstring; the
    options are :class:`ShapesGenevalConfig`'s)."""
    cv2 = opencv("the shapes verifier")
    height, width = image.shape[:2]
    chroma = image.max(-1).astype(np.float32) - image.min(-1)
    hue = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)[..., 0]
    labels = np.where(chroma >= min_chroma, _HUE_LABELS[hue], 255)
    ring = np.ones((3, 3), np.uint8)
    found = []
    for index, colour in enumerate(_COLOUR_NAMES):
        mask = (labels == index).astype(np.uint8)
        if not mask.any():
            continue
        # 4-connectivity: two objects a pixel apart diagonally stay two objects
        n, components, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=4)
        for k in range(1, n):
            x, y, w, h, area = (int(v) for v in stats[k])
            if area < min_area * height * width:
                continue
            x0, y0, x1, y1 = max(x - 1, 0), max(y - 1, 0), min(x + w + 1, width), min(y + h + 1, height)
            blob = (components[y0:y1, x0:x1] == k).astype(np.uint8)
            # the blob and the faint anti-aliased pixels around it, not a neighbouring object
            rim = cv2.dilate(blob, ring).astype(bool) & ((blob > 0) | (chroma[y0:y1, x0:x1] < min_chroma))
            level = float(np.median(chroma[y0:y1, x0:x1][blob > 0]))
            fills = shape_fills(np.where(rim, chroma[y0:y1, x0:x1], 0.0), level, cv2)
            shape = max(fills, key=fills.get)
            found.append(Detection(colour, shape if fills[shape] >= min_fill else UNRECOGNISED, area, (x, y, w, h)))
    return found


def _on_side(a: Detection, b: Detection, relation: str, margin: float) -> bool:
    """a lies on the ``relation`` side of b (image y grows downwards)."""
    (ax, ay), (bx, by) = a.centre, b.centre
    if relation in ("above", "below"):
        offset = by - ay if relation == "above" else ay - by
        return offset >= margin * (a.box[3] + b.box[3]) / 2
    offset = bx - ax if relation == "left of" else ax - bx
    return offset >= margin * (a.box[2] + b.box[2]) / 2


def _object_multisets(scene: Scene, detections: list[Detection]) -> tuple[Counter, Counter]:
    """The prompted and the detected (colour, shape) multisets."""
    return Counter(scene.objects()), Counter((d.colour, d.shape) for d in detections)


def check_criteria(scene: Scene, detections: list[Detection], position_margin: float = 0.5) -> dict[str, bool]:
    """Which of ``count``, ``colour`` and (for a relation) ``position`` the detections meet."""
    wanted, seen = _object_multisets(scene, detections)
    criteria = {
        "count": Counter(shape for _, shape in wanted.elements()) == Counter(d.shape for d in detections),
        "colour": seen == wanted,
    }
    if scene.relation is not None:
        first = [d for d in detections if (d.colour, d.shape) == scene.groups[0].key]
        second = [d for d in detections if (d.colour, d.shape) == scene.groups[1].key]
        criteria["position"] = bool(first and second) and all(_on_side(a, b, scene.relation, position_margin) for a in first for b in second)
    return criteria


def matched_fraction(scene: Scene, detections: list[Detection]) -> float:
    """|detected ∩ prompted| / max(|detected|, |prompted|) over (colour, shape) multisets:
    1 exactly when the objects are the prompt's, 0 when none of them is."""
    wanted, seen = _object_multisets(scene, detections)
    return sum((wanted & seen).values()) / max(sum(wanted.values()), sum(seen.values()), 1)


@dataclass
class ShapesGenevalConfig(RewardConfig):
    """Does each image show its prompt's shapes scene: counts, colours and positions."""

    type: str = option("shapes_geneval", "registered name of this component (see `mmrl list`)")
    mode: Literal["strict", "partial", "objects"] = option(
        "strict",
        "strict: 1 if the image satisfies the whole prompt, else 0; partial: the fraction of its criteria (count, colour, position) it meets; objects: the matched fraction of (colour, shape) objects, over the larger of the detected and prompted counts (averaged with position under a relation)",
    )
    min_chroma: int = option(60, "a pixel belongs to an object when max(R,G,B) - min(R,G,B) >= this (grey has 0)", ge=1, le=255)
    min_area: float = option(0.01, "smallest object, as a fraction of the image's pixels (smaller blobs are ignored as noise)", gt=0, lt=1)
    min_fill: float = option(0.8, "a blob is a circle, square or triangle when it fills at least this fraction of that enclosing outline; otherwise an unrecognised object", gt=0, le=1)
    position_margin: float = option(0.5, "a relation holds when the objects' box centres are apart along its axis by at least this x their mean extent on that axis", ge=0)


def _scene(rollout: Rollout, i: int) -> Scene:
    """Sample i's scene: its record's metadata['scene'] if present, else its parsed prompt."""
    metadata = rollout.info["metadata"][i] if "metadata" in rollout.info else {}
    record = int(rollout.info["record_id"][i]) if "record_id" in rollout.info else i
    try:
        if "scene" in metadata:
            return Scene.from_dict(metadata["scene"])
        return parse_prompt(rollout.info["prompt"][i])
    except ValueError as e:
        raise ConfigError("rewards", "shapes_geneval", f"record {record} is not a shapes scene: {e}") from None


@REWARDS.register("shapes_geneval", config=ShapesGenevalConfig)
def shapes_geneval(rollout: Rollout, cfg: ShapesGenevalConfig) -> Tensor:
    """strict: r_i = Π_c [criterion c holds]; partial: r_i = mean_c [criterion c holds], over
    count, colour and (with a relation) position of the objects detected in image i;
    objects: r_i = |detected ∩ prompted| / max(|detected|, |prompted|) over (colour, shape)
    multisets (averaged with [position holds] under a relation)."""
    images = rollout_images(rollout, "shapes_geneval")
    if "prompt" not in rollout.info:
        raise ConfigError("rewards", "shapes_geneval", "reads each sample's prompt record; use it with sampler.type: prompt and a shapes prompt set (python -m mmrl.tasks.shapes.world)")
    scores = []
    for i, image in enumerate(images):
        detections = detect_shapes(image, min_chroma=cfg.min_chroma, min_area=cfg.min_area, min_fill=cfg.min_fill)
        scene = _scene(rollout, i)
        criteria = check_criteria(scene, detections, cfg.position_margin)
        if cfg.mode == "objects":
            score = matched_fraction(scene, detections)
            scores.append((score + criteria["position"]) / 2 if "position" in criteria else score)
        else:
            met = criteria.values()
            scores.append(float(all(met)) if cfg.mode == "strict" else sum(met) / len(met))
    return torch.tensor(scores, dtype=torch.float32)
