"""Running a denoising chain as an MDP, and recomputing its log-probs for training.

A chain of K steps turns x_init (pure noise) into a sample: latents[:, 0] = x_init and
step k draws latents[:, k + 1] ~ N(mean_k, std_k²) from the transition's Gaussian
(:mod:`mmrl.denoising.transitions`). Each *stochastic* step is one decision whose
log-prob log N(x_{k+1}; mean_k, std_k²) the RL objective uses (DDPO, Black et al. 2023;
DPPO, Ren et al. 2024; Flow-GRPO, Liu et al. 2025); deterministic steps (ODE, DDIM η = 0)
carry no log-prob. Which steps are stochastic is a boolean mask [N, K]:

- all steps (DDPO, Flow-GRPO): ``torch.ones(n, K, dtype=bool)``;
- the last K' steps (DPPO fine-tunes only those): :func:`last_steps`;
- a window of consecutive steps, the rest ODE (MixGRPO, Li et al. 2025; Flow-GRPO-Fast):
  :func:`sde_window`;
- one random step per sample (πRL's Flow-SDE, Chen et al. 2025): :func:`random_step`.

The denoiser is any callable ``denoiser(x, t, rows)``: ``x`` [B, …] latents, ``t`` [B] the
transition's model time of each row (a training timestep or a flow σ), ``rows`` [B] long
— which of the chain's N samples each row belongs to, so the callable can pick that
sample's conditioning (``cond[rows]``). It returns the model output the transition
expects (ε, v, or ``(v, std)`` for Flow-Noise). During sampling ``rows = arange(N)``;
:func:`chain_log_probs` instead evaluates every stochastic (sample, step) pair of a
stored chain in one batched call.

``min_std`` floors the std of stochastic steps, when sampling and when recomputing, so
the log-prob stays the exact density of the drawn transition (DPPO's minimum denoising
std; it also keeps steps whose std vanishes, such as the last DDIM step, usable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from mmrl.denoising.gaussian import gaussian_entropy, gaussian_log_prob
from mmrl.denoising.transitions import Transition

Denoiser = Callable[[Tensor, Tensor, Tensor], object]


@dataclass
class ChainSample:
    """A sampled chain of N samples and K steps."""

    latents: Tensor  # [N, K + 1, ...]: x_init, then the latent after each step
    log_probs: Tensor  # [N, K]: log-prob of each stochastic step, 0 on deterministic steps
    stochastic: Tensor  # [N, K] bool: which steps were stochastic
    entropies: Tensor  # [N, K]: differential entropy of each stochastic step's Gaussian, 0 elsewhere

    @property
    def final(self) -> Tensor:
        return self.latents[:, -1]


def _floor(std: Tensor, min_std: float) -> Tensor:
    return std.clamp(min=min_std) if min_std > 0 else std


@torch.no_grad()
def run_chain(
    denoiser: Denoiser,
    transition: Transition,
    x_init: Tensor,
    stochastic: Tensor,
    generator: torch.Generator | None = None,
    *,
    min_std: float = 0.0,
    reduce: str = "sum",
    clamp: tuple[float, float] | None = None,
) -> ChainSample:
    """Run the K = ``transition.num_steps`` steps from ``x_init`` [N, …].

    ``stochastic`` [N, K] bool picks the stochastic steps per sample. Noise is drawn on the
    CPU from ``generator`` and moved to the latents' device, so a seed gives the same chain
    on every device. ``reduce`` / ``clamp`` are those of
    :func:`~mmrl.denoising.gaussian.gaussian_log_prob`. Raises ``ValueError`` if a
    stochastic step has std 0 (choose ``min_std > 0`` or make that step deterministic).
    """
    n, k_steps = x_init.shape[0], transition.num_steps
    stochastic = stochastic.to(device=x_init.device, dtype=torch.bool)
    if stochastic.shape != (n, k_steps):
        raise ValueError(f"stochastic must be [N, K] = [{n}, {k_steps}], got {list(stochastic.shape)}")
    rows = torch.arange(n, device=x_init.device)
    x = x_init
    latents = [x]
    log_probs = x.new_zeros(n, k_steps)
    entropies = x.new_zeros(n, k_steps)
    for k in range(k_steps):
        step = torch.full((n,), k, dtype=torch.long, device=x.device)
        out = denoiser(x, transition.model_time(step), rows)
        is_stochastic = stochastic[:, k]
        mean, std = transition.mean_std(step, x, out, is_stochastic)
        if is_stochastic.any():
            std = _floor(std, min_std)
            noisy = is_stochastic.view(n, *([1] * (x.ndim - 1))).expand_as(x)
            if bool((std <= 0)[noisy].any()):
                raise ValueError(f"denoising step {k} is stochastic but its std is 0; set a minimum std (min_std > 0) or make the step deterministic")
            noise = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
            x = torch.where(noisy, mean + std * noise, mean)
            safe_std = torch.where(noisy, std, torch.ones_like(std))
            lp = gaussian_log_prob(x, mean, safe_std, reduce, clamp=clamp)
            log_probs[:, k] = torch.where(is_stochastic, lp, torch.zeros_like(lp))
            ent = gaussian_entropy(safe_std, x, reduce)
            entropies[:, k] = torch.where(is_stochastic, ent, torch.zeros_like(ent))
        else:
            x = mean
        latents.append(x)
    return ChainSample(torch.stack(latents, 1), log_probs, stochastic, entropies)


def transition_log_probs(
    denoiser: Denoiser,
    transition: Transition,
    x: Tensor,
    x_next: Tensor,
    step: Tensor,
    rows: Tensor,
    *,
    min_std: float = 0.0,
    reduce: str = "sum",
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    """log N(x_next; mean, std²) [B] of B stored stochastic transitions (x [B, …] at step
    ``step`` [B] of sample ``rows`` [B]) under the denoiser's current parameters, with grad."""
    out = denoiser(x, transition.model_time(step), rows)
    mean, std = transition.mean_std(step, x, out, torch.ones_like(step, dtype=torch.bool))
    return gaussian_log_prob(x_next, mean, _floor(std, min_std), reduce, clamp=clamp)


def chain_log_probs(
    denoiser: Denoiser,
    transition: Transition,
    latents: Tensor,
    stochastic: Tensor,
    *,
    min_std: float = 0.0,
    reduce: str = "sum",
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    """Recompute [N, K] per-step log-probs of a stored chain (``latents`` [N, K + 1, …],
    ``stochastic`` [N, K]) under current parameters, with grad; 0 on deterministic steps.
    Under unchanged parameters this equals :func:`run_chain`'s ``log_probs``. All
    stochastic steps are evaluated in one denoiser call (none if no step is stochastic)."""
    n, k_steps = stochastic.shape
    rows, steps = stochastic.to(torch.bool).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return latents.new_zeros(n, k_steps)
    lp = transition_log_probs(
        denoiser, transition, latents[rows, steps], latents[rows, steps + 1], steps, rows, min_std=min_std, reduce=reduce, clamp=clamp
    )
    return latents.new_zeros(n, k_steps).index_put((rows, steps), lp)


# ------------------------------------------------------------------ which steps are stochastic


def sde_window(n: int, num_steps: int, start: int | Tensor, size: int, device=None) -> Tensor:
    """[N, K] bool: steps start … start + size − 1 stochastic, the rest ODE (MixGRPO's
    sliding window; Flow-GRPO-Fast). ``start`` is an int or a long tensor [N] (a window per
    sample); the window is cut at the chain's end."""
    steps = torch.arange(num_steps, device=device)
    start_t = torch.as_tensor(start, device=device).reshape(-1, 1)
    return ((steps >= start_t) & (steps < start_t + size)).expand(n, num_steps).clone()


def last_steps(n: int, num_steps: int, count: int, device=None) -> Tensor:
    """[N, K] bool: the last ``count`` steps stochastic (DPPO fine-tunes the last K' steps)."""
    return sde_window(n, num_steps, num_steps - count, count, device)


def random_step(n: int, num_steps: int, generator: torch.Generator | None = None, low: int = 0, high: int | None = None, device=None) -> Tensor:
    """[N, K] bool: one step per sample, uniform in [low, high) (default: any step), drawn
    on the CPU from ``generator`` (πRL's Flow-SDE: one stochastic step per action chunk)."""
    high = num_steps if high is None else high
    if not 0 <= low < high <= num_steps:
        raise ValueError(f"need 0 <= low < high <= {num_steps}, got low={low}, high={high}")
    chosen = torch.randint(low, high, (n,), generator=generator).to(device)
    return torch.nn.functional.one_hot(chosen, num_steps).bool()
