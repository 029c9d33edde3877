"""Discrete-token VLA (OpenVLA style): actions binned and predicted as tokens."""

from mmrl.policies.token_vla.config import TokenVLAConfig
from mmrl.policies.token_vla.model import TokenVLAPolicy

__all__ = ["TokenVLAConfig", "TokenVLAPolicy"]
