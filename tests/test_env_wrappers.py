"""env.wrappers: gymnasium wrappers named in the config wrap each env before vectorization."""

import gymnasium
import numpy as np
import pytest
import torch

import mmrl.envs  # noqa: F401  (registers mmrl/PointReach-v0)
from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.env_wrappers import WrapperConfig
from mmrl.envs.gym import GymEnvConfig
from mmrl.errors import ConfigError
from mmrl.policies.gaussian_mlp import GaussianMLPConfig
from mmrl.registry import ENVS
from mmrl.core.sampler import sampler_context
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
from mmrl.train.run_config import AlgoConfig, TrainConfig


class ReachedInfo(gymnasium.Env):
    """Reports success at step 2 as ``info["reached"]``, a name mmrl does not look for; ends at step 3."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(3,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(2,))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {"reached": False}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 0.0, False, self.t == 3, {"reached": self.t == 2}


gymnasium.register("test/ReachedInfo-v0", entry_point=ReachedInfo)


class RenameInfoKey(gymnasium.Wrapper):
    """Renames one key of the env's info dicts."""

    def __init__(self, env, old: str, new: str):
        super().__init__(env)
        self.old, self.new = old, new

    def _renamed(self, info: dict) -> dict:
        info = dict(info)
        if self.old in info:
            info[self.new] = info.pop(self.old)
        return info

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, self._renamed(info)

    def step(self, action):
        *out, info = self.env.step(action)
        return (*out, self._renamed(info))


def sampler_for(env: dict) -> EnvSampler:
    cfg = TrainConfig(env=from_dict(GymEnvConfig, {"type": "gym", "num_envs": 2, **env}, "env"), sampler=EnvSamplerConfig(), algo=AlgoConfig(group_size=2))
    return EnvSampler(cfg.sampler, sampler_context(cfg))


def collect(sampler: EnvSampler):
    torch.manual_seed(0)
    policy = build_policy(GaussianMLPConfig(hidden_sizes=[8]), sampler.policy_spec())
    return sampler.collect(policy, num_groups=1, group_size=2, step=0)


def test_a_wrapper_from_the_test_module_renames_an_info_key_the_sampler_reads_success_from():
    plain = sampler_for({"id": "test/ReachedInfo-v0"})
    assert collect(plain).info["success"].tolist() == [0.0, 0.0]
    renamed = sampler_for({"id": "test/ReachedInfo-v0", "wrappers": [{"type": f"{__name__}:RenameInfoKey", "kwargs": {"old": "reached", "new": "success"}}]})
    assert collect(renamed).info["success"].tolist() == [1.0, 1.0]


@pytest.mark.filterwarnings("ignore:.*precision lowered by casting:UserWarning")  # inside RescaleAction
def test_gymnasium_wrappers_change_the_actions_and_rewards_the_sampler_sees():
    env = {"id": "mmrl/PointReach-v0", "kwargs": {"max_steps": 6, "min_steps": 6}}
    plain = sampler_for(env)
    wrapped = sampler_for({**env, "wrappers": [
        {"type": "RescaleAction", "kwargs": {"min_action": -0.5, "max_action": 0.5}},  # a bare name is a gymnasium wrapper
        {"type": "gymnasium.wrappers.ClipReward", "kwargs": {"min_reward": -0.05, "max_reward": 0.0}},
    ]})
    assert plain.policy_spec()["action_low"] == [-1.0, -1.0]
    assert wrapped.policy_spec()["action_low"] == [-0.5, -0.5] and wrapped.policy_spec()["action_high"] == [0.5, 0.5]
    plain_rollout, wrapped_rollout = collect(plain), collect(wrapped)
    # PointReach pays minus the distance to the goal (~0.1 to 1 here); clipped, each of the 6 steps pays -0.05
    assert (plain_rollout.info["return"] < -0.6).all()
    torch.testing.assert_close(wrapped_rollout.info["return"], torch.full((2,), -0.3))


def test_wrappers_reach_spawned_async_workers():
    cfg = from_dict(
        GymEnvConfig,
        {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 2, "vectorization": "async", "wrappers": [{"type": "FlattenObservation"}, {"type": "ClipAction"}]},
        "env",
    )
    env = ENVS.get("gym")(cfg, seed=0)
    try:
        assert isinstance(env, gymnasium.vector.AsyncVectorEnv)
        assert env.call("class_name") == ("ClipAction", "ClipAction")  # the outermost wrapper of each worker's env
    finally:
        env.close()


@pytest.mark.parametrize(
    ("wrapper", "field", "message"),
    [
        ({"type": "no_such_package.wrappers:Thing"}, "env.wrappers[1].type", "could not import the module 'no_such_package.wrappers'"),
        ({"type": "gymnasium.wrappers:ClipRewardz"}, "env.wrappers[1].type", "close matches: ClipReward"),
        ({"type": "ClipReward", "kwargs": {"low": 0.0}}, "env.wrappers[1].kwargs", "ClipReward takes (min_reward, max_reward)"),
        ({"type": "gymnasium.wrappers.vector:ClipReward"}, "env.wrappers[1].type", "vector-env wrapper"),
        ({"type": "gymnasium.wrappers:__doc__"}, "env.wrappers[1].type", "not a wrapper class or function"),
        ({"kwargs": {}}, "env.wrappers[1].type", "required"),
    ],
)
def test_bad_wrappers_are_config_errors_naming_their_entry(wrapper, field, message):
    with pytest.raises(ConfigError) as err:
        from_dict(GymEnvConfig, {"type": "gym", "id": "mmrl/PointReach-v0", "wrappers": [{"type": "ClipAction"}, wrapper]}, "env")
    assert err.value.field == field and message in str(err.value)


def test_a_wrapper_that_fails_on_the_env_is_a_config_error_naming_its_entry():
    # valid arguments, but ClipReward refuses a lower bound above the upper one
    cfg = GymEnvConfig(id="mmrl/PointReach-v0", num_envs=2, wrappers=[WrapperConfig("ClipReward", {"min_reward": 1.0, "max_reward": 0.0})])
    with pytest.raises(ConfigError) as err:
        ENVS.get("gym")(cfg, seed=0)
    assert err.value.field == "env.wrappers[0]" and "mmrl/PointReach-v0" in str(err.value)
