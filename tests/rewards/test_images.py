"""JPEG compressibility and incompressibility (DDPO) on rollout.info["images"]."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS


def image_rollout(images: np.ndarray, **info) -> Rollout:
    n = len(images)
    return Rollout(group_id=torch.zeros(n, dtype=torch.long), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info={"images": torch.from_numpy(images), **info})


def reward(name: str, **options):
    return build_reward(from_dict(REWARDS.entry(name).config, {"type": name, **options}), RewardContext())


def test_a_flat_image_compresses_far_better_than_noise():
    rng = np.random.RandomState(0)
    flat = np.full((64, 64, 3), (40, 120, 200), dtype=np.uint8)
    noise = rng.randint(0, 256, (64, 64, 3)).astype(np.uint8)
    sizes = reward("jpeg_incompressibility")(image_rollout(np.stack([flat, noise])))
    assert sizes[0] < 0.2 * sizes[1]
    compressibility = reward("jpeg_compressibility")(image_rollout(np.stack([flat, noise])))
    assert compressibility[0] > compressibility[1]


@pytest.mark.parametrize("quality", [95, 50])
def test_the_two_rewards_are_minus_each_other_and_the_jpeg_size_in_kilobytes(quality):
    rng = np.random.RandomState(1)
    ramp = np.broadcast_to(np.arange(48, dtype=np.uint8)[None, :, None] * 5, (40, 48, 3))
    images = np.stack([
        rng.randint(0, 256, (40, 48, 3)).astype(np.uint8),
        np.ascontiguousarray(ramp),
        np.full((40, 48, 3), 7, dtype=np.uint8),
        np.clip(ramp + rng.randint(0, 30, (40, 48, 3)), 0, 255).astype(np.uint8),
    ])
    rollout = image_rollout(images)
    plus = reward("jpeg_incompressibility", quality=quality)(rollout)
    minus = reward("jpeg_compressibility", quality=quality)(rollout)
    assert torch.equal(minus, -plus)
    # the size of the RGB image encoded by OpenCV (which takes BGR), in units of 1000 bytes
    expected = [cv2.imencode(".jpg", cv2.cvtColor(x, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])[1].size / 1000 for x in images]
    assert plus.tolist() == pytest.approx(expected, rel=1e-6)
    assert len(set(expected)) == len(expected)


def test_sizes_match_ddpo_which_encoded_with_pil():
    pil = pytest.importorskip("PIL.Image")
    import io

    rng = np.random.RandomState(3)
    images = np.stack([rng.randint(0, 256, (64, 64, 3)).astype(np.uint8), cv2.resize(rng.randint(0, 256, (8, 8, 3)).astype(np.uint8), (64, 64))])
    expected = []
    for x in images:
        buffer = io.BytesIO()
        pil.fromarray(x).save(buffer, format="JPEG", quality=95)
        expected.append(buffer.tell() / 1000)  # DDPO's incompressibility
    assert reward("jpeg_incompressibility")(image_rollout(images)).tolist() == pytest.approx(expected, rel=0.02)


def test_lower_quality_gives_smaller_files_of_the_same_image():
    noise = np.random.RandomState(2).randint(0, 256, (1, 32, 32, 3)).astype(np.uint8)
    assert reward("jpeg_incompressibility", quality=30)(image_rollout(noise)) < reward("jpeg_incompressibility")(image_rollout(noise))


def test_missing_or_malformed_images_and_bad_quality_are_explained():
    bare = Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"sample": torch.zeros(1, 2)})
    with pytest.raises(ConfigError, match=r"needs rollout.info\['images'\].*the rollout info has \['sample'\]"):
        reward("jpeg_compressibility")(bare)
    floats = Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"images": torch.zeros(1, 8, 8, 3)})
    with pytest.raises(ValueError, match=r"must be a uint8 tensor \[B, H, W, 3\].*torch.float32 tensor of shape \(1, 8, 8, 3\)"):
        reward("jpeg_compressibility")(floats)
    with pytest.raises(ConfigError, match="quality"):
        reward("jpeg_compressibility", quality=0)
