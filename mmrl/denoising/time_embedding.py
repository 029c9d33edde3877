"""Sinusoidal embedding of a denoiser's time input (a flow σ or a normalized DDPM timestep)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sinusoidal_periods(dim: int, min_period: float = 4e-3, max_period: float = 4.0, device=None) -> Tensor:
    """The dim/2 periods p_i of :func:`sinusoidal_embedding`, spaced geometrically from
    ``min_period`` to ``max_period`` (a denoiser that embeds many times computes them once)."""
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=device, dtype=torch.float32)
    return min_period * (max_period / min_period) ** fraction


def sinusoidal_embedding(t: Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0, periods: Tensor | None = None) -> Tensor:
    """[B] times in about [0, 1] → [B, dim] features [sin(2πt/p_i), cos(2πt/p_i)] over dim/2
    periods p_i spaced geometrically from ``min_period`` to ``max_period`` (π0's time
    embedding, Black et al. 2024; the Transformer's position encoding with periods suited
    to t ∈ [0, 1]). ``dim`` must be even. ``periods``: :func:`sinusoidal_periods` of the same
    arguments, computed beforehand ([dim/2], or [1, dim/2] as the division broadcasts it)."""
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    period = sinusoidal_periods(dim, min_period, max_period, t.device) if periods is None else periods
    angle = 2 * math.pi * t.float()[:, None] / (period[None] if period.dim() == 1 else period)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
