"""Partial rollouts for language agents (APRIL by turn): conversations in flight across
collections keep their token ids, drop the key/value states the old weights computed, and
train; GiGPO's state keys are recorded for episodes in flight too."""

from __future__ import annotations

import gymnasium
import pytest
import torch
from gymnasium import spaces

pytest.importorskip("transformers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.tasks.guess_number.env import CHARSET  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import Trainer, train  # noqa: E402


class CountdownEnv(gymnasium.Env):
    """Test-only text env whose episodes last 1 + (reset seed mod 4) turns whatever the agent
    says: groups (one reset seed each) end at different turns, so some are still running when
    a collection has enough finished groups."""

    def __init__(self):
        self.observation_space = spaces.Text(max_length=64, charset=CHARSET)
        self.action_space = spaces.Text(max_length=64, charset=CHARSET)
        self.left = 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.left = 1 + (seed or 0) % 4
        return f"{self.left} turns.", {"success": False}

    def step(self, action):
        self.left -= 1
        done = self.left == 0
        return f"{self.left} left.", float(done and len(str(action)) > 0), done, False, {"success": done}


gymnasium.register(id="mmrl_test/Countdown-v0", entry_point=CountdownEnv)


def config(**changes) -> dict:
    cfg = {
        "name": "agent_partial", "seed": 0, "total_steps": 3, "device": "cpu",
        "env": {"type": "gym", "id": "mmrl_test/Countdown-v0", "num_envs": 8},
        "sampler": {"type": "env"},
        "policy": {"type": "text_agent", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 4}, "max_context_tokens": 160},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.0}},
        "rollout": {"over_provision": 2.0},
        "eval": {"at_start": False, "at_end": False, "episodes": 4}, "log": {"progress": False, "tensorboard": False},
    }
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def _turns(rollout, b):
    replay = rollout.replay
    out = []
    for t in range(replay["completion_ids"].shape[1]):
        turn = replay["completion_ids"][b, t][replay["completion_mask"][b, t].bool()].tolist()
        if turn:
            out.append((replay["prompt_ids"][b, t][replay["prompt_mask"][b, t].bool()].tolist(), turn))
    return out


@pytest.fixture
def trainer(tmp_path):
    made = []

    def make(**changes):
        t = Trainer(from_dict(TrainConfig, config(**changes)), tmp_path / f"run{len(made)}")
        made.append(t)
        return t

    yield make
    for t in made:
        t.metrics.close()
        t.engine.close()
        t.sampler.close()


def test_conversations_in_flight_go_on_in_the_next_collection_token_for_token(trainer):
    t = trainer()
    resumed = []
    for step in range(3):
        rollout = t.engine.collect(step, t.learner.version).rollout
        assert rollout.old_logp.shape[0] == 4
        for b in range(4):
            turns = _turns(rollout, b)
            assert len(turns) == int(rollout.info["length"][b])
            for (prompt, turn), (later, _) in zip(turns, turns[1:]):
                assert later[: len(prompt) + len(turn)] == prompt + turn  # token in, token out, across collections too
            versions = rollout.info["decision_version"][b][rollout.mask[b] > 0]
            if versions.min() < versions.max():  # turns sampled under two policy versions
                assert int(rollout.info["steps_in_flight"][b]) > 1
                resumed.append(b)
        with torch.no_grad():
            again = t.policy.log_prob(rollout.replay)
        valid = rollout.mask > 0
        # the replay of a conversation continued across collections recomputes as any other
        assert torch.allclose(again[valid], rollout.old_logp[valid], atol=1e-4)
        t.engine.publish(t.policy, step + 1)  # what an update does between collections
    assert resumed, "no conversation was carried into a later collection"


def test_a_resumed_episode_drops_the_key_value_states_of_the_old_weights(trainer):
    t = trainer()
    assert t.policy.caches_turns()
    t.engine.collect(0, 0)
    carried = t.sampler.partial.carry
    live = [e for e, ep in t.sampler.partial.episodes.items() if ep["alive"]]
    assert live and all("kv" in carried[e] for e in live)  # in flight with their cache
    renewed = t.policy.renew_carry(list(carried))
    assert all("kv" not in state and state["ids"] == carried[e]["ids"] for e, state in enumerate(renewed) if state is not None)
    seen = []
    renew = t.policy.renew_carry
    t.policy.renew_carry = lambda carry: seen.append([e for e, c in enumerate(carry) if c is not None and "kv" in c]) or renew(carry)
    t.engine.publish(t.policy, 1)
    t.engine.collect(1, 1)
    assert seen and set(live) <= set(seen[0])  # the sampler renews the carries in flight before sampling on


def test_gigpo_state_keys_are_recorded_for_episodes_in_flight(trainer):
    t = trainer(algo={"advantage": {"type": "grpo", "level": "step", "step_groups": "state", "episode_weight": 1.0}})
    for step in range(2):
        rollout = t.engine.collect(step, t.learner.version).rollout
        keys = rollout.info["state_keys"]
        assert keys.shape == rollout.mask.shape
        adv, _ = t.learner.advantages(rollout)
        assert torch.isfinite(adv).all()
        turn = 4
        first = keys[:, :turn]
        assert (first == first[:, :1]).all()  # a decision's key on each of its columns


def test_an_agent_with_partial_rollouts_trains_through_the_loop(tmp_path):
    out = train(from_dict(TrainConfig, config(total_steps=3)), tmp_path / "run")
    assert out["step"] == 3


def test_an_agent_with_an_off_policy_correction_trains_with_partial_rollouts_in_a_worker(tmp_path):
    """Turns sampled under several versions (episodes in flight, an async worker) with a
    correction that reads the behaviour's log-probs; a minibatch split into more pieces than
    it has rows runs the spare sample, which must carry them too."""
    env = {"type": "gym", "id": "mmrl/GuessNumber-v0", "num_envs": 8, "max_episode_steps": 3}
    algo = {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.0}, "correction": {"type": "tis"}}
    assert train(from_dict(TrainConfig, config(env=env, algo=algo, total_steps=2)), tmp_path / "sync")["step"] == 2
    rollout = {"over_provision": 2.0, "workers": 1, "mode": "async"}
    assert train(from_dict(TrainConfig, config(env=env, algo=algo, rollout=rollout, total_steps=3)), tmp_path / "async")["step"] == 3
