import gymnasium
import numpy as np
import pytest
import torch

from mmrl.core.policy import Sample
from mmrl.core.weights import build_policy
from mmrl.core.sampler import group_seed, sampler_context
from mmrl.core.statistics import wilson_interval
from mmrl.envs.gym import GymEnvConfig
from mmrl.errors import ConfigError
from mmrl.policies.gaussian_mlp import GaussianMLPConfig
from mmrl.registry import REWARDS, SAMPLERS
from mmrl.rewards.env import ReturnRewardConfig, SuccessRewardConfig
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
from mmrl.algo.advantage import GroupNormConfig
from mmrl.train.run_config import AlgoConfig, TrainConfig

# Episodes end after 3..10 steps (or on success), so waves hold episodes of different
# lengths and finished envs keep being stepped (and auto-reset) while others run.
ENV_KWARGS = {"max_steps": 10, "min_steps": 3}


def make_sampler(num_envs=4, group_size=2, seed=0, gamma=1.0, env_kwargs=ENV_KWARGS, **sampler_fields):
    cfg = TrainConfig(
        seed=seed,
        env=GymEnvConfig(id="mmrl/PointReach-v0", num_envs=num_envs, kwargs=dict(env_kwargs)),
        policy=GaussianMLPConfig(hidden_sizes=[16]),
        sampler=EnvSamplerConfig(**sampler_fields),
        algo=AlgoConfig(group_size=group_size, advantage=GroupNormConfig(gamma=gamma)),
    )
    return EnvSampler(cfg.sampler, sampler_context(cfg))


def make_policy(sampler, **fields):
    torch.manual_seed(0)
    return build_policy(GaussianMLPConfig(hidden_sizes=[16], **fields), sampler.policy_spec())


def replay_by_hand(policy, rollout, b, seed, env_kwargs=ENV_KWARGS, gamma=1.0):
    """Re-run sample b's executed actions in a fresh env: (env rewards per decision,
    length, success, truncated)."""
    env = gymnasium.make("mmrl/PointReach-v0", **env_kwargs)
    env.reset(seed=seed)
    chunks = policy.action_center + policy.action_half_range * rollout.replay["action"][b]  # [T, C, A]
    decision_rewards, length = [], 0
    for t in range(int(rollout.mask[b].sum())):
        total = 0.0
        for j, action in enumerate(chunks[t].clamp(-1, 1).numpy()):
            _, reward, terminated, truncated, info = env.step(action)
            total += gamma**j * reward
            length += 1
            if terminated or truncated:
                return decision_rewards + [total], length, info["success"], truncated and not terminated
        decision_rewards.append(total)
    raise AssertionError("episode did not end within its masked decisions")


@pytest.mark.parametrize("num_envs, group_size, action_chunk", [(4, 2, 1), (3, 4, 1), (8, 4, 3)])
def test_masks_returns_and_lengths_match_the_env_replayed_by_hand(num_envs, group_size, action_chunk):
    sampler = make_sampler(num_envs=num_envs, group_size=group_size)
    policy = make_policy(sampler, action_chunk=action_chunk)
    rollout = sampler.collect(policy, num_groups=3, group_size=group_size, step=7, group_offset=2)
    batch = 3 * group_size
    assert rollout.batch_size == batch and rollout.group_id.tolist() == [2 + i // group_size for i in range(batch)]
    assert rollout.old_logp.shape == rollout.mask.shape == rollout.step_rewards.shape
    assert rollout.num_decisions == int(rollout.mask.sum(1).max())  # T is the longest episode
    lengths = set()
    for b in range(batch):
        seed = group_seed(0, 7, rollout.group_id[b].item()) % 2**31
        rewards, length, success, truncated = replay_by_hand(policy, rollout, b, seed)
        decisions = len(rewards)
        assert decisions == -(-length // action_chunk)
        # the mask covers exactly the episode's decisions, from the first one on
        assert rollout.mask[b].tolist() == [1.0] * decisions + [0.0] * (rollout.num_decisions - decisions)
        # no reward from after the episode ended (auto-reset) leaks into the rollout
        torch.testing.assert_close(rollout.step_rewards[b, :decisions], torch.tensor(rewards, dtype=torch.float32))
        assert (rollout.step_rewards[b, decisions:] == 0).all()
        assert rollout.info["return"][b].item() == pytest.approx(sum(rewards), abs=1e-4)
        assert rollout.info["length"][b].item() == length
        assert rollout.info["success"][b].item() == float(success)
        assert rollout.info["truncated"][b].item() == truncated
        lengths.add(length)
    assert len(lengths) > 1


@pytest.mark.numerics
def test_log_prob_of_the_rollout_replay_equals_old_logp_on_valid_decisions():
    sampler = make_sampler()
    policy = make_policy(sampler, obs_norm=True)
    rollout = sampler.collect(policy, num_groups=2, group_size=2, step=0)
    logp = policy.log_prob(rollout.replay)
    torch.testing.assert_close(logp * rollout.mask, rollout.old_logp * rollout.mask, atol=1e-5, rtol=1e-6)  # one pass against the waves' (measured: equal)


@pytest.mark.parametrize("num_envs", [8, 2])  # whole groups per wave; a group spread over waves
def test_the_copies_of_a_group_share_their_initial_state_and_groups_differ(num_envs):
    sampler = make_sampler(num_envs=num_envs, group_size=4)
    rollout = sampler.collect(make_policy(sampler), num_groups=2, group_size=4, step=0)
    first = rollout.replay["obs"][:, 0]  # obs_norm is off: the raw observations
    for g in (0, 1):
        copies = first[rollout.group_id == g]
        assert (copies == copies[0]).all()
    assert not torch.equal(first[0], first[4])
    # the policy's noise differs between copies
    actions = rollout.replay["action"][rollout.group_id == 0, 0]
    assert len({tuple(a.flatten().tolist()) for a in actions}) == 4


def test_same_seed_step_and_group_give_identical_rollouts():
    a = make_sampler(num_envs=4, group_size=2)
    b = make_sampler(num_envs=4, group_size=2)
    policy = make_policy(a)
    one = a.collect(policy, num_groups=2, group_size=2, step=5)
    two = b.collect(policy, num_groups=2, group_size=2, step=5)
    for x, y in [(one.old_logp, two.old_logp), (one.replay["action"], two.replay["action"]), (one.info["return"], two.info["return"])]:
        assert torch.equal(x, y)
    other_step = a.collect(policy, num_groups=2, group_size=2, step=6)
    assert not torch.equal(other_step.replay["obs"][:, 0], one.replay["obs"][:, 0])
    # a process holding only group 1 (num_envs = G: one group per wave) samples it identically
    c = make_sampler(num_envs=2, group_size=2)
    d = make_sampler(num_envs=2, group_size=2)
    both = c.collect(policy, num_groups=2, group_size=2, step=5)
    second = d.collect(policy, num_groups=1, group_size=2, step=5, group_offset=1)
    assert torch.equal(both.replay["action"][2:, : second.num_decisions], second.replay["action"])
    assert torch.equal(both.info["return"][2:], second.info["return"])


class GoalSeeker:
    """A scripted policy (any object with ``sample``) that moves straight to the goal."""

    def sample(self, obs, generator=None, deterministic=False):
        action = (obs[:, 2:] / 0.2).clamp(-1, 1)
        n = obs.shape[0]
        return Sample(output=action[:, None], logp=torch.zeros(n, 1), replay={"obs": obs[:, None]})


def test_successful_episodes_terminate_and_count_as_successes_not_truncations():
    sampler = make_sampler(num_envs=4, env_kwargs={"max_steps": 30})
    rollout = sampler.collect(GoalSeeker(), num_groups=2, group_size=2, step=0)
    assert rollout.info["success"].tolist() == [1.0] * 4
    assert not rollout.info["truncated"].any()
    assert (rollout.mask.sum(1) == rollout.info["length"]).all()
    assert rollout.entropy is None  # the policy did not report one


def test_max_decisions_cuts_episodes_and_marks_them_truncated():
    sampler = make_sampler(num_envs=4, env_kwargs={"max_steps": 30}, max_decisions=2)
    rollout = sampler.collect(make_policy(sampler), num_groups=2, group_size=2, step=0)
    assert rollout.num_decisions == 2 and (rollout.mask == 1).all()
    assert (rollout.info["length"] == 2).all() and rollout.info["truncated"].all()
    assert sampler.state_dict() == {"env_steps": 8}


class FlashSuccess(gymnasium.Env):
    """Reports success at its second step only; never terminates; 5 steps long."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(3,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(2,))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {"success": False}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 0.0, False, self.t == 5, {"success": self.t == 2}


gymnasium.register("test/FlashSuccess-v0", entry_point=FlashSuccess)


@pytest.mark.parametrize("success_at, expected", [("any", 1.0), ("end", 0.0)])
def test_success_at_decides_whether_a_success_before_the_last_step_counts(success_at, expected):
    cfg = TrainConfig(
        env=GymEnvConfig(id="test/FlashSuccess-v0", num_envs=2),
        sampler=EnvSamplerConfig(success_at=success_at),
        algo=AlgoConfig(group_size=2),
    )
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    rollout = sampler.collect(make_policy(sampler), num_groups=1, group_size=2, step=0)
    assert rollout.info["success"].tolist() == [expected] * 2
    assert rollout.info["length"].tolist() == [5, 5] and rollout.info["truncated"].all()


def test_a_policy_with_several_decisions_per_chunk_gets_the_reward_on_the_last_one():
    class TwoStepHead(GoalSeeker):
        """Like a denoising action head: two decisions per emitted chunk."""

        def sample(self, obs, generator=None, deterministic=False):
            out = super().sample(obs)
            out.logp = torch.zeros(obs.shape[0], 2)
            out.replay = {"obs": obs[:, None].expand(-1, 2, -1)}
            return out

    sampler = make_sampler(num_envs=2)
    rollout = sampler.collect(TwoStepHead(), num_groups=1, group_size=2, step=0)
    length = rollout.info["length"]
    assert (rollout.mask.sum(1) == 2 * length).all() and rollout.replay["obs"].shape[1] == rollout.num_decisions
    assert (rollout.step_rewards[:, 0::2] == 0).all()
    torch.testing.assert_close(rollout.step_rewards.sum(1), rollout.info["return"])


def test_step_rewards_are_discounted_within_a_chunk():
    sampler = make_sampler(num_envs=2, gamma=0.5)
    policy = make_policy(sampler, action_chunk=3)
    rollout = sampler.collect(policy, num_groups=1, group_size=2, step=0)
    for b in range(2):
        rewards, *_ = replay_by_hand(policy, rollout, b, group_seed(0, 0, 0) % 2**31, gamma=0.5)
        torch.testing.assert_close(rollout.step_rewards[b, : len(rewards)], torch.tensor(rewards, dtype=torch.float32))


def test_evaluate_is_deterministic_and_depends_on_its_seed():
    sampler = make_sampler(num_envs=4)
    policy = make_policy(sampler, obs_norm=True)
    mean_before = policy.obs_stats.mean.clone()
    first = sampler.evaluate(policy, episodes=6, seed=1)
    assert first == sampler.evaluate(policy, episodes=6, seed=1)
    assert set(first) == {"success_rate", "success_rate_ci_low", "success_rate_ci_high", "return_mean", "length_mean", "episodes", "successes"}
    assert first["episodes"] == 6 and len(first["successes"]) == 6 and sum(first["successes"]) / 6 == pytest.approx(first["success_rate"])
    # the 95% Wilson interval of the successes out of 6
    assert (first["success_rate_ci_low"], first["success_rate_ci_high"]) == wilson_interval(sum(first["successes"]), 6)
    assert first["success_rate_ci_low"] <= first["success_rate"] <= first["success_rate_ci_high"]
    assert torch.equal(policy.obs_stats.mean, mean_before)  # deterministic sampling leaves the statistics
    assert first != sampler.evaluate(policy, episodes=6, seed=2)
    long_episodes = make_sampler(num_envs=4, env_kwargs={"max_steps": 30})
    assert long_episodes.evaluate(GoalSeeker(), episodes=5, seed=0)["success_rate"] == 1.0


def test_env_steps_count_every_training_env_step_and_round_trip_through_state_dict():
    sampler = make_sampler(num_envs=4)
    rollout = sampler.collect(make_policy(sampler), num_groups=2, group_size=2, step=0)
    assert sampler.env_steps == 4 * int(rollout.info["length"].max())
    sampler.evaluate(make_policy(sampler), episodes=4, seed=0)  # evaluation is not training experience
    assert sampler.env_steps == 4 * int(rollout.info["length"].max())
    other = make_sampler(num_envs=4)
    other.load_state_dict(sampler.state_dict())
    assert other.env_steps == sampler.env_steps


def test_policy_spec_describes_the_single_env_spaces():
    assert make_sampler().policy_spec() == {"obs_dim": 4, "action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0]}


def test_env_sampler_without_an_env_section_is_a_config_error():
    cfg = TrainConfig(sampler=EnvSamplerConfig())
    with pytest.raises(ConfigError) as err:
        EnvSampler(cfg.sampler, sampler_context(cfg))
    assert err.value.field == "env"
    assert SAMPLERS.get("env") is EnvSampler


def test_success_and_return_rewards_read_the_episode_stats():
    sampler = make_sampler(num_envs=4, env_kwargs={"max_steps": 30})
    rollout = sampler.collect(GoalSeeker(), num_groups=2, group_size=2, step=0)
    success = REWARDS.get("success")(rollout, SuccessRewardConfig())
    scaled = REWARDS.get("return")(rollout, ReturnRewardConfig(scale=0.5))
    assert success.tolist() == [1.0] * 4
    torch.testing.assert_close(scaled, 0.5 * rollout.info["return"])
    with pytest.raises(ConfigError, match="env"):
        REWARDS.get("success")(rollout.with_(info={}), SuccessRewardConfig())


def test_stochastic_evaluation_is_seeded_and_differs_from_the_mean_action():
    from mmrl.config import from_dict
    from mmrl.core.weights import build_policy
    from mmrl.registry import SAMPLERS
    from mmrl.train.run_config import TrainConfig

    def evaluate(deterministic):
        cfg = from_dict(
            TrainConfig,
            {
                "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4},
                "policy": {"type": "gaussian_mlp", "hidden_sizes": [8]},
                "sampler": {"type": "env", "eval_deterministic": deterministic},
                "rewards": [{"type": "return"}],
                "algo": {"group_size": 2, "groups_per_step": 2},
            },
        )
        torch.manual_seed(0)
        sampler = SAMPLERS.get("env")(cfg.sampler, sampler_context(cfg))
        policy = build_policy(cfg.policy, sampler.policy_spec())
        try:
            return sampler.evaluate(policy, 8, seed=5)["return_mean"]
        finally:
            sampler.close()

    assert evaluate(False) == evaluate(False)
    assert evaluate(False) != evaluate(True)


class NamedSuccess(gymnasium.Env):
    """Reports its success at step 2 under ``info[key]`` (and ``info[also] = False`` at every
    step, if given); ends at step 3."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(3,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(2,))

    def __init__(self, key: str, also: str | None = None):
        self.key, self.also = key, also

    def _info(self, success: bool) -> dict:
        info = {self.key: success}
        if self.also is not None:
            info[self.also] = False
        return info

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), self._info(False)

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 0.0, False, self.t == 3, self._info(self.t == 2)


gymnasium.register("test/NamedSuccess-v0", entry_point=NamedSuccess)


def named_success_sampler(key, success_key=None, also=None, rewards=()):
    cfg = TrainConfig(
        env=GymEnvConfig(id="test/NamedSuccess-v0", num_envs=2, kwargs={"key": key, "also": also}, success_key=success_key),
        sampler=EnvSamplerConfig(),
        algo=AlgoConfig(group_size=2),
        rewards=list(rewards),
    )
    return EnvSampler(cfg.sampler, sampler_context(cfg))


@pytest.mark.parametrize("key", ["is_success", "succeed"])
def test_success_under_another_common_name_is_found_without_configuration(key, caplog):
    sampler = named_success_sampler(key, rewards=[SuccessRewardConfig()])
    rollout = sampler.collect(make_policy(sampler), num_groups=1, group_size=2, step=0)
    assert rollout.info["success"].tolist() == [1.0, 1.0]
    assert sampler.evaluate(make_policy(sampler), episodes=2, seed=0)["success_rate"] == 1.0
    assert not caplog.records


def test_success_keys_are_looked_up_in_their_documented_order_and_success_key_overrides_it():
    # both present: "success" (always False here) is read before "is_success"
    auto = named_success_sampler("is_success", also="success")
    assert auto.collect(make_policy(auto), num_groups=1, group_size=2, step=0).info["success"].tolist() == [0.0, 0.0]
    named = named_success_sampler("is_success", also="success", success_key="is_success")
    assert named.collect(make_policy(named), num_groups=1, group_size=2, step=0).info["success"].tolist() == [1.0, 1.0]
    custom = named_success_sampler("goal_reached", success_key="goal_reached")
    assert custom.collect(make_policy(custom), num_groups=1, group_size=2, step=0).info["success"].tolist() == [1.0, 1.0]
    from mmrl.samplers.success import SUCCESS_KEYS
    from mmrl.train.run_config import EnvConfig

    doc = EnvConfig.__dataclass_fields__["success_key"].metadata["doc"]
    assert doc.index(SUCCESS_KEYS[0]) < doc.index(SUCCESS_KEYS[1]) < doc.index(SUCCESS_KEYS[2])  # `mmrl train --help` tells the order


def test_an_env_that_never_reports_success_warns_once_when_success_is_rewarded(caplog):
    sampler = named_success_sampler("goal_reached", rewards=[SuccessRewardConfig()])
    policy = make_policy(sampler)
    for step in range(3):
        assert sampler.collect(policy, num_groups=1, group_size=2, step=step).info["success"].tolist() == [0.0, 0.0]
    sampler.evaluate(policy, episodes=2, seed=0)
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "\n" not in record.getMessage()
    assert "'test/NamedSuccess-v0' reported no success" in record.getMessage() and "env.success_key" in record.getMessage()
    assert "success / is_success / succeed" in record.getMessage() and "success reward is 0" in record.getMessage()


def test_without_a_success_reward_only_evaluation_warns_and_a_named_key_is_named(caplog):
    sampler = named_success_sampler("goal_reached", success_key="goal")
    policy = make_policy(sampler)
    sampler.collect(policy, num_groups=1, group_size=2, step=0)
    assert not caplog.records  # trained on other rewards: success is not in use
    sampler.evaluate(policy, episodes=2, seed=0)
    (record,) = caplog.records
    assert "during evaluation (looked for 'goal')" in record.getMessage() and "success_rate reads 0" in record.getMessage()
