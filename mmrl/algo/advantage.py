"""Advantage estimators: per-sample rewards in, per-sample policy-gradient weights out, as
pure functions of one batch (the learner's stage that applies the run's estimator over all
processes' samples is ``mmrl/train/advantage_stage.py``).

Every registered advantage has the signature ::

    fn(rewards: Tensor[B], group_id: Tensor[B] long, *, eps: float = 1e-6, **options)
        -> (adv: Tensor[B], keep: Tensor[B] bool)

A group is the set of samples drawn for one prompt or initial state. ``group_id`` may hold
any integers, in any order (not necessarily contiguous or sorted). ``keep`` is False for
samples that must get no gradient (the MC-GRPO pivot) and True everywhere else. Every
advantage accepts ``eps`` so a caller can pass it uniformly; some ignore it. Group
statistics are vectorised (``torch.unique`` + ``index_add``), never a loop over groups.

An advantage registered with the trait ``needs_values`` (``gae``, mmrl/algo/value.py) is the
exception: it takes per-decision rewards [B, T] with a critic's values and returns the
critic's targets as well; the learner calls it with those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.config import Component, option
from mmrl.registry import ADVANTAGES

STD_MODES = ("group", "batch", "none")


@dataclass
class AdvantageConfig(Component):
    """``algo.advantage``: the estimator (``type``) and how the loop applies it. The fields
    below are the loop's; each estimator's own options come from its subclass."""

    type: str = option("grpo", "advantage estimator (mmrl list advantages)")
    clip: float | None = option(None, "clip advantages to [-clip, clip] (null = no clip)", gt=0)
    level: Literal["sequence", "step"] = option(
        "sequence", "sequence: one advantage per sample; step: per decision, from group-relative returns-to-go (env samplers)"
    )
    gamma: float = option(1.0, "step level: discount of the returns-to-go (and of the env sampler's chunk rewards)", ge=0, le=1)
    step_reward_weight: float = option(0.0, "step level: weight of the env's per-step rewards added to the returns-to-go", ge=0)
    step_groups: Literal["decision", "state"] = option(
        "decision", "step level: the decisions compared with each other: those of a group at the same index (decision), or those of a group taken from the same env state, wherever in their episodes (state: GiGPO's anchor states; the env sampler keys each decision's observation)"
    )
    episode_weight: float = option(0.0, "step level: add this x the sample's episode-level advantage (the same advantage over the combined rewards) to each of its decisions (GiGPO: 1)", ge=0)
    step_reward_gate: float | None = option(
        None, "gated reward accumulation (G-RA): the step rewards count only in episodes whose combined terminal reward reaches this (e.g. 1 = success); null = in every episode"
    )
    best_worst: int | None = option(
        None,
        "train on the k highest- and k lowest-reward samples of each group only (DanceGRPO's best/worst-of-n); the advantages are computed over the whole group first, the other samples leave the update (and its recompute); null = every sample",
        ge=1,
    )
    group_weight: Literal["sample", "group"] = option(
        "sample",
        "when groups differ in size (sampler.budget): sample = every sample counts the same (TRL, verl); group = each group's advantages x mean size / its size, so every prompt counts the same however many samples it drew",
    )


@dataclass
class GroupNormConfig(AdvantageConfig):
    """Group-centred advantages scaled by a std (grpo, median)."""

    std: Literal["group", "batch", "none"] = option("group", "scale: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)")
    ddof: int = option(0, "delta degrees of freedom of the std (0 population as Flow-GRPO, 1 Bessel as TRL/verl)", ge=0, le=1)
    eps: float = option(1e-6, "added to the std (TRL 1e-4, verl 1e-6)", gt=0)


@dataclass
class RlooConfig(AdvantageConfig):
    type: str = option("rloo", "advantage estimator (mmrl list advantages)")


@dataclass
class PsrNsrConfig(AdvantageConfig):
    type: str = option("psr_nsr", "advantage estimator (mmrl list advantages)")
    psr_weight: float = option(0.1, "advantage of positive samples (W-REINFORCE lambda)", ge=0)
    nsr_weight: float = option(1.0, "magnitude of the negative samples' advantage", ge=0)


@dataclass
class PasskConfig(AdvantageConfig):
    type: str = option("passk", "advantage estimator (mmrl list advantages)")


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


@ADVANTAGES.register("grpo", config=GroupNormConfig, min_group_size=2)
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


@ADVANTAGES.register("rloo", config=RlooConfig, min_group_size=2)
def rloo(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6):
    """RLOO: A_i = G/(G−1)·(r_i − mean_g r) = r_i − mean of the other G−1 rewards
    (Kool et al. 2019 "Buy 4 REINFORCE Samples"; Ahmadian et al. 2024 "Back to Basics").

    A group of one gets A = 0. ``eps`` is unused. ``keep`` is all True.
    """
    index, counts = _groups(group_id)
    scale = counts / (counts - 1).clamp(min=1)
    return scale[index] * (rewards - _group_mean(rewards, index, counts)), _keep_all(rewards)


@ADVANTAGES.register("median", config=GroupNormConfig, min_group_size=2)
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


@ADVANTAGES.register("psr_nsr", config=PsrNsrConfig)
def psr_nsr(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6, psr_weight: float = 0.1, nsr_weight: float = 1.0):
    """W-REINFORCE: A = psr_weight if r > 0.5 else −nsr_weight (Zhu et al. 2025, "The
    Surprising Effectiveness of Negative Reinforcement in LLM Reasoning").

    Rewards are read as binary: r > 0.5 is a success. Groups and ``eps`` are ignored.
    ``psr_weight=0`` trains on negative samples only (NSR), ``nsr_weight=0`` on positive
    samples only (PSR). ``keep`` is all True.
    """
    adv = torch.where(rewards > 0.5, psr_weight, -nsr_weight).to(rewards.dtype)
    return adv, _keep_all(rewards)


@ADVANTAGES.register("passk", config=PasskConfig)
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


def best_worst(adv: Tensor, keep: Tensor, rewards: Tensor, group_id: Tensor, k: int | None) -> tuple[Tensor, Tensor]:
    """Advantages ([B] or [B, T]) and keep mask [B] of the whole group's estimate, restricted
    to the k highest- and the k lowest-reward samples of each group (DanceGRPO's
    best/worst-of-n; equal rewards are ranked by position): the others get advantage 0 and
    keep False. A group of at most 2k keeps every sample; ``k`` None returns both unchanged."""
    if k is None:
        return adv, keep
    index, counts = _groups(group_id)
    order, starts = _sorted_within_groups(rewards, index, counts)
    rank = torch.empty_like(index)
    rank[order] = torch.arange(len(order), device=rewards.device) - starts[index[order]]
    chosen = (rank < k) | (rank >= counts[index] - k)
    return adv * chosen.view(-1, *[1] * (adv.ndim - 1)).to(adv.dtype), keep & chosen


def group_weights(adv: Tensor, group_id: Tensor, mode: str) -> Tensor:
    """``group_weight``: with ``"group"``, each sample's advantage ([B] or [B, T]) times
    mean group size / its group's size, so that under a per-sample mean every group (prompt)
    weighs the same in the gradient: (1/G) Σ_g (1/n_g) Σ_{i in g} A_i ∇log π_i, each prompt's
    gradient estimated from its own n_g samples (Knapsack RL's budgets change n_g, not how
    much a prompt counts). Groups of equal size, and ``"sample"``, leave ``adv`` as it is."""
    if mode == "sample":
        return adv
    if mode != "group":
        raise ValueError(f"group_weight must be 'sample' or 'group', got {mode!r}")
    index, counts = _groups(group_id)
    if bool((counts == counts[0]).all()):
        return adv
    weight = (counts.double().mean() / counts.double())[index].to(adv.dtype)
    return adv * weight.view(-1, *([1] * (adv.dim() - 1)))


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


def decision_rewards(terminal: Tensor, mask: Tensor, step_rewards: Tensor | None, step_reward_weight: float, gate: float | None = None) -> Tensor:
    """Per-decision rewards [B, T] of env episodes: the combined terminal reward on each
    sample's last valid decision, plus ``step_reward_weight`` × the env's step rewards — with
    a ``gate``, only in episodes whose terminal reward reaches it (gated reward accumulation:
    turn rewards of an episode whose outcome failed are not accumulated, so they cannot
    outweigh the outcome)."""
    B, T = mask.shape
    per_step = torch.zeros(B, T)
    last = (mask * torch.arange(1, T + 1)).argmax(1)
    per_step[torch.arange(B), last] = terminal
    if step_reward_weight > 0:
        steps = step_rewards if gate is None else step_rewards * (terminal >= gate).to(step_rewards.dtype)[:, None]
        per_step = per_step + step_reward_weight * steps
    return per_step


def trains_on_step_rewards(advantage: AdvantageConfig) -> bool:
    """Whether the advantages add ``step_reward_weight`` × the env's step rewards to the
    combined reward: a weight above 0 with a step-level advantage or one that reads values
    (``needs_values``: GAE with a critic). Otherwise the combined reward alone is trained on."""
    if advantage.step_reward_weight <= 0:
        return False
    return advantage.level == "step" or ADVANTAGES.entry(advantage.type, "algo.advantage.type").traits.get("needs_values", False)


def trained_returns(terminal: Tensor, mask: Tensor, step_rewards: Tensor, step_reward_weight: float, gate: float | None = None) -> Tensor:
    """Per sample [B], the undiscounted sum of the per-decision rewards that a step-level or
    value advantage discounts (:func:`decision_rewards` over the valid decisions): the
    combined reward ``terminal`` plus ``step_reward_weight`` × the episode's step rewards.
    The trainer logs its mean as ``trained_return``, the progress bar's and the plot's
    headline for such runs."""
    valid = (mask > 0).to(torch.float32)
    return (decision_rewards(terminal.float(), valid, step_rewards.float(), step_reward_weight, gate) * valid).sum(1)


def step_advantages(
    advantage_fn, terminal: Tensor, group_id: Tensor, mask: Tensor, step_rewards: Tensor | None = None,
    *, gamma: float = 1.0, step_reward_weight: float = 0.0, step_reward_gate: float | None = None,
    state_keys: Tensor | None = None, episode_weight: float = 0.0, decision_index: Tensor | None = None, **options,
) -> tuple[Tensor, Tensor]:
    """Per-decision advantages [B, T] for env episodes: the combined terminal reward sits on
    each sample's last valid decision, ``step_reward_weight`` × the env's step rewards on every
    decision; the discounted returns-to-go G_t (:func:`discounted_returns`) are compared within
    the cell (group, t) by ``advantage_fn`` (a registered advantage, with its ``options``) —
    or, with ``state_keys`` [B, T] (a key of the env state each decision was taken in), within
    the cell (group, state): GiGPO's anchor-state groups, where the decisions of a group's
    episodes taken from one state are compared, whatever their index. ``episode_weight`` adds
    that × each sample's episode-level advantage (``advantage_fn`` over the terminal rewards
    within the groups) to its valid decisions (GiGPO: A = A_episode + A_step).

    ``decision_index`` [B, T] (the env sampler's ``info["decision_index"]``) names the decision
    each column belongs to, where a decision spans several columns (a language agent's turn:
    one column per token, masked past the turn's end; an action chunk's tokens). The returns
    are then those of decisions: a decision's reward is the sum of its columns' (its step
    reward sits on its last column, which is masked when the turn ended earlier), it is valid
    if any of its columns is, and each of its valid columns gets its advantage. Without it,
    or with one column per decision, each column is a decision.
    Returns the advantages (0 on invalid decisions) and per sample whether any decision was
    kept."""
    per_column = decision_rewards(terminal, mask, step_rewards, step_reward_weight, step_reward_gate)
    if decision_index is not None and int(decision_index.max()) + 1 < mask.shape[1]:
        idx = decision_index.long().clamp(min=0)
        B, D = mask.shape[0], int(idx.max()) + 1
        rewards = torch.zeros(B, D).scatter_add_(1, idx, per_column)
        valid = torch.zeros(B, D).scatter_reduce_(1, idx, (mask > 0).float(), "amax")
        keys = None if state_keys is None else torch.zeros(B, D, dtype=state_keys.dtype).scatter_(1, idx, state_keys)
        adv, keep = _returns_advantages(advantage_fn, rewards, group_id, valid, gamma, keys, **options)
        adv = adv.gather(1, idx) * (mask > 0)
    else:
        adv, keep = _returns_advantages(advantage_fn, per_column, group_id, mask, gamma, state_keys, **options)
    if episode_weight > 0:
        episode, episode_keep = advantage_fn(terminal, group_id, **options)
        adv = adv + episode_weight * episode[:, None] * (mask > 0)
        keep = keep | episode_keep
    return adv, keep


def _returns_advantages(advantage_fn, rewards: Tensor, group_id: Tensor, mask: Tensor, gamma: float, state_keys: Tensor | None, **options) -> tuple[Tensor, Tensor]:
    """``advantage_fn`` over the returns-to-go of per-decision ``rewards`` [B, T], within the
    cells (group, t) or (group, state key); 0 on invalid decisions, and per sample whether
    any decision was kept."""
    B, T = mask.shape
    returns = discounted_returns(rewards, mask, gamma)
    valid = mask.reshape(-1) > 0
    if state_keys is None:
        cell = (group_id[:, None] * T + torch.arange(T)).reshape(-1)
    else:  # one cell per (group, state)
        pairs = torch.stack([group_id[:, None].expand(B, T).reshape(-1), state_keys.reshape(-1).to(group_id.dtype)], dim=1)
        cell = torch.unique(pairs, dim=0, return_inverse=True)[1]
    adv_valid, keep_valid = advantage_fn(returns.reshape(-1)[valid], cell[valid], **options)
    adv = torch.zeros(B * T)
    adv[valid] = adv_valid
    keep = torch.zeros(B * T, dtype=torch.bool)
    keep[valid] = keep_valid
    return adv.view(B, T), keep.view(B, T).any(1)


@dataclass
class CopoConfig(AdvantageConfig):
    type: str = option("copo", "advantage estimator (mmrl list advantages)")
    threshold: float = option(0.5, "a sample's outcome is a success when its reward is >= this")
    std: Literal["group", "none"] = option("group", "the local (GRPO) advantage's scale: group std or none")
    ddof: int = option(0, "delta degrees of freedom of the stds", ge=0, le=1)


@ADVANTAGES.register("copo", config=CopoConfig)
def copo(rewards: Tensor, group_id: Tensor, *, eps: float = 1e-6, threshold: float = 0.5, std: str = "group", ddof: int = 0):
    """COPO (Han et al. 2025, "COPO: Consistency-Aware Policy Optimization",
    arXiv:2508.04138), as mmrl reads it: a local GRPO advantage blended, per group, with a
    global advantage of the group's outcome consistency, by the entropy of its outcomes.

    With p_g the fraction of successes (reward ≥ ``threshold``) in group g and
    H_g = −p log₂ p − (1−p) log₂(1−p) ∈ [0, 1] its outcome entropy:

        A_i = H_g · A_local_i + (1 − H_g) · A_global_g,
        A_local_i = GRPO's (r_i − mean_g r) / (std_g r + ε),
        A_global_g = (p_g − mean_batch p) / (std_batch p + ε)   (p over the batch's samples)

    A group whose samples all agree (all right, all wrong: H = 0, where GRPO's advantage
    vanishes) still gets a signal — up if it agrees on success more than the batch does,
    down otherwise; a maximally mixed group (p = ½, H = 1) gets GRPO's advantage. ``keep``
    is all True.
    """
    index, counts = _groups(group_id)
    local = _normalize(rewards - _group_mean(rewards, index, counts), rewards, index, counts, std, ddof, eps)
    p = _group_mean((rewards >= threshold).to(rewards.dtype), index, counts)
    q = p.clamp(1e-12, 1 - 1e-12)
    entropy = torch.where((p > 0) & (p < 1), -(q * torch.log2(q) + (1 - q) * torch.log2(1 - q)), torch.zeros_like(p))
    spread = p.std(correction=ddof) if len(p) > ddof else p.new_zeros(())
    global_adv = (p - p.mean()) / (spread + eps)
    return entropy * local + (1 - entropy) * global_adv, _keep_all(rewards)
