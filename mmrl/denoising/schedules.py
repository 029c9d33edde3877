"""Noise schedules: DDPM betas → ᾱ_t, the timesteps a K-step sampler visits, flow sigmas
(and their resolution-dependent shift).

Diffusion (DDPM, Ho et al. 2020): x_t = sqrt(ᾱ_t)·x_0 + sqrt(1 − ᾱ_t)·ε, ᾱ_t = Π_{s≤t}(1 − β_s),
t = 0 … T−1 (t = 0 the least noisy).

Flow matching (rectified flow; SD3, Flow-GRPO and openpi's π0 use this direction):
x_σ = (1 − σ)·x_0 + σ·ε, the model predicts v = ε − x_0, and sampling integrates
dx = v dσ from σ = 1 (pure noise) down to σ = 0 (data).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BETA_SCHEDULES = ("linear", "scaled_linear", "cosine")
TIMESTEP_SPACINGS = ("trailing", "leading")


def ddpm_betas(num_train_timesteps: int, schedule: str = "cosine", beta_start: float = 1e-4, beta_end: float = 0.02) -> Tensor:
    """β_t for t = 0 … T−1 (float64 for exact cumulative products; cast when used).

    - ``linear``: evenly from ``beta_start`` to ``beta_end`` (Ho et al. 2020).
    - ``scaled_linear``: evenly in sqrt(β) (Stable Diffusion).
    - ``cosine``: ᾱ(t) = f(t)/f(0), f(t) = cos²(((t/T) + s)/(1 + s)·π/2), s = 0.008,
      β_t = 1 − ᾱ_t/ᾱ_{t−1} capped at 0.999 (Nichol & Dhariwal 2021; DPPO's default).
    """
    if schedule not in BETA_SCHEDULES:
        raise ValueError(f"schedule must be one of {BETA_SCHEDULES}, got {schedule!r}")
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
    t = num_train_timesteps
    if schedule == "linear":
        return torch.linspace(beta_start, beta_end, t, dtype=torch.float64)
    if schedule == "scaled_linear":
        return torch.linspace(beta_start**0.5, beta_end**0.5, t, dtype=torch.float64) ** 2
    s = 0.008
    steps = torch.arange(t + 1, dtype=torch.float64) / t
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    alpha_bar = f / f[0]
    return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=0.999)


def alphas_cumprod(betas: Tensor) -> Tensor:
    """ᾱ_t = Π_{s≤t} (1 − β_s)."""
    return torch.cumprod(1 - betas, 0)


def ddim_timesteps(num_train_timesteps: int, num_steps: int, spacing: str = "trailing") -> Tensor:
    """The K = ``num_steps`` training timesteps a sampler visits, noisiest first (long [K]).

    - ``trailing``: t_k = round(T − k·T/K) − 1, so the first step starts at t = T − 1, where
      x_T ~ N(0, I) is the right prior (Lin et al. 2024, "Common diffusion noise schedules
      and sample steps are flawed").
    - ``leading``: t_k = (K − 1 − k)·(T // K) (DDIM's original spacing, used by DDPO and DPPO).
    """
    if spacing not in TIMESTEP_SPACINGS:
        raise ValueError(f"spacing must be one of {TIMESTEP_SPACINGS}, got {spacing!r}")
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(f"num_steps must be in [1, {num_train_timesteps}], got {num_steps}")
    if spacing == "trailing":
        k = torch.arange(num_steps, dtype=torch.float64)
        return (torch.round(num_train_timesteps - k * num_train_timesteps / num_steps) - 1).long()
    return torch.arange(num_steps - 1, -1, -1, dtype=torch.long) * (num_train_timesteps // num_steps)


def flow_sigmas(num_steps: int, shift: float = 1.0) -> Tensor:
    """σ_0 = 1 > σ_1 > … > σ_K = 0 for K = ``num_steps`` Euler steps (float64 [K + 1]).

    Evenly spaced, then shifted σ' = shift·σ / (1 + (shift − 1)·σ) (SD3, Esser et al.
    2024): shift > 1 spends more steps at high noise.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not 0 < shift < math.inf:
        raise ValueError(f"shift must be a finite number > 0, got {shift}")
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def resolution_shift(
    image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15, shift_type: str = "exponential"
) -> float:
    """The shift of :func:`flow_sigmas` for a resolution-dependent ("dynamic") time shift, as
    diffusers' FLUX pipelines and ``FlowMatchEulerDiscreteScheduler`` with
    ``use_dynamic_shifting`` apply it: μ = ``calculate_shift`` — linear in the image's token
    count, ``base_shift`` at ``base_seq_len`` tokens and ``max_shift`` at ``max_seq_len`` —
    and the scheduler's ``time_shift`` σ' = e^μ / (e^μ + (1/σ − 1)) (``exponential``; FLUX.1)
    or μ / (μ + (1/σ − 1)) (``linear``), which is SD3's shift σ' = s·σ / (1 + (s − 1)·σ) with
    s = e^μ (or μ). Returns s."""
    if shift_type not in ("exponential", "linear"):
        raise ValueError(f"shift_type must be exponential or linear, got {shift_type!r}")
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len must differ from base_seq_len ({base_seq_len})")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    mu = image_seq_len * m + (base_shift - m * base_seq_len)
    if shift_type == "exponential" and mu > math.log(torch.finfo(torch.float64).max):
        raise ValueError(f"e^mu overflows a float (mu = {mu:.4g})")
    shift = math.exp(mu) if shift_type == "exponential" else mu
    if not shift > 0:
        raise ValueError(f"the shift must be > 0, got {shift} (mu = {mu:.4g}, {shift_type})")
    return shift


def terminal_stretch(sigmas: Tensor, terminal: float) -> Tensor:
    """σ_0 … σ_K = 0 (a :func:`flow_sigmas` grid) stretched so that the last step before 0
    lands at ``terminal``, as diffusers' ``FlowMatchEulerDiscreteScheduler`` with
    ``shift_terminal``: 1 − σ_k scaled by (1 − terminal) / (1 − σ_{K−1}) for k < K; σ_0 = 1
    and σ_K = 0 stay."""
    if not 0 < terminal < 1:
        raise ValueError(f"terminal must lie in (0, 1), got {terminal}")
    head = sigmas[:-1]
    scale = (1 - head[-1]) / (1 - terminal)
    return torch.cat([1 - (1 - head) / scale, sigmas[-1:]])


def lcm_timesteps(num_train_timesteps: int, num_steps: int, original_steps: int = 50) -> Tensor:
    """The K = ``num_steps`` timesteps of a multistep latent-consistency sampler (LCM), noisiest
    first: the distillation schedule t_j = (j + 1)·(T // original_steps) − 1 (j < original_steps),
    reversed, at K evenly spaced indices (floor(i·original_steps / K)), as diffusers'
    ``LCMScheduler`` spaces them (long [K])."""
    if not 1 <= original_steps <= num_train_timesteps:
        raise ValueError(f"original_steps must be in [1, {num_train_timesteps}], got {original_steps}")
    if not 1 <= num_steps <= original_steps:
        raise ValueError(f"num_steps must be in [1, original_steps={original_steps}], got {num_steps}")
    origin = (torch.arange(1, original_steps + 1, dtype=torch.long) * (num_train_timesteps // original_steps) - 1).flip(0)
    index = torch.floor(torch.arange(num_steps, dtype=torch.float64) * original_steps / num_steps).long()
    return origin[index]
