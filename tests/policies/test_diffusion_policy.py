import math

import pytest
import torch

from mmrl.core.sampler import sampler_context
from mmrl.config import from_dict
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained
from mmrl.errors import ConfigError
from mmrl.policies.diffusion_policy import DiffusionPolicy, DiffusionPolicyConfig
from mmrl.registry import POLICIES
from tests.kernel_emulation import check_recompute

SPEC = {"action_dim": 2, "action_low": [-1.0, 0.0], "action_high": [1.0, 4.0], "state_dim": 3, "obs_dim": 3, "image_shape": [16, 16, 3]}
TWO_CAMERAS = {**SPEC, "image_shape": [2, 12, 12, 3], "state_dim": 0, "obs_dim": 0}
STATE_ONLY = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "obs_dim": 3}
TINY = {"hidden_size": 32, "num_layers": 2, "vision_channels": [8, 8], "action_chunk": 3, "denoising": {"num_train_timesteps": 20, "num_inference_steps": 5, "window_size": 3}}
VARIANTS = {
    "image_state": (SPEC, {}),
    "two_cameras": (TWO_CAMERAS, {}),
    "spatial_softmax": (TWO_CAMERAS, {"image_pooling": "spatial_softmax", "keypoints": 4}),
    "flat_state": (STATE_ONLY, {}),
    "ddpm": (SPEC, {"denoising": {"transition": "ddpm"}}),
    "mean_clamped": (SPEC, {"denoising": {"logp_reduction": "mean", "logp_element_clamp": [-5.0, 2.0], "clip_denoised": None}}),
    "all_steps_chunked": (SPEC, {"denoising": {"stochastic_steps": "all", "chunk_steps": 2}}),
    "window_chain": (SPEC, {"denoising": {"stochastic_steps": "window", "window_start": 1, "window_size": 2, "logp_granularity": "chain"}}),
    "random_step": (SPEC, {"denoising": {"stochastic_steps": "random", "window_size": None}}),
}



@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy machine (other test
    processes, simulators) the threads' synchronisation made these tests 10-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(**fields) -> DiffusionPolicyConfig:
    """TINY with ``fields`` on top (``denoising`` keys merged into TINY's); the other
    denoising options keep the policy's defaults."""
    data = {"type": "diffusion_policy", **TINY, **fields, "denoising": {**TINY["denoising"], **fields.get("denoising", {})}}
    return from_dict(DiffusionPolicyConfig, data, "policy")


def make(spec=SPEC, **fields) -> DiffusionPolicy:
    torch.manual_seed(0)
    return build_policy(config(**fields), spec)


def concat_calls(*replays):
    """Replays of several policy calls concatenated along dim 1, as the env sampler does."""
    return {key: concat_calls(*(r[key] for r in replays)) if isinstance(value, dict) else torch.cat([r[key] for r in replays], 1) for key, value in replays[0].items()}


def zeros_like_replay(replay):
    return {key: zeros_like_replay(value) if isinstance(value, dict) else torch.zeros_like(value) for key, value in replay.items()}


def inputs(spec, n=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if "image_shape" not in spec:
        return torch.randn(n, spec["obs_dim"], generator=gen)  # a flat-observation env
    out = {"image": torch.randint(0, 256, (n, *spec["image_shape"]), generator=gen, dtype=torch.uint8)}
    if spec.get("state_dim"):
        out["state"] = torch.randn(n, spec["state_dim"], generator=gen)
    return out


def test_registered_under_its_type_name():
    assert POLICIES.get("diffusion_policy") is DiffusionPolicy
    assert POLICIES.entry("diffusion_policy").config is DiffusionPolicyConfig


@pytest.mark.numerics
@pytest.mark.parametrize("variant", VARIANTS)
def test_sample_shapes_and_log_prob_of_replay_equals_sampling_logp(variant):
    spec, fields = VARIANTS[variant]
    policy = make(spec, **fields)
    options = policy.denoising
    first, width = options.window[0], 5 - options.window[0]
    sample = policy.sample(inputs(spec), torch.Generator().manual_seed(0))
    assert sample.output.shape == (6, 3, 2)
    decisions = 1 if options.logp_granularity == "chain" else width
    assert sample.logp.shape == sample.entropy.shape == (6, decisions)
    chain = sample.replay["chain"]
    assert chain["latents"].shape == (6, 1, width + 1, 3, 2)
    assert chain["step_index"].tolist() == [[list(range(first, 5))]] * 6
    assert chain["stochastic"].shape == (6, 1, width) and chain["stochastic"].dtype == torch.bool
    if "image_shape" in spec:
        assert sample.replay["image"].shape == (6, 1, *spec["image_shape"]) and sample.replay["image"].dtype == torch.uint8
    check_recompute(policy, sample, atol=1e-4)  # ratio 1, exactly, at the sampling layout (the contract's bound otherwise)
    # a second call with other observations, concatenated along dim 1 as the env sampler does
    other = policy.sample(inputs(spec, seed=2), torch.Generator().manual_seed(1))
    logp = policy.log_prob(concat_calls(sample.replay, other.replay))
    assert logp.shape == (6, 2 * decisions) and logp.requires_grad
    # one denoiser pass over both calls' chunks: another batch, other float32 sums (measured: at
    # most 2.6e-6 under ATEN_CPU_CAPABILITY default, avx2 and avx512, 6% of the tolerance)
    torch.testing.assert_close(logp, torch.cat([sample.logp, other.logp], 1), atol=1e-5, rtol=1e-5)


def test_by_default_the_last_three_steps_are_the_decisions():
    sample = make().sample(inputs(SPEC), torch.Generator().manual_seed(0))
    assert sample.replay["chain"]["stochastic"].all() and sample.mask.shape == (6, 3) and (sample.mask == 1).all()


def test_actions_are_clipped_chain_ends_mapped_to_env_units():
    policy = make()
    sample = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    final = sample.replay["chain"]["latents"][:, 0, -1].clamp(-1, 1)
    torch.testing.assert_close(sample.output, torch.tensor([0.0, 2.0]) + torch.tensor([1.0, 2.0]) * final)
    assert (sample.output[..., 1] >= 0).all() and (sample.output[..., 1] <= 4).all()


def test_log_prob_of_zero_padded_decisions_is_finite():
    """Rollout.cat right-pads shorter rollouts with zeros; those decisions are masked, but
    their log-probs must not be NaN (0 * NaN would poison the loss)."""
    policy = make()
    sample = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    logp = policy.log_prob(concat_calls(sample.replay, zeros_like_replay(sample.replay)))
    assert torch.isfinite(logp).all() and (logp[:, 3:] == 0).all()


def test_deterministic_sampling_is_a_ddim_ode_independent_of_the_generator():
    policy = make()
    a = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0), deterministic=True)
    b = policy.sample(inputs(SPEC), None, deterministic=True)
    c = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    assert torch.equal(a.output, b.output) and not torch.allclose(a.output, c.output)
    assert (a.logp == 0).all()


def test_same_generator_seed_gives_the_same_sample():
    policy = make()
    a = policy.sample(inputs(SPEC), torch.Generator().manual_seed(3))
    b = policy.sample(inputs(SPEC), torch.Generator().manual_seed(3))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)


def test_log_probs_are_those_of_the_floored_ddim_steps():
    """Each trained step is N(mu, max(sigma, min_std)^2); the last DDIM step's sigma
    is 0, so its std is the floor."""
    policy = make(denoising={"min_std": 0.2})
    sample = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    per_element = math.log(0.2) + 0.5 * math.log(2 * math.pi * math.e)
    torch.testing.assert_close(sample.entropy[:, -1], torch.full((6,), 6 * per_element))


@pytest.mark.parametrize("variant", ["image_state", "mean_clamped", "all_steps_chunked"])
def test_positive_advantage_raises_that_chunks_chain_log_prob_after_one_adam_step(variant):
    spec, fields = VARIANTS[variant]
    policy = make(spec, **fields)
    sample = policy.sample(inputs(spec), torch.Generator().manual_seed(0))
    advantage = torch.zeros(6, 1)
    advantage[2] = 1.0
    # the floored stds are small (0.1), so the log-prob is sharp: a small step, as in RL training
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4)
    loss = -(advantage * policy.log_prob(sample.replay)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = policy.log_prob(sample.replay)
    assert after[2].sum() > sample.logp[2].sum() + 1e-3


@pytest.mark.learning
def test_sft_makes_deterministic_actions_reach_the_expert_chunks_of_two_states(learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): max error before 1.4 to 1.6 (>= 0.3);
    max error after 0.0232 to 0.0903 (<= 0.15); gap between the two states' chunks 0.685 to 0.752 (>= 0.3).
    """
    torch.manual_seed(learning_seed)
    policy = build_policy(config(), STATE_ONLY)
    state = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]).repeat(32, 1)
    targets = torch.tensor([[[0.6, -0.4]] * 3, [[-0.5, 0.5], [-0.3, 0.3], [0.0, 0.0]]]).repeat(32, 1, 1)
    mask = torch.ones(64, 3)
    mask[1::2, 2] = 0  # the second state's last action is padding: not learned, not checked
    before = policy.sample(state[:2], deterministic=True).output
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(200):
        loss = policy.sft_loss({"state": state, "actions": targets, "action_mask": mask})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = policy.sample(state[:2], deterministic=True).output
    valid = mask[:2, :, None].expand(2, 3, 2).bool()
    error_before = (before - targets[:2])[valid].abs().max()
    error_after = (after - targets[:2])[valid].abs().max()
    learned(error_before.item(), 0.3, name="max error before")
    learned(error_after.item(), 0.15, higher=False, name="max error after")
    learned((after[0] - after[1])[:2].abs().min().item(), 0.3, name="gap between the two states' chunks")  # they get different chunks


def test_save_and_load_pretrained_round_trip_gives_exactly_equal_outputs(tmp_path):
    policy = make(TWO_CAMERAS)
    save_pretrained(policy, tmp_path / "policy")
    loaded = load_pretrained(tmp_path / "policy")
    assert isinstance(loaded, DiffusionPolicy) and loaded.config == policy.config
    a = policy.sample(inputs(TWO_CAMERAS), torch.Generator().manual_seed(4))
    b = loaded.sample(inputs(TWO_CAMERAS), torch.Generator().manual_seed(4))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
    assert torch.equal(policy.log_prob(a.replay), loaded.log_prob(a.replay))


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"window_size": 6, "num_inference_steps": 5}, "policy.denoising.window_size"),
        ({"num_inference_steps": 30, "num_train_timesteps": 20}, "policy.denoising.num_inference_steps"),
        ({"logp_element_clamp": [2.0, -5.0]}, "policy.denoising.logp_element_clamp"),
        ({"min_std": 0.0}, "policy.denoising.min_std"),
        ({"transition": "flow_sde"}, "policy.denoising.transition"),
        ({"transition": "euler"}, "policy.denoising.transition"),
        ({"stochastic_steps": "first"}, "policy.denoising.stochastic_steps"),
        ({"chunk_steps": 0}, "policy.denoising.chunk_steps"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_field(fields, field):
    with pytest.raises(ConfigError, match=field):
        from_dict(DiffusionPolicyConfig, {"type": "diffusion_policy", "denoising": fields}, "policy")


def test_a_partial_denoising_section_keeps_the_policys_other_defaults():
    cfg = from_dict(DiffusionPolicyConfig, {"type": "diffusion_policy", "denoising": {"transition": "ddpm"}}, "policy")
    assert cfg.denoising.transition == "ddpm"
    assert (cfg.denoising.stochastic_steps, cfg.denoising.window_size, cfg.denoising.min_std, cfg.denoising.num_train_timesteps) == ("last", 5, 0.1, 100)


@pytest.mark.parametrize("variant", ["image_state", "mean_clamped", "window_chain"])
def test_exact_kl_is_zero_to_an_identical_reference_and_positive_after_a_perturbation(variant):
    import copy

    spec, fields = VARIANTS[variant]
    # unclipped x0: where a clipped x0 saturates, both policies have the same mean
    policy = make(spec, **{**fields, "denoising": {**fields.get("denoising", {}), "clip_denoised": None}})
    reference = copy.deepcopy(policy).requires_grad_(False)
    sample = policy.sample(inputs(spec), torch.Generator().manual_seed(0))
    replay = concat_calls(sample.replay, policy.sample(inputs(spec, seed=2), torch.Generator().manual_seed(1)).replay)
    kl = policy.exact_kl(replay, reference)
    assert kl.shape == policy.log_prob(replay).shape and torch.equal(kl, torch.zeros_like(kl))
    with torch.no_grad():
        policy.denoiser.out[1].weight.add_(0.05 * torch.randn_like(policy.denoiser.out[1].weight))
    kl = policy.exact_kl(replay, reference)
    assert (kl > 0).all()
    kl.sum().backward()
    assert policy.denoiser.out[1].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in reference.parameters())


def test_imitation_batch_repeats_each_chunk_for_each_of_its_step_decisions():
    policy = make()
    sample = policy.sample(inputs(SPEC), torch.Generator().manual_seed(0))
    flat = policy.imitation_batch(sample.replay)
    assert flat["actions"].shape == (6 * 3, 3, 2) and flat["image"].shape[0] == flat["state"].shape[0] == 18
    torch.testing.assert_close(flat["actions"], sample.output.repeat_interleave(3, 0))
    assert torch.isfinite(policy.sft_loss(flat))


def test_a_spec_without_observations_is_a_config_error():
    with pytest.raises(ConfigError, match="needs image and/or state"):
        make({"action_dim": 2, "obs_dim": 0})


@pytest.mark.numerics
def test_env_sampler_rollout_replays_exactly_and_a_train_step_runs(tmp_path):
    """Through the env sampler (k = 3 decisions per chunk, waves of different lengths
    right-padded) and two steps of the trainer on PointReach."""
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import train
    from tests.conftest import point_reach_config

    data = point_reach_config(
        total_steps=2,
        env={"num_envs": 4, "kwargs": {"max_steps": 10, "min_steps": 3}},
        algo={"group_size": 2, "groups_per_step": 4, "ppo_epochs": 1},
    )
    data["policy"] = {"type": "diffusion_policy", **{k: v for k, v in TINY.items() if k != "vision_channels"}}  # the last 3 of 5 steps
    cfg = from_dict(TrainConfig, data)
    from mmrl.samplers.env import EnvSampler

    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    policy = make(sampler.policy_spec())
    rollout = sampler.collect(policy, num_groups=4, group_size=2, step=0)
    assert rollout.old_logp.shape[1] % 3 == 0
    logp = policy.log_prob(rollout.replay)
    # one pass over the rollout's decisions against the env waves' passes: other batches (measured: equal)
    torch.testing.assert_close(logp * rollout.mask, rollout.old_logp * rollout.mask, atol=1e-5, rtol=1e-5)
    sampler.close()
    train(cfg, tmp_path / "run")
    steps = [r for r in read_metrics(tmp_path / "run") if "loss/policy" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) and math.isfinite(r["grad_norm"]) for r in steps)
