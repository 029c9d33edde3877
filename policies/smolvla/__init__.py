"""SmolVLA from LeRobot policy directories: run as LeRobot runs it, fine-tuned with RL, written back."""

from mmrl.policies.smolvla.config import SmolVLAConfig
from mmrl.policies.smolvla.model import SmolVLAPolicy, lerobot_actions  # registers smolvla
from mmrl.policies.vla.lerobot_flow import save_lerobot_policy
from mmrl.policies.smolvla.tiny import write_tiny_smolvla

__all__ = ["SmolVLAConfig", "SmolVLAPolicy", "lerobot_actions", "save_lerobot_policy", "write_tiny_smolvla"]
