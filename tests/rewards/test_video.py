"""The temporal-consistency reward on rollout.info["videos"]."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS


def video_rollout(videos: torch.Tensor, **info) -> Rollout:
    n = len(videos)
    return Rollout(group_id=torch.zeros(n, dtype=torch.long), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info={"videos": videos, **info})


def reward(**options):
    return build_reward(from_dict(REWARDS.entry("temporal_consistency").config, {"type": "temporal_consistency", **options}), RewardContext())


def test_a_static_video_scores_higher_than_a_flickering_one_per_sample():
    g = torch.Generator().manual_seed(0)
    frame = torch.randint(0, 256, (1, 1, 8, 8, 3), generator=g, dtype=torch.uint8)
    static = frame.expand(1, 5, 8, 8, 3)
    flicker = torch.randint(0, 256, (1, 5, 8, 8, 3), generator=g, dtype=torch.uint8)
    black_white = torch.zeros(1, 5, 8, 8, 3, dtype=torch.uint8)
    black_white[:, 1::2] = 255
    scores = reward()(video_rollout(torch.cat([static, flicker, black_white])))
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert scores[0] == 1.0 and scores[2] == 0.0
    assert scores[0] > scores[1] > scores[2]
    assert 0.55 < scores[1] < 0.75  # uniform noise: E|u - v| = 255 / 3 grey levels


def test_the_reference_frame_sets_whether_a_slow_drift_counts():
    # brightness rising by 10 grey levels a frame: 10 / 255 against the previous frame,
    # 10 t / 255 against the first
    ramp = (torch.arange(5) * 10).to(torch.uint8).view(1, 5, 1, 1, 1).expand(1, 5, 4, 4, 3)
    previous = reward()(video_rollout(ramp))
    first = reward(reference="first")(video_rollout(ramp))
    torch.testing.assert_close(previous, torch.tensor([1 - 10 / 255]))
    torch.testing.assert_close(first, torch.tensor([1 - 25 / 255]))  # mean of 10, 20, 30, 40


def test_a_single_frame_is_consistent():
    assert reward()(video_rollout(torch.full((2, 1, 4, 4, 3), 9, dtype=torch.uint8))).tolist() == [1.0, 1.0]


def test_missing_or_malformed_videos_say_what_was_expected():
    rollout = Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"images": torch.zeros(1, 4, 4, 3, dtype=torch.uint8)})
    with pytest.raises(ConfigError, match="videos"):
        reward()(rollout)
    with pytest.raises(ValueError, match=r"uint8 tensor \[B, F, H, W, 3\]"):
        reward()(video_rollout(torch.zeros(1, 2, 4, 4, 3)))
    with pytest.raises(ConfigError, match="reference"):
        reward(reference="last")
