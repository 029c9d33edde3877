"""``image_diffusion``: image generators over diffusers UNets, each denoising step a decision."""

from mmrl.policies.image_diffusion.config import ImageDiffusionConfig
from mmrl.policies.image_diffusion.model import ImageDiffusionPolicy  # registers it

__all__ = ["ImageDiffusionConfig", "ImageDiffusionPolicy"]
