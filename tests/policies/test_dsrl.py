"""``policy.type: dsrl``: a noise policy steering a frozen flow or diffusion policy, trained by
``algo.loss: sac`` in the noise space. The frozen policy stays as it was, the noise policy
learns, the env gets the frozen policy's own chunk for the chosen noise, every family that can
act from a noise does so deterministically, and a policy that cannot is refused in one line."""

import copy
import importlib
import subprocess
import sys

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.policy import overrides
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained
from mmrl.errors import ConfigError
from mmrl.policies.dsrl.model import steerable_policies
from mmrl.registry import POLICIES
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer
from tests.conftest import ROOT, point_reach_config

# a frozen diffusion policy over PointReach's state (random weights: its chunks are some function of the noise)
BASE = {"type": "diffusion_policy", "hidden_size": 32, "num_layers": 1, "action_chunk": 1,
        "denoising": {"num_train_timesteps": 20, "num_inference_steps": 3, "window_size": 2}}
SPEC = {"obs_dim": 4, "action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0]}
QUIET = {"log": {"progress": False, "tensorboard": False}, "eval": {"episodes": 64, "at_start": False, "at_end": False}}


def dsrl_config(seed: int = 0, total_steps: int = 3, base: dict | None = None, loss: dict | None = None, **policy) -> dict:
    """DSRL over ``base`` on PointReach, trained by SAC: 8 episodes a step."""
    options = {"type": "sac", "gamma": 0.9, "batch_size": 128, "learning_starts": 256, "utd": 0.5, "critic_hidden_sizes": [64, 64], "buffer_size": 20_000, **(loss or {})}
    section = {"type": "dsrl", "hidden_sizes": [64, 64], "inputs": "state", "policy": dict(base or BASE), **policy}
    return point_reach_config(
        name="dsrl", seed=seed, total_steps=total_steps, env={"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 8}, policy=section,
        rewards=[{"type": "success"}], algo={"group_size": 1, "groups_per_step": 8, "ppo_epochs": 1, "loss": options},
        optim={"lr": 1e-3, "max_grad_norm": None}, **QUIET,
    )


def build(section: dict, spec: dict = SPEC):
    return build_policy(from_dict(POLICIES.entry("dsrl").config, {"type": "dsrl", "hidden_sizes": [16], "inputs": "state", **section}, "policy"), spec)


# ---------------------------------------------------------------- frozen and trained


def test_sac_steps_train_the_noise_policy_and_leave_the_frozen_policy_unchanged(tmp_path):
    trainer = Trainer(from_dict(TrainConfig, dsrl_config(total_steps=3, loss={"learning_starts": 64})), tmp_path / "run")
    policy = trainer.policy
    frozen = {k: v.clone() for k, v in policy.base.state_dict().items()}
    noise_policy = {k: v.clone() for k, v in policy.net.state_dict().items()}
    assert not any(p.requires_grad for p in policy.base.parameters())
    trained = {id(p) for group in trainer.learner.optimizer.param_groups for p in group["params"]}
    assert not trained & {id(p) for p in policy.base.parameters()} and {id(p) for p in policy.net.parameters()} <= trained
    steps = sum(trainer.rl_step(step)["update/steps"] for step in range(3))
    assert steps > 0
    assert all(torch.equal(v, policy.base.state_dict()[k]) for k, v in frozen.items())
    assert all(p.grad is None for p in policy.base.parameters())
    assert any(not torch.equal(v, policy.net.state_dict()[k]) for k, v in noise_policy.items())
    assert not policy.base.training  # frozen: kept in eval mode while the noise policy trains


def test_the_env_gets_the_frozen_policys_chunk_for_the_chosen_noise():
    policy = build({"policy": BASE})
    obs = torch.randn(6, 4)
    sample = policy.sample(obs, torch.Generator().manual_seed(0))
    noise = sample.info["noise"]
    assert noise.shape == (6, *policy.base.noise_shape) and noise.abs().max() <= policy.config.noise_bound
    assert torch.equal(sample.output, policy.base.sample_from_noise(obs, noise).output)
    assert torch.equal(sample.replay["action"].tanh() * policy.config.noise_bound, noise.reshape(6, 1, -1))
    with torch.no_grad():
        assert torch.allclose(policy.log_prob(sample.replay), sample.logp, atol=1e-6)
    mean = policy.sample(obs, None, deterministic=True)
    assert torch.equal(mean.output, policy.sample(obs, torch.Generator().manual_seed(5), deterministic=True).output)


def test_the_replay_holds_the_noise_policys_inputs_and_sac_reads_its_noise_space():
    policy = build({"policy": BASE, "inputs": "features_and_state"})
    sample = policy.sample(torch.randn(5, 4), torch.Generator().manual_seed(0))
    assert policy.critic_input_dim == BASE["hidden_size"] + 4 == sample.replay["obs"].shape[-1]
    assert policy.action_values == sample.replay["action"].shape[-1] == 2
    assert overrides(policy, "rsample") and policy.rsample_refusal() is None
    action, logp = policy.rsample(sample.replay, noise=torch.zeros(5, 1, 2))
    assert action.shape == (5, 1, 2) and logp.shape == (5, 1) and logp.requires_grad
    assert torch.equal(policy.replayed_action(sample.replay), sample.replay["action"].tanh())


def test_a_frozen_policy_loaded_from_files_is_left_out_of_the_saved_weights(tmp_path):
    base = build_policy(from_dict(POLICIES.entry("diffusion_policy").config, BASE, "policy"), SPEC)
    save_pretrained(base, tmp_path / "base")
    policy = build({"policy": {**BASE, "pretrained": str(tmp_path / "base")}})
    assert policy.state_dict() and not any(k.startswith("base.") for k in policy.state_dict())
    assert all(torch.equal(v, policy.base.state_dict()[k]) for k, v in base.state_dict().items())
    save_pretrained(policy, tmp_path / "dsrl")
    loaded = load_pretrained(tmp_path / "dsrl")
    obs = torch.randn(4, 4)
    assert torch.equal(policy.sample(obs, deterministic=True).output, loaded.sample(obs, deterministic=True).output)


# ---------------------------------------------------------------- every family that can act from a noise


@pytest.mark.parametrize("family", steerable_policies())
def test_each_steerable_family_decodes_a_given_noise_deterministically(family, tmp_path, monkeypatch):
    """Each family's contract example, steered: the same noise gives the same chunk, the
    chunk DSRL handed the env; the zero noise gives the family's own deterministic chunk."""
    monkeypatch.chdir(ROOT)  # the contracts' data paths
    contract = POLICIES.entry(family).traits["contract"]
    train = copy.deepcopy(contract["train"])
    if "prepare" in contract:
        module, _, function = contract["prepare"].partition(":")
        for key, value in getattr(importlib.import_module(module), function)(tmp_path / "prepared").items():
            train[key] = {**train[key], **value} if isinstance(value, dict) and isinstance(train.get(key), dict) else value
    train["policy"] = {"type": "dsrl", "hidden_sizes": [8], "inputs": "features", "policy": train["policy"]}
    data = {"name": "dsrl", "seed": 0, "total_steps": 1, "device": "cpu", **train, "algo": {"group_size": 2, "groups_per_step": 1, "kl": {"coef": 0.0}}, **QUIET}
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / "run")
    try:
        base = trainer.policy.base
        decode = base.sample_from_noise
        seen = []
        monkeypatch.setattr(base, "sample_from_noise", lambda inputs, noise: seen.append((inputs, decode(inputs, noise))) or seen[-1][1])
        trainer.engine.collect(0, trainer.learner.version)
        inputs, handed = seen[0]
        noise = handed.info["noise"]
        assert noise.shape[1:] == tuple(base.noise_shape) and handed.info["features"].shape[1:] == (base.noise_feature_dim,)
        once, twice = decode(inputs, noise.clone()), decode(inputs, noise.clone())
        assert torch.equal(once.output, handed.output) and torch.equal(twice.output, handed.output)
        assert not torch.equal(decode(inputs, -noise).output, handed.output)
        own = base.sample(inputs, torch.Generator().manual_seed(0), deterministic=True).output
        assert torch.equal(decode(inputs, torch.zeros_like(noise)).output, own)
    finally:
        trainer.engine.close()
        trainer.sampler.close()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("base", ["gaussian_mlp", "token_vla"])
def test_a_policy_that_cannot_act_from_a_noise_is_refused_in_one_line(base):
    with pytest.raises(ConfigError) as e:
        build({"policy": {"type": base}})
    assert (e.value.field, e.value.value) == ("policy.policy.type", base) and "\n" not in str(e.value)
    assert "allowed: " + ", ".join(steerable_policies()) in str(e.value) and "flow_vla" in str(e.value)


def test_a_section_without_a_frozen_policy_is_refused():
    with pytest.raises(ConfigError) as e:
        from_dict(POLICIES.entry("dsrl").config, {"type": "dsrl"}, "policy")
    assert e.value.field == "policy.policy.type"


def test_the_command_line_refuses_a_base_that_cannot_act_from_a_noise_with_exit_status_2(tmp_path, write_config):
    data = dsrl_config(base={"type": "gaussian_mlp"})
    path = write_config({**data, "run_dir": str(tmp_path / "run")})
    done = subprocess.run([sys.executable, "-m", "mmrl", "train", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "policy.policy.type" in done.stderr and "gaussian_mlp" in done.stderr


# ---------------------------------------------------------------- learning


@pytest.mark.learning
def test_steering_a_frozen_policy_raises_success_on_point_reach(tmp_path, learning_seed, learned):
    """SAC in the noise space of a frozen random diffusion policy: 20 steps of 8 episodes (10-20 s
    on a loaded core); the steered policy's mean-action success on 64 held-out episodes gains
    0.64, 0.67, 0.30 over seeds 0-2 (0.08 -> 0.72, 0.0 -> 0.67, 0.09 -> 0.39)."""
    trainer = Trainer(from_dict(TrainConfig, dsrl_config(seed=learning_seed, total_steps=20)), tmp_path / "run")
    before = trainer.evaluate(0)["success_rate"]
    trainer.train()
    after = trainer.evaluate(20)["success_rate"]
    learned(after - before, 0.2, name="success gain")


# ---------------------------------------------------------------- the shipped config


def test_the_shipped_config_steers_a_flow_vla_start_for_a_few_steps(tmp_path):
    """configs/tabletop_spatial_flow_dsrl.yaml with fewer and shorter episodes, from a start of
    the SFT run's shape (its frozen flow VLA with random weights): SAC updates the noise policy."""
    from mmrl.config import load_config
    from mmrl.core.sampler import build_sampler

    path = ROOT / "configs" / "tabletop_spatial_flow_dsrl.yaml"
    small = ["total_steps=3", "env.num_envs=2", "env.max_episode_steps=8", "algo.groups_per_step=2", "algo.loss.learning_starts=4",
             "algo.loss.batch_size=8", "algo.loss.buffer_size=1000", "log.progress=false", "log.tensorboard=false", "eval.at_start=false", "eval.at_end=false"]
    cfg = load_config(TrainConfig, path, [*small, "policy.policy.pretrained=null"])
    sampler = build_sampler(cfg)
    try:
        save_pretrained(build_policy(cfg.policy.policy, sampler.policy_spec()), tmp_path / "start")
    finally:
        sampler.close()
    trainer = Trainer(load_config(TrainConfig, path, [*small, f"policy.policy.pretrained={tmp_path / 'start'}"]), tmp_path / "run")
    try:
        frozen = {k: v.clone() for k, v in trainer.policy.base.state_dict().items()}
        steps = sum(trainer.rl_step(step)["update/steps"] for step in range(3))
        assert steps > 0 and all(torch.equal(v, trainer.policy.base.state_dict()[k]) for k, v in frozen.items())
    finally:
        trainer.engine.close()
        trainer.sampler.close()


def test_an_asymmetric_critic_reads_the_privileged_state_that_the_noise_policy_never_sees(tmp_path):
    from mmrl.config import load_config

    path = ROOT / "configs" / "tabletop_spatial_flow_dsrl.yaml"
    small = ["total_steps=2", "env.num_envs=2", "env.max_episode_steps=8", "algo.groups_per_step=2", "algo.loss.learning_starts=4", "algo.loss.batch_size=8",
             "algo.loss.buffer_size=1000", "log.progress=false", "log.tensorboard=false", "eval.at_start=false", "eval.at_end=false",
             "policy.policy.pretrained=null", "env.kwargs.privileged_state=true", "policy.critic_privileged=true"]
    trainer = Trainer(load_config(TrainConfig, path, small), tmp_path / "run")
    try:
        policy = trainer.policy
        assert policy.critic_input_dim == policy.input_dim + policy.spec["privileged_dim"] and policy.privileged_dim > 0
        assert sum(trainer.rl_step(step)["update/steps"] for step in range(2)) > 0
        batch = trainer.learner.off_policy.buffer.sample(4)
        inputs = policy.critic_inputs(batch["replay"])
        assert inputs.shape[-1] == policy.critic_input_dim and torch.equal(inputs[..., policy.input_dim :], batch["replay"]["privileged"])
        assert policy.critic_inputs(batch["next"]).shape == inputs.shape
        assert policy.net[0].in_features == policy.input_dim  # the noise policy reads no privileged entry
    finally:
        trainer.engine.close()
        trainer.sampler.close()
    with pytest.raises(ConfigError) as e:
        build({"policy": BASE, "critic_privileged": True})
    assert e.value.field == "policy.critic_privileged" and "\n" not in str(e.value)


def test_the_noise_sensitivity_benchmark_measures_how_far_the_noise_moves_the_chunk(tmp_path, write_config):
    """benchmarks/dsrl_noise_sensitivity.py on a frozen random diffusion policy: a wider noise
    moves the decoded actions further (the std across noises, at most 1 on PointReach's
    [-1, 1] actions but for the n/(n-1) of a sample std over 8 noises)."""
    import re
    import subprocess
    import sys

    path = write_config(dsrl_config())
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dsrl_noise_sensitivity.py"), str(path), "--states", "4", "--noises", "8", "--scales", "0.1", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"\| N\(0, ([0-9.]+)²\) \| ([0-9.]+) \| ([0-9.]+) \|", done.stdout)
    assert [scale for scale, _, _ in rows] == ["0.1", "2"]
    (_, narrow, _), (_, wide, largest) = rows
    assert 0 < float(narrow) < float(wide) and float(largest) <= (8 / 7) ** 0.5 + 1e-3
