"""Checkpoints: safetensors weights + optimizer + RNG + step + sampler state, written atomically.

A checkpoint is a directory ``checkpoints/step_XXXXXXXX`` assembled under a temporary name
and renamed into place, so a run killed mid-write never leaves a half checkpoint; the file
``checkpoints/latest`` (also replaced atomically) names the newest one. The directory is
also a pretrained-policy directory (``config.yaml`` + ``model.safetensors``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.core.weights import CHECKPOINT_STATE, CHECKPOINTS, LATEST, latest_checkpoint, save_pretrained


def rng_state() -> dict[str, Any]:
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 2):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINTS
        self.keep = keep

    def latest(self) -> Path | None:
        return latest_checkpoint(self.run_dir)

    def save(self, step: int, policy, optimizer, state: dict[str, Any], config_text: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:08d}"
        tmp = self.dir / f".tmp_{name}_{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_pretrained(policy, tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"step": step, "rng": rng_state(), **state}, tmp / CHECKPOINT_STATE)
        (tmp / "train_config.yaml").write_text(config_text)
        final = self.dir / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = self.dir / ".latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, self.dir / LATEST)
        self._prune(keep_name=name)
        return final

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.dir.glob("step_*") if p.is_dir())
        for old in done[: max(0, len(done) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load(path: Path, policy, optimizer) -> dict[str, Any]:
        """Restore weights and optimizer into the given objects; returns the state dict
        (step, rng, sampler ...). Everything is read with safe loaders."""
        from mmrl.core.weights import load_state

        load_state(policy, path, "--resume")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        return torch.load(path / CHECKPOINT_STATE, weights_only=True)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
