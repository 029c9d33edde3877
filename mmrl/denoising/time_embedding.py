"""Sinusoidal embedding of a denoiser's time input (a flow σ or a normalized DDPM timestep)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sinusoidal_embedding(t: Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> Tensor:
    """[B] times in about [0, 1] → [B, dim] features [sin(2πt/p_i), cos(2πt/p_i)] over dim/2
    periods p_i spaced geometrically from ``min_period`` to ``max_period`` (π0's time
    embedding, Black et al. 2024; the Transformer's position encoding with periods suited
    to t ∈ [0, 1]). ``dim`` must be even."""
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    half = dim // 2
    fraction = torch.linspace(0.0, 1.0, half, device=t.device, dtype=torch.float32)
    period = min_period * (max_period / min_period) ** fraction
    angle = 2 * math.pi * t.float()[:, None] / period[None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
