"""π0 and π0.5 from LeRobot policy directories: run as LeRobot runs them, fine-tuned with RL, written back."""

from mmrl.policies.pi0.config import PI0Config, PI05Config
from mmrl.policies.pi0.model import PI0Policy, PI05Policy, lerobot_actions  # registers pi0, pi05
from mmrl.policies.vla.lerobot_flow import save_lerobot_policy
from mmrl.policies.pi0.tiny import write_tiny_pi0

__all__ = ["PI0Config", "PI05Config", "PI0Policy", "PI05Policy", "lerobot_actions", "save_lerobot_policy", "write_tiny_pi0"]
