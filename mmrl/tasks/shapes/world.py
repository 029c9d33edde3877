"""A synthetic "shapes" world: a scene grammar, its prompts, a renderer and prompt sets.

The world exists so that image generators can be trained and verified with no network: the
renderer draws ground truth for any prompt (pretraining data, and the images the verifier
``shapes_geneval`` in :mod:`mmrl.tasks.shapes.rewards` is measured on), and the verifier checks a
generated image against the prompt exactly.

Grammar. A scene is one or two object groups, at most three objects in all; a group is a
count (1–3), a colour from :data:`COLOURS` and a shape from :data:`SHAPES`; two groups are
either joined by "and" or related by a spatial relation from :data:`RELATIONS` (group 0
relative to group 1). The two groups of a scene differ in colour or shape, so each object
belongs to one group. Prompts read as

    a red circle                               single
    three green triangles                      count
    a yellow square and two blue circles       colour   (colour attribution)
    two red circles above a blue square        position

The category is implied by the scene (:attr:`Scene.category`).

Records. :func:`write_prompt_sets` writes ``train.jsonl`` and ``eval.jsonl`` for the prompt
sampler: ``{"prompt": ..., "metadata": {"category": ..., "scene": {...}}}`` with the scene as
:meth:`Scene.to_dict`. The held-out set is compositional: a seeded fraction of the
(colour, shape, count) combinations is never seen in training (every colour, shape, count
and colour–shape pair still is), and a scene is held out when any of its groups uses such a
combination: with the default fraction 0.2 and seed 0, 11 of the 54 combinations, and 2,913
train and 1,731 held-out scenes of the grammar's 4,644. ``python -m mmrl.tasks.shapes.world --out
DIR`` writes them (``--num-train`` / ``--num-eval`` cap a split, balanced over categories).

Rendering (:func:`render_scene`, needs the ``image`` extra: OpenCV) draws RGB uint8 images
of any size with a seeded layout: object sizes 22–38% of the side, random rotation, colour
jitter (hue ±6°, saturation and value 0.75–1) on a random grey background; objects never
touch (3-pixel gap between bounding boxes), and for a relation every object of group 0 lies
wholly on its side of every object of group 1.

Randomness comes from numpy's legacy ``RandomState``, whose streams numpy keeps fixed across
versions, so a seed names the same layout and the same split after upgrades.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mmrl.errors import MissingExtraError

# hue of each colour in degrees, at least 48° apart, so that the verifier's nearest-hue labels
# survive the renderer's ±6° jitter, anti-aliasing and an imperfect generator
COLOURS: dict[str, float] = {"red": 0.0, "yellow": 58.0, "green": 120.0, "cyan": 180.0, "blue": 228.0, "purple": 282.0}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("above", "below", "left of", "right of")
CATEGORIES: tuple[str, ...] = ("single", "count", "colour", "position")
MAX_OBJECTS = 3
_NUMBERS = {1: "a", 2: "two", 3: "three"}
_NUMBER_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "1": 1, "2": 2, "3": 3}


@dataclass(frozen=True)
class ObjectGroup:
    """``count`` objects of one colour and shape."""

    count: int
    colour: str
    shape: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.colour, self.shape)

    def text(self) -> str:
        return f"{_NUMBERS[self.count]} {self.colour} {self.shape}{'s' if self.count > 1 else ''}"


@dataclass(frozen=True)
class Scene:
    """One or two object groups; ``relation`` (or None for "and") places group 0 relative to
    group 1. Build checked scenes with :func:`parse_prompt` or :meth:`from_dict`; the
    constructor itself does not check the grammar, so that deliberately wrong scenes (four
    objects, say) can be rendered."""

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    @property
    def category(self) -> str:
        if self.relation is not None:
            return "position"
        if len(self.groups) == 2:
            return "colour"
        return "count" if self.groups[0].count > 1 else "single"

    def text(self) -> str:
        if len(self.groups) == 1:
            return self.groups[0].text()
        join = self.relation if self.relation is not None else "and"
        return f"{self.groups[0].text()} {join} {self.groups[1].text()}"

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [{"count": g.count, "colour": g.colour, "shape": g.shape} for g in self.groups], "relation": self.relation}

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Scene:
        """The scene of :meth:`to_dict`; ValueError if it is not one the grammar allows."""
        try:
            groups = tuple(ObjectGroup(int(g["count"]), str(g["colour"]), str(g["shape"])) for g in spec["groups"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a scene is {{'groups': [{{'count', 'colour', 'shape'}}, ...], 'relation'}}; got {spec!r} ({e})") from None
        scene = cls(groups, spec.get("relation"))
        check_scene(scene)
        return scene

    def objects(self) -> list[tuple[str, str]]:
        """(colour, shape) of every object, group 0's first."""
        return [g.key for g in self.groups for _ in range(g.count)]


def check_scene(scene: Scene) -> None:
    """ValueError naming what breaks the grammar (see the module docstring)."""
    if not 1 <= len(scene.groups) <= 2:
        raise ValueError(f"a scene has 1 or 2 object groups, not {len(scene.groups)}")
    for g in scene.groups:
        if g.colour not in COLOURS:
            raise ValueError(f"unknown colour {g.colour!r}; colours: {', '.join(COLOURS)}")
        if g.shape not in SHAPES:
            raise ValueError(f"unknown shape {g.shape!r}; shapes: {', '.join(SHAPES)}")
        if g.count < 1:
            raise ValueError(f"a group has at least one object, not {g.count}")
    total = sum(g.count for g in scene.groups)
    if total > MAX_OBJECTS:
        raise ValueError(f"a scene has at most {MAX_OBJECTS} objects, not {total}")
    if len(scene.groups) == 2 and scene.groups[0].key == scene.groups[1].key:
        raise ValueError(f"the two groups must differ in colour or shape (both are {' '.join(scene.groups[0].key)})")
    if scene.relation is not None:
        if scene.relation not in RELATIONS:
            raise ValueError(f"unknown relation {scene.relation!r}; relations: {', '.join(RELATIONS)}")
        if len(scene.groups) != 2:
            raise ValueError("a relation needs two object groups")


_GROUP = r"(a|an|one|two|three|1|2|3)\s+({colours})\s+({shapes})s?".format(colours="|".join(COLOURS), shapes="|".join(SHAPES))
_JOIN = r"and|above|below|(?:to\s+the\s+)?left\s+of|(?:to\s+the\s+)?right\s+of"
_PROMPT = re.compile(rf"\s*{_GROUP}(?:\s+({_JOIN})\s+{_GROUP})?\s*\.?\s*", re.IGNORECASE)


def parse_prompt(text: str) -> Scene:
    """The scene a prompt of the grammar describes ("two red circles above a blue square");
    "to the left of" is read as "left of", number words or digits as counts. ValueError if
    the text is not such a prompt."""
    match = _PROMPT.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a shapes prompt: expected '<count> <colour> <shape>[s]' optionally followed by 'and' or one of {', '.join(RELATIONS)} and a second group (count: a, two, three; colours: {', '.join(COLOURS)}; shapes: {', '.join(SHAPES)})")
    count0, colour0, shape0, join, count1, colour1, shape1 = (m.lower() if m else m for m in match.groups())
    groups = [ObjectGroup(_NUMBER_WORDS[count0], colour0, shape0)]
    relation = None
    if join is not None:
        groups.append(ObjectGroup(_NUMBER_WORDS[count1], colour1, shape1))
        join = re.sub(r"\s+", " ", join).removeprefix("to the ")
        relation = None if join == "and" else join
    scene = Scene(tuple(groups), relation)
    check_scene(scene)
    return scene


# ---------------------------------------------------------------- the scenes and their split


def all_scenes() -> Iterator[Scene]:
    """Every scene of the grammar once, by category (single, count, colour, position)."""
    keys = [(c, s) for c in COLOURS for s in SHAPES]
    for colour, shape in keys:
        yield Scene((ObjectGroup(1, colour, shape),))
    for count in range(2, MAX_OBJECTS + 1):
        for colour, shape in keys:
            yield Scene((ObjectGroup(count, colour, shape),))
    pairs = [(a, b) for a in keys for b in keys if a != b]
    counts = [(n0, n1) for n0 in range(1, MAX_OBJECTS) for n1 in range(1, MAX_OBJECTS) if n0 + n1 <= MAX_OBJECTS]
    for relation in (None, *RELATIONS):
        for (c0, s0), (c1, s1) in pairs:
            for n0, n1 in counts:
                yield Scene((ObjectGroup(n0, c0, s0), ObjectGroup(n1, c1, s1)), relation)


def held_out_combinations(fraction: float, seed: int) -> set[tuple[str, str, int]]:
    """About ``fraction`` of the (colour, shape, count) combinations, drawn from ``seed``,
    such that training still sees every colour, shape and count, and every colour–shape
    pair with some count: held-out prompts then ask for new combinations of known words."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the held-out fraction must be in [0, 1), not {fraction}")
    combos = [(c, s, n) for c in COLOURS for s in SHAPES for n in range(1, MAX_OBJECTS + 1)]
    wanted = round(fraction * len(combos))
    order = np.random.RandomState(seed).permutation(len(combos))
    held: set[tuple[str, str, int]] = set()
    for i in order:
        if len(held) == wanted:
            break
        trial = held | {combos[i]}
        kept = [c for c in combos if c not in trial]
        covered = (
            {c for c, _, _ in kept} == set(COLOURS)
            and {s for _, s, _ in kept} == set(SHAPES)
            and {n for _, _, n in kept} == set(range(1, MAX_OBJECTS + 1))
            and {(c, s) for c, s, _ in kept} == {(c, s) for c in COLOURS for s in SHAPES}
        )
        if covered:
            held = trial
    return held


def split_scenes(fraction: float, seed: int) -> tuple[list[Scene], list[Scene]]:
    """(train, held-out) scenes: a scene is held out when any group's (colour, shape, count)
    is in :func:`held_out_combinations`. Each part is shuffled by ``seed``."""
    held = held_out_combinations(fraction, seed)
    train, held_out = [], []
    for scene in all_scenes():
        unseen = any((g.colour, g.shape, g.count) in held for g in scene.groups)
        (held_out if unseen else train).append(scene)
    rng = np.random.RandomState(seed + 1)
    return [train[i] for i in rng.permutation(len(train))], [held_out[i] for i in rng.permutation(len(held_out))]


def balanced(scenes: list[Scene], limit: int | None) -> list[Scene]:
    """At most ``limit`` scenes taken round-robin over the categories (in their order in
    ``scenes``), so a small set still covers every category; all of them with None."""
    if limit is None:
        return list(scenes)
    by_category = {c: [s for s in scenes if s.category == c] for c in CATEGORIES}
    out: list[Scene] = []
    depth = 0
    while len(out) < min(limit, len(scenes)):
        for category in CATEGORIES:
            if depth < len(by_category[category]) and len(out) < limit:
                out.append(by_category[category][depth])
        depth += 1
    return out


def record(scene: Scene) -> dict[str, Any]:
    """The JSONL record of a scene, as the prompt sampler reads it."""
    return {"prompt": scene.text(), "metadata": {"category": scene.category, "scene": scene.to_dict()}}


def write_prompt_sets(
    out_dir: str | Path,
    *,
    held_out_fraction: float = 0.2,
    seed: int = 0,
    num_train: int | None = None,
    num_eval: int | None = None,
    categories: tuple[str, ...] | list[str] | None = None,
) -> dict[str, int]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (:func:`split_scenes`, capped per split by
    :func:`balanced`) into ``out_dir``; returns the number of records of each. ``categories``
    keeps only the scenes of those categories (the split itself is unchanged: the same
    combinations are held out)."""
    if categories is not None:
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"categories must be a non-empty subset of {list(CATEGORIES)}, got {list(categories)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = split_scenes(held_out_fraction, seed)
    if categories is not None:
        train = [s for s in train if s.category in categories]
        held_out = [s for s in held_out if s.category in categories]
    counts = {}
    for name, scenes in (("train", balanced(train, num_train)), ("eval", balanced(held_out, num_eval))):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(record(s)) + "\n" for s in scenes)
        counts[name] = len(scenes)
    return counts


# ---------------------------------------------------------------- deliberately wrong scenes

MISTAKES: tuple[str, ...] = ("extra object", "missing object", "wrong colour", "wrong shape", "swapped position")
_OPPOSITE = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}


def mistaken_scene(scene: Scene, mistake: str, seed: int) -> Scene | None:
    """The scene with one mistake (:data:`MISTAKES`), which an image of it must fail
    against the original prompt; None when the mistake does not apply ("swapped position"
    needs a relation). One group, drawn from ``seed``, is changed: one object more or less
    (a group of one disappears, and with it the relation), another colour or another shape
    (never the other group's), or the opposite relation. The result may break the grammar
    (four objects, or none), which the renderer allows. Negative examples for measuring a
    verifier, or for a preference model."""
    if mistake not in MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}; mistakes: {', '.join(MISTAKES)}")
    if mistake == "swapped position":
        return Scene(scene.groups, _OPPOSITE[scene.relation]) if scene.relation is not None else None
    rng = np.random.RandomState(seed)
    i = int(rng.randint(len(scene.groups)))
    groups = list(scene.groups)
    g = groups[i]
    taken = {other.key for j, other in enumerate(groups) if j != i}
    if mistake == "extra object":
        groups[i] = replace(g, count=g.count + 1)
    elif mistake == "missing object":
        if g.count > 1:
            groups[i] = replace(g, count=g.count - 1)
        else:
            del groups[i]
            return Scene(tuple(groups))
    elif mistake == "wrong colour":
        colours = [c for c in COLOURS if c != g.colour and (c, g.shape) not in taken]
        groups[i] = replace(g, colour=colours[rng.randint(len(colours))])
    else:
        shapes = [s for s in SHAPES if s != g.shape and (g.colour, s) not in taken]
        groups[i] = replace(g, shape=shapes[rng.randint(len(shapes))])
    return Scene(tuple(groups), scene.relation)


# ---------------------------------------------------------------- rendering


def _cv2(what: str):
    try:
        import cv2
    except ImportError:
        raise MissingExtraError("opencv-python", "image", what) from None
    return cv2


@dataclass(frozen=True)
class PlacedObject:
    """An object as drawn: its outline (polygon vertices, or a circle's centre and radius)
    and its axis-aligned bounding box (x0, y0, x1, y1) in pixels."""

    colour: str
    shape: str
    centre: tuple[float, float]
    size: float  # circle diameter, square side, triangle side
    rotation: float  # degrees
    rgb: tuple[int, int, int]

    def vertices(self) -> np.ndarray:
        """Square and triangle corners [k, 2] (x, y); a triangle points up at rotation 0."""
        cx, cy = self.centre
        theta = math.radians(self.rotation)
        if self.shape == "square":
            radius, start, k = self.size / math.sqrt(2), math.pi / 4, 4
        else:
            radius, start, k = self.size / math.sqrt(3), -math.pi / 2, 3
        angles = start + theta + np.arange(k) * 2 * math.pi / k
        return np.stack([cx + radius * np.cos(angles), cy + radius * np.sin(angles)], axis=1)

    def box(self) -> tuple[float, float, float, float]:
        if self.shape == "circle":
            r = self.size / 2
            return (self.centre[0] - r, self.centre[1] - r, self.centre[0] + r, self.centre[1] + r)
        v = self.vertices()
        return (v[:, 0].min(), v[:, 1].min(), v[:, 0].max(), v[:, 1].max())


def _apart(a: tuple, b: tuple, gap: float) -> bool:
    """Boxes (x0, y0, x1, y1) at least ``gap`` apart along x or y."""
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _related(a: tuple, b: tuple, relation: str, gap: float) -> bool:
    """Box a wholly on the ``relation`` side of box b (image y grows downwards)."""
    return {
        "above": a[3] + gap <= b[1],
        "below": b[3] + gap <= a[1],
        "left of": a[2] + gap <= b[0],
        "right of": b[2] + gap <= a[0],
    }[relation]


def _jittered_rgb(colour: str, rng: np.random.RandomState) -> tuple[int, int, int]:
    hue = (COLOURS[colour] + rng.uniform(-6.0, 6.0)) % 360.0
    r, g, b = colorsys.hsv_to_rgb(hue / 360.0, rng.uniform(0.75, 1.0), rng.uniform(0.75, 1.0))
    return (round(255 * r), round(255 * g), round(255 * b))


def layout(scene: Scene, size: int, rng: np.random.RandomState, *, object_size: tuple[float, float] = (0.22, 0.38), gap: float = 3.0, attempts: int = 50) -> list[PlacedObject]:
    """A random placement (from ``rng``) of the scene's objects in a ``size``×``size`` image
    that satisfies it: objects inside the image and ``gap`` pixels apart, and for a relation every object of
    group 0 on its side of every object of group 1 with the same gap. Objects are placed one
    at a time, each at the first of ``attempts`` random centres that fits beside those
    already placed; when one does not fit the placement starts over, and after 20 restarts
    the objects shrink by 10% (four objects at 32×32 may need it)."""
    objects = scene.objects()
    group_of = [i for i, g in enumerate(scene.groups) for _ in range(g.count)]
    sizes = rng.uniform(object_size[0], object_size[1], len(objects)) * size
    rotations = rng.uniform(0, 360.0, len(objects))
    colours = [_jittered_rgb(c, rng) for c, _ in objects]

    def fits(box: tuple, i: int, boxes: list[tuple]) -> bool:
        for j, other in enumerate(boxes):
            if not _apart(box, other, gap):
                return False
            if scene.relation is not None and group_of[i] != group_of[j]:
                first, second = (box, other) if group_of[i] == 0 else (other, box)
                if not _related(first, second, scene.relation, gap):
                    return False
        return True

    for shrink in range(30):
        # each object's box relative to its centre: centres are then drawn inside the image
        shapes = [PlacedObject(c, sh, (0.0, 0.0), float(s), float(r), rgb) for (c, sh), s, r, rgb in zip(objects, sizes * 0.9**shrink, rotations, colours)]
        extents = [shape.box() for shape in shapes]
        for _ in range(20):
            placed: list[PlacedObject] = []
            boxes: list[tuple] = []
            for i, (shape, (x0, y0, x1, y1)) in enumerate(zip(shapes, extents)):
                for _ in range(attempts):
                    cx, cy = rng.uniform(-x0, size - 1 - x1), rng.uniform(-y0, size - 1 - y1)
                    box = (cx + x0, cy + y0, cx + x1, cy + y1)
                    if fits(box, i, boxes):
                        placed.append(replace(shape, centre=(cx, cy)))
                        boxes.append(box)
                        break
                else:
                    break
            if len(placed) == len(objects):
                return placed
    raise ValueError(f"could not place {scene.text()!r} in a {size}x{size} image")


def draw(placed: list[PlacedObject], size: int, background: int) -> np.ndarray:
    """An RGB uint8 image [size, size, 3] of the placed objects, anti-aliased, on a grey
    ``background`` level."""
    cv2 = _cv2("rendering shapes scenes")
    image = np.full((size, size, 3), background, dtype=np.uint8)
    sub = 16  # 4 fractional bits (cv2 `shift`): sub-pixel outlines keep small shapes true
    for p in placed:
        if p.shape == "circle":
            centre = (round(p.centre[0] * sub), round(p.centre[1] * sub))
            cv2.circle(image, centre, round(p.size / 2 * sub), p.rgb, thickness=-1, lineType=cv2.LINE_AA, shift=4)
        else:
            corners = np.round(p.vertices() * sub).astype(np.int32)
            cv2.fillPoly(image, [corners], p.rgb, lineType=cv2.LINE_AA, shift=4)
    return image


def render_scene(scene: Scene, size: int = 32, seed: int = 0, **layout_options) -> np.ndarray:
    """An RGB uint8 image [size, size, 3] of the scene: a grey level in [20, 235] and then
    the :func:`layout`, both drawn from ``seed``."""
    rng = np.random.RandomState(seed)
    background = int(rng.randint(20, 236))
    return draw(layout(scene, size, rng, **layout_options), size, background)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.shapes.world", description="Write the shapes world's train and held-out prompt sets (JSONL).")
    parser.add_argument("--out", required=True, help="output directory (train.jsonl, eval.jsonl)")
    parser.add_argument("--held-out-fraction", type=float, default=0.2, help="fraction of (colour, shape, count) combinations never seen in training")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the record order")
    parser.add_argument("--num-train", type=int, default=None, help="at most this many train records, balanced over categories (default: all)")
    parser.add_argument("--num-eval", type=int, default=None, help="at most this many held-out records, balanced over categories (default: all)")
    parser.add_argument("--categories", default=None, help=f"comma-separated categories to keep, of {','.join(CATEGORIES)} (default: all)")
    args = parser.parse_args(argv)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    try:
        counts = write_prompt_sets(args.out, held_out_fraction=args.held_out_fraction, seed=args.seed, num_train=args.num_train, num_eval=args.num_eval, categories=categories)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {counts['train']} train and {counts['eval']} held-out prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
