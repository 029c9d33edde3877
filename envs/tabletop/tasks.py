"""The tabletop tasks: an instruction, an initial-state distribution and a success predicate.

Geometry (metres): the table's inner area is ``[-0.25, 0.25]^2`` (walls beyond), ``+x`` is
the image's right and ``+y`` its top in the ``top`` camera. Blocks are 5 cm cubes, zones
10 cm squares, the pusher a cylinder of radius 2 cm that reaches ``[-0.225, 0.225]^2``.

Three families, LIBERO-style (Liu et al., 2023, "LIBERO: Benchmarking Knowledge Transfer for
Lifelong Robot Learning"): the tasks of a family share one scene and one initial-state
distribution, so only the instruction tells them apart.

- ``spatial``: three identical white blocks and a green zone; the block is named by where
  it lies (left/right/top/bottom). Blocks are at least 8 cm apart along both axes, so the
  words are never ambiguous.
- ``object``: red, blue, yellow and purple blocks and a green zone; the block is named by
  its colour.
- ``goal``: red, blue and yellow blocks; the goals differ (a corner of the table, next to
  another block).

An initial state is drawn by rejection sampling from the reset seed: blocks at least 9 cm
apart, the pusher at least 7 cm from them, no block on a zone or already at its goal, and
the straight push of the task's block to its goal (from 6 cm behind the block) passes no
other block by less than 8.5 cm and starts where the pusher can reach. In the ``spatial``
and ``object`` families the state must suit every task of the family, so the layout never
hints at which block is meant; ``goal`` states suit the episode's task, so that each goal
sees varied layouts. The scripted expert never has to clear a blocked path.

Two initial-state distributions (the env's ``layout``): ``random`` places everything anywhere
on the table; ``nominal`` keeps the objects near one fixed arrangement per scene, jittered by a
few centimetres, like LIBERO's init states (objects sampled in small regions around where the
task's scene file puts them). Under ``nominal`` a colour names a block that is always roughly
in the same place, so the instruction alone says where to go, and the image says exactly where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mmrl.errors import ConfigError

BLOCK_HALF = 0.025
ZONE_HALF = 0.05
PUSHER_RADIUS = 0.02
PUSHER_LIMIT = 0.225
BLOCK_RANGE = 0.15  # initial block centres lie in [-BLOCK_RANGE, BLOCK_RANGE]^2
ZONE_RANGE = 0.15
PUSHER_RANGE = 0.2
CORNER = 0.13  # a block is "in the corner" when both coordinates lie beyond this, with the corner's signs
CORNER_AIM = 0.18  # where the expert pushes a block meant for a corner
NEXT_TO = 0.08  # "next to": centres closer than this (touching cubes are 5-7 cm apart)
NEXT_TO_AIM = 0.058
PREPUSH = 0.06  # the pusher starts a push this far behind the block's centre
CORRIDOR = 0.085  # other blocks keep this far from a push's path at reset
MIN_BLOCK_GAP = 0.09
SPATIAL_GAP = 0.08


# ---------------------------------------------------------------- goals
#
# Geometry functions take block centres ``[..., n, 2]`` and the zone's centre ``[..., 2]``
# (or None) with any leading batch dimensions: the reset samples many candidate states at once.


def _pick(blocks: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``blocks[..., index, :]`` with one index per batch element."""
    return np.take_along_axis(blocks, np.asarray(index)[..., None, None], axis=-2)[..., 0, :]


@dataclass(frozen=True)
class Zone:
    """Into the zone: the block's centre lies inside the zone's square."""

    def point(self, blocks: np.ndarray, target: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
        return np.broadcast_to(zone, blocks.shape[:-2] + (2,))

    def reached(self, blocks: np.ndarray, target: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
        return np.all(np.abs(_pick(blocks, target) - zone) <= ZONE_HALF, axis=-1)

    def ignored(self) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True)
class Corner:
    """To a corner of the table: both coordinates beyond ``CORNER`` with the corner's signs."""

    sign_x: int
    sign_y: int

    def point(self, blocks: np.ndarray, target: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
        return np.broadcast_to(np.array([self.sign_x, self.sign_y], dtype=np.float64) * CORNER_AIM, blocks.shape[:-2] + (2,))

    def reached(self, blocks: np.ndarray, target: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
        block = _pick(blocks, target)
        return (self.sign_x * block[..., 0] >= CORNER) & (self.sign_y * block[..., 1] >= CORNER)

    def ignored(self) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True)
class NextTo:
    """Next to another block: centres closer than ``NEXT_TO``. The expert aims for the side
    of the other block that faces the pushed one."""

    other: int

    def point(self, blocks: np.ndarray, target: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
        away = _pick(blocks, target) - blocks[..., self.other, :]
        norm = np.maximum(np.linalg.norm(away, axis=-1, keepdims=True), 1e-9)
        return blocks[..., self.other, :] + away / norm * NEXT_TO_AIM

    def reached(self, blocks: np.ndarray, target: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
        return np.linalg.norm(_pick(blocks, target) - blocks[..., self.other, :], axis=-1) < NEXT_TO

    def ignored(self) -> tuple[int, ...]:
        """Blocks that are not obstacles of the push: the one to end next to."""
        return (self.other,)


# ---------------------------------------------------------------- tasks and families


@dataclass(frozen=True)
class Family:
    """A scene: its MJCF file, the colour of each block, whether it has a zone.

    ``shared_layout``: an initial state must suit every task of the family (spatial,
    object: so the layout never hints at which block is meant); otherwise only the
    episode's own task (goal: so that each goal sees varied layouts)."""

    name: str
    scene: str
    colours: tuple[str, ...]
    zone: bool
    shared_layout: bool
    spatial_gap: float = 0.0  # minimum gap between the blocks' sorted x and sorted y coordinates


@dataclass(frozen=True)
class Task:
    """One task: its instruction, which block (``target`` maps initial block centres
    ``[..., n, 2]`` to block indices ``[...]``) and which goal."""

    name: str
    family: str
    instruction: str
    target: Callable[[np.ndarray], np.ndarray]
    goal: Zone | Corner | NextTo

    def target_of(self, blocks: np.ndarray) -> int:
        return int(self.target(blocks))

    def goal_point(self, blocks: np.ndarray, target: int, zone: np.ndarray | None) -> np.ndarray:
        return np.array(self.goal.point(blocks, np.asarray(target), zone), dtype=np.float64)

    def success(self, blocks: np.ndarray, target: int, zone: np.ndarray | None) -> bool:
        return bool(self.goal.reached(blocks, np.asarray(target), zone))


def _block(index: int) -> Callable[[np.ndarray], np.ndarray]:
    def target(blocks: np.ndarray) -> np.ndarray:
        return np.full(blocks.shape[:-2], index)

    return target


def _extreme(axis: int, sign: int) -> Callable[[np.ndarray], np.ndarray]:
    """The block with the largest ``sign * coordinate`` along ``axis`` (0 = x, 1 = y)."""

    def target(blocks: np.ndarray) -> np.ndarray:
        return np.argmax(sign * blocks[..., axis], axis=-1)

    return target


FAMILIES: dict[str, Family] = {
    "spatial": Family("spatial", "tabletop_spatial.xml", ("white", "white", "white"), zone=True, shared_layout=True, spatial_gap=SPATIAL_GAP),
    "object": Family("object", "tabletop_object.xml", ("red", "blue", "yellow", "purple"), zone=True, shared_layout=True),
    "goal": Family("goal", "tabletop_goal.xml", ("red", "blue", "yellow"), zone=False, shared_layout=False),
}

_RED, _BLUE, _YELLOW = 0, 1, 2  # block indices of the goal scene

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("spatial_left", "spatial", "push the block on the left into the green zone", _extreme(0, -1), Zone()),
        Task("spatial_right", "spatial", "push the block on the right into the green zone", _extreme(0, 1), Zone()),
        Task("spatial_top", "spatial", "push the block at the top into the green zone", _extreme(1, 1), Zone()),
        Task("spatial_bottom", "spatial", "push the block at the bottom into the green zone", _extreme(1, -1), Zone()),
        Task("object_red", "object", "push the red block into the green zone", _block(0), Zone()),
        Task("object_blue", "object", "push the blue block into the green zone", _block(1), Zone()),
        Task("object_yellow", "object", "push the yellow block into the green zone", _block(2), Zone()),
        Task("object_purple", "object", "push the purple block into the green zone", _block(3), Zone()),
        Task("goal_blue_top_left", "goal", "push the blue block to the top-left corner", _block(_BLUE), Corner(-1, 1)),
        Task("goal_red_bottom_right", "goal", "push the red block to the bottom-right corner", _block(_RED), Corner(1, -1)),
        Task("goal_yellow_bottom_left", "goal", "push the yellow block to the bottom-left corner", _block(_YELLOW), Corner(-1, -1)),
        Task("goal_red_next_to_yellow", "goal", "push the red block next to the yellow one", _block(_RED), NextTo(_YELLOW)),
        Task("goal_blue_next_to_red", "goal", "push the blue block next to the red one", _block(_BLUE), NextTo(_RED)),
    )
}

ALL = "all"


def family_tasks(family: str) -> list[str]:
    return [name for name, task in TASKS.items() if task.family == family]


def resolve_tasks(spec, field: str = "task") -> list[str]:
    """Task names of ``spec``: a task name, a family name (``spatial``, ``object``,
    ``goal``), ``all``, or a list of these (order kept, duplicates dropped)."""
    items = [spec] if isinstance(spec, str) else spec
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(s, str) for s in items):
        raise ConfigError(field, spec, "expected a task name, a family name or a non-empty list of them")
    names: list[str] = []
    for item in items:
        if item in TASKS:
            found = [item]
        elif item in FAMILIES:
            found = family_tasks(item)
        elif item == ALL:
            found = list(TASKS)
        else:
            raise ConfigError(field, item, f"not a tabletop task or family; families: {', '.join(FAMILIES)}, {ALL}; tasks: {', '.join(TASKS)}")
        names += [n for n in found if n not in names]
    return names


# ---------------------------------------------------------------- initial states


@dataclass
class Scene:
    """An initial state: block centres [n, 2] and yaws [n], the zone's centre (or None), the
    pusher's position [2]."""

    blocks: np.ndarray
    yaw: np.ndarray
    zone: np.ndarray | None
    pusher: np.ndarray


def _segment_distance(points: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance of points ``[..., n, 2]`` to the segments ``a``-``b`` (``[..., 2]``) → ``[..., n]``."""
    a, ab = a[..., None, :], (b - a)[..., None, :]
    t = np.clip(np.sum((points - a) * ab, -1) / np.maximum(np.sum(ab * ab, -1), 1e-12), 0.0, 1.0)
    return np.linalg.norm(points - (a + t[..., None] * ab), axis=-1)


def push_is_clear(task: Task, blocks: np.ndarray, zone: np.ndarray | None) -> np.ndarray:
    """The task is unsolved, its goal at least 12 cm away, and the straight push of its block
    from ``PREPUSH`` behind it to the goal keeps ``CORRIDOR`` from every other block
    (batched like the goals)."""
    target = task.target(blocks)
    goal = task.goal.point(blocks, target, zone)
    start = _pick(blocks, target)
    distance = np.linalg.norm(goal - start, axis=-1)
    prepush = start - (goal - start) / np.maximum(distance, 1e-9)[..., None] * PREPUSH
    n = blocks.shape[-2]
    obstacle = np.arange(n) != np.asarray(target)[..., None]
    for other in task.goal.ignored():
        obstacle = obstacle & (np.arange(n) != other)
    clearance = np.where(obstacle, _segment_distance(blocks, prepush, goal), np.inf).min(axis=-1)
    return (
        ~task.goal.reached(blocks, target, zone)
        & (distance >= 0.12)
        & np.all(np.abs(prepush) <= PUSHER_LIMIT - 0.01, axis=-1)
        & (clearance >= CORRIDOR)
    )


def _valid(family: Family, tasks: list[Task], blocks, zone, pusher) -> np.ndarray:
    """Which candidate states ``blocks [b, n, 2]``, ``zone [b, 2]`` (or None), ``pusher [b, 2]``
    are valid initial states for every task of ``tasks``."""
    n = blocks.shape[1]
    gaps = np.linalg.norm(blocks[:, :, None] - blocks[:, None], axis=-1) + np.eye(n)
    valid = gaps.min(axis=(1, 2)) >= MIN_BLOCK_GAP
    if family.spatial_gap:
        for axis in (0, 1):
            valid &= np.diff(np.sort(blocks[..., axis], axis=1), axis=1).min(axis=1) >= family.spatial_gap
    valid &= np.linalg.norm(blocks - pusher[:, None], axis=-1).min(axis=1) >= 0.07
    valid &= np.all(np.abs(pusher) <= PUSHER_LIMIT, axis=-1)
    if zone is not None:
        valid &= np.abs(blocks - zone[:, None]).max(axis=-1).min(axis=1) >= ZONE_HALF + BLOCK_HALF + 0.02
    survivors = np.flatnonzero(valid)  # the push checks cost most: run them on survivors only
    clear = np.ones(len(survivors), dtype=bool)
    for t in tasks:
        clear &= push_is_clear(t, blocks[survivors], None if zone is None else zone[survivors])
    valid[survivors] = clear
    return valid


LAYOUTS = ("random", "nominal")
NOMINAL_SEED = 20231  # seed of the draw that fixes each family's (or goal task's) nominal layout
_NOMINAL: dict[str, "Scene"] = {}  # nominal layouts by family (or goal task) name, drawn once


def nominal_scene(family: Family, task: Task) -> Scene:
    """The nominal layout of ``family`` (of ``task`` in a family without a shared layout): one
    fixed draw of the ``random`` distribution, valid for every task it serves."""
    key = family.name if family.shared_layout else task.name
    if key not in _NOMINAL:
        _NOMINAL[key] = sample_scene(family, task, np.random.default_rng([NOMINAL_SEED, sum(map(ord, key))]))
    return _NOMINAL[key]


def sample_scene(
    family: Family,
    task: Task,
    rng: np.random.Generator,
    batch: int = 1024,
    max_batches: int = 1000,
    layout: str = "random",
    noise: float = 0.03,
) -> Scene:
    """Rejection-sample an initial state of ``family`` for ``task`` (and, with a shared
    layout, for every other task of the family): candidates are drawn ``batch`` at a time and
    the first valid one is kept, so the state is a function of the generator's state.

    ``layout="random"``: blocks, zone and pusher anywhere on the table (every arrangement).
    ``layout="nominal"``: LIBERO-style, objects stay near one fixed arrangement
    (:func:`nominal_scene`): each coordinate of the blocks, the zone and the pusher is the
    nominal one plus uniform noise in ``[-noise, noise]``; block yaws stay uniform."""
    n = len(family.colours)
    tasks = [TASKS[name] for name in family_tasks(family.name)] if family.shared_layout else [task]
    center = nominal_scene(family, task) if layout == "nominal" else None
    for _ in range(max_batches):
        if center is None:
            blocks = rng.uniform(-BLOCK_RANGE, BLOCK_RANGE, size=(batch, n, 2))
            yaw = rng.uniform(0.0, np.pi / 2, size=(batch, n))
            zone = rng.uniform(-ZONE_RANGE, ZONE_RANGE, size=(batch, 2)) if family.zone else None
            pusher = rng.uniform(-PUSHER_RANGE, PUSHER_RANGE, size=(batch, 2))
        else:
            blocks = center.blocks + rng.uniform(-noise, noise, size=(batch, n, 2))
            yaw = rng.uniform(0.0, np.pi / 2, size=(batch, n))
            zone = center.zone + rng.uniform(-noise, noise, size=(batch, 2)) if family.zone else None
            pusher = center.pusher + rng.uniform(-noise, noise, size=(batch, 2))
        valid = _valid(family, tasks, blocks, zone, pusher)
        if valid.any():
            i = int(np.argmax(valid))
            return Scene(blocks[i], yaw[i], None if zone is None else zone[i], pusher[i])
    raise RuntimeError(f"no valid initial state of the {family.name} family in {batch * max_batches} tries")
