"""Image + language observations reach the policy as a dict, and its spec says their shapes."""

import gymnasium
import numpy as np
import torch
from gymnasium import spaces

from mmrl.core.policy import Sample
from mmrl.envs.gym import GymEnvConfig
from mmrl.core.sampler import sampler_context
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
from mmrl.train.run_config import AlgoConfig, PolicyConfig, TrainConfig

INSTRUCTIONS = ["go left", "go right"]


class ColourSide(gymnasium.Env):
    """The image is red (go left) or blue (go right); the instruction says the same; the
    agent succeeds by moving its state coordinate to the instructed side within 5 steps."""

    instructions = INSTRUCTIONS

    def __init__(self):
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (8, 8, 3), np.uint8),
                "state": spaces.Box(-np.inf, np.inf, (1,), np.float32),
                "instruction": spaces.Text(max_length=32, charset="abcdefghijklmnopqrstuvwxyz "),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def _obs(self):
        image = np.zeros((8, 8, 3), np.uint8)
        image[..., 0 if self.side < 0 else 2] = 255
        return {"image": image, "state": np.array([self.x], np.float32), "instruction": INSTRUCTIONS[self.side > 0]}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.side, self.x, self.t = (-1 if self.np_random.random() < 0.5 else 1), 0.0, 0
        return self._obs(), {}

    def step(self, action):
        self.x += float(action[0])
        self.t += 1
        success = self.x * self.side >= 2
        return self._obs(), float(success), success, self.t >= 5, {"success": success}


gymnasium.register("test/ColourSide-v0", entry_point=ColourSide)


class Recorder:
    """Acts by the instruction (right → +1, left → −1) and records what it saw."""

    def __init__(self):
        self.seen = []

    def sample(self, inputs, generator=None, deterministic=False):
        self.seen.append(inputs)
        sign = torch.tensor([1.0 if text.endswith("right") else -1.0 for text in inputs["instruction"]])
        n = len(sign)
        return Sample(output=sign.view(n, 1, 1), logp=torch.zeros(n, 1), replay={"state": inputs["state"][:, None]})


def make_sampler(num_envs=4):
    cfg = TrainConfig(env=GymEnvConfig(id="test/ColourSide-v0", num_envs=num_envs), policy=PolicyConfig(), sampler=EnvSamplerConfig(), algo=AlgoConfig(group_size=2))
    return EnvSampler(cfg.sampler, sampler_context(cfg))


def test_spec_describes_image_state_and_instructions():
    sampler = make_sampler()
    spec = sampler.policy_spec()
    assert spec["image_shape"] == [8, 8, 3]
    assert spec["state_dim"] == spec["obs_dim"] == 1
    assert spec["instructions"] == INSTRUCTIONS
    sampler.close()


def test_policy_gets_uint8_images_float_state_and_strings_and_can_follow_them():
    sampler = make_sampler()
    policy = Recorder()
    rollout = sampler.collect(policy, num_groups=2, group_size=2, step=0)
    first = policy.seen[0]
    assert first["image"].dtype == torch.uint8 and first["image"].shape == (4, 8, 8, 3)
    assert first["state"].dtype == torch.float32 and first["state"].shape == (4, 1)
    assert isinstance(first["instruction"], list) and all(t in INSTRUCTIONS for t in first["instruction"])
    # the image and the instruction agree, env by env
    red = first["image"][:, 0, 0, 0] == 255
    assert [t == "go left" for t in first["instruction"]] == red.tolist()
    assert rollout.info["success"].tolist() == [1.0] * 4  # following the instruction always succeeds
    assert rollout.replay["state"].shape[:2] == (4, 2)  # two decisions, replay concatenated
    sampler.close()
