"""Rewards of generated videos that need no network: temporal consistency.

Videos reach rewards as ``rollout.info["videos"]``: a uint8 tensor [B, F, H, W, 3], RGB, F
frames per sample (a video generator's policy puts its decoded samples there, and its
first frames as ``info["images"]`` so that the image rewards apply as well).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS


def rollout_videos(rollout: Rollout, reward: str) -> Tensor:
    """``rollout.info["videos"]`` as a uint8 tensor [B, F, H, W, 3] on the CPU; an error says
    what the reward expected when the videos are missing or of another kind."""
    if "videos" not in rollout.info:
        raise ConfigError("rewards", reward, f"scores videos and needs rollout.info['videos'] (uint8 [B, F, H, W, 3], RGB) from a video-generating policy; the rollout info has {sorted(rollout.info)}")
    videos = rollout.info["videos"]
    if not isinstance(videos, Tensor) or videos.dtype != torch.uint8 or videos.dim() != 5 or videos.shape[-1] != 3:
        kind = f"a {videos.dtype} tensor of shape {tuple(videos.shape)}" if isinstance(videos, Tensor) else type(videos).__name__
        raise ValueError(f"reward {reward!r}: rollout.info['videos'] must be a uint8 tensor [B, F, H, W, 3] (RGB); got {kind}")
    return videos.detach().cpu()


def frame_differences(videos: Tensor, reference: str = "previous") -> Tensor:
    """Mean absolute difference [B] of each video's frames, in [0, 1] (grey levels / 255):
    d = mean over t ≥ 1 and pixels of |x_t − x_ref(t)| / 255, where x_ref(t) is frame t − 1
    (``previous``) or frame 0 (``first``). A single-frame video has d = 0."""
    x = videos.float() / 255.0
    if x.shape[1] < 2:
        return x.new_zeros(x.shape[0])
    ref = x[:, :-1] if reference == "previous" else x[:, :1]
    return (x[:, 1:] - ref).abs().flatten(1).mean(1)


@dataclass
class TemporalConsistencyConfig(RewardConfig):
    """1 − the mean absolute frame-to-frame difference of each video (in [0, 1]): a static
    video scores 1, one whose every pixel jumps between black and white every frame 0."""

    type: str = option("temporal_consistency", "registered name of this component (see `mmrl list`)")
    reference: Literal["previous", "first"] = option("previous", "each frame is compared with the frame before it (flicker), or with the first frame (drift as well)")


@REWARDS.register("temporal_consistency", config=TemporalConsistencyConfig)
def temporal_consistency(rollout: Rollout, cfg: TemporalConsistencyConfig) -> Tensor:
    """r_i = 1 − mean_{t ≥ 1, pixels} |x_t − x_ref(t)| / 255 for video i (:func:`frame_differences`)."""
    return 1.0 - frame_differences(rollout_videos(rollout, "temporal_consistency"), cfg.reference)
