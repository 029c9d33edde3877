"""Group filters: decide which groups of samples enter the update.

Every registered filter has the signature ::

    fn(rewards: Tensor[B], group_id: Tensor[B], **options) -> keep: Tensor[B] bool

and keeps or drops whole groups. ``group_id`` may hold any integers, in any order.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mmrl.registry import FILTERS


def _per_group(rewards: Tensor, group_id: Tensor, reduce: str) -> Tensor:
    """``reduce`` ("mean", "amax", "amin") of each sample's group, per sample."""
    ids, index = torch.unique(group_id, return_inverse=True)
    per_group = rewards.new_zeros(len(ids)).scatter_reduce(0, index, rewards, reduce, include_self=False)
    return per_group[index]


@FILTERS.register("zero_variance")
def zero_variance(rewards: Tensor, group_id: Tensor, *, tol: float = 1e-8) -> Tensor:
    """Drop groups whose rewards are all equal (max − min ≤ tol): their group-relative
    advantages are zero (DAPO dynamic sampling, Yu et al. 2025). Groups of one are dropped."""
    spread = _per_group(rewards, group_id, "amax") - _per_group(rewards, group_id, "amin")
    return spread > tol


@FILTERS.register("accuracy_band")
def accuracy_band(rewards: Tensor, group_id: Tensor, *, lo: float = 0.1, hi: float = 0.9) -> Tensor:
    """Keep groups whose mean reward (success rate) lies in [lo, hi], bounds included
    (SimpleVLA-RL, Li et al. 2025): too easy and too hard tasks give little signal."""
    success_rate = _per_group(rewards, group_id, "mean")
    return (success_rate >= lo) & (success_rate <= hi)


def apply_filters(names_with_kwargs: Sequence[tuple[str, dict]], rewards: Tensor, group_id: Tensor) -> Tensor:
    """AND of the named filters, e.g. ``[("zero_variance", {}), ("accuracy_band", {"lo": 0.2})]``;
    an empty list keeps everything."""
    keep = torch.ones_like(rewards, dtype=torch.bool)
    for name, kwargs in names_with_kwargs:
        keep &= FILTERS.get(name, "filters")(rewards, group_id, **kwargs)
    return keep
