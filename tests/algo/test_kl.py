import math

import pytest
import torch

from mmrl.algo.kl import KLConfig, gaussian_kl, k1, k2, k3, kl_in_reward
from mmrl.errors import ConfigError
from mmrl.registry import KL_ESTIMATORS

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])


def test_registry_holds_every_estimator():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


def test_k1_and_k2():
    torch.testing.assert_close(k1(LOGP, REF), torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(k2(LOGP, REF), torch.tensor([[0.125, 0.5, 0.0]]))


def test_k3_values_and_gradient():
    logp = LOGP.clone().requires_grad_()
    kl = k3(logp, REF)
    # δ = ref − logp = −0.5, 1, 0:  e^−0.5 + 0.5 − 1 = 0.106531,  e − 2 = 0.718282,  0
    torch.testing.assert_close(kl, torch.tensor([[0.106531, 0.718282, 0.0]]))
    kl.sum().backward()
    # d/dlogp = 1 − e^δ
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.e, 0.0]]))


def test_k3_caps_the_estimate_at_ten_as_verl():
    logp = torch.tensor([0.0, 0.0, 0.0, -50.0], requires_grad=True)
    ref = torch.tensor([5.0, 2.0, -5.0, 0.0])
    kl = k3(logp, ref)
    # δ = 5: e^5 − 6 = 142.413 → 10;  δ = 2: e^2 − 3 = 4.389056 (under the cap);
    # δ = −5: e^−5 + 4 = 4.006738 (grows only linearly for δ < 0);  δ = 50 → 20: e^20 − 21 → 10
    torch.testing.assert_close(kl, torch.tensor([10.0, 4.389056, 4.006738, 10.0]))
    kl.sum().backward()
    # d/dlogp = 1 − e^δ under the cap, 0 where the cap acts
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1 - math.exp(2.0), 1 - math.exp(-5.0), 0.0]))


def test_k3_clamps_the_log_ratio_before_exp():
    # δ = −50 → −20: e^−20 + 19 = 19.000000002, then the cap: 10
    torch.testing.assert_close(k3(torch.tensor([50.0]), torch.tensor([0.0])), torch.tensor([10.0]))
    # uncapped: the clamp alone bounds it
    torch.testing.assert_close(k3(torch.tensor([50.0]), torch.tensor([0.0]), cap=None), torch.tensor([19.0]))
    # δ = 50 → 10 with log_ratio_clamp=10: e^10 − 11 = 22015.465795
    kl = k3(torch.tensor([0.0]), torch.tensor([50.0]), log_ratio_clamp=10.0, cap=None)
    torch.testing.assert_close(kl, torch.tensor([22015.465795]))


def test_k3_without_clamps_is_trls_form():
    # δ = 5: e^5 − 6 = 142.413159, neither clamped nor capped
    kl = k3(torch.tensor([0.0]), torch.tensor([5.0]), log_ratio_clamp=math.inf, cap=None)
    torch.testing.assert_close(kl, torch.tensor([142.413159]))


def test_gaussian_kl_mean_and_sum_over_latent_dims():
    mean = torch.tensor([[[1.0, 2.0]], [[1.0, 1.0]]])  # [B=2, C=1, H=2]
    ref = torch.zeros(2, 1, 2)
    # σ = 2: per element 1/8, 4/8 → mean 0.3125, sum 0.625;  second row 1/8 each
    torch.testing.assert_close(gaussian_kl(mean, ref, 2.0), torch.tensor([0.3125, 0.125]))
    torch.testing.assert_close(gaussian_kl(mean, ref, 2.0, reduce="sum"), torch.tensor([0.625, 0.25]))
    # per-sample σ = 2, 1: second row 1/2 each
    std = torch.tensor([2.0, 1.0]).view(2, 1, 1)
    torch.testing.assert_close(gaussian_kl(mean, ref, std), torch.tensor([0.3125, 0.5]))
    # keep two leading dims
    torch.testing.assert_close(gaussian_kl(mean, ref, 2.0, batch_dims=2), torch.tensor([[0.3125], [0.125]]))
    with pytest.raises(ValueError, match="'max'"):
        gaussian_kl(mean, ref, 2.0, reduce="max")


def test_gaussian_kl_with_a_reference_std_is_the_kl_of_two_diagonal_gaussians():
    mean, ref = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]])
    std, ref_std = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 1.0]])
    # element 1: log 2 + (1 + 1)/8 - 1/2 = log 2 - 1/4; element 2: equal Gaussians, 0
    torch.testing.assert_close(gaussian_kl(mean, ref, std, reduce="sum", ref_std=ref_std), torch.tensor([math.log(2) - 0.25]))
    # equal stds: the shared-std form
    torch.testing.assert_close(gaussian_kl(mean, ref, 2.0, ref_std=2.0), gaussian_kl(mean, ref, 2.0))


def test_kl_in_reward_subtracts_masked_sum():
    rewards = torch.tensor([1.0, 2.0])
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -3.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    # k1 row 0: 0.5 − 1 = −0.5 → 1 + 0.1·0.5 = 1.05;  row 1: 0 (the 2 is masked) → 2
    shaped = kl_in_reward(rewards, logp, ref, mask, coef=0.1)
    torch.testing.assert_close(shaped, torch.tensor([1.05, 2.0]))
    assert not shaped.requires_grad
    # k3 row 0: 0.106531 + 0.718282 = 0.824813 → 1 − 0.0824813 = 0.917519
    torch.testing.assert_close(kl_in_reward(rewards, logp, ref, mask, coef=0.1, estimator="k3"), torch.tensor([0.917519, 2.0]))
    with pytest.raises(ConfigError, match="k1, k2, k3"):
        kl_in_reward(rewards, logp, ref, mask, coef=0.1, estimator="k4")


def test_the_reference_log_probs_are_recorded_for_a_sampled_estimator_that_is_on():
    """What the rollout workers read from the run config to record ``Rollout.ref_logp``."""
    assert KLConfig(type="k3", coef=0.04).needs_reference_logp
    assert KLConfig(type="k1", coef=0.04, in_reward=True).needs_reference_logp
    assert not KLConfig(type="k3", coef=0.0).needs_reference_logp  # off: no reference
    assert not KLConfig(type="exact", coef=0.04).needs_reference_logp  # closed form in the loss's own forward
