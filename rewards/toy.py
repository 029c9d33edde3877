"""Rewards for the toy policies: verifiable, closed-form, instant."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.config import option
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.train.config import RewardConfig


def _info(rollout: Rollout, key: str, reward: str, policy: str) -> Tensor:
    if key not in rollout.info:
        raise ConfigError("rewards", reward, f"needs info[{key!r}] from the policy (use it with policy.type: {policy}); the rollout info has {sorted(rollout.info)}")
    return rollout.info[key]


@dataclass
class TokenFractionConfig(RewardConfig):
    """Fraction of a sample's valid tokens equal to ``token``."""

    token: int = option(3, "the token id being rewarded", ge=0)


@REWARDS.register("token_fraction", config=TokenFractionConfig)
def token_fraction(rollout: Rollout, cfg: TokenFractionConfig) -> Tensor:
    """Fraction of valid tokens equal to ``cfg.token``: Σ_l m_l·[x_l = token] / max(Σ_l m_l, 1)."""
    tokens = _info(rollout, "tokens", "token_fraction", "categorical_sequence")
    mask = rollout.mask.to(tokens.device)
    hits = (tokens == cfg.token).float() * mask
    return hits.sum(1) / mask.sum(1).clamp(min=1.0)


@dataclass
class TargetDistanceConfig(RewardConfig):
    """Negative distance of the generated sample to a target value."""

    target: float = option(2.0, "the value every dimension of x_0 should reach")


@REWARDS.register("target_distance", config=TargetDistanceConfig)
def target_distance(rollout: Rollout, cfg: TargetDistanceConfig) -> Tensor:
    """−mean_d |x_0,d − target| of the final sample ``info["sample"]`` [B, dim]."""
    sample = _info(rollout, "sample", "target_distance", "gaussian_chain")
    return -(sample.float() - cfg.target).abs().flatten(1).mean(1)
