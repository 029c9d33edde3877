import pytest
import torch

from mmrl.algo.filters import accuracy_band, apply_filters, zero_variance
from mmrl.errors import ConfigError
from mmrl.registry import FILTERS


def _groups_of_ten(successes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Binary rewards, groups of 10 with the given success counts, shuffled, with sparse ids."""
    rewards = torch.cat([torch.tensor([1.0] * k + [0.0] * (10 - k)) for k in successes])
    groups = torch.arange(len(successes)).repeat_interleave(10) * 100 - 50
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(0))
    return rewards[perm], groups[perm], perm


def test_registry_holds_every_filter():
    assert FILTERS.names() == ["accuracy_band", "zero_variance"]


def test_zero_variance_drops_constant_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 3.0, 2.0, 2.0 + 1e-9, 5.0, 5.0 + 1e-6], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4])
    keep = zero_variance(rewards, groups)
    # group 0 constant, 1 varied, 2 alone, 3 within tolerance, 4 beyond it
    expected = [False] * 3 + [True] * 3 + [False] + [False] * 2 + [True] * 2
    assert keep.tolist() == expected


def test_accuracy_band_is_inclusive():
    rewards, groups, perm = _groups_of_ten([1, 0, 9, 10, 5])
    group_kept = torch.tensor([True, False, True, False, True])  # rates 0.1, 0, 0.9, 1, 0.5
    expected = group_kept.repeat_interleave(10)[perm]
    assert accuracy_band(rewards, groups).tolist() == expected.tolist()
    group_kept = torch.tensor([False, False, False, False, True])  # band [0.2, 0.8]
    assert accuracy_band(rewards, groups, lo=0.2, hi=0.8).tolist() == group_kept.repeat_interleave(10)[perm].tolist()


def test_apply_filters_is_the_and_of_all():
    rewards, groups, perm = _groups_of_ten([10, 1, 5, 0])
    rewards[groups == 250] = 0.5  # group 3: mean 0.5 but no variance
    keep = apply_filters([("zero_variance", {}), ("accuracy_band", {"lo": 0.3})], rewards, groups)
    # group 0 fails both, group 1 (rate 0.1) fails the band only, group 3 fails zero_variance only
    group_kept = torch.tensor([False, False, True, False])
    assert keep.tolist() == group_kept.repeat_interleave(10)[perm].tolist()
    assert apply_filters([], rewards, groups).all()


def test_apply_filters_names_the_known_filters():
    with pytest.raises(ConfigError, match="accuracy_band, zero_variance"):
        apply_filters([("oracle", {})], torch.zeros(2), torch.zeros(2, dtype=torch.long))
