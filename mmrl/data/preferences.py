"""Preference pairs for pairwise (Bradley–Terry) reward models: the pair-file format and
merging (``python -m mmrl pairs`` writes them: :mod:`mmrl.commands.pairs`).

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
the verifier. Each kind's items are read, checked and merged by its class in
:mod:`mmrl.policies.reward_model.inputs`, the registry of the reward models' input kinds.

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
    from mmrl.policies.reward_model.inputs import pair_kinds

    d = Path(directory)
    if not (d / "info.json").is_file():
        raise ConfigError(field, str(directory), "expected a preference directory with info.json, train.jsonl and held_out.jsonl (python -m mmrl pairs)")
    info = json.loads((d / "info.json").read_text())
    kinds = pair_kinds()
    if info.get("kind") not in kinds:
        raise ConfigError(field, str(directory), f"info.json names kind {info.get('kind')!r}; kinds: {', '.join(kinds)}")
    return info


def read_pairs(directory: str | Path, split: str, field: str = "data.path", frames: int | None = None) -> PreferencePairs:
    """The pairs of ``split`` (train or held_out), images gathered from ``images.npz``, or
    episodes from the saved episodes (``trajectory``: ``frames`` keyframes each): each kind's
    ``read_pairs`` (:mod:`mmrl.policies.reward_model.inputs`)."""
    from mmrl.policies.reward_model.inputs import input_kind

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
    chosen, rejected = input_kind(kind, field).read_pairs(d, info, path, rows, prompts, field, frames)
    return PreferencePairs(kind, prompts, chosen, rejected, metadata)


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
    from mmrl.policies.reward_model.inputs import input_kind

    if not sources:
        raise ValueError("nothing to merge: name at least one preference directory")
    kinds = {read_info(d, "sources")["kind"] for d in sources}
    if len(kinds) > 1:
        raise ValueError(f"cannot merge pairs of different kinds: {sorted(kinds)}")
    kind = input_kind(kinds.pop(), "sources")
    if kind.merge_refusal:
        raise ValueError(kind.merge_refusal)
    splits: dict[str, list[dict]] = {"train": [], "held_out": []}
    images: list[np.ndarray] = []
    for k, d in enumerate(sources):
        d = Path(d)
        shift = len(images)
        if kind.images_file:
            with np.load(d / "images.npz") as f:
                images.extend(f["images"])
        for split in SPLITS if k == 0 else ("train",):
            for line in (d / f"{split}.jsonl").read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    moved = {side: kind.merge_item(row[side], shift) for side in ("chosen", "rejected")}
                    splits[split].append({**row, **moved, "metadata": {**(row.get("metadata") or {}), "source": str(d)}})
    return write_preferences(out, kind.name, splits, images if kind.images_file else None, source="merge", sources=[str(d) for d in sources])
