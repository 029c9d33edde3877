"""Rewards for the toy policies: verifiable, closed-form, instant."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.records import record_answers


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


@dataclass
class AnswerTokenConfig(RewardConfig):
    """Fraction of a sample's valid tokens equal to its prompt record's answer (a token id)."""

    type: str = option("answer_token", "registered name of this component (see `mmrl list`)")


@REWARDS.register("answer_token", config=AnswerTokenConfig)
def answer_token(rollout: Rollout, cfg: AnswerTokenConfig) -> Tensor:
    """Σ_l m_l·[x_l = a] / max(Σ_l m_l, 1), with a the sample's record answer as a token id."""
    tokens = _info(rollout, "tokens", "answer_token", "categorical_sequence")
    answer = torch.tensor(record_answers(rollout, "answer_token", int, "a token id"), device=tokens.device)
    mask = rollout.mask.to(tokens.device)
    hits = (tokens == answer[:, None]).float() * mask
    return hits.sum(1) / mask.sum(1).clamp(min=1.0)


@dataclass
class AnswerTargetConfig(RewardConfig):
    """Negative distance of the generated sample to its prompt record's answer (a number)."""

    type: str = option("answer_target", "registered name of this component (see `mmrl list`)")


@REWARDS.register("answer_target", config=AnswerTargetConfig)
def answer_target(rollout: Rollout, cfg: AnswerTargetConfig) -> Tensor:
    """−mean_d |x_0,d − a| of the final sample ``info["sample"]`` [B, dim], with a the
    sample's record answer."""
    sample = _info(rollout, "sample", "answer_target", "gaussian_chain").float()
    answer = torch.tensor(record_answers(rollout, "answer_target", float, "a number"), device=sample.device)
    return -(sample.flatten(1) - answer[:, None]).abs().mean(1)
