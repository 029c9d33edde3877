"""The env sampler keeps whole episodes on request: evaluation returns and saves them,
training collections keep keyframes for trajectory reward models; costs per episode."""

import gymnasium
import numpy as np
import pytest
import torch
import yaml

from mmrl.config import from_dict
from mmrl.core.sampler import group_seed, sampler_context
from mmrl.core.weights import build_policy
from mmrl.demos import keyframes
from mmrl.errors import ConfigError
from mmrl.samplers.env import EnvSampler
from mmrl.train.run_config import TrainConfig
from tests.conftest import point_reach_config

pytest.importorskip("mujoco")

RUN = {
    "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 8, "kwargs": {"task": "spatial", "image_size": 16, "cameras": ["top", "front"]}},
    "policy": {"type": "flow_vla", "action_chunk": 3, "denoising": {"num_inference_steps": 2},
               "backbone": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "vision_channels": [4, 8], "patch_grid": 4}},
    "rewards": [{"type": "success"}],
    "algo": {"group_size": 2, "groups_per_step": 2},
}


def _sampler(**sampler):
    cfg = from_dict(TrainConfig, {**RUN, "sampler": {"type": "env", **sampler}})
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    torch.manual_seed(0)
    return sampler, build_policy(cfg.policy, sampler.policy_spec())


def test_evaluation_keeps_every_episode_as_the_rollout_counted_it_and_saves_them(tmp_path):
    from mmrl.episodes import read_episodes

    sampler, policy = _sampler(save_eval_episodes=str(tmp_path / "saved"))
    try:
        out = sampler.evaluate(policy, 6, seed=3, keep_episodes=True)
    finally:
        sampler.close()
    episodes = out["kept_episodes"]
    assert [float(e.success) for e in episodes] == out["successes"] and len(episodes) == 6
    env = gymnasium.make("mmrl/Tabletop-v0", task="spatial", image_size=16, cameras=["top", "front"], max_episode_steps=8)
    for episode in episodes:  # the recorded actions replay to the recorded observations, costs and outcome
        obs, info = env.reset(seed=episode.seed)
        assert info["task"] == episode.task and obs["instruction"] == episode.instruction
        for t, action in enumerate(episode.action):
            assert np.array_equal(obs["image"], episode.image[t]) and np.array_equal(obs["state"], episode.state[t])
            obs, reward, terminated, truncated, info = env.step(action)
            assert reward == episode.reward[t]
        assert terminated or truncated
        assert info["success"] == episode.success and info["costs"] == pytest.approx(episode.costs)
    env.close()
    saved = read_episodes(tmp_path / "saved" / "env_steps_000000000000")
    assert [(e.seed, e.success, e.costs) for e in saved] == [(e.seed, e.success, e.costs) for e in episodes]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(saved, episodes))


def test_training_collections_keep_keyframes_of_each_episode_and_its_costs():
    sampler, policy = _sampler(keep_frames=3)
    try:
        rollout = sampler.collect(policy, num_groups=2, group_size=2, step=5)
    finally:
        sampler.close()
    trajectory, info = rollout.info["trajectory"], rollout.info
    assert trajectory["image"].shape == (4, 3, 2, 16, 16, 3) and trajectory["image"].dtype == torch.uint8
    assert trajectory["state"].shape == (4, 3, 4) and trajectory["action"].shape == (4, 3, 3)
    assert torch.equal(trajectory["length"], info["length"].float()) and torch.equal(info["costs"]["steps"], info["length"].double())
    env = gymnasium.make("mmrl/Tabletop-v0", task="spatial", image_size=16, cameras=["top", "front"])
    for b in range(4):  # the first keyframe is the episode's reset observation
        obs, _ = env.reset(seed=group_seed(0, 5, b // 2) % 2**31)
        assert np.array_equal(trajectory["image"][b, 0].numpy(), obs["image"]) and info["instruction"][b] == obs["instruction"]
    env.close()
    metrics = sampler.metrics(rollout)
    assert torch.equal(metrics["cost/path_length"], info["costs"]["path_length"])


def test_keyframes_take_the_first_and_last_observation_and_segment_means_of_the_actions():
    from mmrl.demos import Episode

    steps = 5
    action = np.array([[3, 4], [0, 0], [1, 0], [0, 1], [6, 8]], np.float32)
    episode = Episode(image=np.arange(steps, dtype=np.uint8)[:, None, None, None].repeat(2, 1).repeat(2, 2).repeat(3, 3), state=np.arange(steps, dtype=np.float32)[:, None],
                      action=action, reward=np.zeros(steps, np.float32), success=True, instruction="x", task="x", seed=0)
    frames = keyframes(episode, 3)  # steps 0, 2, 4; segments [0, 2), [2, 4), [4, 5)
    assert frames["image"][:, 0, 0, 0].tolist() == [0, 2, 4] and frames["state"][:, 0].tolist() == [0, 2, 4]
    assert np.allclose(frames["action"], [[1.5, 2, 2.5], [0.5, 0.5, 1], [6, 8, 10]]) and frames["length"] == 5
    short = keyframes(episode, 8)  # more keyframes than steps: steps repeat, empty segments take their step's action
    assert short["state"][:, 0].tolist() == [0, 1, 1, 2, 2, 3, 3, 4] and np.allclose(short["action"][1], [0, 0, 0])


@pytest.mark.parametrize("change, field", [
    ({"sampler": {"type": "env", "keep_frames": 1}}, "keep_frames"),
    ({"sampler": {"type": "env", "keep_frames": 4}, "rollout": {"over_provision": 2}}, "sampler.keep_frames"),
    ({"sampler": {"type": "env", "keep_frames": 4}, "env": {"type": "gym", "id": "mmrl/PointReach-v0"}}, "sampler.keep_frames"),
])
def test_keeping_frames_where_it_cannot_work_is_a_config_error_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        cfg = from_dict(TrainConfig, {**RUN, **change})
        EnvSampler(cfg.sampler, sampler_context(cfg))


def test_a_state_only_env_saves_its_evaluation_episodes_with_the_state_and_no_image(tmp_path):
    # `mmrl eval RUN --save-episodes DIR` on an env whose observation is a plain Box (PointReach,
    # ManiSkill's obs_mode state): each episode keeps the state vector, the actions replay it
    from mmrl.cli import main
    from mmrl.episodes import read_episodes

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(point_reach_config(eval={"episodes": 5})))
    assert main(["eval", str(config), "--out", str(tmp_path / "eval"), "--save-episodes", str(tmp_path / "episodes")]) == 0
    episodes = read_episodes(tmp_path / "episodes")
    assert len(episodes) == 5
    env = gymnasium.make("mmrl/PointReach-v0")
    for episode in episodes:
        assert episode.image.shape == (len(episode), 0) and episode.state.shape[1] == env.observation_space.shape[0]
        obs, _ = env.reset(seed=episode.seed)
        for t, action in enumerate(episode.action):
            assert np.allclose(obs, episode.state[t])
            obs, reward, terminated, truncated, info = env.step(action)
            assert reward == pytest.approx(episode.reward[t])
        assert terminated or truncated
        assert bool(info.get("success", False)) == episode.success
    env.close()
