import pytest
import torch
from torch import nn

from mmrl.denoising import (
    DiffusionTransition,
    FlowTransition,
    alphas_cumprod,
    chain_log_probs,
    ddpm_betas,
    last_steps,
    random_step,
    run_chain,
    sde_window,
)

K = 5


class ToyDenoiser(nn.Module):
    """out = MLP([x, t, cond[rows]]) (+ a learned std for Flow-Noise)."""

    def __init__(self, dim: int, cond: torch.Tensor, learned_std: bool = False):
        super().__init__()
        self.cond, self.learned_std = cond, learned_std
        self.net = nn.Sequential(nn.Linear(dim + 1 + cond.shape[1], 32), nn.Tanh(), nn.Linear(32, dim * (2 if learned_std else 1)))

    def forward(self, x, t, rows):
        out = self.net(torch.cat([x, t[:, None].float() / 10, self.cond[rows]], 1))
        if self.learned_std:
            v, raw = out.chunk(2, dim=1)
            return v, 0.05 + 0.2 * torch.sigmoid(raw)
        return out


def transitions():
    return {
        "ddim": (DiffusionTransition.from_config(50, K, kind="ddim", eta=1.0, clip_denoised=1.0), 0.1),
        "ddpm": (DiffusionTransition.from_config(50, K, kind="ddpm"), 0.05),
        "flow_sde": (FlowTransition.from_config(K, "sde", noise_level=0.7), 0.0),
        "flow_cps": (FlowTransition.from_config(K, "cps", noise_level=0.5), 0.0),
        "flow_noise": (FlowTransition.from_config(K, "noise"), 0.0),
    }


def stochastic_masks(n, name):
    last = K - 1 if name == "flow_cps" else K  # CPS's last step is deterministic
    return {
        "all": torch.ones(n, K, dtype=torch.bool) if last == K else sde_window(n, K, 0, last),
        "window": sde_window(n, K, 1, 2),
        "random_one": random_step(n, K, torch.Generator().manual_seed(3), high=last),
    }


def make(name, n=6, dim=3, seed=0):
    torch.manual_seed(seed)
    cond = torch.randn(n, 2)
    return ToyDenoiser(dim, cond, learned_std=name == "flow_noise")


@pytest.mark.parametrize("name", ["ddim", "ddpm", "flow_sde", "flow_cps", "flow_noise"])
@pytest.mark.parametrize("mode", ["all", "window", "random_one"])
def test_recomputed_log_probs_equal_the_sampling_ones(name, mode):
    transition, min_std = transitions()[name]
    denoiser = make(name)
    stochastic = stochastic_masks(6, name)[mode]
    x_init = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    chain = run_chain(denoiser, transition, x_init, stochastic, torch.Generator().manual_seed(2), min_std=min_std)
    assert chain.latents.shape == (6, K + 1, 3) and chain.log_probs.shape == (6, K)
    assert torch.equal(chain.latents[:, 0], x_init)
    assert (chain.log_probs[~stochastic] == 0).all() and (chain.log_probs[stochastic] != 0).all()
    recomputed = chain_log_probs(denoiser, transition, chain.latents, stochastic, min_std=min_std)
    torch.testing.assert_close(recomputed, chain.log_probs, atol=1e-5, rtol=1e-5)
    assert recomputed.requires_grad


def test_deterministic_steps_follow_the_ode_and_ignore_the_generator():
    transition, _ = transitions()["flow_sde"]
    denoiser = make("flow_sde")
    x_init = torch.zeros(6, 3)
    none = torch.zeros(6, K, dtype=torch.bool)
    a = run_chain(denoiser, transition, x_init, none, torch.Generator().manual_seed(0))
    b = run_chain(denoiser, transition, x_init, none, torch.Generator().manual_seed(1))
    assert torch.equal(a.latents, b.latents) and (a.log_probs == 0).all()
    ode = run_chain(denoiser, FlowTransition.from_config(K, "ode"), x_init, none)
    torch.testing.assert_close(a.latents, ode.latents)
    assert torch.equal(chain_log_probs(denoiser, transition, a.latents, none), torch.zeros(6, K))  # nothing to evaluate


def test_stochastic_step_with_zero_std_needs_a_floor_and_the_floor_is_the_sampling_std():
    transition = DiffusionTransition.from_config(50, K, kind="ddim", eta=1.0)  # last step: sigma = 0
    denoiser = make("ddim")
    every = torch.ones(6, K, dtype=torch.bool)
    with pytest.raises(ValueError, match="step 4 is stochastic but its std is 0"):
        run_chain(denoiser, transition, torch.randn(6, 3), every, torch.Generator().manual_seed(0))
    chain = run_chain(denoiser, transition, torch.randn(6, 3), every, torch.Generator().manual_seed(0), min_std=0.3)
    # each element of the last step deviates from its mean by 0.3 * z; its entropy is that of N(., 0.3^2)
    expected_entropy = 3 * (torch.log(torch.tensor(0.3)) + 0.5 * torch.log(torch.tensor(2 * torch.pi * torch.e)))
    torch.testing.assert_close(chain.entropies[:, -1], expected_entropy.expand(6))


def test_mean_reduction_divides_the_log_prob_by_the_latent_size():
    transition, _ = transitions()["flow_sde"]
    denoiser = make("flow_sde")
    every = torch.ones(6, K, dtype=torch.bool)
    x_init = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    summed = run_chain(denoiser, transition, x_init, every, torch.Generator().manual_seed(2))
    averaged = run_chain(denoiser, transition, x_init, every, torch.Generator().manual_seed(2), reduce="mean")
    torch.testing.assert_close(averaged.log_probs, summed.log_probs / 3)


def test_step_masks():
    assert last_steps(2, 5, 2).tolist() == [[False, False, False, True, True]] * 2
    assert sde_window(1, 5, 1, 2).tolist() == [[False, True, True, False, False]]
    assert sde_window(2, 4, torch.tensor([0, 3]), 2).tolist() == [[True, True, False, False], [False, False, False, True]]
    one = random_step(100, 5, torch.Generator().manual_seed(0), low=1, high=3)
    assert (one.sum(1) == 1).all() and not one[:, [0, 3, 4]].any() and one[:, 1].any() and one[:, 2].any()


@pytest.mark.parametrize("name", ["ddim", "flow_sde", "flow_noise"])
def test_positive_advantage_raises_the_chain_log_prob_of_that_sample_after_one_step(name):
    """A 1-D toy chain: one policy-gradient step with advantage +1 on sample 2 (0 elsewhere)."""
    transition, min_std = transitions()[name]
    if name == "ddim":  # unclipped x0 (a saturated clipped x0 passes no gradient), mild schedule
        transition = DiffusionTransition.from_config(50, K, beta_schedule="linear", kind="ddim", eta=1.0)
    denoiser = make(name, n=8, dim=1)
    every = torch.ones(8, K, dtype=torch.bool) if name != "ddim" else last_steps(8, K, 3)
    chain = run_chain(denoiser, transition, torch.randn(8, 1, generator=torch.Generator().manual_seed(5)), every, torch.Generator().manual_seed(6), min_std=min_std)
    advantage = torch.zeros(8, 1)
    advantage[2] = 1.0
    optimizer = torch.optim.Adam(denoiser.parameters(), lr=1e-3)
    loss = -(advantage * chain_log_probs(denoiser, transition, chain.latents, every, min_std=min_std)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = chain_log_probs(denoiser, transition, chain.latents, every, min_std=min_std).sum(1)
    assert after[2] > chain.log_probs[2].sum() + 1e-3


_FINE = pytest.mark.slow  # 1000 small steps: ~1 s on an idle core, much more on a busy one


@pytest.mark.parametrize(
    "name, steps, std_tol",
    [
        ("flow_sde", 100, 0.01),
        ("flow_ode", 100, 0.01),
        ("ddim", 100, 0.035),
        ("ddpm", 100, 0.035),
        ("ddim_eta0", 100, 0.035),
        pytest.param("ddim", 1000, 0.01, marks=_FINE),
        pytest.param("ddpm", 1000, 0.01, marks=_FINE),
        pytest.param("ddim_eta0", 1000, 0.01, marks=_FINE),
    ],
)
def test_with_the_exact_model_of_gaussian_data_the_sampler_reaches_the_data_distribution(name, steps, std_tol):
    """Data x0 ~ N(m, s^2): the exact ε (diffusion) and v = ε − x0 (flow) are linear in x,
    so the chains must end with mean m and std s up to discretization error (diffusion
    samplers lose ~10% of the std at 100 strided steps of a 1000-step schedule, < 1% at 1000)."""
    m, s, n = 0.5, 0.3, 10000
    schedule = alphas_cumprod(ddpm_betas(1000, "linear"))

    def exact_eps(x, t, rows):  # x_t = sqrt(ab) x0 + sqrt(1 - ab) eps
        ab = schedule[t.long()].float().view(-1, 1)
        return (1 - ab).sqrt() / (ab * s**2 + 1 - ab) * (x - ab.sqrt() * m)

    def exact_v(x, sigma, rows):  # x_sigma = (1 - sigma) x0 + sigma eps
        sig = sigma.view(-1, 1)
        var = (1 - sig) ** 2 * s**2 + sig**2
        centred = x - (1 - sig) * m
        return sig / var * centred - (m + (1 - sig) * s**2 / var * centred)

    if name.startswith("flow"):
        transition, denoiser = FlowTransition.from_config(steps, name[5:], noise_level=0.7), exact_v
    else:
        kind, eta = ("ddpm", 1.0) if name == "ddpm" else ("ddim", 0.0 if name == "ddim_eta0" else 1.0)
        transition, denoiser = DiffusionTransition.from_config(1000, steps, beta_schedule="linear", kind=kind, eta=eta), exact_eps
    # every step stochastic except the last (its std is 0 for DDIM/DDPM)
    stochastic = torch.zeros(n, steps, dtype=torch.bool) if name in ("flow_ode", "ddim_eta0") else sde_window(n, steps, 0, steps - 1)
    chain = run_chain(denoiser, transition, torch.randn(n, 1, generator=torch.Generator().manual_seed(0)), stochastic, torch.Generator().manual_seed(1))
    final = chain.final[:, 0]
    assert final.mean().item() == pytest.approx(m, abs=0.015)
    assert final.std().item() == pytest.approx(s, abs=std_tol)
