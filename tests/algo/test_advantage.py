import math
import pytest
import torch

from mmrl.errors import ConfigError

from mmrl.algo.advantage import best_worst, clip_advantages, discounted_returns, group_weights, grpo, median, passk, psr_nsr, rloo, step_advantages, trained_returns, trains_on_step_rewards
from mmrl.config import from_dict
from mmrl.train.run_config import AlgoConfig
from mmrl.registry import ADVANTAGES

# Two groups with non-contiguous, negative and interleaved ids:
#   group 7:  rewards 1, 0, 0, 1  (mean 0.5, population std 0.5, Bessel std sqrt(1/3) = 0.57735)
#   group -3: rewards 2, 4        (mean 3,   population std 1,   Bessel std sqrt(2) = 1.41421)
REWARDS = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0])
GROUPS = torch.tensor([7, -3, 7, 7, -3, 7])


def test_registry_holds_every_advantage():
    assert ADVANTAGES.names() == ["copo", "gae", "grpo", "median", "passk", "psr_nsr", "rloo"]


def test_grpo_divides_by_population_group_std():
    adv, keep = grpo(REWARDS, GROUPS, eps=0.0)
    # group 7: ±0.5 / 0.5;  group -3: ±1 / 1
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0]))
    assert keep.dtype == torch.bool and keep.all()


def test_grpo_ddof_one_matches_bessel_std():
    adv, _ = grpo(REWARDS, GROUPS, eps=0.0, ddof=1)
    # group 7: 0.5 / 0.57735 = 0.866025;  group -3: 1 / 1.414214 = 0.707107
    torch.testing.assert_close(adv, torch.tensor([0.866025, -0.707107, -0.866025, -0.866025, 0.707107, 0.866025]))


def test_grpo_batch_std_keeps_group_mean():
    adv, _ = grpo(REWARDS, GROUPS, eps=0.0, std="batch")
    # batch mean 8/6, E[r²] = 22/6, var = 22/6 − 64/36 = 1.888889, std = 1.374369
    # group 7: ±0.5 / 1.374369 = ±0.363803;  group -3: ±1 / 1.374369 = ±0.727607
    torch.testing.assert_close(adv, torch.tensor([0.363803, -0.727607, -0.363803, -0.363803, 0.727607, 0.363803]))


def test_grpo_std_none_is_dr_grpo_centering():
    adv, _ = grpo(REWARDS, GROUPS, std="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.0, -0.5, -0.5, 1.0, 0.5]))


def test_grpo_eps_is_added_to_std():
    adv, _ = grpo(REWARDS, GROUPS, eps=0.5)
    # group 7: 0.5 / (0.5 + 0.5);  group -3: 1 / (1 + 0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.666667, -0.5, -0.5, 0.666667, 0.5]))


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("std", ["group", "batch", "none"])
def test_grpo_group_of_one_gets_zero(std, ddof):
    adv, _ = grpo(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5, 9, 9]), std=std, ddof=ddof)
    assert adv[0] == 0.0
    assert torch.isfinite(adv).all()


def test_grpo_rejects_unknown_std_mode():
    with pytest.raises(ValueError, match="'global'"):
        grpo(REWARDS, GROUPS, std="global")


def test_rloo_subtracts_mean_of_the_others():
    adv, keep = rloo(torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0, 5.0]), torch.tensor([7, -3, 7, 7, -3, 7, 11]))
    # group 7: 1 − (0+0+1)/3 = 0.666667, 0 − 2/3 = −0.666667;  group -3: 2 − 4 = −2, 4 − 2 = 2;  group 11: alone → 0
    torch.testing.assert_close(adv, torch.tensor([0.666667, -2.0, -0.666667, -0.666667, 2.0, 0.666667, 0.0]))
    assert keep.all()


def test_median_baseline_and_single_pivot_per_group():
    # group 0: 4, 1, 3, 2 → sorted 1 2 3 4, lower median 2 (sample 3);  group 1: 1, 0, 0, 1, 3 → median 1
    rewards = torch.tensor([4.0, 1.0, 3.0, 2.0, 1.0, 0.0, 0.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    adv, keep = median(rewards, groups, std="none")
    torch.testing.assert_close(adv, torch.tensor([2.0, -1.0, 1.0, 0.0, 0.0, -1.0, -1.0, 0.0, 2.0]))
    assert not keep[3] and keep[:3].all()
    # group 1: exactly one of the two samples with the median reward is the pivot
    assert (~keep[4:]).sum() == 1 and not (keep[4] and keep[7]) and keep[[5, 6, 8]].all()


def test_median_divides_by_group_std():
    adv, keep = median(torch.tensor([4.0, 1.0, 3.0, 2.0]), torch.tensor([3, 3, 3, 3]), eps=0.0)
    # mean 2.5, population var (2.25 + 2.25 + 0.25 + 0.25)/4 = 1.25, std 1.118034; baseline 2
    torch.testing.assert_close(adv, torch.tensor([1.788854, -0.894427, 0.894427, 0.0]))
    assert keep.tolist() == [True, True, True, False]


def test_median_group_of_one_is_its_own_pivot():
    adv, keep = median(torch.tensor([5.0, 1.0, 2.0, 3.0]), torch.tensor([0, 1, 1, 1]), eps=0.0)
    assert adv[0] == 0.0 and not keep[0]
    assert (~keep).sum() == 2


def test_psr_nsr_weights_binary_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.7, 0.2, 0.5])
    adv, keep = psr_nsr(rewards, torch.zeros(5, dtype=torch.long))
    torch.testing.assert_close(adv, torch.tensor([0.1, -1.0, 0.1, -1.0, -1.0]))
    adv, _ = psr_nsr(rewards, torch.zeros(5, dtype=torch.long), psr_weight=0.5, nsr_weight=2.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, -2.0, 0.5, -2.0, -2.0]))
    assert keep.all()


def test_passk_rewards_only_the_best_by_its_margin():
    # group 4: best 0.9, second 0.5 → 0.4;  group 1: tie at the top → 0;  group 8: alone → 0
    rewards = torch.tensor([0.2, 1.0, 0.9, 1.0, 0.5, 0.0, 0.3])
    groups = torch.tensor([4, 1, 4, 1, 4, 1, 8])
    adv, keep = passk(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0]))
    assert keep.all()


def test_advantages_handle_a_large_batch_of_many_groups():
    rewards = torch.rand(4096)
    groups = torch.randperm(4096) // 8 * 1000  # 512 sparse ids, shuffled
    for name in ADVANTAGES.names():
        if ADVANTAGES.entry(name).traits.get("needs_values"):  # gae: per decision, with values (tests/algo/test_value.py)
            continue
        adv, keep = ADVANTAGES.get(name)(rewards, groups)
        assert adv.shape == keep.shape == (4096,)
    adv, _ = grpo(rewards, groups)
    group_sums = torch.zeros(4096 * 1000).index_add_(0, groups, adv)
    assert group_sums.abs().max() < 1e-4  # advantages sum to zero within each group


def test_clip_advantages():
    adv = torch.tensor([-3.0, -0.5, 0.5, 3.0])
    torch.testing.assert_close(clip_advantages(adv, 1.0), torch.tensor([-1.0, -0.5, 0.5, 1.0]))
    assert clip_advantages(adv, None) is adv
    with pytest.raises(ValueError):
        clip_advantages(adv, 0.0)


def test_best_worst_keeps_the_k_highest_and_lowest_rewards_of_each_group():
    # group 7: rewards 1, 0, 0, 1 (positions 0, 2, 3, 5); group -3: 2, 4 (positions 1, 4)
    # k = 1: group 7 keeps its first 0 (position 2, ties by position) and its last 1 (position 5)
    adv, keep = grpo(REWARDS, GROUPS)
    picked_adv, picked = best_worst(adv, keep, REWARDS, GROUPS, 1)
    assert picked.tolist() == [False, True, True, False, True, True]
    torch.testing.assert_close(picked_adv, torch.where(picked, adv, 0.0))
    assert best_worst(adv, keep, REWARDS, GROUPS, 2)[1].all()  # groups of at most 2k keep everything
    unchanged = best_worst(adv, keep, REWARDS, GROUPS, None)
    assert unchanged[0] is adv and unchanged[1] is keep
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.5, 0.7, 0.2])
    per_step = torch.ones(6, 3)
    step_adv, chosen = best_worst(per_step, torch.ones(6, dtype=torch.bool), rewards, torch.zeros(6, dtype=torch.long), 2)
    assert chosen.tolist() == [False, True, True, False, True, True]
    assert step_adv.tolist() == [[float(c)] * 3 for c in chosen.tolist()]  # [B, T]: whole rows zeroed


def test_discounted_returns_within_mask():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    returns = discounted_returns(rewards, mask, gamma=0.5)
    # row 0: G2 = 3, G1 = 2 + 0.5·3 = 3.5, G0 = 1 + 0.5·3.5 = 2.75;  row 1: G1 = 1, G0 = 1.5
    # row 2: the hole at t=2 cuts the sum: G3 = 1, G2 = 0, G1 = 1, G0 = 1.5
    expected = torch.tensor([[2.75, 3.5, 3.0, 0.0], [1.5, 1.0, 0.0, 0.0], [1.5, 1.0, 0.0, 1.0]])
    torch.testing.assert_close(returns, expected)


# ------------------------------------------------------------------ COPO


def test_copo_gives_groups_that_all_agree_a_signal_and_mixed_groups_grpo():
    from mmrl.algo.advantage import copo

    rewards = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0])
    group = torch.arange(4).repeat_interleave(4)
    adv, keep = copo(rewards, group)
    assert keep.all()
    local, _ = grpo(rewards, group)
    p = torch.tensor([1.0, 0.0, 0.5, 0.25])
    glob = (p - p.mean()) / (p.std(correction=0) + 1e-6)
    # all right / all wrong (entropy 0): GRPO gives 0, COPO the global consistency advantage
    assert torch.equal(local[:8], torch.zeros(8))
    assert torch.allclose(adv[:4], glob[0].expand(4)) and torch.allclose(adv[4:8], glob[1].expand(4)) and adv[0] > 0 > adv[4]
    # half right (entropy 1): exactly GRPO
    assert torch.allclose(adv[8:12], local[8:12])
    # a quarter right: H(1/4) = 0.8113 of the local advantage, the rest global
    h = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    assert torch.allclose(adv[12:], h * local[12:] + (1 - h) * glob[3], atol=1e-6)
    # the order of samples and the values of group ids do not matter
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(copo(rewards[perm], group[perm] * 7 + 3)[0], adv[perm])


def test_step_advantages_compare_discounted_returns_within_group_and_decision():
    """Two samples of one group, 2 and 3 decisions: the terminal reward sits on each one's
    last decision, half the step rewards on every decision, returns-to-go with gamma 0.5;
    decision t of the two samples are compared by rloo (A = r - mean of the others)."""
    terminal = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    step = torch.tensor([[0.0, 2.0, 0.0], [2.0, 0.0, 0.0]])
    adv, keep = step_advantages(rloo, terminal, torch.tensor([0, 0]), mask, step, gamma=0.5, step_reward_weight=0.5)
    # per-step rewards: [0, 1 + 1, -] and [1, 0, 0]; returns-to-go: [1.0, 2.0, -] and [1.0, 0.0, 0.0]
    # rloo within (group, t): t=0 -> 1-1, 1-1; t=1 -> 2-0, 0-2; t=2 -> a cell of one sample: 0
    assert torch.allclose(adv, torch.tensor([[0.0, 2.0, 0.0], [0.0, -2.0, 0.0]]))
    assert keep.tolist() == [True, True]


def test_the_trained_return_is_the_undiscounted_sum_of_the_rewards_step_advantages_discount():
    """The samples above: each one's combined reward plus half its step rewards on its valid
    decisions (a step past the mask is not counted) — what ``trained_return`` logs."""
    terminal = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    step = torch.tensor([[0.0, 2.0, 4.0], [2.0, 0.0, 0.0]])
    assert trained_returns(terminal, mask, step, 0.5).tolist() == [2.0, 1.0]


def test_gated_step_rewards_count_only_in_episodes_whose_outcome_passes():
    """Gated reward accumulation: with gate 1, the failed episode's turn rewards are not
    accumulated (its returns are its terminal reward alone), the successful one's are."""
    terminal = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    step = torch.tensor([[0.0, 2.0, 0.0], [2.0, 2.0, 2.0]])
    assert trained_returns(terminal, mask, step, 0.5, gate=1.0).tolist() == [2.0, 0.0]
    assert trained_returns(terminal, mask, step, 0.5).tolist() == [2.0, 3.0]
    adv, _ = step_advantages(rloo, terminal, torch.tensor([0, 0]), mask, step, gamma=1.0, step_reward_weight=0.5, step_reward_gate=1.0)
    # per-step rewards: [0, 1 + 1, -] and [0, 0, 0]; returns-to-go [2, 2, -] and [0, 0, 0]
    assert torch.allclose(adv, torch.tensor([[2.0, 2.0, 0.0], [-2.0, -2.0, 0.0]]))


def test_anchor_state_groups_compare_decisions_taken_from_the_same_state():
    """GiGPO's step level: two episodes of one group; both visit state 7 (at index 0 and at
    index 1), state 9 only once. rloo over (group, state) cells: the two decisions from state 7
    are compared (returns 1.0 and 0.0), the lone one gets 0; with episode_weight 1 each
    decision also gets its episode's advantage (rloo over the terminal rewards: +1 / −1)."""
    terminal = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    keys = torch.tensor([[7, 9], [3, 7]])
    adv, _ = step_advantages(rloo, terminal, torch.tensor([0, 0]), mask, gamma=1.0, state_keys=keys)
    # returns-to-go: [1, 1] and [0, 0]; cells: state 7 -> (sample 0, t 0), (sample 1, t 1); 9 and 3 alone
    assert torch.allclose(adv, torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
    both, _ = step_advantages(rloo, terminal, torch.tensor([0, 0]), mask, gamma=1.0, state_keys=keys, episode_weight=1.0)
    assert torch.allclose(both, adv + torch.tensor([[1.0], [-1.0]]))
    by_index, _ = step_advantages(rloo, terminal, torch.tensor([0, 0]), mask, gamma=1.0)
    assert torch.allclose(by_index, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))  # the default cells: (group, t)


@pytest.mark.parametrize("field,value", [("step_groups", "state"), ("episode_weight", 1.0)])
def test_step_level_options_outside_the_step_level_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"algo.advantage.{field}"):
        from_dict(AlgoConfig, {"advantage": {"type": "grpo", field: value}}, "algo")
    assert getattr(from_dict(AlgoConfig, {"advantage": {"type": "grpo", "level": "step", field: value}}).advantage, field) == value


def test_a_gate_on_step_rewards_the_run_does_not_train_on_is_refused():
    with pytest.raises(ConfigError, match="algo.advantage.step_reward_gate"):
        from_dict(AlgoConfig, {"advantage": {"type": "grpo", "step_reward_gate": 1.0}}, "algo")
    assert from_dict(AlgoConfig, {"advantage": {"type": "grpo", "level": "step", "step_reward_weight": 0.5, "step_reward_gate": 1.0}}).advantage.step_reward_gate == 1.0


@pytest.mark.parametrize(
    ("advantage", "trains"),
    [
        ({"type": "gae", "step_reward_weight": 1.0}, True),  # a value baseline over per-decision rewards
        ({"type": "grpo", "level": "step", "step_reward_weight": 0.5}, True),
        ({"type": "grpo", "step_reward_weight": 0.5}, False),  # sequence level: the combined reward alone
        ({"type": "gae"}, False),  # weight 0: GAE on the combined reward at each episode's end
    ],
)
def test_step_rewards_are_trained_on_with_a_weight_and_a_step_or_value_advantage(advantage, trains):
    assert trains_on_step_rewards(from_dict(AlgoConfig, {"advantage": advantage}).advantage) is trains


def test_a_decision_of_several_columns_shares_its_return_and_sees_the_later_turns():
    """A language agent's turn is one decision over several token columns, masked past its
    end: its step reward sits on its last (masked) column, and its tokens must see the rewards
    of the turns after it — a masked column is not an episode boundary."""
    k = 3  # columns per turn
    # two episodes of one group, 2 turns each; turn tokens: [2 valid, 1 pad], [1 valid, 2 pad]
    mask = torch.tensor([[1.0, 1, 0, 1, 0, 0], [1.0, 1, 0, 1, 0, 0]])
    step_rewards = torch.tensor([[0.0, 0, 0.5, 0, 0, 0], [0.0, 0, 0.0, 0, 0, 0]])  # a turn reward on episode 0's first turn
    terminal = torch.tensor([1.0, 0.0])  # episode 0 succeeds
    index = torch.arange(2).repeat_interleave(k).expand(2, -1)
    adv, keep = step_advantages(grpo, terminal, torch.zeros(2, dtype=torch.long), mask, step_rewards, step_reward_weight=1.0, decision_index=index, eps=0.0)
    # returns by turn: episode 0: [0.5 + 1, 1], episode 1: [0, 0]; GRPO in each (group, turn) cell: +1 / -1
    expected = torch.tensor([[1.0, 1, 0, 1, 0, 0], [-1.0, -1, 0, -1, 0, 0]])
    torch.testing.assert_close(adv, expected)
    assert keep.all()
    # read column by column, the first turn's tokens would see neither its reward nor the outcome
    by_column, _ = step_advantages(grpo, terminal, torch.zeros(2, dtype=torch.long), mask, step_rewards, step_reward_weight=1.0)
    assert (by_column[:, :2] == 0).all()


def test_with_one_column_per_decision_the_decision_index_changes_nothing():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=g) > 0.2).float().cummin(1).values
    step_rewards, terminal = torch.rand(6, 5, generator=g), torch.rand(6, generator=g)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    plain = step_advantages(grpo, terminal, groups, mask, step_rewards, gamma=0.9, step_reward_weight=0.5)
    indexed = step_advantages(grpo, terminal, groups, mask, step_rewards, gamma=0.9, step_reward_weight=0.5, decision_index=torch.arange(5).expand(6, -1))
    assert torch.equal(plain[0], indexed[0]) and torch.equal(plain[1], indexed[1])


def test_group_weight_makes_every_group_count_the_same_under_a_sample_mean():
    # groups of 2, 6 and 4 samples (mean size 4), rewards that give each a non-zero advantage
    group_id = torch.tensor([5, 5, 1, 1, 1, 1, 1, 1, 9, 9, 9, 9])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    adv, _ = grpo(rewards, group_id)
    weighted = group_weights(adv, group_id, "group")
    # per-sample mean of |A| per group, as a per-sample mean of the loss sees it
    share = lambda a: torch.stack([a[group_id == g].abs().sum() for g in (5, 1, 9)]) / len(a)  # noqa: E731
    raw, even = share(adv), share(weighted)
    # unweighted, a group counts in proportion to its size; weighted, as its mean |A|
    assert torch.allclose(weighted[group_id == 5], adv[group_id == 5] * 2.0)
    assert torch.allclose(weighted[group_id == 1], adv[group_id == 1] * (4 / 6))
    assert torch.allclose(weighted[group_id == 9], adv[group_id == 9])
    means = torch.stack([adv[group_id == g].abs().mean() for g in (5, 1, 9)])
    assert torch.allclose(even, means * 4 / 12)  # n_g · mean_g · (4 / n_g) / 12: the size drops out
    assert not torch.allclose(raw, means * 4 / 12)
    # per decision [B, T]: the same weight on every decision of a sample
    steps = adv[:, None].repeat(1, 3)
    assert torch.equal(group_weights(steps, group_id, "group"), weighted[:, None].repeat(1, 3))


def test_group_weight_leaves_equal_groups_and_sample_mode_bit_for_bit():
    group_id = torch.arange(4).repeat_interleave(3)
    adv = torch.randn(12)
    assert group_weights(adv, group_id, "group") is adv
    assert torch.equal(group_weights(adv, torch.tensor([0] * 2 + [1] * 10), "sample"), adv)
    with pytest.raises(ValueError, match="group_weight"):
        group_weights(adv, group_id, "prompt")
