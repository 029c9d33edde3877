"""Group filters: decide which groups of samples enter the update.

Every registered filter has the signature ::

    fn(rewards: Tensor[B], group_id: Tensor[B], **options) -> keep: Tensor[B] bool

and keeps or drops whole groups. ``group_id`` may hold any integers, in any order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from mmrl.config import Component, option
from mmrl.errors import ConfigError
from mmrl.registry import FILTERS


@dataclass
class FilterConfig(Component):
    """An entry of ``algo.filters``: a group filter (``type``) and its own options."""


@dataclass
class ZeroVarianceConfig(FilterConfig):
    type: str = option("zero_variance", "group filter (mmrl list filters)")
    tol: float = option(1e-8, "groups whose reward spread (max - min) is at most this are dropped", ge=0)


@dataclass
class AccuracyBandConfig(FilterConfig):
    type: str = option("accuracy_band", "group filter (mmrl list filters)")
    lo: float = option(0.1, "lowest group mean reward kept", ge=0)
    hi: float = option(0.9, "highest group mean reward kept", ge=0)

    def validate(self, path: str) -> None:
        if self.lo > self.hi:
            raise ConfigError(f"{path}.lo", self.lo, f"must be <= hi ({self.hi})")


def _per_group(rewards: Tensor, group_id: Tensor, reduce: str) -> Tensor:
    """``reduce`` ("mean", "amax", "amin") of each sample's group, per sample."""
    ids, index = torch.unique(group_id.to(rewards.device), return_inverse=True)
    per_group = rewards.new_zeros(len(ids)).scatter_reduce(0, index, rewards, reduce, include_self=False)
    return per_group[index]


@FILTERS.register("zero_variance", config=ZeroVarianceConfig)
def zero_variance(rewards: Tensor, group_id: Tensor, *, tol: float = 1e-8) -> Tensor:
    """Drop groups whose rewards are all equal (max − min ≤ tol): their group-relative
    advantages are zero (DAPO dynamic sampling, Yu et al. 2025). Groups of one are dropped."""
    spread = _per_group(rewards, group_id, "amax") - _per_group(rewards, group_id, "amin")
    return spread > tol


@FILTERS.register("accuracy_band", config=AccuracyBandConfig)
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
