"""Diffusion policy (DPPO style): DDPM/DDIM action-chunk denoiser on images + state."""

from mmrl.policies.diffusion_policy.config import DiffusionPolicyConfig
from mmrl.policies.diffusion_policy.model import DiffusionPolicy  # registers diffusion_policy

__all__ = ["DiffusionPolicy", "DiffusionPolicyConfig"]
