"""Loss masks: narrow a decision mask ``Tensor[B, T]`` (bool or 0/1 float; dtype kept)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def truncation_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the rows of truncated completions (no EOS within the budget), whose reward
    judges an unfinished answer (DAPO overlong filtering, Yu et al. 2025)."""
    return mask.masked_fill(truncated[:, None], 0)


def top_entropy_mask(mask: Tensor, entropy: Tensor, rho: float = 0.2) -> Tensor:
    """Keep only the top-ρ fraction of valid decisions by entropy, across the whole batch
    (the 80/20 rule, Wang et al. 2025 "Beyond the 80/20 Rule").

    Exactly ⌈ρ·N⌉ of the N valid decisions are kept; ties are broken arbitrarily.
    """
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1], got {rho!r}")
    valid = mask.bool()
    # round() first: 0.07 * 100 is 7.000000000000001, whose ceil would keep one too many
    num_kept = math.ceil(round(rho * int(valid.sum()), 9))
    scores = entropy.detach().masked_fill(~valid, -math.inf).flatten()
    selected = torch.zeros_like(valid).flatten()
    selected[scores.topk(num_kept).indices] = True
    return mask.masked_fill(~selected.view_as(valid), 0)
