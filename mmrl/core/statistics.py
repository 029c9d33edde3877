"""Running statistics that stay identical across processes.

A component that keeps statistics of what it sees (an observation normalizer, a decision
counter that drives a schedule, a reward normalizer) holds them in one of these modules.
What it observes is only *pending* until the trainer commits it, once per training step,
with the pending sums of all processes added together. So every process normalizes with
the same statistics, and they are the statistics one process would have had: N processes
= 1 process. Within a step the statistics are fixed, so the samples of one step are all
normalized alike.

:func:`wilson_interval` is the confidence interval every evaluation reports.

The committed statistics are buffers (saved with the weights, restored on resume); the
pending sums are not buffers, so the distributed wrapper never broadcasts them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

Reduce = Callable[[Tensor], Tensor]  # sums a tensor over processes (identity for one process)


class SyncedStatistic(nn.Module):
    """Base of statistics committed by the trainer (:func:`commit_statistics`). A subclass
    keeps what it observed and has not committed in one float64 tensor ``_pending``."""

    def commit(self, reduce: Reduce) -> None:
        raise NotImplementedError


class RunningMoments(SyncedStatistic):
    """Mean and (population) variance of every row observed so far, per feature.

    Starts from a tiny prior count with mean 0 and variance 1, which keeps the first
    normalizations finite. ``commit`` merges the step's rows as one batch (parallel
    Welford): with n new rows of mean m_b and variance v_b,
    mean ← mean + (m_b − mean)·n/(c + n),
    var ← (c·var + n·v_b + (m_b − mean)²·c·n/(c + n)) / (c + n), c ← c + n.
    """

    def __init__(self, dim: int, prior_count: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(prior_count, dtype=torch.float64))
        self._pending = torch.zeros(2 * dim + 1, dtype=torch.float64)  # count, sum, sum of squares

    @torch.no_grad()
    def observe(self, rows: Tensor) -> None:
        """Add rows [N, dim] to the pending sums (used from the next commit on)."""
        x = rows.detach().to("cpu", torch.float64).reshape(rows.shape[0], -1)
        self._pending += torch.cat([torch.tensor([float(x.shape[0])], dtype=torch.float64), x.sum(0), x.square().sum(0)])

    @torch.no_grad()
    def commit(self, reduce: Reduce) -> None:
        pending = reduce(self._pending.clone()).to(self.mean.device)  # summed on the CPU; the buffers sit with the model
        self._pending.zero_()
        n = pending[0].item()
        if n == 0:
            return
        dim = self.mean.numel()
        batch_mean = pending[1 : 1 + dim] / n
        batch_var = (pending[1 + dim :] / n - batch_mean.square()).clamp_min(0)
        count = self.count.item()
        total = count + n
        mean = self.mean.double()
        delta = batch_mean - mean
        self.mean.copy_(mean + delta * (n / total))
        self.var.copy_((self.var.double() * count + batch_var * n + delta.square() * (count * n / total)) / total)
        self.count.fill_(total)

    def normalize(self, x: Tensor, clip: float | None = None) -> Tensor:
        out = (x - self.mean) / torch.sqrt(self.var + 1e-8)
        return out if clip is None else out.clamp(-clip, clip)


class RunningCount(SyncedStatistic):
    """A count of events (e.g. sampled decisions, the clock of an exploration schedule)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("value", torch.tensor(0.0, dtype=torch.float64))
        self._pending = torch.zeros(1, dtype=torch.float64)

    def add(self, n: float) -> None:
        self._pending += n

    @torch.no_grad()
    def commit(self, reduce: Reduce) -> None:
        self.value += reduce(self._pending.clone())[0]
        self._pending.zero_()


def commit_statistics(module: nn.Module, reduce: Reduce) -> None:
    """Commit every :class:`SyncedStatistic` inside ``module``, in module order (the same on
    every process, so the reductions pair up)."""
    for m in module.modules():
        if isinstance(m, SyncedStatistic):
            m.commit(reduce)


def take_pending(module: nn.Module) -> list[Tensor]:
    """The pending sums of every :class:`SyncedStatistic` inside ``module`` (module order),
    cleared: what a rollout worker's policy copy observed while sampling, for the learner's
    policy to commit (:func:`add_pending`)."""
    out = []
    for m in module.modules():
        if isinstance(m, SyncedStatistic):
            out.append(m._pending.clone())
            m._pending.zero_()
    return out


def add_pending(module: nn.Module, pending: list[Tensor]) -> None:
    """Add sums taken by :func:`take_pending` from a copy of ``module`` to its pending sums
    (none: nothing to add)."""
    if not pending:
        return
    stats = [m for m in module.modules() if isinstance(m, SyncedStatistic)]
    if len(stats) != len(pending):
        raise ValueError(f"{len(pending)} pending statistics for a module with {len(stats)}")
    for m, sums in zip(stats, pending):
        m._pending += sums.to(m._pending)


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sound at 0 and 1, unlike ±1.96·SE)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))
