"""OpenVLA checkpoints (Hugging Face layout) as an mmrl policy: load, run, RL-fine-tune, export.

A tiny random checkpoint in the released layout: ``mmrl.policies.openvla.tiny.write_tiny_openvla``."""

from mmrl.policies.openvla.config import OpenVLAConfig
from mmrl.policies.openvla.model import OpenVLAPolicy

__all__ = ["OpenVLAConfig", "OpenVLAPolicy"]
