"""A denoising chain makes no host synchronisation between its steps: on a GPU each would stall
the launch queue (what made batched sampling launch-bound). On the CPU the syncs are seen as the
dispatcher calls that read a tensor's value on the host (``bool(t)``, ``t.item()``, boolean
indexing); none may run while :func:`~mmrl.denoising.chain.run_chain` runs, whatever the
transition, the stochastic steps or the policy around it."""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmrl.denoising import DenoisingOptions, make_transition, run_chain, stochastic_mask

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default, aten.item.default}


class HostReads(TorchDispatchMode):
    """Counts the host reads of tensor values made while ``run_chain`` is on the stack."""

    def __init__(self):
        super().__init__()
        self.inside: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            stack = traceback.extract_stack()
            if any(frame.name == "run_chain" for frame in stack):
                self.inside.append(f"{func} at " + " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(stack[-6:-1])))
        return func(*args, **(kwargs or {}))


CASES = {
    "flow_sde_all": {"transition": "flow_sde", "num_inference_steps": 4},
    "flow_sde_window": {"transition": "flow_sde", "num_inference_steps": 4, "stochastic_steps": "window", "window_size": 2},
    "flow_sde_random": {"transition": "flow_sde", "num_inference_steps": 4, "stochastic_steps": "random"},
    "flow_cps": {"transition": "flow_cps", "num_inference_steps": 3},
    "ddim": {"transition": "ddim", "num_inference_steps": 3, "eta": 1.0},
    "ddpm": {"transition": "ddpm", "num_inference_steps": 3},
}


@pytest.mark.parametrize("case", CASES)
def test_run_chain_reads_nothing_on_the_host_between_its_steps(case):
    options = DenoisingOptions(**CASES[case])
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.SiLU(), torch.nn.Linear(16, 2))

    def denoiser(x, t, rows):
        return net(torch.cat([x, t[:, None].float() / 1000], 1))

    generator = torch.Generator().manual_seed(0)
    x_init = torch.randn(8, 2, generator=generator)
    stochastic = stochastic_mask(options, 8, generator)
    reads = HostReads()
    with reads:
        chain = run_chain(denoiser, make_transition(options), x_init, stochastic, generator, min_std=1e-3)  # a last DDIM or CPS step has std 0
    assert reads.inside == []
    assert chain.log_probs.shape == (8, options.num_inference_steps) and torch.isfinite(chain.log_probs).all()


def test_a_zero_std_is_still_refused_after_the_chain():
    options = DenoisingOptions(transition="ddim", num_inference_steps=3, eta=0.0)  # eta 0: every std is 0
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="denoising step 0 is stochastic but its std is 0"):
        run_chain(lambda x, t, rows: torch.zeros_like(x), make_transition(options), torch.randn(4, 2), torch.ones(4, 3, dtype=torch.bool), generator)


@pytest.mark.parametrize("policy_type", ["flow_vla", "diffusion_policy"])
def test_an_action_chunk_policy_samples_its_chains_without_host_reads(policy_type):
    """The whole chain of a VLA's action expert (or a diffusion policy's denoiser) at a batch of
    observations: its network and the chain's steps together."""
    if policy_type == "flow_vla":
        from tests.policies.test_flow_vla import VARIANTS, inputs, make
    else:
        from tests.policies.test_diffusion_policy import VARIANTS, inputs, make
    spec, fields = VARIANTS["image_state"] if "image_state" in VARIANTS else VARIANTS["sde_all"]
    policy = make(spec, **fields)
    reads = HostReads()
    with torch.no_grad(), reads:
        sample = policy.sample(inputs(spec), torch.Generator().manual_seed(0))
    assert reads.inside == []
    assert torch.isfinite(sample.logp).all()
