"""Pairwise (Bradley–Terry) reward models: ``bt_image``, ``bt_image_set``, ``bt_text`` and ``bt_trajectory``,
trained on preference pairs by ``mmrl train-reward`` and used in RL by the
``pairwise_preference`` reward (docs/reward_models.md)."""

from mmrl.policies.reward_model.config import BTImageConfig, BTImageSetConfig, BTTextConfig, BTTrajectoryConfig
from mmrl.policies.reward_model.model import BTImageModel, BTImageSetModel, BTTextModel, BTTrajectoryModel, RewardModel, bradley_terry_loss  # registers all four

__all__ = [
    "BTImageConfig", "BTImageModel", "BTImageSetConfig", "BTImageSetModel", "BTTextConfig", "BTTextModel", "BTTrajectoryConfig", "BTTrajectoryModel",
    "RewardModel", "bradley_terry_loss",
]
