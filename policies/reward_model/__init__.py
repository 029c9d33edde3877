"""Pairwise (Bradley–Terry) reward models: ``bt_image``, ``bt_image_set`` and ``bt_text``,
trained on preference pairs by ``mmrl train-reward`` and used in RL by the
``pairwise_preference`` reward (docs/reward_models.md)."""

from mmrl.policies.reward_model.config import BTImageConfig, BTImageSetConfig, BTTextConfig
from mmrl.policies.reward_model.model import BTImageModel, BTImageSetModel, BTTextModel, RewardModel, bradley_terry_loss  # registers all three

__all__ = ["BTImageConfig", "BTImageModel", "BTImageSetConfig", "BTImageSetModel", "BTTextConfig", "BTTextModel", "RewardModel", "bradley_terry_loss"]
