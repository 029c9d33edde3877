"""``wan_video``: Wan 2.x text-to-video (diffusers' WanPipeline), each denoising step a decision."""

from mmrl.policies.wan_video.config import WanVideoConfig
from mmrl.policies.wan_video.model import WanVideoPolicy  # registers it

__all__ = ["WanVideoConfig", "WanVideoPolicy"]
