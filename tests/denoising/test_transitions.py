import math

import pytest
import torch

from mmrl.denoising import (
    DiffusionTransition,
    FlowTransition,
    ddim_step,
    ddpm_step,
    flow_cps_step,
    flow_noise_step,
    flow_ode_step,
    flow_sde_step,
    learned_noise_std,
    predicted_x0,
)

X, EPS = torch.tensor([[0.5]]), torch.tensor([[0.2]])


def close(tensor, value):
    assert tensor.item() == pytest.approx(value, rel=1e-5, abs=1e-6)


def test_ddim_step_with_eta_by_hand():
    # ab = 0.5, ab_prev = 0.8: x0 = 0.5/sqrt(0.5) - 0.2; sigma^2 = (0.2/0.5)(1 - 0.5/0.8) = 0.15
    mean, std = ddim_step(X, EPS, 0.5, 0.8, eta=1.0)
    x0 = 0.5 / math.sqrt(0.5) - 0.2
    close(std, math.sqrt(0.15))
    close(mean, math.sqrt(0.8) * x0 + math.sqrt(1 - 0.8 - 0.15) * 0.2)
    # eta = 0.5 scales sigma; eta = 0 is deterministic
    mean_half, std_half = ddim_step(X, EPS, 0.5, 0.8, eta=0.5)
    close(std_half, 0.5 * math.sqrt(0.15))
    close(mean_half, math.sqrt(0.8) * x0 + math.sqrt(1 - 0.8 - 0.25 * 0.15) * 0.2)
    mean0, std0 = ddim_step(X, EPS, 0.5, 0.8, eta=0.0)
    close(std0, 0.0)
    close(mean0, math.sqrt(0.8) * x0 + math.sqrt(0.2) * 0.2)


def test_ddpm_step_is_the_posterior_of_the_joint_gaussian():
    """Given the true x0, x_prev | x_t, x0 from the joint Gaussian of
    x_prev = sqrt(ab_prev) x0 + sqrt(1 - ab_prev) e1 and x_t = sqrt(a) x_prev + sqrt(1 - a) e2."""
    ab, ab_prev = 0.3, 0.6
    a = ab / ab_prev
    x0, x_t = 0.7, -0.4
    eps = (x_t - math.sqrt(ab) * x0) / math.sqrt(1 - ab)
    cov = math.sqrt(a) * (1 - ab_prev)  # Cov(x_prev, x_t | x0)
    post_mean = math.sqrt(ab_prev) * x0 + cov / (1 - ab) * (x_t - math.sqrt(ab) * x0)
    post_var = (1 - ab_prev) - cov**2 / (1 - ab)
    mean, std = ddpm_step(torch.tensor([[x_t]]), torch.tensor([[eps]]), ab, ab_prev)
    close(mean, post_mean)
    close(std, math.sqrt(post_var))
    # DDIM with eta = 1 is the same Gaussian (Song et al. 2021)
    mean_ddim, std_ddim = ddim_step(torch.tensor([[x_t]]), torch.tensor([[eps]]), ab, ab_prev, eta=1.0)
    close(mean_ddim, post_mean)
    close(std_ddim, math.sqrt(post_var))


def test_clip_denoised_clips_x0_and_recomputes_eps():
    x, eps = torch.tensor([[2.0]]), torch.tensor([[-1.0]])
    x0, eps_c = predicted_x0(x, eps, 0.25, clip_denoised=1.0)  # unclipped x0 = (2 + sqrt(.75))/0.5 > 1
    close(x0, 1.0)
    close(eps_c, (2.0 - 0.5 * 1.0) / math.sqrt(0.75))
    mean, _ = ddim_step(x, eps, 0.25, 1.0, eta=0.0, clip_denoised=1.0)  # last step lands on x0
    close(mean, 1.0)


def test_flow_sde_step_by_hand():
    # sigma = 0.6 -> 0.4, a = 0.7: sigma_t^2 = 0.49 * 1.5 = 0.735, dt = -0.2
    # mean = 0.3 + (-0.4 + 0.735 / 1.2 * (0.3 + 0.4 * -0.4)) * -0.2 = 0.36285
    mean, std = flow_sde_step(torch.tensor([[0.3]]), torch.tensor([[-0.4]]), 0.6, 0.4, noise_level=0.7)
    close(mean, 0.36285)
    close(std, 0.7 * math.sqrt(1.5) * math.sqrt(0.2))
    # noise level 0 is the ODE step x + v dt = 0.3 + 0.08
    mean0, std0 = flow_sde_step(torch.tensor([[0.3]]), torch.tensor([[-0.4]]), 0.6, 0.4, noise_level=0.0)
    close(mean0, 0.38)
    close(std0, 0.0)


def test_flow_sde_step_with_constant_diffusion_is_dancegrpos_step():
    # DanceGRPO writes the step with the score of x given the predicted clean sample
    # x0 = x - sigma v: score = -(x - (1 - sigma) x0) / sigma^2, and with eta, dsigma < 0:
    # mean = x + v dsigma - eta^2 / 2 * score * dsigma, std = eta sqrt(-dsigma)
    x, v, sigma, sigma_next, eta = torch.tensor([[0.3, -1.2]]), torch.tensor([[-0.4, 0.9]]), 0.6, 0.4, 0.3
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    dsigma = sigma_next - sigma
    mean, std = flow_sde_step(x, v, sigma, sigma_next, noise_level=eta, diffusion="constant")
    torch.testing.assert_close(mean, x + v * dsigma - eta**2 / 2 * score * dsigma)
    torch.testing.assert_close(std, torch.full_like(x, eta * math.sqrt(0.2)))
    # the same step as Flow-GRPO's where Flow-GRPO's sigma_t = a sqrt(sigma / (1 - sigma)) equals eta
    a = eta / math.sqrt(sigma / (1 - sigma))
    torch.testing.assert_close(flow_sde_step(x, v, sigma, sigma_next, noise_level=a), (mean, std))
    # at sigma = 1 nothing needs a stand-in: sigma_t is eta there too
    mean1, std1 = flow_sde_step(x, v, 1.0, 0.8, noise_level=eta, diffusion="constant")
    torch.testing.assert_close(std1, torch.full_like(x, eta * math.sqrt(0.2)))
    torch.testing.assert_close(mean1, x + (v + eta**2 / 2 * x) * -0.2)
    transition = FlowTransition(torch.tensor([1.0, 0.6, 0.4, 0.0]), "flow_sde", noise_level=eta, diffusion="constant")
    torch.testing.assert_close(transition.mean_std(torch.tensor([1]), x, v, torch.tensor([True])), (mean, std))
    with pytest.raises(ValueError, match="'flow_grpo', 'constant'"):
        FlowTransition(torch.tensor([1.0, 0.0]), "flow_sde", diffusion="langevin")


def test_flow_sde_step_at_sigma_one_uses_sigma_max_in_the_ratio():
    # sigma = 1 -> 0.75 with sigma_max = 0.75: sigma_t = a sqrt(1 / 0.25) = 2a
    mean, std = flow_sde_step(torch.tensor([[0.3]]), torch.tensor([[-0.4]]), 1.0, 0.75, noise_level=0.5, sigma_max=0.75)
    close(std, 1.0 * math.sqrt(0.25))
    close(mean, 0.3 + (-0.4 + 1.0 / 2 * 0.3) * -0.25)


def test_cps_step_by_hand_and_preserves_the_noise_coefficient():
    # x0 = 0.3 + 0.6 * 0.4 = 0.54, x1 = 0.3 + 0.4 * -0.4 = 0.14, std = 0.4 sin(pi/4)
    mean, std = flow_cps_step(torch.tensor([[0.3]]), torch.tensor([[-0.4]]), 0.6, 0.4, noise_level=0.5)
    close(std, 0.4 * math.sqrt(0.5))
    close(mean, 0.6 * 0.54 + math.sqrt(0.16 - 0.08) * 0.14)
    # noise coefficient: sqrt(sigma_next^2 - std^2)^2 + std^2 = sigma_next^2
    assert (0.16 - std.item() ** 2) + std.item() ** 2 == pytest.approx(0.16)
    # a = 0 is the ODE step
    mean0, _ = flow_cps_step(torch.tensor([[0.3]]), torch.tensor([[-0.4]]), 0.6, 0.4, noise_level=0.0)
    close(mean0, 0.38)


def test_ode_and_flow_noise_steps():
    mean, std = flow_ode_step(torch.tensor([[0.3]]), torch.tensor([[-0.4]]), 0.6, 0.4)
    close(mean, 0.38)
    close(std, 0.0)
    mean, std = flow_noise_step(torch.tensor([[0.3, 0.1]]), torch.tensor([[-0.4, 0.0]]), 0.6, 0.4, torch.tensor([[0.05, 0.2]]))
    torch.testing.assert_close(mean, torch.tensor([[0.38, 0.1]]))
    torch.testing.assert_close(std, torch.tensor([[0.05, 0.2]]))


def test_learned_noise_std_is_squashed_log_uniformly_into_its_range():
    std = learned_noise_std(torch.tensor([-1e4, 0.0, 1e4]), [0.05, 0.2])
    torch.testing.assert_close(std, torch.tensor([0.05, 0.1, 0.2]))  # sigmoid(0) = 1/2: the geometric mean


def test_diffusion_transition_binds_the_schedule_and_mixes_sde_and_ode_rows():
    ab = torch.tensor([0.9, 0.6, 0.3], dtype=torch.float64)
    tr = DiffusionTransition(ab, torch.tensor([2, 1]), "ddim", eta=1.0)
    assert tr.num_steps == 2
    torch.testing.assert_close(tr.alpha_bar_prev, torch.tensor([0.6, 1.0]))
    step = torch.tensor([0, 0, 1])
    x, eps = torch.full((3, 2), 0.5), torch.full((3, 2), 0.2)
    mean, std = tr.mean_std(step, x, eps, torch.tensor([True, False, True]))
    m_s, s_s = ddim_step(x[:1], eps[:1], 0.3, 0.6, 1.0)
    m_d, _ = ddim_step(x[:1], eps[:1], 0.3, 0.6, 0.0)
    torch.testing.assert_close(mean[0], m_s[0])
    torch.testing.assert_close(std[0], s_s[0])
    torch.testing.assert_close(mean[1], m_d[0])
    assert (std[1] == 0).all()
    assert (std[2] == 0).all()  # the last step to alpha_bar = 1 has sigma = 0
    torch.testing.assert_close(tr.model_time(step), torch.tensor([2.0, 2.0, 1.0]))
    ddpm = DiffusionTransition(ab, torch.tensor([2, 1]), "ddpm")
    mean, std = ddpm.mean_std(step[:1], x[:1], eps[:1], torch.tensor([True]))
    m, s = ddpm_step(x[:1], eps[:1], 0.3, 0.6)
    torch.testing.assert_close(mean, m)
    torch.testing.assert_close(std, s)


def test_flow_transitions_and_model_time():
    sigmas = torch.tensor([1.0, 0.6, 0.4, 0.0])
    x, v = torch.full((2, 1), 0.3), torch.full((2, 1), -0.4)
    step = torch.tensor([1, 1])
    both = torch.tensor([True, False])
    sde = FlowTransition(sigmas, "flow_sde", noise_level=0.7)
    mean, std = sde.mean_std(step, x, v, both)
    close(mean[0], 0.36285)
    close(mean[1], 0.38)
    assert std[1].item() == 0
    assert sde.sigma_max == pytest.approx(0.6)
    cps = FlowTransition(sigmas, "flow_cps", noise_level=0.5)
    close(cps.mean_std(step, x, v, both)[1][0], 0.4 * math.sqrt(0.5))
    noise = FlowTransition(sigmas, "flow_noise")
    mean, std = noise.mean_std(step, x, (v, torch.full((2, 1), 0.1)), both)
    close(mean[0], 0.38)
    close(std[0], 0.1)
    with pytest.raises(ValueError, match="returns \\(v, std\\)"):
        noise.mean_std(step, x, v, both)
    close(sde.mean_std(step, x, (v, torch.full((2, 1), 0.1)), both)[0][0], 0.36285)  # a learned std is ignored
    ode = FlowTransition(sigmas, "flow_ode")
    assert (ode.mean_std(step, x, v, both)[1] == 0).all()
    torch.testing.assert_close(sde.model_time(torch.tensor([0, 2])), torch.tensor([1.0, 0.4]))
    with pytest.raises(ValueError, match="'flow_sde', 'flow_cps'"):
        FlowTransition(sigmas, "langevin")
    with pytest.raises(ValueError, match="ddim"):
        DiffusionTransition(torch.tensor([0.9, 0.5]), torch.tensor([1, 0]), "flow_sde")


@pytest.mark.numerics
@pytest.mark.parametrize("set_alpha_to_one", [True, False])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_steps_equal_diffusers_ddim_scheduler_with_its_set_alpha_to_one(set_alpha_to_one, eta):
    # DDIMScheduler's last step goes to final_alpha_cumprod: 1, or alphas_cumprod[0] = 1 - beta_0
    # with set_alpha_to_one false (Stable Diffusion's and SDXL's scheduler configs)
    diffusers = pytest.importorskip("diffusers")
    sd = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}
    scheduler = diffusers.DDIMScheduler(**sd, clip_sample=False, set_alpha_to_one=set_alpha_to_one, timestep_spacing="trailing")
    scheduler.set_timesteps(4)
    ours = DiffusionTransition.from_config(1000, 4, sd["beta_schedule"], "ddim", eta, beta_start=sd["beta_start"], beta_end=sd["beta_end"], set_alpha_to_one=set_alpha_to_one)
    assert ours.timesteps.tolist() == scheduler.timesteps.tolist()
    generator = torch.Generator().manual_seed(0)
    x, eps, noise = (torch.randn((2, 4, 8, 8), generator=generator) for _ in range(3))
    for k, t in enumerate(scheduler.timesteps):
        step = torch.full((2,), k)
        mean, std = ours.mean_std(step, x, eps, torch.full((2,), eta > 0))
        theirs = scheduler.step(eps, t, x, eta=eta, variance_noise=noise).prev_sample
        torch.testing.assert_close(mean + std * noise, theirs, atol=1e-6, rtol=1e-6)
    final = 1.0 if set_alpha_to_one else 1 - sd["beta_start"]
    assert ours.alpha_bar_prev[-1].item() == pytest.approx(final, abs=1e-7) and scheduler.final_alpha_cumprod.item() == pytest.approx(final, abs=1e-7)
    # what ᾱ_0 changes: the last step keeps sqrt(1 - ᾱ_0) = 0.029 of the noise estimate (0.1 here)
    if not set_alpha_to_one and eta == 0:
        one = DiffusionTransition.from_config(1000, 4, sd["beta_schedule"], "ddim", eta, beta_start=sd["beta_start"], beta_end=sd["beta_end"])
        last = torch.full((2,), 3)
        gap = (one.mean_std(last, x, eps, torch.zeros(2, dtype=torch.bool))[0] - ours.mean_std(last, x, eps, torch.zeros(2, dtype=torch.bool))[0]).abs().max()
        assert gap > 0.05
