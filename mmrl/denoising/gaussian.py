"""Log-density and entropy of the diagonal Gaussians that every denoising transition is.

A transition x_{t−1} ~ N(μ, σ² I) over a latent of D elements (an image latent, or an
action chunk of C × A numbers) has

    log p = Σ_d [ −(x_d − μ_d)² / (2σ_d²) − log σ_d − ½ log 2π ]

``reduce="sum"`` returns exactly that (the density of the whole latent; a log-ratio of
two policies is then the sum of D per-element log-ratios). ``reduce="mean"`` divides it
by D, as DDPO and Flow-GRPO do for image latents (Black et al. 2023; Liu et al. 2025) and
DPPO for action chunks (Ren et al. 2024). The choice changes the scale of log-ratios by
a factor D, and with it the right PPO clip range: per-element-averaged log-probs move
little per update, which is why DDPO clips at ~1e-4 and DPPO at ~1e-3–1e-2 while a
summed log-prob over a few dozen action numbers wants the usual ~0.2.
"""

from __future__ import annotations

import math

from torch import Tensor

REDUCTIONS = ("sum", "mean")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _reduce(per_element: Tensor, reduce: str, batch_dims: int) -> Tensor:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    dims = tuple(range(batch_dims, per_element.ndim))
    if not dims:
        return per_element
    return per_element.sum(dims) if reduce == "sum" else per_element.mean(dims)


def gaussian_log_prob(
    x: Tensor,
    mean: Tensor,
    std: Tensor | float,
    reduce: str = "sum",
    batch_dims: int = 1,
    clamp: tuple[float, float] | None = None,
    log_std: Tensor | None = None,
) -> Tensor:
    """log N(x; mean, std²) per element, reduced (``"sum"`` or ``"mean"``) over every dim
    after the first ``batch_dims``; ``std`` broadcasts against ``x`` (a float, a per-sample
    ``[B, 1, …]`` or a per-element tensor).

    ``clamp=(lo, hi)`` clamps the per-element log-densities before the reduction, as DPPO
    does with (−5, 2) so that one far-off element cannot dominate the ratio; the gradient
    of a clamped element is zero. ``log_std``: ``std.log()``, where the caller has it already.
    """
    std_t = std if isinstance(std, Tensor) else x.new_tensor(float(std))
    log_std = std_t.log() if log_std is None else log_std
    per_element = -0.5 * ((x - mean) / std_t).square() - log_std - _LOG_SQRT_2PI
    if clamp is not None:
        per_element = per_element.clamp(clamp[0], clamp[1])
    return _reduce(per_element, reduce, batch_dims)


def gaussian_entropy(std: Tensor, shape_like: Tensor, reduce: str = "sum", batch_dims: int = 1, log_std: Tensor | None = None) -> Tensor:
    """Differential entropy of N(·, std²) over the elements of ``shape_like``:
    Σ_d (log σ_d + ½ log 2πe), reduced like :func:`gaussian_log_prob` (``log_std``:
    ``std.log()``, where the caller has it already)."""
    per_element = ((std.log() if log_std is None else log_std) + _LOG_SQRT_2PI + 0.5).expand_as(shape_like)
    return _reduce(per_element, reduce, batch_dims)
