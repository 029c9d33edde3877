"""Demonstrations on disk, and the supervised (SFT) samples cut from them.

A demonstrations directory holds::

    index.json            {"format": "mmrl-demos", "version": 1,
                           "episodes": ["episode_000000.npz", ...],
                           ...metadata (env_id, env_kwargs, tasks, seed, ...)}
    episode_000000.npz    one episode (numpy .npz, compressed)
    episode_000001.npz
    ...

Each episode file holds T env steps (observation t is what the agent saw before action t):

=============  ==================  ===========================================
key            dtype, shape        meaning
=============  ==================  ===========================================
``image``      uint8 [T, ...]      camera image(s): [T, H, W, 3] or [T, K, H, W, 3]
``state``      float32 [T, D]      proprioception
``action``     float32 [T, A]      the action taken, in env units
``reward``     float32 [T]         the env's reward of each step
``success``    bool []             whether the episode solved its task
``instruction`` str []             the task's language instruction
``task``       str []              the task's name
``seed``       int64 []            the reset seed of the episode
``costs``      str []              JSON object of the episode's costs (name →
                                   number, e.g. ``path_length``); absent in
                                   files written before costs existed
``step_success`` bool [T]          the env's success flag after each action
                                   (optional: episodes recorded by mmrl)
``final_state`` float32 [D]        the state after the last action (optional)
``terminated`` bool []             the task ended the episode, not a time limit
                                   (optional, false when absent)
=============  ==================  ===========================================

The same episodes can be written in LeRobotDataset v3's layout instead (parquet + mp4 +
meta): :mod:`mmrl.episodes`; :func:`read_demos` reads either.

Files are written to a temporary name and renamed into place (``os.replace``), episodes
first and ``index.json`` last, so a reader never sees a half-written file or an index that
names a missing episode. Reading back gives arrays equal to those written, dtypes included.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.episodes import Episode, read_episodes
from mmrl.errors import ConfigError

FORMAT = "mmrl-demos"
VERSION = 1
INDEX = "index.json"
_RESERVED = ("format", "version", "episodes")


def atomic_write(path: Path, write) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it to ``path``."""
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            write(f)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``index.json`` of a demonstrations directory (format and version checked)."""
    path = Path(directory) / INDEX
    if not path.is_file():
        raise ConfigError("demos", str(directory), f"no {INDEX}: not a demonstrations directory (write one with `mmrl collect`)")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("demos", str(path), f"not valid JSON: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("episodes"), list):
        raise ConfigError("demos", str(path), f'expected {{"format": "{FORMAT}", "version": {VERSION}, "episodes": [...]}}')
    if index.get("version") != VERSION:
        raise ConfigError("demos", str(path), f"format version {index.get('version')!r}; this mmrl reads version {VERSION}")
    return index


def write_demos(directory: str | os.PathLike, episodes: list[Episode], metadata: dict[str, Any] | None = None, append: bool = False) -> Path:
    """Write ``episodes`` (and JSON-able ``metadata``, stored in the index) to ``directory``.

    A directory that already holds demonstrations is an error unless ``append``, which adds
    the episodes after the existing ones (metadata keys are updated)."""
    directory = Path(directory)
    for i, episode in enumerate(episodes):
        episode.check(f"episodes[{i}]")
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "episodes": []}
    if (directory / INDEX).exists():
        if not append:
            raise ConfigError("demos directory", str(directory), "already holds demonstrations; write to another directory or append (mmrl collect --append)")
        index = read_index(directory)
    for key in metadata or {}:
        if key in _RESERVED:
            raise ValueError(f"metadata key {key!r} is reserved by the index")
    directory.mkdir(parents=True, exist_ok=True)
    first = len(index["episodes"])
    names = []
    for offset, episode in enumerate(episodes):
        name = f"episode_{first + offset:06d}.npz"
        arrays = {
            "image": episode.image,
            "state": episode.state,
            "action": episode.action,
            "reward": episode.reward,
            "success": np.array(bool(episode.success)),
            "instruction": np.array(str(episode.instruction)),
            "task": np.array(str(episode.task)),
            "seed": np.array(int(episode.seed), dtype=np.int64),
            "costs": np.array(json.dumps({k: float(v) for k, v in episode.costs.items()})),
        }
        if episode.step_success is not None:
            arrays["step_success"] = np.asarray(episode.step_success, dtype=bool)
        if episode.final_state is not None:
            arrays["final_state"] = episode.final_state
        if episode.terminated:
            arrays["terminated"] = np.array(True)
        atomic_write(directory / name, lambda f, arrays=arrays: np.savez_compressed(f, **arrays))
        names.append(name)
    index = {**index, **(metadata or {}), "episodes": index["episodes"] + names}
    atomic_write(directory / INDEX, lambda f: f.write((json.dumps(index, indent=1) + "\n").encode()))
    return directory


def read_demos(directory: str | os.PathLike) -> list[Episode]:
    """Every episode of a demonstrations directory, in index order (or of a directory in
    LeRobotDataset v3's layout, :func:`mmrl.episodes.read_episodes`)."""
    directory = Path(directory)
    if not (directory / INDEX).exists() and (directory / "meta" / "info.json").is_file():
        return read_episodes(directory)
    episodes = []
    for name in read_index(directory)["episodes"]:
        path = directory / name
        if not path.is_file():
            raise ConfigError("demos", str(path), f"listed in {INDEX} but missing")
        with np.load(path, allow_pickle=False) as data:
            episodes.append(
                Episode(
                    image=data["image"],
                    state=data["state"],
                    action=data["action"],
                    reward=data["reward"],
                    success=bool(data["success"]),
                    instruction=str(data["instruction"]),
                    task=str(data["task"]),
                    seed=int(data["seed"]),
                    costs=json.loads(str(data["costs"])) if "costs" in data else {},
                    step_success=data["step_success"] if "step_success" in data else None,
                    final_state=data["final_state"] if "final_state" in data else None,
                    terminated=bool(data["terminated"]) if "terminated" in data else False,
                )
            )
    return episodes


def chunk_samples(episodes: list[Episode], chunk: int) -> dict[str, Any]:
    """One supervised sample per time step t of every episode, for behaviour cloning with
    action chunks (as in ACT, Zhao et al. 2023, and pi0, Black et al. 2024): the observation
    at t and the expert's next ``chunk`` actions t..t+C-1. Past the episode's end the chunk is
    padded with its last action and ``action_mask`` 0.

    Returns numpy arrays: ``image`` uint8 [N, ...], ``state`` float32 [N, D], ``instruction``
    list of N str, ``actions`` float32 [N, C, A], ``action_mask`` float32 [N, C], where N is
    the total number of steps (the batch layout of ``policy.sft_loss``)."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    if not episodes:
        raise ValueError("no episodes to cut samples from")
    images, states, instructions, actions, masks = [], [], [], [], []
    offsets = np.arange(chunk)
    for episode in episodes:
        steps = len(episode)
        index = np.arange(steps)[:, None] + offsets[None]  # [T, C]
        images.append(episode.image)
        states.append(episode.state)
        instructions += [episode.instruction] * steps
        actions.append(episode.action[np.minimum(index, steps - 1)])
        masks.append((index < steps).astype(np.float32))
    return {
        "image": np.concatenate(images),
        "state": np.concatenate(states).astype(np.float32),
        "instruction": instructions,
        "actions": np.concatenate(actions).astype(np.float32),
        "action_mask": np.concatenate(masks),
    }


def keyframe_indices(length: int, frames: int) -> np.ndarray:
    """i_k = round(k (T − 1) / (K − 1)), k = 0 .. K−1: K evenly spaced steps of an episode of
    T steps, its first and last observation included (steps repeat when T < K)."""
    if frames < 2:
        raise ValueError(f"keyframes need at least 2 frames (the first and the last), got {frames}")
    return np.rint(np.linspace(0, length - 1, frames)).astype(np.int64)


def keyframes(episode: Episode, frames: int) -> dict[str, np.ndarray]:
    """What a trajectory reward model reads of an episode (GRAPE-style trajectory
    preferences): the observations at :func:`keyframe_indices` and what the agent did in
    between.

    Returns ``image`` uint8 [K, ...] and ``state`` float32 [K, D], the observations at steps
    i_k; ``action`` float32 [K, A + 1], for each k the mean action over its segment of steps
    [i_k, i_{k+1}) (the last segment runs to the episode's end; an empty segment, from
    repeated steps, takes action i_k) followed by the mean action norm there, ‖a‖₂ (how far
    the agent moved); ``length`` float32 [], T."""
    steps = len(episode)
    index = keyframe_indices(steps, frames)
    ends = np.append(index[1:], steps)
    action = episode.action.astype(np.float64)
    norms = np.linalg.norm(action, axis=1, keepdims=True)
    summed = np.concatenate([np.zeros((1, action.shape[1] + 1)), np.cumsum(np.concatenate([action, norms], axis=1), axis=0)])
    width = ends - index
    mean = (summed[ends] - summed[index]) / np.maximum(width, 1)[:, None]
    single = np.concatenate([action[index], norms[index]], axis=1)
    segments = np.where((width > 0)[:, None], mean, single)
    return {"image": episode.image[index], "state": episode.state[index].astype(np.float32), "action": segments.astype(np.float32), "length": np.float32(steps)}


class Trajectories:
    """Rows of a store of episodes' :func:`keyframes` (tensors with one row per episode:
    ``image`` uint8 [E, K, ...], ``state`` [E, K, D], ``action`` [E, K, A + 1], ``length``
    [E]): the items a trajectory reward model scores. Indexing and ``+`` (concatenation, as
    for lists) select rows without copying frames; :meth:`gather` copies the rows out. A
    preference pair's chosen and rejected items are rows of one store."""

    def __init__(self, store: dict[str, torch.Tensor], index: torch.Tensor | None = None):
        self.store = store
        self.index = torch.arange(len(store["length"])) if index is None else index.long().cpu()

    @classmethod
    def from_episodes(cls, episodes: list[Episode], frames: int) -> "Trajectories":
        rows = [keyframes(episode, frames) for episode in episodes]
        return cls({key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in ("image", "state", "action", "length")})

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, rows) -> "Trajectories":
        return Trajectories(self.store, self.index[torch.as_tensor(rows) if isinstance(rows, list) else rows])

    def __add__(self, other: "Trajectories") -> "Trajectories":
        if other.store is self.store:
            return Trajectories(self.store, torch.cat([self.index, other.index]))
        a, b = self.gather("cpu"), other.gather("cpu")
        return Trajectories({key: torch.cat([a[key], b[key]]) for key in a})

    def to(self, device) -> "Trajectories":
        """Itself: rows are gathered onto the scorer's device when scored."""
        return self

    def gather(self, device) -> dict[str, torch.Tensor]:
        """The selected rows of every store tensor, on ``device``."""
        return {key: value[self.index].to(device) for key, value in self.store.items()}
