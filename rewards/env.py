"""Rewards of env episodes, read from the per-episode stats the env sampler writes into
``rollout.info``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.config import option
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.core.component_config import RewardConfig


def _episode_stat(rollout: Rollout, key: str, reward: str) -> Tensor:
    if key not in rollout.info:
        raise ConfigError("rewards", reward, f"needs rollout.info[{key!r}], which the env sampler writes; use it with sampler type 'env'")
    return rollout.info[key].float()


@dataclass
class SuccessRewardConfig(RewardConfig):
    type: str = option("success", "registered name of this component (see `mmrl list`)")


@REWARDS.register("success", config=SuccessRewardConfig)
def success(rollout: Rollout, cfg: SuccessRewardConfig) -> Tensor:
    """1 if the episode succeeded, else 0 (sparse; the sampler's success_at decides when)."""
    return _episode_stat(rollout, "success", "success")


@dataclass
class ReturnRewardConfig(RewardConfig):
    type: str = option("return", "registered name of this component (see `mmrl list`)")
    scale: float = option(1.0, "multiplies the episode return (e.g. 1/max_episode_steps to bring it near [-1, 1])")


@REWARDS.register("return", config=ReturnRewardConfig)
def episode_return(rollout: Rollout, cfg: ReturnRewardConfig) -> Tensor:
    """scale x the undiscounted sum of the episode's env rewards."""
    return cfg.scale * _episode_stat(rollout, "return", "return")
