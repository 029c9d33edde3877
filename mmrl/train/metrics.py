"""Metrics: ``metrics.jsonl`` is the source of truth; TensorBoard and the progress bar are
views of it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is a dependency, but a trimmed install may lack it
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint (they will be redone)."""
        if not self.enabled or not self.path.exists():
            return
        self._file.close()
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line).get("step", -1) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def add_media(self, step: int, media: dict) -> None:
        """Sample images [N, H, W, 3] / videos [N, F, H, W, 3] as TensorBoard images: a grid
        per name (a video: one row of frames per sample); the files are mmrl.media's."""
        if not self.enabled or self._tb is None:
            return
        from mmrl.media import media_grid

        for name, array in media.items():
            self._tb.add_image(f"samples/{name}", media_grid(array), step, dataformats="HWC")
        self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``; of a run still writing, a last line caught
    half-written is left out."""
    lines = [line for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        records += [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:
        pass
    return records


def rl_metrics(dist, collected, rollout, adv, update: dict[str, float], filters_on: bool, counters: dict[str, float], version: int | None, times: dict[str, float]) -> dict[str, Any]:
    """A training step's metrics, global values (sums and counts of every process, reduced):
    the sampler's and the rewards' means over everything collected, the filters' kept
    fraction, the advantages, the update's metrics, the workers' ``counters`` (env steps), the
    version lag of the trained samples behind ``version`` (async runs; None: not logged) and
    the seconds of each role."""
    out: dict[str, Any] = {}
    for name, pair in collected.sums.items():
        total, count = dist.sum(pair).tolist()
        out[name] = total / max(count, 1.0)
    kept, num_collected = dist.sum(rollout.batch_size).item(), dist.sum(collected.num_collected).item()
    if filters_on:
        out["filter/kept_fraction"] = kept / max(num_collected, 1.0)
    out["adv/abs_mean"] = (dist.sum(adv.abs().sum()) / max(dist.sum(adv.numel()).item(), 1.0)).item()
    # the share of trained samples with any non-zero advantage (a group whose rewards are all
    # equal gives its samples none: what dynamic sampling and knapsack budgets act on)
    nonzero = (adv.reshape(adv.shape[0], -1) != 0).any(1) if adv.numel() else adv.new_zeros(0, dtype=torch.bool)
    out["adv/nonzero_fraction"] = (dist.sum(nonzero.sum()) / max(dist.sum(adv.shape[0]).item(), 1.0)).item()
    # how many prompts (groups) the step learns from: those with a sample whose advantage is not zero
    out["adv/informative_groups"] = dist.sum(torch.unique(rollout.group_id[nonzero.to(rollout.group_id.device)]).numel()).item()
    out["decisions"] = dist.sum(rollout.mask.sum()).item()
    if rollout.entropy is not None:
        # the sampling policy's entropy per decision (sharpening or spreading under RL)
        mask = rollout.mask.to(rollout.entropy.device)
        out["entropy"] = (dist.sum((rollout.entropy * mask).sum()) / dist.sum(mask.sum()).clamp_min(1)).item()
    out.update(update)
    for name, value in counters.items():
        out[name] = dist.sum(value).item()
    if version is not None and rollout.policy_version is not None:
        lag = (version - rollout.policy_version).double()
        out["staleness/lag_mean"] = (dist.sum(lag.sum()) / max(dist.sum(lag.numel()).item(), 1.0)).item()
        out["staleness/lag_max"] = dist.max(float(lag.max()) if lag.numel() else 0.0)
        out["staleness/dropped"] = dist.sum(collected.dropped).item()
    out.update(times)
    out.update({f"time/{k}": v for k, v in collected.times.items()})
    return out


class MinibatchMetrics:
    """The metrics of one optimizer step, summed over its pieces (a loss module's
    :class:`~mmrl.algo.losses.LossOutput` each) and then taken over all processes: the
    named loss parts as a process's share x processes, the per-decision statistics as masked
    means over the decisions that ran (a name ending in ``_max``: the maximum)."""

    def __init__(self):
        self.sums: dict[str, Any] = {}
        self.maxima: dict[str, float] = {}

    def add(self, out, mask) -> None:
        """Add one piece's :class:`LossOutput` ``out`` with its training ``mask``."""
        with torch.no_grad():
            parts = dict(out.terms)
            parts["_count"] = mask.sum()
            for name, v in out.decision_stats.items():
                if name.endswith("_max"):  # a maximum over the valid decisions, not a mean
                    self.maxima[name] = max(self.maxima.get(name, float("-inf")), float(v[mask.bool()].max()) if mask.any() else float("-inf"))
                else:
                    parts["_mean/" + name] = (v * mask).sum()
        for name, v in parts.items():
            self.sums[name] = self.sums.get(name, 0.0) + v.detach().cpu()

    def mean(self, dist, name: str):
        """The masked mean of decision statistic ``name`` over all processes (None if absent)."""
        if "_mean/" + name not in self.sums:
            return None
        return dist.sum(self.sums["_mean/" + name]) / dist.sum(self.sums["_count"]).clamp_min(1)

    def result(self, dist) -> dict[str, Any]:
        # global values: a process's loss is its share of the global loss x processes
        out = {k: dist.sum(v) / dist.world for k, v in self.sums.items() if not k.startswith("_")}
        count = dist.sum(self.sums["_count"]).clamp_min(1)
        for k, v in self.sums.items():
            if k.startswith("_mean/"):  # masked means over the decisions that ran
                out[k[6:]] = dist.sum(v) / count
        for k, v in self.maxima.items():
            out[k] = torch.tensor(dist.max(v))
        return out
