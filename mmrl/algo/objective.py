"""Objectives: per-decision policy-gradient losses, to be reduced by an aggregation.

Every registered objective has the signature ::

    fn(logp: Tensor[B, T], old_logp: Tensor[B, T], adv: Tensor[B, T], *, mask: Tensor[B, T],
       log_ratio_clamp: float = 20.0, **options)
        -> (loss: Tensor[B, T], stats: dict[str, Tensor[B, T]])

``logp`` carries the gradient; ``old_logp`` is the policy that sampled the data. Every
objective takes ``mask`` so a caller can pass it uniformly (only :func:`gspo` reads it).
Log-ratios are clamped to ±``log_ratio_clamp`` before ``exp`` (as verl) so a stale sample
cannot overflow. ``stats`` are detached float tensors, always with ``"ratio"`` and
``"clipped"`` (1 where clipping removed the gradient or changed the weight), for masked
averaging by the caller. An objective that also needs the log-probs of a proximal policy
has ``fn.needs_proximal = True`` and takes ``prox_logp``. An objective whose loss and
gradient are exactly 0 at a decision with advantage 0, whatever the ratio (every one here: each
is the advantage times a finite factor), has ``fn.zero_at_zero_advantage = True``; the trainer
then leaves samples without a non-zero advantage out of the update's passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.config import Component, option
from mmrl.registry import OBJECTIVES


@dataclass
class ObjectiveConfig(Component):
    """``algo.objective``: the per-decision surrogate (``type``) and its own options."""

    type: str = option("ppo_clip", "per-decision surrogate (mmrl list objectives)")
    log_ratio_clamp: float = option(20.0, "log-ratios are clamped to +-this before exp", gt=0)


@dataclass
class PPOClipConfig(ObjectiveConfig):
    eps_low: float = option(0.2, "lower clip range of the importance ratio: 1 - eps_low", ge=0)
    eps_high: float = option(0.2, "upper clip range: 1 + eps_high (DAPO clip-higher 0.28)", ge=0)
    dual_clip: float | None = option(None, "dual-clip constant c > 1 bounding the loss of negative advantages (null = off)", gt=1)


@dataclass
class CISPOConfig(ObjectiveConfig):
    type: str = option("cispo", "per-decision surrogate (mmrl list objectives)")
    eps_high: float = option(5.0, "absolute cap on the importance weight: w <= eps_high (MiniMax-M1, TRL)", gt=0)
    eps_low: float | None = option(None, "if set, also clamp the weight below at 1 - eps_low (verl's two-sided form); null = one-sided", ge=0)


@dataclass
class GSPOConfig(ObjectiveConfig):
    type: str = option("gspo", "per-decision surrogate (mmrl list objectives)")
    eps_low: float = option(3e-4, "lower clip range of the sequence ratio", ge=0)
    eps_high: float = option(4e-4, "upper clip range of the sequence ratio", ge=0)


@dataclass
class ReinforceConfig(ObjectiveConfig):
    type: str = option("reinforce", "per-decision surrogate (mmrl list objectives)")


@dataclass
class DecoupledPPOConfig(ObjectiveConfig):
    type: str = option("decoupled_ppo", "per-decision surrogate (mmrl list objectives)")
    eps_low: float = option(0.2, "lower clip range of the ratio to the proximal policy", ge=0)
    eps_high: float = option(0.2, "upper clip range of the ratio to the proximal policy", ge=0)
    behav_weight_cap: float = option(5.0, "behaviour weights above this are zeroed", gt=0)


def _ratio(logp: Tensor, base_logp: Tensor, log_ratio_clamp: float) -> Tensor:
    return torch.exp((logp - base_logp.detach()).clamp(-log_ratio_clamp, log_ratio_clamp))


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """−min(w·A, clip(w, 1−eps_low, 1+eps_high)·A), and where the clipped term is the minimum
    (there the gradient is zero)."""
    neg_adv = -adv  # negate the (often [B, 1]) advantage, not the [B, T] products
    unclipped = ratio * neg_adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * neg_adv
    return torch.maximum(unclipped, clipped), clipped > unclipped


@OBJECTIVES.register("ppo_clip", config=PPOClipConfig)
def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    mask: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
):
    """PPO clip: L = −min(w·A, clip(w, 1−eps_low, 1+eps_high)·A), w = exp(logπθ − logπold)
    (Schulman et al. 2017; eps_high > eps_low is DAPO's clip-higher, Yu et al. 2025).

    ``dual_clip`` = c > 1 bounds the loss of negative advantages: for A < 0,
    L = min(L, −c·A) (Ye et al. 2020; verl's ``clip_ratio_c``, typically 3). Adds the stat
    ``"dual_clipped"``.
    """
    ratio = _ratio(logp, old_logp, log_ratio_clamp)
    loss, clipped = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    stats = {"ratio": ratio.detach(), "clipped": clipped.float()}
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (verl uses 3), got {dual_clip!r}")
        bound = -dual_clip * adv
        dual_clipped = (adv < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
        stats["dual_clipped"] = dual_clipped.float()
    return loss, stats


@OBJECTIVES.register("cispo", config=CISPOConfig)
def cispo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    mask: Tensor | None = None,
    eps_high: float = 5.0,
    eps_low: float | None = None,
    log_ratio_clamp: float = 20.0,
):
    """CISPO: L = −sg(min(w, eps_high))·A·logπθ, one-sided (MiniMax 2025, "MiniMax-M1").

    With ``eps_low`` set, L = −sg(clamp(w, 1 − eps_low, eps_high))·A·logπθ. The clipped
    importance weight is a constant coefficient, so every decision keeps a gradient.

    Library semantics: ``eps_high`` is an absolute cap on w, not 1 + eps_high. The default
    (``eps_low=None``) is one-sided, as the paper and TRL's ``cispo``: a ratio far below 1
    keeps its small weight. Setting ``eps_low`` also raises weights below 1 − eps_low, as
    verl's ``cispo`` does (verl's upper bound is 1 + clip_ratio_high, i.e.
    ``eps_high = 1 + clip_ratio_high`` here). The loss value depends on logπθ itself; only
    its gradient is meaningful.
    """
    ratio = _ratio(logp.detach(), old_logp, log_ratio_clamp)
    weight = ratio.clamp(min=None if eps_low is None else 1 - eps_low, max=eps_high)
    return -weight * adv * logp, {"ratio": ratio, "clipped": (weight != ratio).float()}


@OBJECTIVES.register("gspo", config=GSPOConfig)
def gspo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    log_ratio_clamp: float = 20.0,
):
    """GSPO: L = −min(s·A, clip(s, 1−eps_low, 1+eps_high)·A) with the sequence ratio
    s_i = exp(Σ_t m·ℓ_t / Σ_t m) (Zheng et al. 2025, "Group Sequence Policy Optimization").

    Token form (as verl): s_{i,t} = sg(s_i)·exp(logπθ − sg(logπθ)) has the value s_i and the
    gradient s_i·∇logπθ(y_t), so advantages may vary per token; with ``seq_mean_token_mean``
    aggregation and per-sequence advantages it is GSPO's sequence objective exactly.
    Requires ``mask``; the sequence log-ratio is clamped before ``exp``.
    """
    valid = mask.to(logp.dtype)
    seq_log_ratio = ((logp.detach() - old_logp) * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
    ratio = seq_ratio[:, None] * torch.exp(logp - logp.detach())
    loss, clipped = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    return loss, {"ratio": ratio.detach(), "clipped": clipped.float()}


@OBJECTIVES.register("reinforce", config=ReinforceConfig)
def reinforce(
    logp: Tensor, old_logp: Tensor, adv: Tensor, *, mask: Tensor | None = None, log_ratio_clamp: float = 20.0
):
    """REINFORCE: L = −A·logπθ (Williams 1992). ``old_logp`` only feeds the ``"ratio"``
    stat; nothing is clipped."""
    ratio = _ratio(logp.detach(), old_logp, log_ratio_clamp)
    return -adv * logp, {"ratio": ratio, "clipped": torch.zeros_like(ratio)}


@OBJECTIVES.register("decoupled_ppo", config=DecoupledPPOConfig)
def decoupled_ppo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    prox_logp: Tensor,
    mask: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    behav_weight_cap: float = 5.0,
    log_ratio_clamp: float = 20.0,
):
    """Decoupled PPO: L = −b·min(r·A, clip(r, 1−eps_low, 1+eps_high)·A) with
    r = exp(logπθ − logπprox) and b = exp(logπprox − logπbehav), b := 0 where b > cap
    (Hilton et al. 2022 "Batch Size-Invariance"; AReaL, Fu et al. 2025).

    ``old_logp`` is the behaviour policy that generated the (possibly stale) sample,
    ``prox_logp`` the proximal policy that the trust region is centred on (e.g. the policy
    before this update). Samples whose behaviour weight exceeds ``behav_weight_cap`` get no
    gradient. Adds the stats ``"behav_weight"`` and ``"behav_capped"``.
    """
    ratio = _ratio(logp, prox_logp, log_ratio_clamp)
    behav_weight = _ratio(prox_logp.detach(), old_logp, log_ratio_clamp)
    capped = behav_weight > behav_weight_cap
    behav_weight = behav_weight.masked_fill(capped, 0.0)
    surrogate, clipped = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    stats = {
        "ratio": ratio.detach(),
        "clipped": clipped.float(),
        "behav_weight": behav_weight,
        "behav_capped": capped.float(),
    }
    return behav_weight * surrogate, stats


decoupled_ppo.needs_proximal = True
for _objective in (ppo_clip, cispo, gspo, reinforce, decoupled_ppo):
    _objective.zero_at_zero_advantage = True
