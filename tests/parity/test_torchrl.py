"""mmrl's GAE against TorchRL 0.10.1's ``generalized_advantage_estimate`` on the same
episodes (docs/parity.md)."""

from __future__ import annotations

import pytest
import torch

from mmrl.algo.value import generalized_advantages
from tests.parity.conftest import reference

pytestmark = pytest.mark.numerics  # two libraries' float64 arithmetic on the same tensors


@pytest.mark.parametrize("bootstrap", [False, True])
@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (0.8, 0.9), (1.0, 1.0), (0.9, 0.0)])
def test_gae_equals_torchrls_on_episodes_of_different_lengths(gamma, lam, bootstrap):
    """B episodes padded to T decisions: TorchRL reads each one's end from ``done`` and
    ``terminated`` at its last valid decision (V after it is 0: terminal, mmrl's convention),
    with next-state values V_{t+1} (0 past the end); mmrl reads it from the mask. With
    ``bootstrap`` the episodes were cut by a time limit: done but not terminated, the
    next-state value at the end is the final observation's (mmrl's ``bootstrap``)."""
    functional = reference("torchrl.objectives.value.functional")
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    lengths = torch.tensor([9, 1, 5, 7, 3, 9])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    values = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    final = torch.randn(B, generator=g, dtype=torch.float64) if bootstrap else torch.zeros(B, dtype=torch.float64)
    adv, returns = generalized_advantages(rewards, values, mask, gamma, lam, final if bootstrap else None)
    next_values = torch.cat([values[:, 1:], torch.zeros(B, 1, dtype=torch.float64)], 1) * torch.cat([mask[:, 1:], torch.zeros(B, 1, dtype=torch.float64)], 1)
    next_values[torch.arange(B), lengths - 1] = final
    done = torch.zeros(B, T, dtype=torch.bool)
    done[torch.arange(B), lengths - 1] = True
    terminated = done & (not bootstrap)
    default = torch.get_default_dtype()
    for b in range(B):  # one episode at a time: TorchRL's time axis holds no padding
        n = int(lengths[b])
        # TorchRL multiplies gamma by an int tensor of flags: the product takes the default
        # dtype, float32 unless told otherwise (gamma rounded: 4e-7 off); float64 here
        torch.set_default_dtype(torch.float64)
        try:
            ref_adv, ref_target = functional.generalized_advantage_estimate(
                gamma, lam, values[b, :n, None], next_values[b, :n, None], rewards[b, :n, None], done[b, :n, None], terminated=terminated[b, :n, None], time_dim=-2,
            )
        finally:
            torch.set_default_dtype(default)
        torch.testing.assert_close(adv[b, :n], ref_adv[:, 0], rtol=0, atol=1e-12)
        torch.testing.assert_close(returns[b, :n], ref_target[:, 0], rtol=0, atol=1e-12)
        assert (adv[b, n:] == 0).all() and (returns[b, n:] == 0).all()
