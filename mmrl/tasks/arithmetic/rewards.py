"""The arithmetic task's own reward: whether a worked completion's answer follows from its steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.registry import REWARDS
from mmrl.rewards.text import decoded_completions
from mmrl.tasks.arithmetic.world import is_consistent


@dataclass
class ArithmeticConsistencyConfig(RewardConfig):
    """1 when a column-by-column addition completion states the answer its reasoning computes."""

    type: str = option("arithmetic_consistency", "registered name of this component (see `mmrl list`)")


@REWARDS.register("arithmetic_consistency", config=ArithmeticConsistencyConfig)
def arithmetic_consistency(rollout: Rollout, cfg: ArithmeticConsistencyConfig) -> Tensor:
    """Reasoning → answer consistency of the addition format of :mod:`mmrl.tasks.arithmetic.world`:
    1 if the ``<answer>`` equals the number the ``<think>`` steps compute (right or wrong),
    else 0 — whether the answer *follows from* the reasoning, not whether it is correct.
    With ``weight: 0`` it only reports the consistency rate (``reward/arithmetic_consistency``
    in training and evaluation metrics)."""
    return torch.tensor([float(is_consistent(c)) for c in decoded_completions(rollout, "arithmetic_consistency")], dtype=torch.float32)
