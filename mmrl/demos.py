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
=============  ==================  ===========================================

Files are written to a temporary name and renamed into place (``os.replace``), episodes
first and ``index.json`` last, so a reader never sees a half-written file or an index that
names a missing episode. Reading back gives arrays equal to those written, dtypes included.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.errors import ConfigError

FORMAT = "mmrl-demos"
VERSION = 1
INDEX = "index.json"
_RESERVED = ("format", "version", "episodes")


@dataclass
class Episode:
    """One demonstration: T steps of observations (``image``, ``state``), ``action`` and
    ``reward``, and what the episode was (``instruction``, ``task``, ``seed``, ``success``)."""

    image: np.ndarray
    state: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    success: bool
    instruction: str
    task: str
    seed: int

    def __len__(self) -> int:
        return int(self.action.shape[0])

    def check(self, where: str = "episode") -> None:
        """Raise ValueError unless the arrays have the format's dtypes and agree on T >= 1."""
        expected = {"image": (np.uint8, None), "state": (np.float32, 2), "action": (np.float32, 2), "reward": (np.float32, 1)}
        for key, (dtype, ndim) in expected.items():
            value = getattr(self, key)
            if not isinstance(value, np.ndarray) or value.dtype != dtype or (ndim is not None and value.ndim != ndim):
                got = f"{value.dtype} array of shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
                raise ValueError(f"{where}.{key}: expected a {np.dtype(dtype)} array{f' with {ndim} dimensions' if ndim else ''}, got {got}")
        lengths = {key: getattr(self, key).shape[0] for key in expected}
        if len(set(lengths.values())) != 1 or lengths["action"] < 1:
            raise ValueError(f"{where}: every array needs the same number T >= 1 of steps, got {lengths}")


def _atomic_write(path: Path, write) -> None:
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
        }
        _atomic_write(directory / name, lambda f, arrays=arrays: np.savez_compressed(f, **arrays))
        names.append(name)
    index = {**index, **(metadata or {}), "episodes": index["episodes"] + names}
    _atomic_write(directory / INDEX, lambda f: f.write((json.dumps(index, indent=1) + "\n").encode()))
    return directory


def read_demos(directory: str | os.PathLike) -> list[Episode]:
    """Every episode of a demonstrations directory, in index order."""
    directory = Path(directory)
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
