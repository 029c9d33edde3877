"""``video_diffusion``: short video generators over a diffusers UNet3D, each denoising step a decision."""

from mmrl.policies.video_diffusion.config import VideoDiffusionConfig
from mmrl.policies.video_diffusion.model import VideoDiffusionPolicy  # registers it

__all__ = ["VideoDiffusionConfig", "VideoDiffusionPolicy"]
