"""A flow transition's step table (``FlowTransition.step_table``): a sampling chain whose steps
every row takes alike computes each step's coefficients once for the chain, and samples the same
latents, log-probs, entropies and gradients, bit for bit, as the per-step ``mean_std``."""

import pytest
import torch

from mmrl.denoising import DenoisingOptions, make_transition, run_chain, stochastic_mask
from mmrl.denoising.transitions import FlowTransition

CASES = {
    "flow_sde_all": {"transition": "flow_sde", "num_inference_steps": 4},
    "flow_sde_constant": {"transition": "flow_sde", "num_inference_steps": 4, "sde_diffusion": "constant"},
    "flow_sde_shifted_min_std": {"transition": "flow_sde", "num_inference_steps": 6, "time_shift": 3.0, "min_std": 0.05, "noise_level": 0.9},
    "flow_sde_window": {"transition": "flow_sde", "num_inference_steps": 5, "stochastic_steps": "window", "window_size": 2},
    "flow_sde_random": {"transition": "flow_sde", "num_inference_steps": 4, "stochastic_steps": "random"},
    "flow_cps": {"transition": "flow_cps", "num_inference_steps": 3, "min_std": 1e-3},
    "flow_noise": {"transition": "flow_noise", "num_inference_steps": 3},
}


class PerStep(FlowTransition):
    """The same transition without its step table: every step through ``mean_std``."""

    step_table = None


def per_step(transition: FlowTransition) -> PerStep:
    plain = PerStep.__new__(PerStep)
    plain.__dict__.update(transition.__dict__)
    return plain


def chain(transition, options, keep_graph: bool, reduce: str):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(7, 32), torch.nn.SiLU(), torch.nn.Linear(32, 12))

    def denoiser(x, t, rows):
        h = net(torch.cat([x.flatten(1), t[:, None]], 1))
        v = h[:, :6].view_as(x)
        return (v, torch.nn.functional.softplus(h[:, 6:]).view_as(x) + 0.01) if options.transition == "flow_noise" else v

    g = torch.Generator().manual_seed(1)
    x_init = torch.randn(9, 2, 3, generator=g)
    out = run_chain(denoiser, transition, x_init, stochastic_mask(options, 9, g), g, min_std=options.min_std, reduce=reduce, keep_graph=keep_graph)
    grads = []
    if keep_graph:
        out.log_probs.sum().backward()
        grads = [p.grad for p in net.parameters()]
    return [out.latents, out.log_probs.detach(), out.entropies, *grads]


@pytest.mark.parametrize("keep_graph", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("case", CASES)
def test_the_step_table_samples_the_per_step_chain_bit_for_bit(case, reduce, keep_graph):
    options = DenoisingOptions(**CASES[case])
    transition = make_transition(options)
    with_table = chain(transition, options, keep_graph, reduce)
    without = chain(per_step(transition), options, keep_graph, reduce)
    assert all(torch.equal(a, b) for a, b in zip(with_table, without, strict=True))


def test_the_ode_chain_of_deterministic_sampling_takes_the_table_too():
    options = DenoisingOptions(transition="flow_sde", num_inference_steps=4)
    transition = make_transition(options)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))

    def denoiser(x, t, rows):
        return torch.sin(3 * x) + t[:, None]

    none = torch.zeros(5, 4, dtype=torch.bool)
    a, b = run_chain(denoiser, transition, x, none), run_chain(denoiser, per_step(transition), x, none)
    assert torch.equal(a.latents, b.latents) and not a.log_probs.any()
