"""OpenVLA-OFT checkpoints (the layout OFT's fine-tune saves) as an mmrl policy: load, run, RL-fine-tune, export.

A tiny random checkpoint in that layout: ``mmrl.policies.openvla_oft.tiny.write_tiny_openvla_oft``."""

from mmrl.policies.openvla_oft.config import OpenVLAOFTConfig
from mmrl.policies.openvla_oft.model import OpenVLAOFTPolicy

__all__ = ["OpenVLAOFTConfig", "OpenVLAOFTPolicy"]
