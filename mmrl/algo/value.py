"""A learned value baseline: generalized advantage estimation (GAE) and the critic's loss.

GAE (Schulman et al. 2016) over the decisions of an episode, with a critic's values V_t:

    δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t
    A_t = δ_t + γλ·m_{t+1}·A_{t+1},      A_T = 0, V_T = 0
    R_t = A_t + V_t                      (the critic's target)

m_t is the decision mask: masked decisions get A = 0 and cut the recursion (the first masked
decision after an episode's last is its end). After an episode's last decision V is 0, unless
``bootstrap_truncated``: then an episode that a time limit (or ``sampler.max_decisions``) cut
continues with the critic's value of its final observation (the env sampler keeps that
observation as ``info["final_replay"]``), as ManiSkill's PPO does; CleanRL's PPO, like the
default, reads every end as terminal, right where the time limit is part of the task. An action chunk is one decision; its reward is the chunk's
env rewards discounted to its first env step (the env sampler's ``step_rewards``), and γ
discounts from decision to decision, as the step-level group returns do.

A registered advantage with the trait ``needs_values`` (this one) is called with the
per-decision rewards [B, T], the values [B, T] and the mask instead of one reward per sample;
the learner (mmrl/train/learner.py) computes both and trains the critic beside the policy
(mmrl/core/critic.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.algo.advantage import AdvantageConfig, _groups
from mmrl.config import option
from mmrl.registry import ADVANTAGES


def generalized_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float | Tensor, lam: float, bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(A, R) [B, T] of the module docstring's recursion in the inputs' dtype; 0 on masked
    decisions. ``bootstrap`` [B]: the value after each sample's last valid decision (V of
    the final observation of an episode a time limit cut; 0 for one that terminated); None:
    0 for every sample. The valid decisions of a row are a prefix (env episodes).
    ``gamma``: one discount, or one per decision [B, T] (γ^k_t for an action chunk of k_t
    env steps: the next decision's value is k_t steps away)."""
    m = mask.to(rewards.dtype)
    if isinstance(gamma, Tensor):
        gamma = gamma.to(rewards.dtype)
    values = values.to(rewards.dtype) * m
    adv = torch.zeros_like(rewards)
    next_adv = rewards.new_zeros(rewards.shape[0])
    next_value = bootstrap.to(rewards.dtype) if bootstrap is not None else rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        g = gamma[:, t] if isinstance(gamma, Tensor) else gamma
        delta = rewards[:, t] + g * next_value - values[:, t]
        next_adv = m[:, t] * (delta + g * lam * next_adv)
        adv[:, t] = next_adv
        # past the last valid decision the bootstrap waits; from there on V_{t+1} is the next one's
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
    return adv, (adv + values) * m


class TokenLayout:
    """GAE over decisions of several columns (a language agent's turn: its tokens, masked past
    the turn's end), as PPO for language models runs it over tokens. ``decision_index`` [B, C]
    names each column's decision and ``mask`` [B, C] its validity; the valid columns of a row
    are taken in order as one sequence (:meth:`compact`), each decision's per-column rewards
    and env steps summed onto its last valid column (:meth:`onto_last`), so γ discounts
    between decisions and not between the tokens of one, and a masked column inside a turn
    does not end the episode. :meth:`expand` puts the results back in the columns they came
    from (0 on masked ones)."""

    def __init__(self, decision_index: Tensor, mask: Tensor):
        self.valid = mask > 0
        self.decision_index = decision_index.long()
        b, c = mask.shape
        # valid columns first, each row's in order (a stable sort of the invalid flags)
        self.order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)
        columns = torch.arange(c).expand(b, c)
        d = int(self.decision_index.max()) + 1 if self.decision_index.numel() else 0
        self.last = torch.full((b, d), -1, dtype=torch.long).scatter_reduce(1, self.decision_index, torch.where(self.valid, columns, -1), reduce="amax")

    def onto_last(self, x: Tensor) -> Tensor:
        """[B, C]: each decision's sum of ``x`` on its last valid column, 0 elsewhere (a
        decision without a valid column keeps nothing)."""
        summed = torch.zeros(self.last.shape, dtype=x.dtype).scatter_add(1, self.decision_index, x)
        has = self.last >= 0
        out = torch.zeros_like(x)
        rows = torch.arange(x.shape[0])[:, None].expand_as(self.last)
        out[rows[has], self.last[has]] = summed[has]
        return out

    def compact(self, x: Tensor) -> Tensor:
        """[B, C]: each row's valid columns first, in order; the invalid after them."""
        return x.gather(1, self.order)

    def expand(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`compact`, with 0 on the invalid columns."""
        return torch.zeros_like(x).scatter(1, self.order, x) * self.valid.to(x.dtype)


@dataclass
class GaeConfig(AdvantageConfig):
    """GAE with a critic (``critic:`` section); per decision."""

    type: str = option("gae", "advantage estimator (mmrl list advantages)")
    level: Literal["sequence", "step"] = option("step", "gae is per decision: step")
    lam: float = option(0.95, "GAE's λ: 0 = one-step TD errors, 1 = Monte Carlo returns minus the value", ge=0, le=1)
    normalize: Literal["batch", "minibatch", "group", "none"] = option(
        "batch",
        "scale of the advantages: batch = centred and scaled over the batch's valid decisions; minibatch = over each minibatch's, in the policy-gradient loss before each optimizer step (CleanRL's, Stable-Baselines3's and ManiSkill's PPO); group = over each group's (group-normalized GAE); none = as estimated",
    )
    eps: float = option(1e-8, "added to the std of the normalization", gt=0)
    bootstrap_truncated: bool = option(
        False,
        "an episode a time limit cut continues with the critic's value of its final observation (partial-episode bootstrapping, as ManiSkill's PPO does where the time limit is not part of the task); false: every episode's end is terminal (CleanRL's PPO)",
    )


def _normalize_by(adv: Tensor, valid: Tensor, index: Tensor, eps: float) -> Tensor:
    """Centre and scale ``adv`` [B, T] over the valid decisions of each set ``index`` [B]."""
    n = int(index.max()) + 1 if index.numel() else 0
    v = valid.to(adv.dtype)
    count = torch.zeros(n, dtype=adv.dtype).index_add_(0, index, v.sum(1)).clamp_min(1)
    mean = torch.zeros(n, dtype=adv.dtype).index_add_(0, index, (adv * v).sum(1)) / count
    centred = (adv - mean[index][:, None]) * v
    var = torch.zeros(n, dtype=adv.dtype).index_add_(0, index, centred.square().sum(1)) / count
    return centred / (var.sqrt()[index][:, None] + eps)


@ADVANTAGES.register("gae", config=GaeConfig, needs_values=True)
def gae(
    rewards: Tensor, group_id: Tensor, *, values: Tensor, mask: Tensor, gamma: float | Tensor = 1.0, lam: float = 0.95, normalize: str = "batch", eps: float = 1e-8,
    bootstrap: Tensor | None = None, bootstrap_truncated: bool = False,
):
    """GAE with a learned value baseline: per-decision advantages from a critic's values.

    ``rewards`` [B, T] per decision, ``values`` [B, T] the critic's, ``mask`` [B, T],
    ``bootstrap`` [B] the values after the last decisions (None: 0; the learner passes the
    final observations' values of truncated episodes when ``bootstrap_truncated``). Returns
    (A [B, T], keep [B]) after ``normalize`` (batch, group or none; minibatch is left to the
    loss) and, as a third item, the
    critic's targets R [B, T] (before normalization)."""
    adv, returns = generalized_advantages(rewards, values, mask, gamma, lam, bootstrap)
    valid = mask > 0
    if normalize == "batch":
        adv = _normalize_by(adv, valid, torch.zeros(adv.shape[0], dtype=torch.long), eps)
    elif normalize == "group":
        index, _ = _groups(group_id)
        adv = _normalize_by(adv, valid, index, eps)
    # minibatch: as estimated here; the loss scales each minibatch's (distributed.normalizers)
    return adv, valid.any(1), returns


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Per-decision critic loss ½·(V − R)², or with ``clip`` PPO's pessimistic clipped form
    ½·max((V − R)², (V_old + clamp(V − V_old, −clip, clip) − R)²)."""
    loss = (values - returns).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns).square())
    return 0.5 * loss
