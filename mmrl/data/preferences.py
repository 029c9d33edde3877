"""Preference pairs for pairwise (Bradley–Terry) reward models: the pair-file format and
merging (``python -m mmrl.pairs`` writes them: :mod:`mmrl.pairs`).

A preference directory holds

    info.json         {"kind": "image" | "image_set" | "text" | "trajectory", "train": N, "held_out": M, ...}
    train.jsonl       one pair per line: {"prompt", "chosen", "rejected", "metadata"}
    held_out.jsonl    the same; held-out pairs are never trained on
    images.npz        (images and image sets) ``images``: uint8 [R, H, W, 3], RGB

where ``chosen`` / ``rejected`` are a completion (``text``), a row of ``images``
(``image``), a list of K rows, the images generated for one prompt (``image_set``, one
K per directory), or an ``episode_index`` of the saved episodes that ``info.json``'s
``episodes`` names, or ``{"episode": i, "steps": n}``, the first n steps of episode i
(``trajectory``: a directory in LeRobotDataset v3's layout or of ``mmrl collect``
demonstrations, relative to the preference directory or absolute; both episodes of a pair
and the pair's prompt carry one instruction). Trajectory items are read as
:class:`~mmrl.demos.Trajectories` of the episodes' keyframes. ``chosen`` is the preferred
one. ``metadata.flipped`` marks a train pair whose label was flipped on purpose (label
noise); held-out labels are never flipped, so held-out accuracy measures agreement with
the verifier.

**Merge** (:func:`merge_preferences`): one directory whose train pairs are those of all the
given directories (of one kind; ``metadata.source`` names the directory each came from) and
whose held-out pairs are those of the first — e.g. rendered shapes pairs added to a
policy's own pairs, evaluated on the policy's held-out pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.errors import ConfigError

KINDS = ("image", "image_set", "text", "trajectory")
SPLITS = ("train", "held_out")


@dataclass
class PreferencePairs:
    """One split of a preference directory: prompts, chosen and rejected items, metadata."""

    kind: str
    prompts: list[str]
    chosen: Any  # list[str] (text) | uint8 array [N, H, W, 3] | [N, K, H, W, 3] | Trajectories
    rejected: Any
    metadata: list[dict]

    def __len__(self) -> int:
        return len(self.prompts)


def read_info(directory: str | Path, field: str = "data.path") -> dict:
    d = Path(directory)
    if not (d / "info.json").is_file():
        raise ConfigError(field, str(directory), "expected a preference directory with info.json, train.jsonl and held_out.jsonl (python -m mmrl.pairs)")
    info = json.loads((d / "info.json").read_text())
    if info.get("kind") not in KINDS:
        raise ConfigError(field, str(directory), f"info.json names kind {info.get('kind')!r}; kinds: {', '.join(KINDS)}")
    return info


def read_pairs(directory: str | Path, split: str, field: str = "data.path", frames: int | None = None) -> PreferencePairs:
    """The pairs of ``split`` (train or held_out), images gathered from ``images.npz``, or
    episodes from the saved episodes (``trajectory``: ``frames`` keyframes each)."""
    d = Path(directory)
    info = read_info(d, field)
    kind = info["kind"]
    path = d / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(field, str(directory), f"holds no {split}.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise ConfigError(field, str(path), f"line {i + 1} lacks {', '.join(missing)}")
    prompts = [str(r["prompt"]) for r in rows]
    metadata = [dict(r.get("metadata") or {}) for r in rows]
    if kind == "text":
        return PreferencePairs(kind, prompts, [str(r["chosen"]) for r in rows], [str(r["rejected"]) for r in rows], metadata)
    if kind == "trajectory":
        return _trajectory_pairs(d, info, path, rows, prompts, metadata, field, frames)
    with np.load(d / "images.npz") as f:
        images = f["images"]
    try:
        chosen = images[np.asarray([r["chosen"] for r in rows], dtype=np.int64)]
        rejected = images[np.asarray([r["rejected"] for r in rows], dtype=np.int64)]
    except (IndexError, ValueError) as e:
        raise ConfigError(field, str(path), f"chosen/rejected must be rows of images.npz ({len(images)} images){' or equally long lists of rows' if kind == 'image_set' else ''}: {e}") from None
    want = 5 if kind == "image_set" else 4
    if chosen.ndim != want:
        raise ConfigError(field, str(path), f"kind {kind} needs {'a list of rows' if kind == 'image_set' else 'one row'} per item, got items of shape {chosen.shape[1:]}")
    return PreferencePairs(kind, prompts, chosen, rejected, metadata)


def _trajectory_pairs(d: Path, info: dict, path: Path, rows: list[dict], prompts: list[str], metadata: list[dict], field: str, frames: int | None) -> PreferencePairs:
    """Trajectory pairs: episode indices of the episodes ``info["episodes"]`` names, checked
    (every index exists, both episodes and the prompt share an instruction), as rows of one
    :class:`~mmrl.demos.Trajectories` store of ``frames`` keyframes per episode."""
    import torch

    from mmrl.demos import Trajectories, read_demos

    if frames is None:
        raise ValueError("trajectory pairs are read as keyframes: pass frames (the reward model's)")
    if not info.get("episodes"):
        raise ConfigError(field, str(d / "info.json"), "a trajectory preference directory names its episodes directory in info.json's 'episodes'")
    source = Path(info["episodes"]) if Path(info["episodes"]).is_absolute() else d / info["episodes"]
    if not source.is_dir():
        raise ConfigError(field, str(source), f"the episodes directory that {d / 'info.json'} names does not exist")
    episodes = read_demos(source)
    prefixes: dict[tuple[int, int], int] = {}  # (episode, steps) -> row of the store after the whole episodes

    def item(i: int, side: str) -> tuple[int, int]:
        """(row of the store, episode) of one side of pair line i."""
        value = rows[i][side]
        e, steps = (value.get("episode"), value.get("steps")) if isinstance(value, dict) else (value, None)
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < len(episodes):
            raise ConfigError(field, str(path), f"line {i + 1}: {side} episode {e!r} is not in {source} ({len(episodes)} episodes, indices 0..{len(episodes) - 1})")
        if steps is None:
            return e, e
        if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= len(episodes[e]) or episodes[e].step_success is None:
            raise ConfigError(field, str(path), f"line {i + 1}: {side} is a prefix of {steps!r} steps of episode {e}, which has {len(episodes[e])} steps{'' if episodes[e].step_success is not None else ' and no step_success'}; a prefix has 2..{len(episodes[e])} steps")
        return prefixes.setdefault((e, steps), len(episodes) + len(prefixes)), e

    index = {side: [] for side in ("chosen", "rejected")}
    for i in range(len(rows)):
        (row_w, e_w), (row_l, e_l) = item(i, "chosen"), item(i, "rejected")
        index["chosen"].append(row_w)
        index["rejected"].append(row_l)
        texts = {prompts[i], episodes[e_w].instruction, episodes[e_l].instruction}
        if len(texts) > 1:
            raise ConfigError(field, str(path), f"line {i + 1}: a pair compares episodes of one instruction; prompt {prompts[i]!r}, chosen episode {e_w} {episodes[e_w].instruction!r}, rejected episode {e_l} {episodes[e_l].instruction!r}")
    trajectories = Trajectories.from_episodes(episodes + [episodes[e].prefix(steps) for e, steps in prefixes], frames)
    chosen = trajectories[torch.tensor(index["chosen"], dtype=torch.long)]
    rejected = trajectories[torch.tensor(index["rejected"], dtype=torch.long)]
    return PreferencePairs("trajectory", prompts, chosen, rejected, metadata)


def write_preferences(out: str | Path, kind: str, splits: dict[str, list[dict]], images: list[np.ndarray] | None = None, **extra) -> dict:
    """Write a preference directory: ``splits`` maps train / held_out to rows {"prompt",
    "chosen", "rejected", "metadata"}; ``images`` are the rows image items index; ``extra``
    goes into info.json. Returns the info."""
    from mmrl.demos import atomic_write

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # each file to a temporary name, then renamed; info.json, which makes it a preference
    # directory, last
    for split, rows in splits.items():
        atomic_write(out / f"{split}.jsonl", lambda f, rows=rows: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))
    if images is not None:
        atomic_write(out / "images.npz", lambda f: np.savez_compressed(f, images=np.stack(images).astype(np.uint8)))
    info = {"kind": kind, **{split: len(rows) for split, rows in splits.items()}, **extra}
    atomic_write(out / "info.json", lambda f: f.write((json.dumps(info, indent=2) + "\n").encode()))
    return info


def flip_labels(rows: list[dict], fraction: float, rng: np.random.RandomState) -> None:
    """Swap chosen and rejected of round(fraction · n) pairs drawn from ``rng``."""
    for i in rng.permutation(len(rows))[: round(fraction * len(rows))]:
        row = rows[i]
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
        row["metadata"]["flipped"] = True


# ---------------------------------------------------------------- shapes


def merge_preferences(out: str | Path, sources: list[str | Path]) -> dict:
    """Write to ``out`` the train pairs of every directory of ``sources`` and the held-out
    pairs of the first (see the module docstring); returns ``info``."""
    if not sources:
        raise ValueError("nothing to merge: name at least one preference directory")
    kinds = {read_info(d, "sources")["kind"] for d in sources}
    if len(kinds) > 1:
        raise ValueError(f"cannot merge pairs of different kinds: {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "trajectory":
        raise ValueError("trajectory pairs name the episodes of their own episodes directory; write pairs of all the episodes at once (python -m mmrl.pairs episodes)")
    splits: dict[str, list[dict]] = {"train": [], "held_out": []}
    images: list[np.ndarray] = []
    for k, d in enumerate(sources):
        d = Path(d)
        shift = len(images)
        if kind != "text":
            with np.load(d / "images.npz") as f:
                images.extend(f["images"])
        move = (lambda item: item) if kind == "text" else (lambda item: [i + shift for i in item] if isinstance(item, list) else item + shift)
        for split in SPLITS if k == 0 else ("train",):
            for line in (d / f"{split}.jsonl").read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    splits[split].append({**row, "chosen": move(row["chosen"]), "rejected": move(row["rejected"]), "metadata": {**(row.get("metadata") or {}), "source": str(d)}})
    return write_preferences(out, kind, splits, images if kind != "text" else None, source="merge", sources=[str(d) for d in sources])
