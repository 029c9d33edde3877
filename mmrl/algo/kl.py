"""KL estimators between the policy and a reference policy, from sampled log-probs.

Every registered estimator maps ``logp, ref_logp: Tensor[B, T]`` to a per-decision
estimate ``Tensor[B, T]`` of KL(πθ ‖ πref) on samples from πθ (Schulman 2020,
"Approximating KL Divergence"); any further parameter is a keyword option with a default,
so ``fn(logp, ref_logp)`` always works. Use one as a loss term (GRPO) or subtract it from
the reward with :func:`kl_in_reward` (PPO-RLHF).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.registry import KL_ESTIMATORS


@dataclass
class KLConfig:
    """``algo.kl``: the divergence to the reference policy. ``coef`` 0 keeps no reference."""

    type: str = option("k3", "estimator from sampled log-probs (k1, k2, k3), or exact: the policy's closed-form per-decision KL (Gaussian denoising steps)")
    coef: float = option(0.0, "weight of the KL (0 = off, no reference model is kept)", ge=0)
    in_reward: bool = option(False, "subtract coef * sum_t KL from the reward (PPO-RLHF) instead of adding a loss term")

    @property
    def in_loss_term(self) -> bool:
        """The KL is on (coef > 0) as a term of the loss."""
        return self.coef > 0 and not self.in_reward

    @property
    def in_reward_penalty(self) -> bool:
        """The KL is on (coef > 0) as a penalty subtracted from the reward."""
        return self.coef > 0 and self.in_reward

    @property
    def needs_reference_logp(self) -> bool:
        """The KL is on (coef > 0) and estimated from sampled log-probs (not exact): whoever
        scores the samples records the reference's log-probs of their decisions
        (``Rollout.ref_logp``)."""
        return self.coef > 0 and self.type != "exact"

    def validate(self, path: str) -> None:
        known = [*KL_ESTIMATORS.names(), "exact"]
        if self.type not in known:
            raise ConfigError(f"{path}.type", self.type, f"known kl types: {', '.join(known)}")
        if self.type == "exact" and self.in_reward:
            raise ConfigError(f"{path}.in_reward", True, "kl type exact is a loss term (it needs the policy's gradient); use k1/k2/k3 in the reward")

REDUCTIONS = ("mean", "sum")


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = logπθ − logπref: unbiased, high variance, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½(logπθ − logπref)²: biased, low variance, non-negative; its gradient is the
    gradient of the true KL on πθ's samples."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor, *, log_ratio_clamp: float = 20.0, cap: float | None = 10.0) -> Tensor:
    """k3 = min(exp(δ) − δ − 1, cap), δ = clamp(logπref − logπθ, ±log_ratio_clamp) (GRPO's KL).

    Non-negative, and unbiased where neither clamp acts. Library semantics, as verl's
    ``low_var_kl``: δ is clamped to ±20 so ``exp`` cannot overflow, then the estimate is
    capped at 10 so one far-off-reference decision cannot dominate the loss (δ = 5 gives
    10, not e⁵ − 6 = 142.4). Where either clamp acts the gradient is zero. TRL clamps
    nothing: ``cap=None`` and ``log_ratio_clamp=math.inf`` give its form.
    """
    delta = (ref_logp - logp).clamp(-log_ratio_clamp, log_ratio_clamp)
    kl = torch.exp(delta) - delta - 1
    return kl if cap is None else kl.clamp(max=cap)


def gaussian_kl(
    mean: Tensor, ref_mean: Tensor, std: Tensor | float, reduce: str = "mean", batch_dims: int = 1, ref_std: Tensor | float | None = None
) -> Tensor:
    """KL between two Gaussian denoising steps with a shared std: ‖μθ − μref‖² / (2σ²)
    (Flow-GRPO, Liu et al. 2025).

    Per latent element (μθ − μref)² / (2σ²), then averaged (``reduce="mean"``, as Flow-GRPO,
    matching its per-element-averaged log-probs) or summed (``"sum"``, the exact KL of the
    two diagonal Gaussians) over all dims after the first ``batch_dims``. ``std``
    broadcasts against ``mean`` (a float, or e.g. ``Tensor[B, 1, 1, 1]``).

    With ``ref_std`` (steps whose std differs, e.g. a learned noise head) each element is
    the general KL(N(μθ, σ²) ‖ N(μref, σref²)) = log(σref/σ) + (σ² + (μθ − μref)²)/(2σref²) − ½.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if ref_std is None:
        per_element = (mean - ref_mean) ** 2 / (2 * std**2)
    else:
        std_t = std if isinstance(std, Tensor) else mean.new_tensor(float(std))
        ref_t = ref_std if isinstance(ref_std, Tensor) else mean.new_tensor(float(ref_std))
        per_element = torch.log(ref_t / std_t) + (std_t**2 + (mean - ref_mean) ** 2) / (2 * ref_t**2) - 0.5
    latent_dims = tuple(range(batch_dims, per_element.ndim))
    return per_element.mean(latent_dims) if reduce == "mean" else per_element.sum(latent_dims)


def kl_in_reward(
    rewards: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, coef: float, estimator: str = "k1"
) -> Tensor:
    """KL-penalised reward: r_i − coef·Σ_t m·k(logπθ, logπref) (Ouyang et al. 2022, PPO-RLHF).

    ``estimator`` names a registered KL estimator. The result is detached: it is a reward,
    a constant for the policy gradient.
    """
    kl = KL_ESTIMATORS.get(estimator, "estimator")(logp, ref_logp)
    return (rewards - coef * (kl * mask).sum(-1)).detach()
