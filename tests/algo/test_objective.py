import math

import pytest
import torch

from mmrl.algo.aggregation import token_mean
from mmrl.algo.objective import cispo, decoupled_ppo, gspo, ppo_clip, reinforce
from mmrl.registry import AGGREGATIONS, OBJECTIVES


def _logp(ratios: list[float], old: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [1, N] with grad whose ratios to ``old`` are the given numbers."""
    old_logp = torch.full((1, len(ratios)), old)
    return (old_logp + torch.tensor([ratios]).log()).requires_grad_(), old_logp


def test_registry_holds_every_objective():
    assert OBJECTIVES.names() == ["cispo", "decoupled_ppo", "gspo", "ppo_clip", "reinforce"]


def test_ppo_clip_loss_and_zero_gradient_where_clipped():
    logp, old = _logp([0.5, 1.0, 1.5, 1.5, 0.5])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]])
    loss, stats = ppo_clip(logp, old, adv)
    # −min(w·A, clip(w, 0.8, 1.2)·A):  −min(.5, .8), −1, −min(1.5, 1.2), −min(−1.5, −1.2), −min(−.5, −.8)
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -1.2, 1.5, 0.8]]))
    torch.testing.assert_close(stats["clipped"], torch.tensor([[0.0, 0.0, 1.0, 0.0, 1.0]]))
    torch.testing.assert_close(stats["ratio"], torch.tensor([[0.5, 1.0, 1.5, 1.5, 0.5]]))
    assert not stats["ratio"].requires_grad
    loss.sum().backward()
    # unclipped: dL/dlogp = −A·w
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.0, 0.0, 1.5, 0.0]]))


def test_ppo_clip_higher_uses_eps_high_above_one():
    logp, old = _logp([1.5, 0.5])
    loss, _ = ppo_clip(logp, old, torch.tensor([[1.0, -1.0]]), eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8]]))


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    logp, old = _logp([5.0, 5.0, 0.5])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, _ = ppo_clip(logp, old, adv)
    torch.testing.assert_close(loss, torch.tensor([[5.0, -1.2, 0.8]]))
    loss, stats = ppo_clip(logp, old, adv, dual_clip=3.0)
    # A < 0: min(5, −3·A = 3) = 3
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2, 0.8]]))
    torch.testing.assert_close(stats["dual_clipped"], torch.tensor([[1.0, 0.0, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip(logp, old, adv, dual_clip=0.5)


def test_log_ratio_is_clamped_before_exp():
    logp, old = torch.tensor([[100.0]], requires_grad=True), torch.tensor([[0.0]])
    loss, stats = ppo_clip(logp, old, torch.tensor([[-1.0]]))
    torch.testing.assert_close(stats["ratio"], torch.tensor([[math.exp(20.0)]]))
    assert torch.isfinite(loss).all()
    _, stats = reinforce(logp, old, torch.tensor([[1.0]]), log_ratio_clamp=5.0)
    torch.testing.assert_close(stats["ratio"], torch.tensor([[math.exp(5.0)]]))


def test_cispo_gradient_is_clipped_weight_times_advantage():
    logp, old = _logp([0.5, 2.0, 8.0], old=0.0)  # logp = ln 0.5, ln 2, ln 8
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, stats = cispo(logp, old, adv)
    # w capped at 5: 0.5, 2, 5;  L = −w·A·logp
    torch.testing.assert_close(loss, torch.tensor([[0.346574, 1.386294, -20.794415]]))
    torch.testing.assert_close(stats["clipped"], torch.tensor([[0.0, 0.0, 1.0]]))
    token_mean(loss, torch.ones_like(loss, dtype=torch.bool)).backward()
    # −w_clipped·A / N, N = 3
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 3, 2.0 / 3, -10.0 / 3]]))


def test_cispo_is_one_sided_unless_eps_low_is_set():
    logp, old = _logp([0.5, 8.0], old=0.0)
    adv = torch.tensor([[1.0, 1.0]])
    one_sided, stats = cispo(logp, old, adv, eps_high=5.0)
    # w: 0.5 kept, 8 → 5:  −0.5·ln 0.5 = 0.346574;  −5·ln 8 = −10.397208
    torch.testing.assert_close(one_sided, torch.tensor([[0.346574, -10.397208]]))
    torch.testing.assert_close(stats["clipped"], torch.tensor([[0.0, 1.0]]))
    (grad,) = torch.autograd.grad(one_sided.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -5.0]]))

    two_sided, stats = cispo(logp, old, adv, eps_low=0.2, eps_high=5.0)
    # w: 0.5 → 0.8 (verl's lower clamp):  −0.8·ln 0.5 = 0.554518
    torch.testing.assert_close(two_sided, torch.tensor([[0.554518, -10.397208]]))
    torch.testing.assert_close(stats["clipped"], torch.tensor([[1.0, 1.0]]))
    (grad,) = torch.autograd.grad(two_sided.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.8, -5.0]]))


def test_gspo_uses_masked_sequence_ratio():
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[0.1, 0.3, 5.0], [0.0, 0.0003, 0.0006]])  # the 5.0 is masked out
    logp = (old + log_ratio).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([[-1.0] * 3, [1.0] * 3])
    loss, stats = gspo(logp, old, adv, mask=mask)
    # row 0: s = e^0.2 = 1.221403 > 1.0004 but A < 0 → unclipped, L = 1.221403
    # row 1: s = e^0.0003 = 1.0003 inside [0.9997, 1.0004] → L = −1.0003
    s0, s1 = math.exp(0.2), math.exp(0.0003)
    torch.testing.assert_close(loss, torch.tensor([[s0] * 3, [-s1] * 3]))
    torch.testing.assert_close(stats["ratio"], torch.tensor([[s0] * 3, [s1] * 3]))
    torch.testing.assert_close(stats["clipped"], torch.zeros(2, 3))
    (loss * mask).sum().backward()
    # token form: dL/dlogp_t = −A·s_i on each valid token
    torch.testing.assert_close(logp.grad, torch.tensor([[s0, s0, 0.0], [-s1] * 3]))


def test_gspo_clips_the_whole_sequence():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    loss, stats = gspo(logp, old, torch.ones(1, 2), mask=torch.ones(1, 2))
    # s = e^0.2 > 1 + 4e-4 with A > 0 → L = −1.0004, no gradient
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004]]))
    torch.testing.assert_close(stats["clipped"], torch.ones(1, 2))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2))


def test_reinforce_is_minus_advantage_times_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = reinforce(logp, logp.detach() + 1.0, torch.tensor([[2.0, -1.0]]))
    torch.testing.assert_close(loss, torch.tensor([[2.0, -2.0]]))
    torch.testing.assert_close(stats["ratio"], torch.full((1, 2), math.exp(-1.0)))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 1.0]]))


def test_decoupled_ppo_weights_by_behaviour_and_caps_it():
    old = torch.tensor([[-1.0, -3.0, -2.0, -2.0]])  # behaviour policy
    prox = old + torch.tensor([[2.0, 6.0, 0.5, 1.0]]).log()  # behaviour weights b = 2, 6 (> cap 5 → 0), 0.5, 1
    logp = (prox + torch.tensor([[1.1, 1.0, 1.5, 0.5]]).log()).requires_grad_()  # r = 1.1, 1, 1.5, 0.5
    adv = torch.tensor([[1.0, 1.0, 1.0, -2.0]])
    loss, stats = decoupled_ppo(logp, old, adv, prox_logp=prox)
    # −b·min(r·A, clip(r)·A): −2·1.1, 0, −0.5·min(1.5, 1.2), −1·min(−1, −1.6)
    torch.testing.assert_close(loss, torch.tensor([[-2.2, 0.0, -0.6, 1.6]]))
    torch.testing.assert_close(stats["behav_weight"], torch.tensor([[2.0, 0.0, 0.5, 1.0]]))
    torch.testing.assert_close(stats["behav_capped"], torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(stats["clipped"], torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    loss.sum().backward()
    # only the first decision is unclipped and uncapped: −b·r·A = −2.2
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.2, 0.0, 0.0, 0.0]]))


def test_only_decoupled_ppo_needs_a_proximal_policy():
    needs = {name: getattr(OBJECTIVES.get(name), "needs_proximal", False) for name in OBJECTIVES.names()}
    assert needs == {"cispo": False, "decoupled_ppo": True, "gspo": False, "ppo_clip": False, "reinforce": False}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "const_norm"])
@pytest.mark.parametrize("objective", ["ppo_clip", "cispo", "gspo", "reinforce", "decoupled_ppo"])
def test_positive_advantage_increases_probability(objective, aggregation):
    generator = torch.Generator().manual_seed(0)
    logits = torch.nn.Parameter(torch.zeros(4))
    batch, length = 16, 6
    actions = torch.multinomial(torch.full((4,), 0.25), batch * length, replacement=True, generator=generator)
    actions = actions.view(batch, length)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    adv = torch.where(actions == 0, 1.0, -1.0)
    prob_before = torch.softmax(logits, 0)[0].item()

    fn = OBJECTIVES.get(objective)
    logp = torch.log_softmax(logits, 0)[actions]
    old_logp = logp.detach()
    extra = {"prox_logp": old_logp} if getattr(fn, "needs_proximal", False) else {}
    loss, _ = fn(logp, old_logp, adv, mask=mask, **extra)
    AGGREGATIONS.get(aggregation)(loss, mask).backward()
    torch.optim.SGD([logits], lr=0.5).step()

    assert torch.softmax(logits, 0)[0].item() > prob_before + 1e-3
