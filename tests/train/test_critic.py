"""A learned value baseline: GAE with a critic (``critic:``, ``algo.advantage.type: gae``)
through the trainer — learning, N processes = 1 process, exact resume, and the one-line
errors where it cannot run."""

import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import from_dict
from mmrl.errors import ConfigError
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.conftest import point_reach_config
from tests.rollout.test_engine import _same, _steps, toy
from tests.train.test_distributed_and_cli_runs import _one_and_two_processes

GAE = {"advantage": {"type": "gae", "gamma": 0.99, "lam": 0.95}, "group_size": 4, "groups_per_step": 4, "ppo_epochs": 4}


def gae_config(critic="mlp", **sections) -> dict:
    data = point_reach_config(algo=GAE, critic={"type": critic, "hidden_sizes": [32, 32]}, optim={"lr": 0.003})
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


@pytest.mark.learning
@pytest.mark.parametrize("critic", ["mlp", "value_head"])
def test_gae_with_a_critic_raises_success_on_point_reach(tmp_path, critic, learning_seed, learned):
    """Measured (seeds 0-4 with avx512, seed 0 also default and avx2; 16 evaluation episodes):
    success at the end mlp 0.75-1.0, value_head 0.63-1.0, from at most 0.2 at the start (>= 0.4)."""
    data = gae_config(critic, seed=learning_seed, total_steps=30, eval={"episodes": 16, "at_start": True})
    train(from_dict(TrainConfig, data), tmp_path / critic)
    evals = [r["eval/success_rate"] for r in read_metrics(tmp_path / critic) if "eval/success_rate" in r]
    assert evals[0] <= 0.2
    learned(evals[-1], 0.4, name=f"success after GAE ({critic})")


def test_an_update_moves_the_values_towards_the_gae_targets(tmp_path):
    """One step's samples: after the update (4 epochs, the value loss beside the policy's),
    the critic's values on those decisions are nearer their targets R = A + V_old than the
    values it had when the advantages were computed; the policy's own weights hold no critic."""
    trainer = Trainer(from_dict(TrainConfig, gae_config(total_steps=1, eval={"at_start": False, "at_end": False})), tmp_path / "run")
    collected = trainer.engine.collect(0, trainer.learner.version)
    targets, _ = trainer.learner.advantage_stage(collected.rollout, trainer.learner.model)  # what the update will compute, at these weights
    rollout, _, stats = trainer.learner.learn(collected.rollout, collected.spare, 0)
    returns, old, mask = targets.returns, targets.old_values, (rollout.mask > 0).cpu()  # targets are kept on the CPU
    with torch.no_grad():
        new = trainer.learner.model(rollout.replay, mode="value").cpu()
    before = (old - returns)[mask].square().mean()
    after = (new - returns)[mask].square().mean()
    assert after < 0.8 * before and stats["loss/value"] > 0
    assert "critic" in trainer.learner.state_dict() and not any(k.startswith("critic") for k in trainer.policy.state_dict())


@pytest.mark.parametrize("critic", ["mlp", "value_head"])
def test_a_critic_warmup_trains_the_critic_only_and_then_the_policy_too(tmp_path, critic):
    """critic.warmup_steps: 2 — the policy's weights (a value head's shared trunk included)
    stay bit for bit through the first two updates while the critic's move; the third update
    moves the policy too."""
    data = gae_config(critic, total_steps=3, eval={"at_start": False, "at_end": False})
    data["critic"]["warmup_steps"] = 2
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / "run")

    def weights():
        return ({k: v.clone() for k, v in trainer.policy.state_dict().items()}, {k: v.clone() for k, v in trainer.learner.critic.state_dict().items()})

    for step in range(3):
        policy_before, critic_before = weights()
        collected = trainer.engine.collect(step, trainer.learner.version)
        _, _, stats = trainer.learner.learn(collected.rollout, collected.spare, step)
        policy_after, critic_after = weights()
        assert any(not torch.equal(critic_before[k], critic_after[k]) for k in critic_before)
        policy_moved = any(not torch.equal(policy_before[k], policy_after[k]) for k in policy_before if policy_before[k].is_floating_point())
        assert policy_moved == (step >= 2) and (stats.get("critic/warmup") == 1.0) == (step < 2)


def test_the_critic_learns_at_its_own_rate_on_the_policys_schedule(tmp_path):
    """critic.lr: the critic's parameters (only they) step at that rate, scaled by the same
    warm-up/decay factor as the policy's; unset, one rate for both."""
    data = gae_config(total_steps=4, optim={"lr": 0.001, "warmup_steps": 1, "lr_schedule": "linear", "final_lr_ratio": 0.5}, eval={"at_start": False, "at_end": False})
    data["critic"]["lr"] = 0.01
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / "run")
    policy_group, critic_group = trainer.learner.optimizer.param_groups
    assert {id(p) for p in critic_group["params"]} == {id(p) for p in trainer.learner.critic.parameters()}
    assert not {id(p) for p in policy_group["params"]} & {id(p) for p in critic_group["params"]}
    for step in range(4):
        lr = trainer.learner.set_lr(step)
        assert policy_group["lr"] == lr and critic_group["lr"] == pytest.approx(10 * lr)
    assert trainer.learner.set_lr(0) == pytest.approx(0.0005)  # warm-up: half the rate at the first step
    data["critic"]["lr"] = None
    assert len(Trainer(from_dict(TrainConfig, data), tmp_path / "one").learner.optimizer.param_groups) == 1


def test_a_run_with_a_critic_resumes_exactly(tmp_path):
    data = gae_config(total_steps=5, checkpoint={"every": 3}, eval={"at_start": False, "at_end": False})
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 3}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    _same(_steps(read_metrics(tmp_path / "split")), _steps(read_metrics(tmp_path / "straight")))
    a = torch.load(tmp_path / "straight/checkpoints/step_00000005/state.pt", weights_only=True)["critic"]
    b = torch.load(tmp_path / "split/checkpoints/step_00000005/state.pt", weights_only=True)["critic"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    wa = load_file(str(tmp_path / "straight/checkpoints/step_00000005/model.safetensors"))
    wb = load_file(str(tmp_path / "split/checkpoints/step_00000005/model.safetensors"))
    assert not any(k.startswith("critic") for k in wa)  # the policy's weights stay the policy's
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.numerics
@pytest.mark.parametrize("normalize", ["batch", "minibatch"])
def test_the_critic_with_two_processes_matches_one_process(tmp_path, write_config, normalize):
    """Values, advantages (normalized over the global batch, or over each global minibatch),
    the value loss's global normalizer and the gradient all-reduce: two processes end with
    one's policy, critic and metrics (float32, as the robot-configuration test)."""
    algo = {**GAE, "num_minibatches": 2, "advantage": {**GAE["advantage"], "normalize": normalize}}
    data = gae_config(total_steps=3, checkpoint={"every": 3}, algo=algo, eval={"at_start": False, "at_end": False})
    ra, rb = _one_and_two_processes(tmp_path, write_config(data), 29537)
    for name in ("model.safetensors",):
        a, b = load_file(str(tmp_path / "one/checkpoints/step_00000003" / name)), load_file(str(tmp_path / "two/checkpoints/step_00000003" / name))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    ca = torch.load(tmp_path / "one/checkpoints/step_00000003/state.pt", weights_only=True)["critic"]
    cb = torch.load(tmp_path / "two/checkpoints/step_00000003/state.pt", weights_only=True)["critic"]
    for k in ca:
        torch.testing.assert_close(ca[k], cb[k], rtol=1e-5, atol=1e-6)
    for x, y in zip(_steps(ra), _steps(rb)):
        for key in x:
            if not key.startswith("time/"):
                assert math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-6), (x["step"], key, x[key], y[key])


def _minibatch_gae(**algo) -> dict:
    return gae_config(total_steps=1, algo={**GAE, "advantage": {**GAE["advantage"], "normalize": "minibatch"}, **algo}, eval={"at_start": False, "at_end": False})


def test_minibatch_normalization_scales_each_minibatch_by_its_own_statistics(tmp_path):
    """``normalize: minibatch`` (CleanRL's and ManiSkill's PPO): the advantages stay as GAE
    estimates them, and each minibatch's loss sees them centred and scaled by that
    minibatch's mean and std over its valid decisions, computed here again in float64 by
    hand. The loss is the one of those scaled advantages handed in directly, at ratio 1 to
    float32 rounding of one subtraction and one division."""
    trainer = Trainer(from_dict(TrainConfig, _minibatch_gae(num_minibatches=4)), tmp_path / "run")
    collected = trainer.engine.collect(0, trainer.learner.version)
    targets, keep = trainer.learner.advantage_stage(collected.rollout, trainer.learner.model)
    rollout = collected.rollout.with_(mask=trainer.learner.train_mask(collected.rollout, keep))
    valid = rollout.mask.cpu() > 0
    raw = targets.adv[valid].double()
    assert abs(raw.mean()) > 1e-3 or abs(raw.std(correction=0) - 1) > 1e-3  # not normalized over the batch
    loss = trainer.learner.loss
    assert not loss.zero_at_zero_advantage  # scaling moves a zero advantage: no row is skipped
    for idx in torch.arange(rollout.batch_size).chunk(4):
        mb, mt = rollout[idx], targets[idx]
        norm = trainer.learner.normalizers(mb, mt)
        a = mt.adv[mb.mask.cpu() > 0].double()
        assert math.isclose(norm["adv_shift"].item(), a.mean().item(), rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(norm["adv_scale"].item(), a.std(correction=0).item() + 1e-8, rel_tol=1e-12)
        scaled = replace(mt, adv=((mt.adv.double() - a.mean()) / (a.std(correction=0) + 1e-8)).float())
        plain = {k: v for k, v in norm.items() if not k.startswith("adv_")}
        got = loss(trainer.learner.model, mb, mt, norm, at_sampling_weights=True).loss
        want = loss(trainer.learner.model, mb, scaled, plain, at_sampling_weights=True).loss
        assert math.isclose(got.item(), want.item(), rel_tol=1e-5), (got, want)


def test_minibatch_normalization_with_one_minibatch_trains_as_batch_normalization(tmp_path):
    """One minibatch is the whole batch: two updates with ``minibatch`` end at the weights of
    ``batch`` (float32 summation order differs, so to the two-process test's tolerance), and
    with four minibatches they end elsewhere."""
    runs = {}
    for name, normalize, minibatches in (("batch", "batch", 1), ("one", "minibatch", 1), ("four", "minibatch", 4)):
        data = _minibatch_gae(num_minibatches=minibatches)
        data.update(total_steps=2, checkpoint={"every": 2})
        data["algo"]["advantage"]["normalize"] = normalize
        train(from_dict(TrainConfig, data), tmp_path / name)
        runs[name] = load_file(str(tmp_path / name / "checkpoints/step_00000002/model.safetensors"))
    for k in runs["batch"]:
        torch.testing.assert_close(runs["one"][k], runs["batch"][k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(runs["four"][k], runs["batch"][k], rtol=1e-3, atol=1e-4) for k in runs["batch"])


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        (point_reach_config(algo={"advantage": {"type": "gae"}}), "critic.type", "algo.advantage.type gae learns a value baseline"),
        (_minibatch_gae(loss={"type": "nft"}), "algo.advantage.normalize", "is applied by the policy_gradient loss"),
        (_minibatch_gae(self_imitation={"size": 64}), "algo.advantage.normalize", "self-imitation keeps the batch's advantages"),
        (point_reach_config(critic={"type": "mlp"}), "critic.type", "nothing reads its values"),
        (toy(algo={"advantage": {"type": "gae"}}, critic={"type": "mlp"}), "algo.advantage.type", "GAE runs over the decisions of env episodes"),
    ],
)
def test_a_critic_where_it_cannot_run_is_a_one_line_error(data, field, message):
    with pytest.raises(ConfigError, match=rf"^{field}: got .*; {message}") as e:
        from_dict(TrainConfig, data)
    assert "\n" not in str(e.value)


def test_a_value_head_on_a_policy_without_features_names_the_field(tmp_path):
    data = {**point_reach_config(algo=GAE, critic={"type": "value_head"}), "policy": {"type": "diffusion_policy", "hidden_size": 16, "num_layers": 1}}
    with pytest.raises(ConfigError, match=r"^critic.type: got 'value_head'; policy 'diffusion_policy' exposes no features for a value head"):
        Trainer(from_dict(TrainConfig, data), tmp_path / "run")


def _privileged_tabletop(policy: dict, **sections) -> dict:
    """A tiny tabletop run whose critic reads the env's privileged state (the simulator's
    block poses, zone and task) while the policy sees its own observation."""
    env = {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 8,
           "kwargs": {"task": "object", "image_size": 16, "privileged_state": True, "reward_mode": "dense"}}
    data = gae_config(env=env, total_steps=2, eval={"at_start": False, "at_end": False}, **sections)
    data["policy"] = policy
    data["critic"] = {"type": "mlp", "inputs": "privileged", "hidden_sizes": [16]}
    data["algo"] = {**data["algo"], "group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "advantage": {**GAE["advantage"], "step_reward_weight": 1.0}}
    return data


@pytest.mark.parametrize("policy", [
    {"type": "gaussian_mlp", "hidden_sizes": [16]},
    {"type": "flow_vla", "action_chunk": 2, "expert_layers": 1, "expert_heads": 2, "denoising": {"num_inference_steps": 2},
     "backbone": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "vision_channels": [4], "patch_grid": 2}},
], ids=["gaussian_mlp", "flow_vla"])
def test_a_privileged_critic_reads_the_simulators_state_that_the_policy_never_sees(tmp_path, policy):
    """Asymmetric actor-critic (critic.inputs: privileged): each decision's replay holds the
    env's privileged observation at that decision; the critic's values are its network of
    exactly those rows, the policy's input holds none of it, and the update trains both."""
    trainer = Trainer(from_dict(TrainConfig, _privileged_tabletop(policy)), tmp_path / "run")
    critic = trainer.learner.critic
    assert critic.net[0].in_features == 26 and trainer.policy.spec["privileged_dim"] == 26
    seen = []
    sample = trainer.policy.sample
    trainer.policy.sample = lambda inputs, *a, **k: seen.append(inputs) or sample(inputs, *a, **k)
    collected = trainer.engine.collect(0, trainer.learner.version)
    trainer.policy.sample = sample
    assert seen and all("privileged" not in inputs for inputs in seen if isinstance(inputs, dict))
    rollout = collected.rollout
    privileged = rollout.replay["privileged"]
    assert privileged.shape[:2] == rollout.mask.shape[:2] and privileged.shape[2] == 26
    first = privileged[:, 0]
    one_hot = first[:, -4:]
    assert torch.equal(one_hot.sum(-1), torch.ones(len(first)))  # the task one-hot of each episode
    with torch.no_grad():
        values = trainer.learner.model(rollout.replay, mode="value")
        torch.testing.assert_close(values, critic.net(privileged).squeeze(-1))
    _, _, stats = trainer.learner.learn(rollout, collected.spare, 0)
    assert math.isfinite(stats["loss/value"]) and stats["loss/value"] > 0


def test_a_privileged_critic_without_the_envs_privileged_observation_names_the_field(tmp_path):
    data = gae_config(total_steps=1)
    data["critic"] = {"type": "mlp", "inputs": "privileged"}
    with pytest.raises(ConfigError, match=r"^critic.inputs: got 'privileged'; the env gives no 'privileged' observation"):
        Trainer(from_dict(TrainConfig, data), tmp_path / "run")
    data["critic"] = {"type": "value_head", "inputs": "privileged"}
    with pytest.raises(ConfigError, match=r"^critic.inputs: got 'privileged'; a value head reads the policy's own features"):
        from_dict(TrainConfig, data)


def test_the_final_observation_of_a_cut_episode_is_the_next_decisions_observation():
    """``bootstrap_truncated``: the env sampler keeps what the policy reads of each episode's
    final observation. Cut at 3 decisions, that is the observation the same episode's 4th
    decision sees when the cap is 4 (same seeds, same noise)."""
    from mmrl.core.weights import build_policy
    from mmrl.core.sampler import sampler_context
    from mmrl.samplers.env import EnvSampler

    replays = {}
    for cap in (3, 4):
        cfg = from_dict(TrainConfig, gae_config(sampler={"type": "env", "max_decisions": cap}, algo={**GAE, "advantage": {**GAE["advantage"], "bootstrap_truncated": True}}))
        sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
        torch.manual_seed(0)
        policy = build_policy(cfg.policy, sampler.policy_spec())
        try:
            replays[cap] = sampler.collect(policy, 2, 4, step=0)
        finally:
            sampler.close()
    three, four = replays[3], replays[4]
    cut = three.info["truncated"] & (three.info["length"] == 3)
    assert cut.any()
    final = three.info["final_replay"]["obs"][:, 0]
    torch.testing.assert_close(final[cut], four.replay["obs"][cut, 3], rtol=0, atol=0)
    plain_cfg = from_dict(TrainConfig, gae_config())
    plain = EnvSampler(plain_cfg.sampler, sampler_context(plain_cfg))
    try:
        assert "final_replay" not in plain.collect(policy, 1, 4, step=0).info  # only when asked
    finally:
        plain.close()


def test_the_env_sampler_records_the_env_steps_of_each_chunk_for_the_discount(tmp_path):
    """A chunk of 3 actions per decision: each decision's env steps (the last one cut by the
    episode's end, 0 past it) are what GAE raises γ to."""
    from mmrl.config import from_dict
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer
    from tests.conftest import point_reach_config

    cfg = from_dict(TrainConfig, point_reach_config(policy={"type": "gaussian_mlp", "hidden_sizes": [16], "action_chunk": 3}))
    trainer = Trainer(cfg, tmp_path / "run")
    rollout = trainer.sampler.collect(trainer.policy, 2, 4, step=0)
    steps, mask, length = (torch.as_tensor(rollout.info["decision_steps"]).cpu(), rollout.mask.cpu(), torch.as_tensor(rollout.info["length"]).cpu())
    assert torch.equal(steps.sum(1), length.to(steps.dtype))  # every env step belongs to one decision
    assert ((steps > 0) == (mask > 0)).all() and (steps <= 3).all()
    full = steps[:, :-1][mask[:, 1:] > 0]  # decisions followed by another took the whole chunk
    assert (full == 3).all()
