"""``compile_denoiser`` of the action-chunk policies (flow_vla, diffusion_policy): no-grad
sampling runs the denoising step's network through ``torch.compile``; ``log_prob``'s recompute
runs the eager one. Off by default, and off changes nothing. The flow VLA's ``compile_prefix``
compiles the backbone's pass over the prefix for sampling the same way.

Tolerance of compiled against eager chunks: the compiled step computes the same float32
operations with other kernels (fused pointwise ops, another summation order in the norms,
softmax and matrix products), so each velocity / noise prediction differs by a few ulps
(float32 eps 1.2e-7) of values of order 1, and a chain of K steps adds K such differences,
each scaled by its step size (Σ dt = 1 for a flow) and carried on by a Lipschitz network.
``LATENT_ATOL`` = 64 eps x max(1, |x|) leaves a margin of > 10 over what was measured (at
most 3.6e-7 = 3 eps, on the tiny flow VLA over seeds 0-2). The log-probs the sampling pass
reports round with it; the trainer's deferred old log-probs are its own eager pass at the
stored latents, so its first ratio stays exactly 1. A compiled prefix pass adds a few ulps to
the prefix states the expert attends to, which move a velocity by as little: the same bound."""

import copy
import json
import math
import pickle

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.errors import ConfigError
from mmrl.policies.diffusion_policy import DiffusionPolicyConfig
from mmrl.policies.flow_vla import FlowVLAConfig
from tests.policies.test_flow_vla import BACKBONE, SPEC, config, inputs, make

EPS = torch.finfo(torch.float32).eps


def latent_atol(x: torch.Tensor) -> float:
    return 64 * EPS * max(1.0, float(x.abs().max()))


pytestmark = pytest.mark.usefixtures("inductor_cache_per_kernel_set", "one_thread")  # tests/policies/conftest.py


def test_off_by_default_and_off_samples_the_eager_chain_bit_for_bit():
    assert FlowVLAConfig().compile_denoiser is False and DiffusionPolicyConfig().compile_denoiser is False and FlowVLAConfig().compile_prefix is False
    policy = make()
    sample = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    # the chain by hand through the eager denoiser: what sampling ran before the option existed
    generator = torch.Generator().manual_seed(0)
    obs = policy.observation(inputs(SPEC))
    with torch.no_grad():
        x_init = torch.randn((6, *policy.latent_shape), generator=generator)
        out = policy.sample_chain(policy._denoiser(policy.conditioning(obs)), x_init, generator)
    assert torch.equal(sample.replay["chain"]["latents"][:, 0], out.chain["latents"]) and torch.equal(sample.logp, out.logp)
    assert torch.equal(sample.output, policy.env_actions(out.final))
    assert len(policy._compiled_steps) == 0  # nothing compiled


@pytest.mark.parametrize("family", ["flow_vla", "diffusion_policy"])
def test_compiling_with_the_samplers_old_logp_is_refused_naming_the_field(family):
    cls = FlowVLAConfig if family == "flow_vla" else DiffusionPolicyConfig
    data = {"type": family, "compile_denoiser": True, "denoising": {"old_logp": "sampler"}}
    if family == "flow_vla":
        data["denoising"]["transition"] = "flow_sde"
    else:
        data["denoising"].update(transition="ddim", min_std=0.1)
    with pytest.raises(ConfigError, match="policy.compile_denoiser"):
        from_dict(cls, data, "policy").validate("policy")
    data["denoising"]["old_logp"] = "deferred"
    from_dict(cls, data, "policy").validate("policy")


def test_the_compiled_step_cache_is_not_state():
    policy = build_policy(config(compile_denoiser=True), SPEC)
    policy._compiled_steps[("expert", "cpu")] = lambda *a: None  # stands in for a compiled network
    assert len(copy.deepcopy(policy)._compiled_steps) == 0
    assert len(pickle.loads(pickle.dumps(policy))._compiled_steps) == 0
    assert not any("compiled" in key for key in policy.state_dict())


@pytest.mark.numerics
def test_compiled_flow_vla_samples_the_eager_chunks_and_recomputes_with_ratio_one():
    """Same seed, same noise: the compiled and eager chains give the same chunks to
    ``latent_atol``; log_prob (eager) of the compiled chains gives the same numbers on every
    pass (the deferred old log-probs: ratio exactly 1) and is within the contract's ratio_atol
    (1e-4) of the sampling pass's own log-probs."""
    eager = make()
    compiled = build_policy(config(compile_denoiser=True), SPEC)
    compiled.load_state_dict(eager.state_dict())
    for seed in range(2):
        a = eager.sample(inputs(SPEC, seed=seed), torch.Generator().manual_seed(seed))
        b = compiled.sample(inputs(SPEC, seed=seed), torch.Generator().manual_seed(seed))
        la, lb = a.replay["chain"]["latents"], b.replay["chain"]["latents"]
        torch.testing.assert_close(lb, la, atol=latent_atol(la), rtol=0)
        torch.testing.assert_close(b.output, a.output, atol=latent_atol(la) * 4, rtol=0)  # x half_range <= 2, and the clip
        assert torch.equal(b.replay["chain"]["stochastic"], a.replay["chain"]["stochastic"])
        recompute = compiled.log_prob(b.replay).detach()
        assert torch.equal(recompute, compiled.log_prob(b.replay).detach())
        assert torch.equal(recompute, eager.log_prob(b.replay).detach())  # the recompute is the eager module's
        torch.testing.assert_close(b.logp, recompute, atol=1e-4, rtol=0)
    # the deterministic (ODE) chain compiles to the same shapes: the same chunks too
    a, b = eager.sample(inputs(SPEC), deterministic=True), compiled.sample(inputs(SPEC), deterministic=True)
    torch.testing.assert_close(b.output, a.output, atol=latent_atol(a.replay["chain"]["latents"]) * 4, rtol=0)
    assert set(compiled._compiled_steps) == {("expert", "cpu")}


def test_compiling_the_prefix_with_the_samplers_old_logp_is_refused_naming_the_field():
    data = {"type": "flow_vla", "compile_prefix": True, "denoising": {"old_logp": "sampler", "transition": "flow_sde"}}
    with pytest.raises(ConfigError, match="policy.compile_prefix"):
        from_dict(FlowVLAConfig, data, "policy").validate("policy")
    data["denoising"]["old_logp"] = "deferred"
    from_dict(FlowVLAConfig, data, "policy").validate("policy")


@pytest.mark.numerics
@pytest.mark.parametrize("denoiser", [False, True])
def test_a_compiled_prefix_pass_samples_the_eager_chunks_and_recomputes_with_ratio_one(denoiser):
    eager = make()
    compiled = build_policy(config(compile_prefix=True, compile_denoiser=denoiser), SPEC)
    compiled.load_state_dict(eager.state_dict())
    a = eager.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    b = compiled.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    la, lb = a.replay["chain"]["latents"], b.replay["chain"]["latents"]
    torch.testing.assert_close(lb, la, atol=latent_atol(la), rtol=0)
    recompute = compiled.log_prob(b.replay).detach()
    assert torch.equal(recompute, eager.log_prob(b.replay).detach())  # the recompute is the eager backbone's and expert's
    torch.testing.assert_close(b.logp, recompute, atol=1e-4, rtol=0)
    assert set(compiled._compiled_steps) == {("backbone", "cpu"), *([("expert", "cpu")] if denoiser else [])}


@pytest.mark.slow
@pytest.mark.numerics
def test_compiled_diffusion_policy_samples_the_eager_chunks():
    data = {"type": "diffusion_policy", "action_chunk": 3, "hidden_size": 32, "num_layers": 2, "vision_channels": [4], "image_grid": 2,
            "denoising": {"num_train_timesteps": 20, "num_inference_steps": 4, "window_size": 2}}
    spec = {k: v for k, v in SPEC.items() if k != "instructions"}
    torch.manual_seed(0)
    eager = build_policy(from_dict(DiffusionPolicyConfig, data, "policy"), spec)
    compiled = build_policy(from_dict(DiffusionPolicyConfig, {**data, "compile_denoiser": True}, "policy"), spec)
    compiled.load_state_dict(eager.state_dict())
    obs = inputs(spec)
    a = eager.sample(obs, torch.Generator().manual_seed(0))
    b = compiled.sample(obs, torch.Generator().manual_seed(0))
    la, lb = a.replay["chain"]["latents"], b.replay["chain"]["latents"]
    torch.testing.assert_close(lb, la, atol=latent_atol(la), rtol=0)
    recompute = compiled.log_prob(b.replay).detach()
    assert torch.equal(recompute, eager.log_prob(b.replay).detach())
    torch.testing.assert_close(b.logp, recompute, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_trainer_update_after_compiled_sampling_starts_from_ratio_exactly_one(tmp_path, monkeypatch):
    from mmrl.policies.vla.action_chunk import ActionChunkPolicy
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import train
    from tests.conftest import point_reach_config

    data = point_reach_config(
        total_steps=1,
        env={"num_envs": 4, "kwargs": {"max_steps": 6, "min_steps": 3}},
        algo={"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1},
        eval={"every": 1000, "at_start": False, "at_end": False},
    )
    data["policy"] = {"type": "flow_vla", "backbone": BACKBONE, "action_chunk": 2, "expert_layers": 1, "expert_heads": 2, "compile_denoiser": True,
                      "denoising": {"num_inference_steps": 3}}
    calls, compiled_step = [], ActionChunkPolicy.compiled_step
    monkeypatch.setattr(ActionChunkPolicy, "compiled_step", lambda self, *args: calls.append(args[0]) or compiled_step(self, *args))
    train(from_dict(TrainConfig, data), tmp_path / "run")
    assert calls and set(calls) == {"expert"}  # the rollout sampled through the compiled expert
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [m for m in metrics if "loss/policy" in m][-1]
    assert step["objective/ratio"] == 1.0 and step["approx_kl"] == 0.0 and math.isfinite(step["loss/policy"]), step
