"""Interventions (``sampler.intervener``, HIL-SERL): the intervener's actions replace the
policy's in the rows it takes over, marked in the transitions and added to the
demonstrations' buffer; the scripted intervener's decaying schedule, an exact resume, the
refusals, a device's intervener by import path, and that interventions speed up SAC on sparse
PointReach."""

import numpy as np
import pytest
import torch

from mmrl.config import from_dict
from mmrl.envs.point_reach import reach_goal
from mmrl.errors import ConfigError
from mmrl.interventions import ScriptedIntervener
from mmrl.train.replay_buffer import ReplayBuffer
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.conftest import point_reach_config
from tests.train.test_sac import sac_config

EXPERT = "mmrl.envs.point_reach:reach_goal"


def scripted(fraction: float, decay_steps: int | None = None) -> dict:
    return {"intervener": {"type": "scripted", "kwargs": {"expert": EXPERT, "fraction": fraction, "decay_steps": decay_steps}}}


class FirstRowPusher:
    """A device's intervener for the tests: takes over env 0 at every decision, pushing +x."""

    calls = 0

    def __init__(self, push: float = 0.5):
        self.push = push

    def intervene(self, observations, proposed, step, env):
        type(self).calls += 1
        rows = np.zeros(proposed.shape[0], dtype=bool)
        rows[0] = True
        return rows, np.tile(np.array([self.push, 0.0], np.float32), (proposed.shape[0], 1))


def _stepped(tmp_path, sampler: dict, **loss) -> Trainer:
    trainer = Trainer(from_dict(TrainConfig, sac_config(loss={"learning_starts": 10_000, **loss}, sampler=sampler)), tmp_path / "run")
    trainer.rl_step(0)  # fills the buffers, no optimizer step
    return trainer


def test_intervened_transitions_are_marked_in_the_buffer_and_join_the_demonstrations_with_the_intervener_action(tmp_path):
    updates = _stepped(tmp_path, scripted(0.5)).learner.off_policy
    online, demos = updates.buffer, updates.demos
    marked = online.storage["intervened"][: len(online)]
    assert 0 < int(marked.sum()) < len(online)  # some of the decisions, not all
    assert len(demos) == int(marked.sum()) and bool(demos.storage["intervened"][: len(demos)].all())
    obs = online.storage["replay/obs"][: len(online), 0]  # obs_norm false: the env's observations
    action = online.storage["replay/action"][: len(online), 0]
    executed = torch.tanh(action.reshape(len(online), -1))  # what the critic reads (replayed_action)
    expert = torch.from_numpy(reach_goal(obs.numpy()))
    assert torch.allclose(executed[marked], expert[marked], atol=2e-4)  # the intervener's, clipped just inside the squash's edge
    assert not torch.allclose(executed[~marked], expert[~marked], atol=0.05)  # the policy's own elsewhere
    assert torch.equal(demos.storage["replay/obs"][: len(demos)], online.storage["replay/obs"][: len(online)][marked])


def test_the_scripted_rate_decays_linearly_to_zero_and_the_logged_rate_follows_it(tmp_path):
    assert [ScriptedIntervener(EXPERT, 0.2, 4).rate(s) for s in range(6)] == pytest.approx([0.2, 0.15, 0.1, 0.05, 0.0, 0.0])
    assert ScriptedIntervener(EXPERT, 0.2, None).rate(1000) == 0.2
    trainer = Trainer(from_dict(TrainConfig, sac_config(loss={"learning_starts": 10_000}, sampler=scripted(0.5, 4))), tmp_path / "run")
    logged = [trainer.rl_step(s) for s in range(6)]
    rates = [m["intervention/rate"] for m in logged]
    assert rates[4:] == [0.0, 0.0]  # no draw takes over from decay_steps on
    for rate, expected, m in zip(rates[:4], [0.5, 0.375, 0.25, 0.125], logged):
        assert abs(rate - expected) < 4 * (expected * (1 - expected) / m["buffer/added"]) ** 0.5
    grown = [m["buffer/demo_transitions"] for m in logged]
    assert grown[2] < grown[3] == grown[4] == grown[5]  # the last intervened transitions joined at step 3


def test_a_resumed_run_intervenes_and_trains_as_the_unbroken_one(tmp_path):
    from safetensors.torch import load_file

    data = sac_config(total_steps=4, loss={"learning_starts": 100}, checkpoint={"every": 2}, sampler=scripted(0.3))
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 2}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    last = "checkpoints/step_00000004"
    wa, wb = (load_file(tmp_path / run / last / "model.safetensors") for run in ("straight", "split"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (torch.load(tmp_path / run / last / "state.pt", weights_only=True) for run in ("straight", "split"))
    assert torch.equal(sa["sampler"]["intervener"]["generator"], sb["sampler"]["intervener"]["generator"])
    da, db = sa["demo_buffer"], sb["demo_buffer"]
    assert da["size"] == db["size"] > 0 and all(torch.equal(da["storage"][k], db["storage"][k]) for k in da["storage"])


def test_interventions_are_refused_for_a_loss_that_does_not_train_from_a_buffer():
    data = point_reach_config(sampler={"type": "env", **scripted(0.2)})
    with pytest.raises(ConfigError, match="replay buffer") as err:
        from_dict(TrainConfig, data)
    assert err.value.field == "sampler.intervener"


def test_a_scripted_expert_that_cannot_be_imported_is_refused_naming_it():
    with pytest.raises(ConfigError) as err:
        from_dict(TrainConfig, sac_config(sampler={"intervener": {"type": "scripted", "kwargs": {"expert": "mmrl.envs.point_reach:no_such_expert"}}}))
    assert err.value.field == "sampler.intervener.kwargs.expert"


def test_interventions_for_a_policy_that_cannot_replay_the_executed_action_are_refused(tmp_path, monkeypatch):
    from mmrl.core.policy import PolicyModule
    from mmrl.policies.gaussian_mlp import GaussianMLPPolicy

    monkeypatch.setattr(GaussianMLPPolicy, "demo_replay", PolicyModule.demo_replay)
    with pytest.raises(ConfigError, match="demo_replay") as err:
        Trainer(from_dict(TrainConfig, sac_config(sampler=scripted(0.2))), tmp_path / "run")
    assert err.value.field == "sampler.intervener"


def test_a_device_intervener_named_by_import_path_takes_over_in_training_only(tmp_path):
    FirstRowPusher.calls = 0
    sampler = {"intervener": {"type": "tests.train.test_interventions:FirstRowPusher", "kwargs": {"push": 0.5}}}
    trainer = _stepped(tmp_path, sampler)
    rows = trainer.learner.off_policy.demos
    assert len(rows) > 0 and torch.allclose(torch.tanh(rows.storage["replay/action"][: len(rows), 0, 0]), torch.tensor([0.5, 0.0]), atol=1e-6)
    calls = FirstRowPusher.calls
    trainer.evaluate(1)
    assert FirstRowPusher.calls == calls  # evaluation never intervenes


def test_demonstrations_from_files_stay_when_intervened_transitions_wrap_the_ring():
    buffer = ReplayBuffer(5, "cpu", 0)
    buffer.add({"x": torch.tensor([10.0, 11.0])})
    buffer.pin()
    buffer.add({"x": torch.tensor([0.0, 1.0, 2.0])})
    buffer.add({"x": torch.tensor([3.0])})
    assert buffer.storage["x"].tolist() == [10.0, 11.0, 3.0, 1.0, 2.0]  # the ring is the last three rows
    restored = ReplayBuffer(5, "cpu", 0)
    restored.load_state_dict(buffer.state_dict())
    restored.add({"x": torch.tensor([4.0])})
    assert restored.storage["x"].tolist() == [10.0, 11.0, 3.0, 4.0, 2.0]


@pytest.mark.learning
def test_interventions_speed_up_sac_on_sparse_point_reach(tmp_path, learning_seed, learned):
    """PointReach with a sparse reward (1 on success), set up as the demonstrations' check
    (tests/train/test_demos_off_policy.py) for 8 steps of 8 episodes: a scripted intervener
    (straight at the goal) on 20% of decisions, decaying linearly to 0 by step 6, against the
    same run without it. The mean action's success on 64 held-out episodes gains 0.59-0.63
    over seeds 0-2 with AVX512 kernels (0.75-0.81 against 0.14-0.19), 0.56-0.58 with avx2,
    0.23-0.78 with ATEN_CPU_CAPABILITY=default; 0.34-0.72 over seeds 0-7 with AVX512."""
    kwargs = {"sparse_reward": True, "success_radius": 0.1, "max_steps": 30}
    options = {"critic_layer_norm": True, "learn_alpha": False, "init_alpha": 0.01, "learning_starts": 128}

    def success(sampler, name):
        data = sac_config(seed=learning_seed, total_steps=8, env={"kwargs": kwargs}, loss=options, sampler=sampler)
        trainer = Trainer(from_dict(TrainConfig, data), tmp_path / name)
        trainer.train()
        return trainer.evaluate(8)["success_rate"]

    gain = success(scripted(0.2, 6), "intervened") - success({}, "plain")
    learned(gain, 0.15, name="success gain from interventions")
