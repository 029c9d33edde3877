import math

import pytest
import torch

from mmrl.denoising import alphas_cumprod, ddim_timesteps, ddpm_betas, flow_sigmas, gaussian_entropy, gaussian_log_prob, resolution_shift, terminal_stretch


def test_log_prob_is_summed_or_averaged_over_latent_elements():
    gen = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    std = torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1)
    per_element = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), per_element.sum((1, 2)))
    torch.testing.assert_close(gaussian_log_prob(x, mean, std, reduce="mean"), per_element.mean((1, 2)))
    # two batch dims: one log-prob per [N, K] entry
    torch.testing.assert_close(gaussian_log_prob(x, mean, std, batch_dims=2), per_element.sum(2))


def test_log_prob_by_hand_and_with_a_float_std():
    # log N(1; 0, 2^2) = -1/8 - log 2 - log sqrt(2 pi), two elements
    expected = 2 * (-1 / 8 - math.log(2) - 0.5 * math.log(2 * math.pi))
    assert gaussian_log_prob(torch.ones(1, 2), torch.zeros(1, 2), 2.0).item() == pytest.approx(expected, rel=1e-6)


def test_clamp_limits_each_element_before_the_reduction():
    x = torch.tensor([[0.0, 10.0]])
    lp = gaussian_log_prob(x, torch.zeros(1, 2), 1.0, clamp=(-5.0, 2.0))
    assert lp.item() == pytest.approx(-0.5 * math.log(2 * math.pi) - 5.0, rel=1e-6)


def test_entropy_matches_torch_distributions():
    std = torch.tensor([0.3, 2.0]).view(2, 1)
    like = torch.zeros(2, 6)
    expected = torch.distributions.Normal(torch.zeros(2, 6), std.expand(2, 6)).entropy().sum(1)
    torch.testing.assert_close(gaussian_entropy(std, like), expected)
    torch.testing.assert_close(gaussian_entropy(std, like, reduce="mean"), expected / 6)


def test_unknown_reduction_is_rejected():
    with pytest.raises(ValueError, match="reduce"):
        gaussian_log_prob(torch.zeros(1, 2), torch.zeros(1, 2), 1.0, reduce="max")


def test_ddpm_betas_and_alpha_bar():
    linear = ddpm_betas(5, "linear", 0.1, 0.5)
    torch.testing.assert_close(linear, torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64))
    torch.testing.assert_close(alphas_cumprod(linear)[:2], torch.tensor([0.9, 0.9 * 0.8], dtype=torch.float64))
    scaled = ddpm_betas(3, "scaled_linear", 0.01, 0.09)
    torch.testing.assert_close(scaled, torch.tensor([0.01, 0.04, 0.09], dtype=torch.float64))
    # cosine: alpha_bar_t = f(t+1)/f(0), f(u) = cos^2((u/T + s)/(1 + s) * pi/2)
    t, s = 10, 0.008
    f = lambda u: math.cos((u / t + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    ab = alphas_cumprod(ddpm_betas(t, "cosine"))
    assert ab[0].item() == pytest.approx(f(1) / f(0), rel=1e-9)
    assert ab[4].item() == pytest.approx(f(5) / f(0), rel=1e-9)
    assert (ab[1:] < ab[:-1]).all()


def test_sampler_timesteps_trailing_and_leading():
    assert ddim_timesteps(100, 4).tolist() == [99, 74, 49, 24]
    assert ddim_timesteps(100, 4, "leading").tolist() == [75, 50, 25, 0]
    assert ddim_timesteps(10, 10).tolist() == list(range(9, -1, -1))
    with pytest.raises(ValueError):
        ddim_timesteps(10, 11)


def test_flow_sigmas_with_and_without_shift():
    torch.testing.assert_close(flow_sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64))
    # shift 3: 3s / (1 + 2s); at s = 0.5: 1.5 / 2 = 0.75
    shifted = flow_sigmas(2, shift=3.0)
    torch.testing.assert_close(shifted, torch.tensor([1.0, 0.75, 0.0], dtype=torch.float64))


def test_a_shift_outside_the_floats_is_a_value_error_not_a_math_error():
    # 65,536 image tokens on a scheduler that goes from shift e^0.5 at 4 tokens to e^2 at 64: mu = 1639
    with pytest.raises(ValueError, match=r"e\^mu overflows a float \(mu = 1639\)"):
        resolution_shift(65536, 4, 64, 0.5, 2.0)
    with pytest.raises(ValueError, match=r"shift must be > 0.*linear"):
        resolution_shift(1, 4, 64, 0.0, 2.0, "linear")
    with pytest.raises(ValueError, match="finite number > 0"):
        flow_sigmas(4, shift=float("inf"))


def test_terminal_stretch_moves_the_last_sigma_before_zero_to_the_terminal():
    # 1 - sigma scaled by (1 - 0.1) / (1 - 0.25): [1, 0.75, 0.5, 0.25, 0] -> [1, 0.7, 0.4, 0.1, 0]
    stretched = terminal_stretch(flow_sigmas(4), 0.1)
    torch.testing.assert_close(stretched, torch.tensor([1.0, 0.7, 0.4, 0.1, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"terminal must lie in \(0, 1\)"):
        terminal_stretch(flow_sigmas(4), 1.0)
