"""Rollout budgets per prompt (Knapsack RL): the value, the exact program, the allocation rules
and the pass-rate history."""

import itertools
import math
import random

import pytest

from mmrl.samplers.budgets import PassHistory, allocate, budget_value, knapsack_sizes, sample_cost


def test_the_value_is_the_probability_of_a_mixed_group_times_the_information_gain():
    # Knapsack RL: Value(N, p) = ProbNonZeroGradient(N, p) * InfoGain(p), with
    # ProbNonZeroGradient = 1 - p^N - (1-p)^N and InfoGain = p (1-p)^2
    for n, p in [(1, 0.3), (2, 0.5), (8, 0.125), (32, 0.9)]:
        assert budget_value(n, p) == pytest.approx((1 - p**n - (1 - p) ** n) * p * (1 - p) ** 2, rel=1e-12)
    assert budget_value(8, 0.0) == 0.0 and budget_value(8, 1.0) == 0.0
    assert budget_value(1, 0.4) == pytest.approx(0.0, abs=1e-15)  # one sample is never a mixed group
    # the cost of seeing both outcomes with probability alpha: log(1 - alpha) / log(max(p, 1 - p))
    assert sample_cost(0.1, 0.9) == pytest.approx(math.log(0.1) / math.log(0.9))
    assert sample_cost(0.5, 0.9) == pytest.approx(math.log(0.1) / math.log(0.5))


def test_the_program_is_exact_against_enumeration():
    rng = random.Random(0)
    for _ in range(200):
        items = rng.randint(1, 4)
        values = []
        for _ in range(items):
            row = [rng.uniform(-1, 1)]
            for _ in range(rng.randint(0, 4)):
                row.append(row[-1] + rng.uniform(-0.5, 1))  # not necessarily increasing or concave
            values.append(row)
        budget = rng.randint(0, 9)
        got = knapsack_sizes(values, budget)
        assert sum(got) <= budget and all(0 <= e < len(row) for e, row in zip(got, values))
        best = max(
            sum(row[e] for row, e in zip(values, choice))
            for choice in itertools.product(*[range(len(row)) for row in values])
            if sum(choice) <= budget
        )
        assert sum(row[e] for row, e in zip(values, got)) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_the_allocation_spends_the_whole_budget_within_its_bounds(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 24)
    rates = [rng.choice([None, 0.0, 1.0, round(rng.uniform(0.01, 0.99), 3)]) for _ in range(n)]
    group_size, low, high = rng.choice([(8, 2, 32), (4, 1, 16), (16, 2, 64)])
    sizes = allocate(rates, group_size * n, group_size, low, high)
    assert sum(sizes) == group_size * n
    assert all(low <= s <= high for s in sizes)
    assert all(s >= group_size for s, p in zip(sizes, rates) if p is None)  # a prompt without a rate keeps its share


def test_informative_prompts_get_more_and_settled_prompts_the_minimum():
    # open prompts that need more than what is left (22 + 32 + 11 + 22 samples to show both
    # outcomes, 48 left after the minimums): no surplus, the program shares it all
    rates = [0.1, 1.0, 0.05, 1.0, 0.2, 1.0, 0.1, 1.0]
    sizes = allocate(rates, 64, 8, 2, 32)
    assert [sizes[i] for i in (1, 3, 5, 7)] == [2, 2, 2, 2]
    assert all(sizes[i] > 8 for i in (0, 2, 4, 6))
    assert sizes[0] == sizes[6]  # equal rates, equal shares
    # the program's choice beats every other split of the same extra samples among the open prompts
    value = lambda s: sum(budget_value(n, p) for n, p in zip(s, rates) if 0 < p < 1)  # noqa: E731
    open_ = [0, 2, 4, 6]
    extra = sum(sizes[i] for i in open_) - 2 * len(open_)
    for split in itertools.product(range(31), repeat=3):
        last = extra - sum(split)
        if 0 <= last <= 30:
            other = list(sizes)
            for i, e in zip(open_, [*split, last]):
                other[i] = 2 + e
            assert value(other) <= value(sizes) + 1e-12


def test_the_variance_gain_treats_hard_and_nearly_solved_prompts_alike():
    for n, p in [(2, 0.5), (8, 0.125), (32, 0.9)]:
        assert budget_value(n, p, "variance") == pytest.approx((1 - p**n - (1 - p) ** n) * p * (1 - p), rel=1e-12)
        assert budget_value(n, p, "variance") == pytest.approx(budget_value(n, 1 - p, "variance"), rel=1e-12)
    # four prompts that need more than the budget: the paper's gain p(1-p)^2 sends the samples
    # to the hard prompts, the variance shares them alike between p and 1 - p
    rates = [0.1, 0.9, 0.2, 0.8]
    paper = allocate(rates, 32, 8, 1, 32)
    variance = allocate(rates, 32, 8, 1, 32, value="variance")
    assert paper[0] > paper[1] and paper[2] > paper[3]
    assert variance[0] == variance[1] and variance[2] == variance[3]
    assert sum(paper) == sum(variance) == 32
    with pytest.raises(ValueError, match="'paper' or 'variance'"):
        budget_value(8, 0.5, "varience")


def test_the_surplus_beyond_what_open_prompts_need_explores_prompts_at_zero():
    # one open prompt at p = 0.1 needs ceil(log 0.1 / log 0.9) = 22 samples; 48 are left after
    # the minimums, so 48 - 20 = 28 go to the three prompts at 0
    sizes = allocate([0.1, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], 64, 8, 2, 32)
    assert sizes == [22, 12, 11, 11, 2, 2, 2, 2]
    # every prompt settled: the rest goes to the prompts at 0, then to all, within the cap
    assert allocate([0.0, 1.0, 1.0, 1.0], 32, 8, 2, 16) == [16, 6, 5, 5]
    assert allocate([1.0] * 4, 32, 8, 2, 32) == [8, 8, 8, 8]
    assert allocate([None] * 4, 32, 8, 2, 32) == [8, 8, 8, 8]


def test_a_budget_that_cannot_be_met_is_an_error():
    with pytest.raises(ValueError, match="cannot give 2 prompts"):
        allocate([0.5, 0.5], 100, 8, 2, 32)


def test_the_history_keeps_the_last_outcomes_and_needs_enough_of_them():
    h = PassHistory(history=4, min_history=3)
    h.add([5, 5], [1.0, 0.0])
    assert h.rate(5) is None and h.rate(6) is None
    h.add([5, 5, 5], [1.0, 1.0, 1.0])  # 1 0 1 1 1: the first falls out
    assert h.rate(5) == 0.75
    restored = PassHistory(history=4, min_history=3)
    restored.load_state_dict(h.state_dict())
    restored.add([5], [0.0])
    h.add([5], [0.0])
    assert restored.rate(5) == h.rate(5) == 0.75  # 1 1 1 0
