"""DSRL: a small noise policy steering a frozen flow or diffusion policy through its initial noise."""

from mmrl.policies.dsrl.config import DSRLConfig
from mmrl.policies.dsrl.model import DSRLPolicy  # registers dsrl

__all__ = ["DSRLConfig", "DSRLPolicy"]
