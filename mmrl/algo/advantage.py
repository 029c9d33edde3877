"""Advantages: per-sample rewards in, per-sample policy-gradient weights out.

Every registered advantage has the signature ::

    fn(rewards: Tensor[B], group_id: Tensor[B] long, *, eps: float = 1e-6, **options)
        -> (adv: Tensor[B], keep: Tensor[B] bool)

A group is the set of samples drawn for one prompt or initial state. ``group_id`` may hold
any integers, in any order (not necessarily contiguous or sorted). ``keep`` is False for
samples that must get no gradient (the MC-GRPO pivot) and True everywhere else. Every
advantage accepts ``eps`` so a caller can pass it uniformly; some ignore it. Group
statistics are vectorised (``torch.unique`` + ``index_add``), never a loop over groups.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from mmrl.registry import ADVANTAGES

STD_MODES = ("group", "batch", "none")
COMBINE_MODES = ("sum_then_normalize", "normalize_then_sum")


def _groups(group_id: Tensor) -> tuple[Tensor, Tensor]:
    """Contiguous group index of each sample (0 … n_groups−1) and the size of each group."""
    _, index, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    return index, counts


def _group_mean(values: Tensor, index: Tensor, counts: Tensor) -> Tensor:
    """Mean of each sample's group, per sample."""
    sums = values.new_zeros(len(counts)).index_add_(0, index, values)
    return (sums / counts)[index]


def _normalize(centered: Tensor, rewards: Tensor, index: Tensor, counts: Tensor, std: str, ddof: int, eps: float):
    """centered / (std + eps), with the std of the rewards taken over the group or the batch."""
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if std == "none":
        return centered
    if std == "batch":  # the whole batch as one group
        index, counts = torch.zeros_like(index), counts.sum().reshape(1)
    deviations = rewards - _group_mean(rewards, index, counts)
    squares = deviations.new_zeros(len(counts)).index_add_(0, index, deviations**2)
    variance = squares / (counts - ddof).clamp(min=1)  # a group of one has variance 0, also with ddof=1
    return centered / (variance.sqrt()[index] + eps)


def _sorted_within_groups(rewards: Tensor, index: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """A permutation sorting samples by group, then by reward (ascending), and the offset of
    each group's first sample in it."""
    by_reward = torch.argsort(rewards, stable=True)
    order = by_reward[torch.argsort(index[by_reward], stable=True)]
    return order, torch.cumsum(counts, 0) - counts


def _keep_all(rewards: Tensor) -> Tensor:
    return torch.ones_like(rewards, dtype=torch.bool)


@ADVANTAGES.register("grpo")
def grpo(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6, std: str = "group", ddof: int = 0):
    """GRPO: A_i = (r_i − mean_g r) / (std r + ε)  (Shao et al. 2024, DeepSeekMath).

    ``std`` chooses the divisor:
      - ``"group"``: the std of the sample's group (GRPO);
      - ``"batch"``: the std of all rewards in the batch, still with the group mean
        (Lite PPO, Liu et al. 2025 "Tricks or Traps?"; Flow-GRPO's ``global_std``);
      - ``"none"``: A_i = r_i − mean_g r (Dr. GRPO, Liu et al. 2025 "Understanding
        R1-Zero-Like Training").

    Library semantics: the population std (``ddof=0``, as Flow-GRPO); TRL and verl use
    Bessel's correction, pass ``ddof=1`` to match them (and ``eps=1e-4`` for TRL). A group
    of one gets A = 0 for every ``ddof``. ``eps`` must be > 0 when a group's rewards can
    all be equal. ``keep`` is all True.
    """
    index, counts = _groups(group_id)
    centered = rewards - _group_mean(rewards, index, counts)
    return _normalize(centered, rewards, index, counts, std, ddof, eps), _keep_all(rewards)


@ADVANTAGES.register("rloo")
def rloo(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6):
    """RLOO: A_i = G/(G−1)·(r_i − mean_g r) = r_i − mean of the other G−1 rewards
    (Kool et al. 2019 "Buy 4 REINFORCE Samples"; Ahmadian et al. 2024 "Back to Basics").

    A group of one gets A = 0. ``eps`` is unused. ``keep`` is all True.
    """
    index, counts = _groups(group_id)
    scale = counts / (counts - 1).clamp(min=1)
    return scale[index] * (rewards - _group_mean(rewards, index, counts)), _keep_all(rewards)


@ADVANTAGES.register("median")
def median(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6, std: str = "group", ddof: int = 0):
    """MC-GRPO (Kim 2026, arXiv:2601.22582): A_i = (r_i − median_g r) / (std r + ε); the
    median sample gets no gradient.

    Sample G+1 per group; the baseline is the group's median, so a small group cannot flip
    the sign of an advantage the way an outlier-pulled mean can. ``std`` and ``ddof`` mean
    what they mean for :func:`grpo` (the std is taken around the group mean).

    Library semantics: the *lower* median (sorted position ⌊(G−1)/2⌋) so the baseline is an
    actual sample, the pivot. Exactly one pivot per group (ties broken arbitrarily): it gets
    A = 0 and ``keep`` False; every other sample has ``keep`` True. A group of one is its
    own pivot.
    """
    index, counts = _groups(group_id)
    order, starts = _sorted_within_groups(rewards, index, counts)
    pivot = order[starts + (counts - 1) // 2]
    centered = rewards - rewards[pivot][index]
    keep = _keep_all(rewards)
    keep[pivot] = False
    adv = _normalize(centered, rewards, index, counts, std, ddof, eps)
    return adv.masked_fill(~keep, 0.0), keep


@ADVANTAGES.register("psr_nsr")
def psr_nsr(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6, psr_weight: float = 0.1, nsr_weight: float = 1.0):
    """W-REINFORCE: A = psr_weight if r > 0.5 else −nsr_weight (Zhu et al. 2025, "The
    Surprising Effectiveness of Negative Reinforcement in LLM Reasoning").

    Rewards are read as binary: r > 0.5 is a success. Groups and ``eps`` are ignored.
    ``psr_weight=0`` trains on negative samples only (NSR), ``nsr_weight=0`` on positive
    samples only (PSR). ``keep`` is all True.
    """
    adv = torch.where(rewards > 0.5, psr_weight, -nsr_weight).to(rewards.dtype)
    return adv, _keep_all(rewards)


@ADVANTAGES.register("passk")
def passk(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6):
    """pass@k: the best sample of a group gets A = r_max − r_second; all others get 0.

    The leave-one-out estimate for maximising the expected best-of-G reward (cf. Walder and
    Karkhanis 2025, "Pass@K Policy Optimization"): removing any sample but the best leaves
    the maximum unchanged. Ties at the top give 0; a group of one gets 0. ``eps`` is
    unused; ``keep`` is all True.
    """
    index, counts = _groups(group_id)
    order, starts = _sorted_within_groups(rewards, index, counts)
    best = order[starts + counts - 1]
    second = order[(starts + counts - 2).clamp(min=0)]
    gap = torch.where(counts > 1, rewards[best] - rewards[second], 0.0)
    adv = torch.zeros_like(rewards)
    adv[best] = gap.to(rewards.dtype)
    return adv, _keep_all(rewards)


def combine_rewards(
    rewards: Tensor,
    group_id: Tensor,
    weights: Sequence[float],
    mode: str,
    advantage_fn: Callable[..., tuple[Tensor, Tensor]],
    *,
    eps: float = 1e-6,
    **adv_kwargs,
) -> tuple[Tensor, Tensor]:
    """Advantages from K reward components ``rewards: Tensor[B, K]``.

    - ``"sum_then_normalize"``: r = Σ_k w_k·r_k, then ``advantage_fn(r)``.
    - ``"normalize_then_sum"``: a_k = ``advantage_fn(r_k)`` per component, a = Σ_k w_k·a_k,
      then a batch z-score (a − mean a) / (std a + ε) with the population std (the scheme of
      TRL's GDPO option, whose z-score takes Bessel's std and ε = 1e-4). The z-score's
      statistics use kept samples only.

    ``eps`` and ``adv_kwargs`` go to ``advantage_fn``. In ``normalize_then_sum`` a sample is
    kept only if every component keeps it, and samples not kept get A = 0.
    """
    if rewards.ndim != 2 or rewards.shape[1] != len(weights):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected [B, {len(weights)}], one column per weight")
    if mode == "sum_then_normalize":
        return advantage_fn(rewards @ rewards.new_tensor(weights), group_id, eps=eps, **adv_kwargs)
    if mode != "normalize_then_sum":
        raise ValueError(f"mode must be one of {COMBINE_MODES}, got {mode!r}")
    per_component = [advantage_fn(column, group_id, eps=eps, **adv_kwargs) for column in rewards.unbind(1)]
    summed = sum(weight * adv for weight, (adv, _) in zip(weights, per_component))
    keep = torch.stack([keep for _, keep in per_component]).all(0)
    kept = summed[keep]
    adv = (summed - kept.mean()) / (kept.std(correction=0) + eps)
    return adv.masked_fill(~keep, 0.0), keep


def clip_advantages(adv: Tensor, clip: float | None) -> Tensor:
    """Clamp advantages to [−clip, clip] (Flow-GRPO and DanceGRPO ``adv_clip_max``); None
    returns ``adv`` unchanged."""
    if clip is None:
        return adv
    if clip <= 0:
        raise ValueError(f"clip must be a positive number or None, got {clip!r}")
    return adv.clamp(-clip, clip)


def discounted_returns(step_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = m_t·(r_t + γ·G_{t+1}) with G_T = 0, for ``step_rewards: Tensor[B, T]``.

    Masked steps get G = 0 and cut the sum: a step before a hole does not see the rewards
    after it (a hole is read as an episode boundary). For the usual mask — valid steps,
    then padding — this is each trajectory's discounted reward-to-go.
    """
    valid = mask.to(step_rewards.dtype)
    returns = torch.zeros_like(step_rewards)
    future = step_rewards.new_zeros(step_rewards.shape[0])
    for t in reversed(range(step_rewards.shape[1])):
        future = valid[:, t] * (step_rewards[:, t] + gamma * future)
        returns[:, t] = future
    return returns
