"""Multi-reward aggregation: K reward components per sample in, one reward per sample out
(``algo.reward_aggregation``; :class:`~mmrl.core.reward.RewardSet` combines a run's columns
with it).

The advantage (:mod:`~mmrl.algo.advantage`) and the group filters then see this one
reward. With a single component every method returns that component times its weight,
except ``log_tamed``, which may tame it (see below).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

METHODS = ("weighted_sum", "normalize_then_sum", "log_tamed")
THRESHOLDS = ("mean", "median")


def aggregate_rewards(
    rewards: Tensor,
    group_id: Tensor,
    weights: Sequence[float],
    method: str = "weighted_sum",
    *,
    eps: float = 1e-6,
    threshold: str = "mean",
    population: Tensor | None = None,
) -> Tensor:
    """One reward per sample from ``rewards: Tensor[B, K]``.

    - ``weighted_sum``: r = Σ_k w_k·r_k.
    - ``normalize_then_sum``: each component is first normalised within its group,
      z_k = (r_k − mean_g r_k) / (std_g r_k + ε) (population std; a group whose component is
      constant contributes 0), then r = Σ_k w_k·z_k — so a component with a large scale
      cannot drown the others (GDPO-style decoupled normalisation).
    - ``log_tamed`` (PaCo-RL): per component the batch coefficient of variation
      h_k = std r_k / (mean r_k + 1e-6); components with h_k above the threshold (the mean or
      the median of the h's) are replaced by log(1 + r_k), which damps a heavy-tailed
      component that would otherwise dominate the sum; then r = Σ_k w_k·r̃_k. Tamed components
      must be > −1.

    ``group_id`` is only read by ``normalize_then_sum``. ``population`` ([N, K], default
    ``rewards``) is the batch whose statistics ``log_tamed`` reads: the rows scored together
    (every process's, when several score parts of one batch), so that a sample's combined
    reward does not depend on how the batch was split.
    """
    if rewards.ndim != 2 or rewards.shape[1] != len(weights):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected [B, {len(weights)}], one column per weight")
    w = rewards.new_tensor(list(weights))
    if method == "weighted_sum":
        return rewards @ w
    if method == "normalize_then_sum":
        _, index, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
        sums = rewards.new_zeros(len(counts), rewards.shape[1]).index_add_(0, index, rewards)
        mean = (sums / counts[:, None])[index]
        squares = rewards.new_zeros(len(counts), rewards.shape[1]).index_add_(0, index, (rewards - mean) ** 2)
        std = (squares / counts[:, None]).sqrt()[index]
        return ((rewards - mean) / (std + eps)) @ w
    if method == "log_tamed":
        if threshold not in THRESHOLDS:
            raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
        batch = rewards if population is None else population
        cv = batch.std(0, correction=0) / (batch.mean(0) + 1e-6)
        bar = cv.mean() if threshold == "mean" else cv.median()
        tame = cv > bar
        if (rewards[:, tame] <= -1).any():
            raise ValueError("log_tamed: a tamed reward component has values <= -1, where log(1 + r) is undefined")
        tamed = torch.where(tame[None, :], torch.log1p(rewards.clamp(min=-1 + 1e-12)), rewards)
        return tamed @ w
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
