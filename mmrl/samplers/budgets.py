"""Rollout budgets per prompt: how many samples each prompt of a step gets (Knapsack RL).

A step draws ``groups_per_step × group_size`` samples. With ``sampler.budget.type: fixed``
every prompt gets ``group_size`` of them. With ``knapsack`` (Li et al. 2025, "Knapsack RL:
Unlocking Exploration of LLMs via Optimizing Budget Allocation", arXiv 2509.25849) the same
total is shared out by each prompt's pass rate p, estimated from its recent samples:

- The value of giving a prompt N samples is V(N, p) = (1 − p^N − (1 − p)^N) · p(1 − p)²:
  the probability that its group has both a pass and a fail (so its group-relative
  advantages are not all zero) times the paper's information gain p(1 − p)².
- Prompts whose p is not known yet (fewer than ``min_history`` samples seen) get
  ``group_size``; prompts at p = 0 or p = 1 get ``min_size``; every other prompt gets
  ``min_size`` plus a share of what is left, chosen by an exact dynamic program (a
  multiple-choice knapsack) that maximizes Σ V(N_i, p_i) with N_i ≤ ``max_size``.
- Surplus: a prompt at 0 < p < 1 needs about c(p) = log(1 − α) / log(max(p, 1 − p))
  samples to show both outcomes with probability α. When what is left exceeds what the
  open prompts need beyond ``min_size`` (Σ ⌈min(c(p_i), max_size)⌉ − min_size), the excess
  goes to the prompts at p = 0 (the paper's exploration of hard prompts; to the other
  prompts when none is at 0), and the program shares out the rest. ``explore: false``
  leaves that rule out: the program shares everything left among the open prompts.
- Every sample of the budget is given out: what the caps leave goes, one by one, to the
  prompts below ``max_size`` in order.

What this follows of the reference (``sampling_budget_by_knapsack`` / ``solve_by_dp`` in the
paper's code): the value, the minimums, the surplus rule and α = 0.9, the pass-rate buffer
(the last 16 outcomes, valid from 8). Two differences: its program scores a prompt that gets no
samples beyond its minimum as 0 instead of V(min_size, p), where here every prompt is scored
by V of what it gets (the objective as the paper writes it); and its surplus test compares the
open prompts' whole costs with the budget left after the minimums, where here both sides
leave the minimums out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from mmrl.config import option
from mmrl.errors import ConfigError


@dataclass
class BudgetConfig:
    """``sampler.budget``: how the samples of a step are shared among its prompts."""

    type: Literal["fixed", "knapsack"] = option("fixed", "fixed: algo.group_size samples per prompt; knapsack: the same total shared by each prompt's recent pass rate (Knapsack RL)")
    min_size: int = option(2, "knapsack: the fewest samples a prompt gets (also what prompts at pass rate 0 or 1 get)", ge=1)
    max_size: int = option(32, "knapsack: the most samples a prompt gets", ge=1)
    history: int = option(16, "knapsack: outcomes kept per prompt (its pass rate is their mean)", ge=1)
    min_history: int = option(8, "knapsack: outcomes a prompt needs before its pass rate is used (before that it gets algo.group_size)", ge=1)
    alpha: float = option(0.9, "knapsack: a prompt's cost is the samples that show both outcomes with this probability (see explore)", gt=0, lt=1)
    value: Literal["paper", "variance"] = option("paper", "knapsack: a prompt's information gain: paper = p(1 - p)^2 (Knapsack RL, weighted to hard prompts); variance = p(1 - p) (hard and nearly solved prompts alike)")
    explore: bool = option(True, "knapsack: samples beyond what the open prompts cost go to the prompts at pass rate 0 (the paper's rule); false: the program shares them all among the open prompts")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.min_size > self.max_size:
            raise ConfigError(p + "min_size", self.min_size, f"must be <= max_size ({self.max_size})")
        if self.min_history > self.history:
            raise ConfigError(p + "min_history", self.min_history, f"must be <= history ({self.history})")


def budget_value(n: int, p: float, value: str = "paper") -> float:
    """V(n, p) = (1 − p^n − (1 − p)^n) · g(p), with the information gain g(p) = p(1 − p)²
    (``paper``) or p(1 − p) (``variance``)."""
    if value not in ("paper", "variance"):
        raise ValueError(f"value {value!r}: must be 'paper' or 'variance'")
    mixed = 1.0 - p**n - (1.0 - p) ** n
    # this order of the products is what the benchmarks ran: the program's ties, and so the
    # runs, follow the last bit of these values
    return mixed * p * (1.0 - p) ** 2 if value == "paper" else mixed * (p * (1.0 - p))


def sample_cost(p: float, alpha: float) -> float:
    """Samples that show both outcomes with probability ``alpha``: log(1 − α) / log(max(p, 1 − p))."""
    return math.log(1.0 - alpha) / math.log(max(p, 1.0 - p))


def knapsack_sizes(values: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Exact multiple-choice knapsack: item i takes extra e_i ∈ [0, len(values[i]) − 1] units
    worth ``values[i][e_i]``; maximizes Σ values[i][e_i] subject to Σ e_i ≤ ``budget``.
    Returns the e_i. Ties go to the smaller extra of the later item first (deterministic)."""
    n = len(values)
    width = budget + 1
    best = np.zeros(width)  # best[w]: the best value of the items so far using at most w units
    choices = np.zeros((n, width), dtype=np.int64)
    for i, row in enumerate(values):
        new = np.full(width, -np.inf)
        pick = np.zeros(width, dtype=np.int64)
        for e, v in enumerate(row[:width]):
            cand = np.full(width, -np.inf)
            cand[e:] = best[: width - e] + v
            better = cand > new  # strict: the smallest extra wins a tie
            new[better], pick[better] = cand[better], e
        best, choices[i] = new, pick
    out, w = [0] * n, budget
    for i in range(n - 1, -1, -1):
        out[i] = int(choices[i, w])
        w -= out[i]
    return out


def allocate(rates: Sequence[float | None], total: int, default: int, min_size: int, max_size: int, alpha: float = 0.9, explore: bool = True, value: str = "paper") -> list[int]:
    """Samples per prompt, summing to ``total`` (the module docstring). ``rates``: each
    prompt's pass rate, None where it is not known (that prompt gets ``default``)."""
    n = len(rates)
    sizes = [default if p is None else min_size for p in rates]
    if not sum(sizes) <= total <= max_size * n:
        raise ValueError(f"a budget of {total} samples cannot give {n} prompts their first {sum(sizes)} and at most {max_size} each")
    left = total - sum(sizes)
    open_ = [i for i, p in enumerate(rates) if p is not None and 0.0 < p < 1.0]
    zeros = [i for i, p in enumerate(rates) if p == 0.0]
    # what the open prompts need beyond min_size to show both outcomes with probability alpha
    need = sum(max(0, math.ceil(min(max_size, sample_cost(rates[i], alpha))) - min_size) for i in open_)
    if explore and open_ and need < left:  # more than the open prompts need: the surplus explores
        left -= _spread(sizes, zeros or [i for i in range(n) if i not in set(open_)], left - need, max_size)
    if open_ and left > 0:
        tables = [[budget_value(min_size + e, rates[i], value) for e in range(max_size - min_size + 1)] for i in open_]
        extra = knapsack_sizes(tables, left)
        for i, e in zip(open_, extra):
            sizes[i] += e
        left -= sum(extra)
    # caps reached, or no open prompt: the rest to the prompts at 0, then to every prompt, in order
    left -= _spread(sizes, zeros, left, max_size)
    left -= _spread(sizes, list(range(n)), left, max_size)
    assert left == 0 and sum(sizes) == total, (sizes, total)
    return sizes


def _spread(sizes: list[int], takers: list[int], amount: int, cap: int) -> int:
    """Give ``amount`` samples one at a time round-robin to ``takers`` below ``cap``;
    returns how many were given."""
    given = 0
    while given < amount:
        room = [i for i in takers if sizes[i] < cap]
        if not room:
            break
        for i in room:
            if given == amount:
                break
            sizes[i] += 1
            given += 1
    return given


class PassHistory:
    """The last ``history`` outcomes (1 pass, 0 fail) of each prompt, by its index among the
    train records; its pass rate is their mean once there are ``min_history`` of them."""

    def __init__(self, history: int, min_history: int):
        self.history, self.min_history = history, min_history
        self.outcomes: dict[int, deque] = {}

    def add(self, prompts: Sequence[int], passed: Sequence[float]) -> None:
        for i, ok in zip(prompts, passed):
            self.outcomes.setdefault(int(i), deque(maxlen=self.history)).append(float(ok))

    def rate(self, prompt: int) -> float | None:
        seen = self.outcomes.get(int(prompt))
        if seen is None or len(seen) < self.min_history:
            return None
        return sum(seen) / len(seen)

    def state_dict(self) -> dict[str, list[float]]:
        return {str(i): list(v) for i, v in self.outcomes.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.outcomes = {int(i): deque(v, maxlen=self.history) for i, v in state.items()}
