"""Rewards of generated images that need no network: JPEG compressibility (DDPO).

Images reach rewards as ``rollout.info["images"]``: a uint8 tensor [B, H, W, 3], RGB, one
image per sample (an image generator's policy puts its decoded samples there). Rewards
computed with OpenCV need the ``image`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import REWARDS


def opencv(what: str):
    """The ``cv2`` module, or an error that names the ``image`` extra."""
    try:
        import cv2
    except ImportError:
        raise MissingExtraError("opencv-python", "image", what) from None
    return cv2


def rollout_images(rollout: Rollout, reward: str) -> np.ndarray:
    """``rollout.info["images"]`` as a uint8 array [B, H, W, 3] (RGB); an error says what the
    reward expected when the images are missing or of another kind."""
    if "images" not in rollout.info:
        raise ConfigError("rewards", reward, f"scores images and needs rollout.info['images'] (uint8 [B, H, W, 3], RGB) from an image-generating policy; the rollout info has {sorted(rollout.info)}")
    images = rollout.info["images"]
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3:
        kind = f"a {images.dtype} tensor of shape {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"reward {reward!r}: rollout.info['images'] must be a uint8 tensor [B, H, W, 3] (RGB); got {kind}")
    return images.detach().cpu().numpy()


def jpeg_kilobytes(images: np.ndarray, quality: int) -> np.ndarray:
    """Size of each image as a JPEG at ``quality``, in kB (1 kB = 1000 bytes, as DDPO):
    s_i = |JPEG_q(x_i)| / 1000 for RGB uint8 images [B, H, W, 3]. DDPO encoded with PIL;
    OpenCV 4.14 and Pillow 13 (both libjpeg-turbo, 4:2:0 chroma subsampling) gave identical
    sizes at quality 95 on every image compared (``tests/rewards/test_images.py`` checks 2%)."""
    cv2 = opencv("the JPEG rewards")
    sizes = np.empty(len(images), dtype=np.float64)
    for i, image in enumerate(images):
        # OpenCV encodes BGR; the colour transform before subsampling depends on the order
        ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise RuntimeError(f"OpenCV could not encode a {image.shape} image as JPEG")
        sizes[i] = encoded.size / 1000.0
    return sizes


@dataclass
class JpegCompressibilityConfig(RewardConfig):
    """−(JPEG size in kB) of each generated image: smaller files score higher."""

    type: str = option("jpeg_compressibility", "registered name of this component (see `mmrl list`)")
    quality: int = option(95, "JPEG quality the images are encoded at (DDPO used 95)", ge=1, le=100)


@dataclass
class JpegIncompressibilityConfig(JpegCompressibilityConfig):
    """+(JPEG size in kB) of each generated image: larger files score higher."""

    type: str = option("jpeg_incompressibility", "registered name of this component (see `mmrl list`)")


@REWARDS.register("jpeg_compressibility", config=JpegCompressibilityConfig)
def jpeg_compressibility(rollout: Rollout, cfg: JpegCompressibilityConfig) -> Tensor:
    """r_i = −|JPEG_q(x_i)| / 1000: minus the image's JPEG size in kB (DDPO's compressibility)."""
    return torch.from_numpy(-jpeg_kilobytes(rollout_images(rollout, "jpeg_compressibility"), cfg.quality)).float()


@REWARDS.register("jpeg_incompressibility", config=JpegIncompressibilityConfig)
def jpeg_incompressibility(rollout: Rollout, cfg: JpegIncompressibilityConfig) -> Tensor:
    """r_i = |JPEG_q(x_i)| / 1000: the image's JPEG size in kB (DDPO's incompressibility)."""
    return torch.from_numpy(jpeg_kilobytes(rollout_images(rollout, "jpeg_incompressibility"), cfg.quality)).float()
