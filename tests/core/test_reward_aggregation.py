import math

import pytest
import torch

from mmrl.core.reward_aggregation import aggregate_rewards

REWARDS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
ONE_GROUP = torch.zeros(4, dtype=torch.long)


def test_weighted_sum():
    out = aggregate_rewards(REWARDS, ONE_GROUP, [1.0, 2.0], "weighted_sum")
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0, 3.0, 0.0]))


def test_normalize_then_sum_normalizes_each_component_within_its_group():
    # groups {0, 1} and {2, 3}; component 0 in group A: [1, 0] -> mean .5, std .5 -> [1, -1];
    # component 1 in group A: [0, 1] -> [-1, 1]; group B: component 0 [1, 0] -> [1, -1],
    # component 1 [1, 0] -> [1, -1]; weights (1, 2): A: [1-2, -1+2] = [-1, 1], B: [3, -3]
    groups = torch.tensor([0, 0, 1, 1])
    out = aggregate_rewards(REWARDS, groups, [1.0, 2.0], "normalize_then_sum", eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 3.0, -3.0]))


def test_normalize_then_sum_gives_zero_for_a_constant_component():
    rewards = torch.tensor([[5.0, 1.0], [5.0, 0.0]])
    out = aggregate_rewards(rewards, torch.zeros(2, dtype=torch.long), [1.0, 1.0], "normalize_then_sum")
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0]), atol=1e-5, rtol=0)


def test_log_tamed_tames_only_the_high_variation_component():
    # component 0: [1, 1, 1, 9] mean 3, std sqrt(12) -> cv 1.1547; component 1: [1, 2, 3, 4]
    # mean 2.5, std sqrt(1.25) -> cv 0.4472; threshold (mean) 0.80: only component 0 -> log(1 + r)
    rewards = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0], [9.0, 4.0]])
    out = aggregate_rewards(rewards, ONE_GROUP, [1.0, 0.5], "log_tamed")
    expected = torch.tensor([math.log(2) + 0.5, math.log(2) + 1.0, math.log(2) + 1.5, math.log(10) + 2.0])
    torch.testing.assert_close(out, expected)


def test_log_tamed_median_threshold_and_untamed_single_component():
    rewards = torch.tensor([[1.0], [3.0]])
    # one component: its cv equals the threshold, so nothing is tamed
    torch.testing.assert_close(aggregate_rewards(rewards, torch.zeros(2, dtype=torch.long), [2.0], "log_tamed", threshold="median"), torch.tensor([2.0, 6.0]))


def test_log_tamed_rejects_values_where_log1p_is_undefined():
    rewards = torch.tensor([[-2.0, 1.0], [10.0, 1.0]])
    with pytest.raises(ValueError, match="<= -1"):
        aggregate_rewards(rewards, torch.zeros(2, dtype=torch.long), [1.0, 1.0], "log_tamed")


def test_mismatched_weights_and_unknown_method_are_errors():
    with pytest.raises(ValueError, match="one column per weight"):
        aggregate_rewards(REWARDS, ONE_GROUP, [1.0], "weighted_sum")
    with pytest.raises(ValueError, match="'average'"):
        aggregate_rewards(REWARDS, ONE_GROUP, [1.0, 1.0], "average")


def test_log_tamed_reads_the_statistics_of_the_whole_scored_batch_however_it_is_split():
    # component 0 varies a lot in the first half only, so each half alone tames differently
    rewards = torch.tensor([[1.0, 1.0], [9.0, 2.0], [1.0, 3.0], [1.0, 4.0]])
    whole = aggregate_rewards(rewards, ONE_GROUP, [1.0, 0.5], "log_tamed")
    halves = [aggregate_rewards(rewards[rows], ONE_GROUP[rows], [1.0, 0.5], "log_tamed", population=rewards) for rows in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(torch.cat(halves), whole)
    alone = aggregate_rewards(rewards[2:], ONE_GROUP[2:], [1.0, 0.5], "log_tamed")  # without the batch: another reward
    assert not torch.allclose(alone, whole[2:])
