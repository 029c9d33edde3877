"""GAE (mmrl/algo/value.py) by hand, its normalizations and the clipped value loss."""

import math

import pytest
import torch

from mmrl.algo.value import gae, generalized_advantages, value_loss


def test_gae_matches_the_recursion_worked_by_hand():
    """Two episodes: three decisions, and one decision then padding (its end is terminal)."""
    gamma, lam = 0.9, 0.8
    r = torch.tensor([[1.0, 0.0, 2.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 1.0, 1.5], [0.2, 9.0, 9.0]], dtype=torch.float64)  # padded values are ignored
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    adv, ret = generalized_advantages(r, v, m, gamma, lam)
    d2 = 2.0 - 1.5
    d1 = 0.0 + gamma * 1.5 - 1.0
    d0 = 1.0 + gamma * 1.0 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 1.0, a2 + 1.5], abs=1e-12)
    assert adv[1].tolist() == pytest.approx([0.5 - 0.2, 0.0, 0.0], abs=1e-12)
    assert ret[1].tolist() == pytest.approx([0.5, 0.0, 0.0], abs=1e-12)


def test_lambda_one_gives_the_discounted_return_minus_the_value_and_zero_the_td_error():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    m = torch.ones(4, 6, dtype=torch.float64)
    gamma = 0.95
    mc, _ = generalized_advantages(r, v, m, gamma, 1.0)
    returns = torch.zeros_like(r)
    future = torch.zeros(4, dtype=torch.float64)
    for t in reversed(range(6)):
        future = r[:, t] + gamma * future
        returns[:, t] = future
    torch.testing.assert_close(mc, returns - v, rtol=0, atol=1e-12)
    td, _ = generalized_advantages(r, v, m, gamma, 0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(4, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(td, r + gamma * next_v - v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("normalize", ["batch", "group"])
def test_normalized_advantages_have_zero_mean_and_unit_std_over_their_set(normalize):
    g = torch.Generator().manual_seed(2)
    r, v = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g, dtype=torch.float64)
    m = (torch.arange(5)[None] < torch.tensor([5, 3, 4, 5, 2, 1])[:, None]).double()
    group_id = torch.tensor([4, 4, 9, 9, 1, 1])
    adv, keep, ret = gae(r, group_id, values=v, mask=m, gamma=0.9, lam=0.9, normalize=normalize)
    assert keep.all() and (adv[m == 0] == 0).all()
    sets = [torch.ones(6, dtype=torch.bool)] if normalize == "batch" else [group_id == k for k in (4, 9, 1)]
    for rows in sets:
        values = adv[rows][m[rows] > 0]
        assert values.mean().item() == pytest.approx(0.0, abs=1e-12)
        assert values.std(correction=0).item() == pytest.approx(1.0, abs=1e-6)
    raw, ret_raw = generalized_advantages(r, v, m, 0.9, 0.9)
    torch.testing.assert_close(ret, ret_raw)  # the critic's targets are not normalized


def test_the_clipped_value_loss_is_the_pessimistic_of_the_two():
    v, old, ret = (torch.tensor(x, dtype=torch.float64) for x in ([2.0, 0.0, 1.05], [1.0, 1.0, 1.0], [3.0, 1.0, 1.0]))
    plain = value_loss(v, old, ret, None)
    assert plain.tolist() == pytest.approx([0.5, 0.5, 0.5 * 0.05**2])
    clipped = value_loss(v, old, ret, 0.2)
    # 1: moved 1.0 towards the target, clipped to 0.2: (1.2 - 3)^2 > (2 - 3)^2; 2: moved away, clipped
    # to 0.8 is nearer: the unclipped one stays; 3: inside the clip range
    assert clipped.tolist() == pytest.approx([0.5 * 1.8**2, 0.5, 0.5 * 0.05**2])
    assert not math.isnan(clipped.sum().item())


def test_a_bootstrap_continues_the_recursion_after_the_last_decision():
    """A row cut by a time limit: V of its final observation stands after its last valid
    decision (also when padding follows it); a zero bootstrap is the terminal case."""
    gamma, lam = 0.9, 0.5
    r = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 1.0, 7.0], [0.5, 1.0, 0.25]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    boot = torch.tensor([4.0, 0.0], dtype=torch.float64)
    adv, ret = generalized_advantages(r, v, m, gamma, lam, boot)
    a1 = 2.0 + gamma * 4.0 - 1.0
    a0 = 1.0 + gamma * 1.0 - 0.5 + gamma * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, 0.0], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 1.0, 0.0], abs=1e-12)
    terminal, _ = generalized_advantages(r[1:], v[1:], m[1:], gamma, lam)
    torch.testing.assert_close(adv[1:], terminal, rtol=0, atol=0)


def test_a_chunk_of_k_env_steps_discounts_the_next_decisions_value_by_gamma_to_the_k():
    """Per-decision discounts: decisions of 4, 4 and 2 env steps (an action chunk of 4, the
    last one cut short by the episode's end) see the next value γ^4 and γ^4 away."""
    gamma, lam = 0.9, 0.8
    r = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.float64)
    steps = torch.tensor([[4.0, 4.0, 2.0]], dtype=torch.float64)
    adv, ret = generalized_advantages(r, v, m, gamma**steps, lam, bootstrap=torch.tensor([3.0], dtype=torch.float64))
    g = [gamma**4, gamma**4, gamma**2]
    a2 = 2.0 + g[2] * 3.0 - 1.5
    a1 = (0.0 + g[1] * 1.5 - 1.0) + g[1] * lam * a2
    a0 = (1.0 + g[0] * 1.0 - 0.5) + g[0] * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 1.0, a2 + 1.5], abs=1e-12)
    # one step per decision is the scalar discount, bit for bit
    ones = generalized_advantages(r, v, m, gamma ** torch.ones(1, 3, dtype=torch.float64), lam)
    assert torch.equal(ones[0], generalized_advantages(r, v, m, gamma, lam)[0])
