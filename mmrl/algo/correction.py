"""Off-policy corrections: weights and masks for decisions a behaviour policy sampled.

The policy μ that sampled a batch (an async worker a few updates behind, a serving engine or
a lower-precision sampler) may differ from π_old, the policy before this update as the
trainer computes it. The objective's ratio π_θ/π_old is the trust region; a correction
multiplies each decision's loss by a stop-gradient weight built from ρ = π_old/μ, or removes
the decision. Every registered correction has the signature ::

    fn(old_logp: Tensor[B, T], behaviour_logp: Tensor[B, T], mask: Tensor[B, T], *,
       log_ratio_clamp: float = 20.0, **options)
        -> (weight: Tensor[B, T], mask: Tensor[B, T] bool, stats: dict[str, Tensor[]])

``old_logp`` is π_old's log-prob of each sampled decision (the trainer's recompute),
``behaviour_logp`` μ's (the sampler's). ``weight`` is detached. On valid decisions it is the
correction's weight, 0 where a decision was masked. On padding it is 1 (nothing to
correct there; the mask removes it anyway). The returned ``mask`` is the input mask without
the masked decisions: the decisions that still carry a gradient. ``stats`` are detached
scalars over the valid decisions of the input mask: ``correction/weight_mean``,
``correction/weight_max`` and ``correction/truncated_fraction`` (tis) or
``correction/masked_fraction`` (mis). ``none`` returns no stats. Each entry carries the
registry trait ``needs_behaviour`` (False only for ``none``): whether the trainer must keep
the sampler's log-probs.

Levels (``level`` option), ℓ_t = logπ_old − logμ on valid decisions, 0 on padding and
where a log-prob is NaN (a sampler that could not score a decision; TRL does the same):

- ``token``: ρ_t = exp(ℓ_t).
- ``sequence``: ρ_t = exp(Σ_t ℓ_t), the product of the token ratios, on every decision of
  the sequence. TRL's ``sequence_*`` modes and verl's ``rollout_is="sequence"``.
- ``geometric``: ρ_t = exp(Σ_t ℓ_t / |y|), the geometric mean of the token ratios, on every
  decision of the sequence. verl's ``rollout_rs="seq_mean_k1"``. A length-independent
  sequence ratio, as GSPO's.

Log-ratios are clamped to ±``log_ratio_clamp`` before ``exp`` (as verl's SAFETY_BOUND),
after the sum or mean at sequence level. mis decides what to mask on the unclamped ratio,
so a bound above e^20 still masks correctly.

**How the weight enters the loss.** As in TRL (``per_token_loss * importance_sampling_ratio``)
and verl (``pg_losses * rollout_is_weights``), the weight multiplies the objective's
per-decision loss before the aggregation: ``apply_correction(loss, weight)``. The KL and
entropy terms are not weighted (TRL adds β·KL after the product, verl's KL loss is a
separate term). The aggregation normalises with the batch's mask, not the returned one. A
masked decision then counts in the normaliser with weight 0 (TRL's ``*_mask`` modes, verl's
IcePop), so masking shrinks the step instead of re-weighting the rest, as mmrl's sequence
means do for empty rows. verl's rejection sampling (``rollout_rs``) instead normalises by
the returned mask. The trainer may also leave out samples with no decision left in it.

**Relation to** ``decoupled_ppo``. The objective ``decoupled_ppo`` (Hilton et al. 2022; AReaL)
is the correction for stale samples with a proximal policy: its ``old_logp`` is μ and its
``prox_logp`` is π_old. Its loss is ``ppo_clip(logp, prox_logp)`` times the token-level
``mis`` weight with ``hi = behav_weight_cap`` (``tests/algo/test_correction.py`` checks the
equality). Use it *or* ``ppo_clip`` with that correction, never both (the weight would be
applied twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.config import Component, option
from mmrl.errors import ConfigError
from mmrl.registry import CORRECTIONS

LEVELS = ("token", "sequence", "geometric")


@dataclass
class CorrectionConfig(Component):
    """``algo.correction``: the off-policy correction (``type``) and its own options."""

    type: str = option("none", "off-policy correction of samples from a behaviour policy (mmrl list corrections)")
    log_ratio_clamp: float = option(20.0, "log-ratios are clamped to +-this before exp", gt=0)


@dataclass
class TISConfig(CorrectionConfig):
    type: str = option("tis", "off-policy correction of samples from a behaviour policy (mmrl list corrections)")
    level: Literal["token", "sequence", "geometric"] = option(
        "token", "ratio per decision (token), per sequence as the product (sequence) or the geometric mean (geometric)"
    )
    cap: float = option(3.0, "weights above this are truncated to it (TRL's vllm_importance_sampling_clip_max 3; verl's rollout_is_threshold 2)", gt=0)
    floor: float | None = option(None, "weights below this are raised to it (TRL's vllm_importance_sampling_clip_min; null = none, as TRL and verl)", gt=0)

    def validate(self, path: str) -> None:
        if self.floor is not None and self.floor >= self.cap:
            raise ConfigError(f"{path}.floor", self.floor, f"must be < cap ({self.cap})")


@dataclass
class MISConfig(CorrectionConfig):
    type: str = option("mis", "off-policy correction of samples from a behaviour policy (mmrl list corrections)")
    level: Literal["token", "sequence", "geometric"] = option(
        "sequence", "ratio per decision (token), per sequence as the product (sequence, TRL's default sequence_mask) or the geometric mean (geometric)"
    )
    lo: float | None = option(None, "decisions whose ratio is below this are masked (TRL's vllm_importance_sampling_clip_min; null = no lower bound)", ge=0)
    hi: float | None = option(3.0, "decisions whose ratio is above this are masked (TRL's vllm_importance_sampling_clip_max 3; null = no upper bound)", gt=0)
    reweight: bool = option(
        True, "kept decisions are weighted by their ratio (TRL's *_mask, verl's IcePop); false: weight 1 (verl's rejection sampling rollout_rs)"
    )

    def validate(self, path: str) -> None:
        if self.lo is None and self.hi is None:
            raise ConfigError(f"{path}.hi", None, "set hi, lo or both: without a bound nothing is masked")
        if self.lo is not None and self.hi is not None and self.lo >= self.hi:
            raise ConfigError(f"{path}.lo", self.lo, f"must be < hi ({self.hi})")


def _log_ratio(old_logp: Tensor, behaviour_logp: Tensor, valid: Tensor, level: str) -> Tensor:
    """ℓ = logπ_old − logμ per decision (token) or per sequence broadcast to its decisions
    (sequence: Σ ℓ_t, geometric: Σ ℓ_t / |y|); 0 on padding and where a log-prob is NaN
    (as TRL), unclamped, detached."""
    token = torch.where(valid, torch.nan_to_num(old_logp.detach() - behaviour_logp.detach(), nan=0.0), 0.0)
    if level == "token":
        return token
    total = token.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / valid.sum(-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown correction level {level!r}; known: {', '.join(LEVELS)}")
    return total.expand_as(token)


def _fraction(flags: Tensor, valid: Tensor) -> Tensor:
    return (flags & valid).sum() / valid.sum().clamp(min=1)


def _weight_stats(weight: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Mean and max of the weights of the valid decisions (0 and 0 without any)."""
    n = valid.sum()
    mean = torch.where(valid, weight, 0.0).sum() / n.clamp(min=1)
    top = torch.where(valid, weight, -torch.inf).max() if weight.numel() else weight.new_zeros(())
    return {"correction/weight_mean": mean, "correction/weight_max": torch.where(n > 0, top, 0.0)}


def apply_correction(per_decision_loss: Tensor, weight: Tensor) -> Tensor:
    """L'_t = w_t·L_t: the objective's per-decision loss times the correction's (detached)
    weight, before the aggregation, as TRL and verl apply their importance weights. The KL
    term is added after, unweighted."""
    return per_decision_loss * weight


@CORRECTIONS.register("none", config=CorrectionConfig, needs_behaviour=False)
def no_correction(
    old_logp: Tensor, behaviour_logp: Tensor | None, mask: Tensor, *, log_ratio_clamp: float = 20.0
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """No correction: weight 1, the mask unchanged (samples taken as on-policy).

    Reads no behaviour log-probs (``behaviour_logp`` may be None) and returns no stats."""
    return torch.ones_like(old_logp, requires_grad=False), mask.bool(), {}


@CORRECTIONS.register("tis", config=TISConfig, needs_behaviour=True)
def tis(
    old_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float = 3.0,
    floor: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Truncated importance sampling: each decision's loss weighted by min(ρ, cap).

    w = sg(min(ρ, cap)), ρ = exp(clamp(ℓ)) at ``level``; with ``floor``, w = sg(clamp(ρ, floor, cap)) (Ionides 2008; Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training").

    TRL's ``token_truncate`` / ``sequence_truncate`` (``clip_max`` = cap, ``clip_min`` =
    floor) and verl's ``rollout_is`` with a single ``rollout_is_threshold`` (= cap; verl has no
    floor). No decision is masked. Adds ``correction/truncated_fraction``: the valid decisions
    whose ratio was outside [floor, cap].
    """
    valid = mask.bool()
    ratio = torch.exp(_log_ratio(old_logp, behaviour_logp, valid, level).clamp(-log_ratio_clamp, log_ratio_clamp))
    weight = ratio.clamp(min=floor, max=cap)
    truncated = weight != ratio
    weight = torch.where(valid, weight, 1.0)
    stats = _weight_stats(weight, valid)
    stats["correction/truncated_fraction"] = _fraction(truncated, valid)
    return weight, valid, stats


@CORRECTIONS.register("mis", config=MISConfig, needs_behaviour=True)
def mis(
    old_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "sequence",
    lo: float | None = None,
    hi: float | None = 3.0,
    reweight: bool = True,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Masked importance sampling: decisions whose ratio lies outside [lo, hi] are removed.

    Decisions whose ratio ρ at ``level`` lies outside [lo, hi] (bounds included in the kept
    range) are masked, w = 0. The kept ones get
    w = sg(ρ), ρ = exp(clamp(ℓ)), or w = 1 with ``reweight=False`` (Liu, Li et al. 2025, "When
    Speed Kills Stability"; IcePop, Ling Team 2025).

    At ``level="sequence"`` or ``"geometric"`` a whole sequence is kept or masked. With
    ``reweight`` (the default) it is TRL's ``token_mask`` / ``sequence_mask`` (``clip_min`` =
    lo, ``clip_max`` = hi) and verl's IcePop (``rollout_is_threshold="lo_hi"``).
    ``reweight=False`` is verl's rejection sampling ``rollout_rs`` =
    ``token_k1`` / ``seq_sum_k1`` / ``seq_mean_k1``, whose ``"a_b"`` threshold bounds
    π_μ/π_old, i.e. ρ ∈ [1/b, 1/a]. Adds ``correction/masked_fraction``: the valid decisions
    masked.
    """
    valid = mask.bool()
    log_ratio = _log_ratio(old_logp, behaviour_logp, valid, level)
    raw = torch.exp(log_ratio)  # unclamped: may be inf, which compares correctly
    keep = valid
    if lo is not None:
        keep = keep & (raw >= lo)
    if hi is not None:
        keep = keep & (raw <= hi)
    kept_weight = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)) if reweight else torch.ones_like(raw)
    weight = torch.where(keep, kept_weight, torch.where(valid, 0.0, 1.0))
    stats = _weight_stats(weight, valid)
    stats["correction/masked_fraction"] = _fraction(~keep, valid)
    return weight, keep, stats
