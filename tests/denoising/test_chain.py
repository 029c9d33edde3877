import pytest
import torch
from torch import nn

from mmrl.algo.kl import gaussian_kl
from mmrl.denoising import (
    DiffusionTransition,
    FlowTransition,
    alphas_cumprod,
    chain_kl,
    chain_log_probs,
    ddpm_betas,
    gaussian_log_prob,
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
        "ddim": (DiffusionTransition.from_config(50, K, name="ddim", eta=1.0, clip_denoised=1.0), 0.1),
        "ddpm": (DiffusionTransition.from_config(50, K, name="ddpm"), 0.05),
        "flow_sde": (FlowTransition.from_config(K, "flow_sde", noise_level=0.7), 0.0),
        "flow_cps": (FlowTransition.from_config(K, "flow_cps", noise_level=0.5), 0.0),
        "flow_noise": (FlowTransition.from_config(K, "flow_noise"), 0.0),
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
    recomputed = chain_log_probs(denoiser, transition, chain.replay(), min_std=min_std)
    torch.testing.assert_close(recomputed, chain.log_probs, atol=1e-5, rtol=1e-5)
    assert recomputed.requires_grad


def test_the_replay_layout_keeps_the_steps_from_the_first_that_may_be_stochastic():
    transition, _ = transitions()["flow_sde"]
    denoiser = make("flow_sde")
    stochastic = sde_window(6, K, 2, 2)  # steps 2 and 3; step 4 deterministic
    chain = run_chain(denoiser, transition, torch.randn(6, 3), stochastic, torch.Generator().manual_seed(0))
    stored = chain.replay(first_step=2)
    assert stored["latents"].shape == (6, K - 2 + 1, 3) and torch.equal(stored["latents"][:, -1], chain.final)
    assert stored["step_index"].tolist() == [[2, 3, 4]] * 6 and stored["step_index"].dtype == torch.long
    assert torch.equal(stored["stochastic"], stochastic[:, 2:])
    torch.testing.assert_close(chain_log_probs(denoiser, transition, stored), chain.log_probs[:, 2:], atol=1e-5, rtol=1e-5)


def test_chains_stacked_along_a_call_axis_recompute_per_chain():
    """A policy with one chain per env decision stores [N, calls, ...]; the denoiser's rows
    index the flattened (sample, call) pairs."""
    transition, _ = transitions()["flow_sde"]
    torch.manual_seed(0)
    cond = torch.randn(8, 2)  # 4 samples x 2 calls, flattened
    denoiser = ToyDenoiser(3, cond)
    chains = []
    for call in range(2):
        rows = torch.arange(4) * 2 + call
        sub = ToyDenoiser(3, cond[rows])
        sub.load_state_dict(denoiser.state_dict())
        chains.append(run_chain(sub, transition, torch.randn(4, 3), random_step(4, K, torch.Generator().manual_seed(call)), torch.Generator().manual_seed(call)))
    stored = {key: torch.stack([c.replay()[key] for c in chains], 1) for key in ("latents", "step_index", "stochastic")}
    recomputed = chain_log_probs(denoiser, transition, stored)
    assert recomputed.shape == (4, 2, K)
    torch.testing.assert_close(recomputed, torch.stack([c.log_probs for c in chains], 1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="latents"):
        chain_log_probs(denoiser, transition, {**stored, "latents": stored["latents"][:, :, :-1]})


class ElementwiseDenoiser(nn.Module):
    """out = a·tanh(b·x + c·t + cond[rows]) (and a std for Flow-Noise): no reduction over a
    row's elements, so a row's output is bitwise the same in any batch; it records the size
    of every batch it is called on."""

    def __init__(self, cond: torch.Tensor, learned_std: bool = False):
        super().__init__()
        dim = cond.shape[1]
        self.cond, self.learned_std, self.batches = cond, learned_std, []
        self.a, self.b, self.c = (nn.Parameter(torch.randn(dim, dtype=cond.dtype)) for _ in range(3))
        if learned_std:
            self.s = nn.Parameter(torch.randn(dim, dtype=cond.dtype))

    def forward(self, x, t, rows):
        self.batches.append(x.shape[0])
        h = torch.tanh(self.b * x + self.c * t[:, None].to(x.dtype) / 10 + self.cond[rows])
        out = self.a * h
        return (out, 0.05 + 0.2 * torch.sigmoid(self.s * h)) if self.learned_std else out


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["ddim", "flow_sde", "flow_noise"])
@pytest.mark.parametrize("chunk_steps", [1, 2, 3])
def test_chunked_recomputation_equals_one_call_exactly_with_equal_gradients(name, chunk_steps):
    transition, min_std = transitions()[name]
    torch.manual_seed(0)
    denoiser = ElementwiseDenoiser(torch.randn(6, 3, dtype=torch.float64), learned_std=name == "flow_noise")
    stochastic = torch.ones(6, K, dtype=torch.bool)
    stochastic[0, 1] = stochastic[2, 4] = False  # a ragged mask: chunks hold different numbers of rows
    chain = run_chain(denoiser, transition, torch.randn(6, 3, dtype=torch.float64), stochastic, torch.Generator().manual_seed(1), min_std=min_std)
    weights = torch.linspace(-1, 2, 6 * K, dtype=torch.float64).view(6, K)

    def logp_and_grads(chunk):
        denoiser.zero_grad()
        denoiser.batches = []
        logp = chain_log_probs(denoiser, transition, chain.replay(), min_std=min_std, chunk_steps=chunk)
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in denoiser.parameters()]

    whole, whole_grads = logp_and_grads(None)
    assert denoiser.batches == [int(stochastic.sum())]
    chunked, chunked_grads = logp_and_grads(chunk_steps)
    chunks = -(-K // chunk_steps)
    # each chunk is evaluated once forward and once more in backward (checkpointed)
    assert len(denoiser.batches) == 2 * chunks and max(denoiser.batches) <= 6 * chunk_steps
    assert denoiser.batches[:chunks] == denoiser.batches[chunks:][::-1]
    denoiser.batches = []
    with torch.no_grad():  # nothing to recompute
        assert torch.equal(chain_log_probs(denoiser, transition, chain.replay(), min_std=min_std, chunk_steps=chunk_steps), whole)
    assert len(denoiser.batches) == chunks
    assert chunked.dtype == torch.float64 and torch.equal(chunked, whole)
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)  # the same terms, summed in another order


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["ddim", "flow_sde"])
def test_uncheckpointed_chunks_run_each_chunk_once_with_the_same_values_and_gradients(name):
    transition, min_std = transitions()[name]
    torch.manual_seed(0)
    denoiser = ElementwiseDenoiser(torch.randn(6, 3, dtype=torch.float64))
    chain = run_chain(denoiser, transition, torch.randn(6, 3, dtype=torch.float64), torch.ones(6, K, dtype=torch.bool), torch.Generator().manual_seed(1), min_std=min_std)
    weights = torch.linspace(-1, 2, 6 * K, dtype=torch.float64).view(6, K)

    def logp_and_grads(**chunking):
        denoiser.zero_grad()
        denoiser.batches = []
        logp = chain_log_probs(denoiser, transition, chain.replay(), min_std=min_std, **chunking)
        (logp * weights).sum().backward()
        return logp.detach(), [p.grad.clone() for p in denoiser.parameters()]

    whole, whole_grads = logp_and_grads()
    kept, kept_grads = logp_and_grads(chunk_steps=1, checkpoint_chunks=False)
    assert denoiser.batches == [6] * K  # one forward per chunk, none again in backward
    assert torch.equal(kept, whole)
    for a, b in zip(kept_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name, reduce", [("flow_sde", "sum"), ("ddim", "sum"), ("flow_noise", "sum"), ("flow_sde", "mean")])
def test_exact_kl_equals_a_monte_carlo_estimate_of_the_step_kl(name, reduce):
    """KL(πθ(·|x_k) ‖ πref(·|x_k)) in closed form against the average of log πθ − log πref
    over many x_{k+1} drawn from πθ's step, at every stochastic step of a stored chain (float64)."""
    transition, min_std = transitions()[name]
    if name == "ddim":  # unclipped x0: a saturated clipped x0 gives both policies the same mean
        transition = DiffusionTransition.from_config(50, K, beta_schedule="linear", name="ddim", eta=1.0)
    torch.manual_seed(0)
    cond = torch.randn(4, 2, dtype=torch.float64)
    policy = ToyDenoiser(3, cond, learned_std=name == "flow_noise").double()
    reference = ToyDenoiser(3, cond, learned_std=name == "flow_noise").double()
    reference.load_state_dict(policy.state_dict())
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.3 * torch.randn_like(p))
    stochastic = stochastic_masks(4, "flow_cps")["all"]  # the first K - 1 steps (DDIM's last std is 0)
    chain = run_chain(policy, transition, torch.randn(4, 3, dtype=torch.float64), stochastic, torch.Generator().manual_seed(1), min_std=min_std)
    stored = chain.replay()
    exact = chain_kl(policy, reference, transition, stored, min_std=min_std, reduce=reduce)
    assert exact.shape == (4, K) and (exact[~stochastic] == 0).all() and (exact[stochastic] > 0).all()

    rows, cols = stochastic.nonzero(as_tuple=True)
    x, step = stored["latents"][rows, cols], stored["step_index"][rows, cols]
    with torch.no_grad():
        gaussians = []
        for model in (policy, reference):
            mean, std = transition.mean_std(step, x, model(x, transition.model_time(step), rows), torch.ones_like(rows, dtype=torch.bool))
            gaussians.append((mean, std.clamp(min=min_std) if min_std else std))
    (mean, std), (ref_mean, ref_std) = gaussians
    draws = mean + std * torch.randn(200_000, *mean.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    log_ratio = gaussian_log_prob(draws, mean, std, reduce, batch_dims=2) - gaussian_log_prob(draws, ref_mean, ref_std, reduce, batch_dims=2)
    estimate, stderr = log_ratio.mean(0), log_ratio.std(0) / 200_000**0.5
    assert ((estimate - exact[rows, cols].detach()).abs() < 5 * stderr + 1e-9).all(), (estimate, exact[rows, cols])
    if name != "flow_noise":  # a shared std: the Flow-GRPO form
        torch.testing.assert_close(exact[rows, cols], gaussian_kl(mean, ref_mean, std, reduce))


def test_exact_kl_is_zero_to_itself_and_its_gradient_reaches_only_the_policy():
    transition, _ = transitions()["flow_noise"]
    policy, reference = make("flow_noise"), make("flow_noise")
    stochastic = torch.ones(6, K, dtype=torch.bool)
    chain = run_chain(policy, transition, torch.randn(6, 3), stochastic, torch.Generator().manual_seed(0))
    assert (chain_kl(policy, reference, transition, chain.replay()).abs() < 1e-6).all()
    with torch.no_grad():
        policy.net[0].weight.add_(0.1)
    kl = chain_kl(policy, reference, transition, chain.replay(), chunk_steps=2)
    assert (kl > 0).all()
    kl.sum().backward()
    assert all(p.grad is not None for p in policy.parameters())
    assert all(p.grad is None for p in reference.parameters())


def test_deterministic_steps_follow_the_ode_and_ignore_the_generator():
    transition, _ = transitions()["flow_sde"]
    denoiser = make("flow_sde")
    x_init = torch.zeros(6, 3)
    none = torch.zeros(6, K, dtype=torch.bool)
    a = run_chain(denoiser, transition, x_init, none, torch.Generator().manual_seed(0))
    b = run_chain(denoiser, transition, x_init, none, torch.Generator().manual_seed(1))
    assert torch.equal(a.latents, b.latents) and (a.log_probs == 0).all()
    ode = run_chain(denoiser, FlowTransition.from_config(K, "flow_ode"), x_init, none)
    torch.testing.assert_close(a.latents, ode.latents)
    assert torch.equal(chain_log_probs(denoiser, transition, a.replay()), torch.zeros(6, K))  # nothing to evaluate


def test_stochastic_step_with_zero_std_needs_a_floor_and_the_floor_is_the_sampling_std():
    transition = DiffusionTransition.from_config(50, K, name="ddim", eta=1.0)  # last step: sigma = 0
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
        transition = DiffusionTransition.from_config(50, K, beta_schedule="linear", name="ddim", eta=1.0)
    denoiser = make(name, n=8, dim=1)
    every = torch.ones(8, K, dtype=torch.bool) if name != "ddim" else last_steps(8, K, 3)
    chain = run_chain(denoiser, transition, torch.randn(8, 1, generator=torch.Generator().manual_seed(5)), every, torch.Generator().manual_seed(6), min_std=min_std)
    advantage = torch.zeros(8, 1)
    advantage[2] = 1.0
    optimizer = torch.optim.Adam(denoiser.parameters(), lr=1e-3)
    loss = -(advantage * chain_log_probs(denoiser, transition, chain.replay(), min_std=min_std)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = chain_log_probs(denoiser, transition, chain.replay(), min_std=min_std).sum(1)
    assert after[2] > chain.log_probs[2].sum() + 1e-3


_FINE = pytest.mark.slow  # 1000 small steps: ~1 s on an idle core, much more on a busy one


@pytest.mark.parametrize(
    "name, steps, std_tol",
    [
        ("flow_sde", 100, 0.01),
        ("flow_sde_constant", 100, 0.01),
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

    if name == "flow_sde_constant":  # DanceGRPO's SDE, eta = 0.5
        transition, denoiser = FlowTransition.from_config(steps, "flow_sde", noise_level=0.5, diffusion="constant"), exact_v
    elif name.startswith("flow"):
        transition, denoiser = FlowTransition.from_config(steps, name, noise_level=0.7), exact_v
    else:
        kind, eta = ("ddpm", 1.0) if name == "ddpm" else ("ddim", 0.0 if name == "ddim_eta0" else 1.0)
        transition, denoiser = DiffusionTransition.from_config(1000, steps, beta_schedule="linear", name=kind, eta=eta), exact_eps
    # every step stochastic except the last (its std is 0 for DDIM/DDPM)
    stochastic = torch.zeros(n, steps, dtype=torch.bool) if name in ("flow_ode", "ddim_eta0") else sde_window(n, steps, 0, steps - 1)
    chain = run_chain(denoiser, transition, torch.randn(n, 1, generator=torch.Generator().manual_seed(0)), stochastic, torch.Generator().manual_seed(1))
    final = chain.final[:, 0]
    assert final.mean().item() == pytest.approx(m, abs=0.015)
    assert final.std().item() == pytest.approx(s, abs=std_tol)


def test_random_subset_draws_the_fraction_of_each_chains_stochastic_steps():
    from mmrl.denoising.chain import random_subset

    stochastic = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0, 0, 0], [0] * 10], dtype=torch.bool)
    picked = random_subset(stochastic, 0.6, torch.Generator().manual_seed(0))
    assert picked.sum(1).tolist() == [6, 2, 1, 0]  # round(0.6 n), at least one where there is one
    assert not (picked & ~stochastic).any()
    assert torch.equal(picked, random_subset(stochastic, 0.6, torch.Generator().manual_seed(0)))
    many = torch.stack([random_subset(stochastic[:1], 0.6, torch.Generator().manual_seed(i))[0] for i in range(400)])
    assert ((many.float().mean(0) - 0.6).abs() < 0.08).all()  # every step as likely
