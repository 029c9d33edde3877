"""ManiSkill3 adapter: state and rgb observations of tasks that need no asset download.

ManiSkill on CPU is slow to start (importing it ~10 s, the first rgb renderer ~10 s) and
renders ~25 rgb steps/s, so every test here makes few envs and takes few steps.
"""

import sys

import gymnasium
import numpy as np
import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.policy import Sample
from mmrl.envs.maniskill import ManiSkillEnvConfig, task_instruction
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import ENVS

pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__:DeprecationWarning")  # inside ManiSkill


def test_maniskill_without_the_package_says_which_extra_to_install(monkeypatch):
    for name in ("mani_skill", "mani_skill.envs", "mani_skill.utils.registration"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError, match=r"mmrl\[maniskill\]"):
        ManiSkillEnvConfig(id="PushCube-v1").validate("env")


def test_task_instructions_are_fixed_sentences_or_the_task_name_in_words():
    assert task_instruction("PushCube-v1") == "push the cube to the goal"
    assert task_instruction("StackCube-v1") == "stack the red cube on the green cube"
    assert task_instruction("TurnFaucet-v1") == "turn faucet"
    assert task_instruction("MS-HumanoidRun-v1") == "ms humanoid run"


@pytest.fixture(scope="module")
def mani_skill():
    return pytest.importorskip("mani_skill", reason="mani_skill is not installed (pip install 'mmrl[maniskill]')")


def test_unknown_maniskill_id_is_a_config_error_with_close_matches(mani_skill):
    with pytest.raises(ConfigError, match="PushCube-v1") as err:
        from_dict(ManiSkillEnvConfig, {"type": "maniskill", "id": "PushCube-v2"}, "env")
    assert err.value.field == "env.id"


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"obs_mode": "pointcloud"}, "env.obs_mode"), ({"image_size": 4}, "env.image_size"), ({"cameras": []}, "env.cameras"), ({"instruction": " "}, "env.instruction"),
        ({"obs_mode": "rgb", "render_backend": "none"}, "env.render_backend"), ({"render_backend": "vulkan"}, "env.render_backend"),
    ],
)
def test_bad_maniskill_observation_settings_are_config_errors(mani_skill, section, field):
    with pytest.raises(ConfigError) as err:
        from_dict(ManiSkillEnvConfig, {"type": "maniskill", "id": "PickCube-v1", **section}, "env")
    assert err.value.field == field


def test_maniskill_pushcube_state_collects_a_small_rollout(mani_skill):
    from mmrl.core.weights import build_policy
    from mmrl.policies.gaussian_mlp import GaussianMLPConfig
    from mmrl.core.sampler import sampler_context
    from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
    from mmrl.train.run_config import AlgoConfig, TrainConfig

    cfg = TrainConfig(
        env=ManiSkillEnvConfig(id="PushCube-v1", num_envs=2),
        policy=GaussianMLPConfig(hidden_sizes=[16]),
        sampler=EnvSamplerConfig(max_decisions=4),
        algo=AlgoConfig(group_size=2),
    )
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    try:
        spec = sampler.policy_spec()
        assert spec["obs_dim"] == 35 and spec["action_dim"] == 4
        rollout = sampler.collect(build_policy(cfg.policy, spec), num_groups=1, group_size=2, step=0)
    finally:
        sampler.close()
    assert rollout.old_logp.shape == (2, 4) and rollout.mask.sum() == 8
    obs = rollout.replay["obs"][:, 0]
    assert np.array_equal(obs[0].numpy(), obs[1].numpy())  # the group shares its initial state
    assert not np.array_equal(rollout.replay["obs"][0, 1].numpy(), rollout.replay["obs"][1, 1].numpy())
    assert rollout.info["truncated"].all() and (rollout.info["length"] == 4).all()
    assert np.isfinite(rollout.info["return"].numpy()).all() and sampler.env_steps == 8


@pytest.mark.parametrize(("env_id", "obs_dim"), [("PickCube-v1", 42), ("StackCube-v1", 48)])
def test_pick_and_stack_cube_state_envs_reset_by_seed_and_step(mani_skill, env_id, obs_dim):
    env = ENVS.get("maniskill")(ManiSkillEnvConfig(id=env_id, num_envs=2), seed=0)
    try:
        assert env.single_observation_space.shape == (obs_dim,) and env.single_action_space.shape == (4,)
        same, _ = env.reset(seed=[7, 7])
        other, _ = env.reset(seed=[7, 8])
        assert np.array_equal(same[0], same[1]) and np.array_equal(same[0], other[0]) and not np.array_equal(other[0], other[1])
        for _ in range(3):
            obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        assert obs.shape == (2, obs_dim) and obs.dtype == np.float32 and np.isfinite(obs).all()
        assert reward.shape == (2,) and np.isfinite(reward).all() and not truncated.any()
        assert info["success"].dtype == bool and not info["success"].any()  # random actions do not stack cubes in 3 steps
    finally:
        env.close()


@pytest.mark.filterwarnings("ignore:.*precision lowered by casting:UserWarning")  # inside RescaleAction
def test_wrappers_wrap_each_cpu_env_and_are_refused_on_the_gpu_backend(mani_skill):
    with pytest.raises(ConfigError) as err:
        from_dict(ManiSkillEnvConfig, {"type": "maniskill", "id": "PushCube-v1", "sim_backend": "gpu", "wrappers": [{"type": "ClipAction"}]}, "env")
    assert err.value.field == "env.wrappers"
    wrappers = [{"type": "RescaleAction", "kwargs": {"min_action": -0.5, "max_action": 0.5}}]
    cfg = from_dict(ManiSkillEnvConfig, {"type": "maniskill", "id": "PushCube-v1", "num_envs": 1, "wrappers": wrappers}, "env")
    env = ENVS.get("maniskill")(cfg, seed=0)
    try:
        assert env.single_action_space.low.tolist() == [-0.5] * 4 and env.single_action_space.high.tolist() == [0.5] * 4
        env.reset(seed=0)
        obs, *_ = env.step(np.full((1, 4), 0.5, np.float32))
        assert obs.shape == (1, 35)
    finally:
        env.close()


def test_making_an_env_asks_for_the_cpu_renderer_without_cuda_and_logs_no_fallback(mani_skill, monkeypatch):
    import logging

    from mmrl.envs.maniskill import render_backend

    assert render_backend("none") == "none"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert render_backend(None) == "gpu"
    monkeypatch.undo()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    maniskill_logger = logging.getLogger("mani_skill ")  # ManiSkill's logger, which does not propagate
    maniskill_logger.addHandler(handler)
    try:
        env = ENVS.get("maniskill")(ManiSkillEnvConfig(id="PushCube-v1", num_envs=2), seed=0)
        env.close()
    finally:
        maniskill_logger.removeHandler(handler)
    fallbacks = [r.getMessage() for r in records if "Falling back" in r.getMessage()]
    assert fallbacks == []
    if not torch.cuda.is_available():
        assert render_backend(None) == "cpu"
    with pytest.raises(ConfigError) as err:
        from_dict(ManiSkillEnvConfig, {"type": "maniskill", "id": "PushCube-v1", "kwargs": {"render_backend": "cpu"}}, "env")
    assert err.value.field == "env.kwargs.render_backend" and "env.render_backend" in str(err.value)


class ImageRecorder:
    """Lifts the gripper and records the inputs it was given."""

    def __init__(self):
        self.seen = []

    def sample(self, inputs, generator=None, deterministic=False):
        self.seen.append(inputs)
        n = inputs["state"].shape[0]
        action = torch.zeros(n, 1, 4)
        action[..., 2] = 1.0
        return Sample(output=action, logp=torch.zeros(n, 1), replay={"image": inputs["image"][:, None]})


def test_pick_cube_rgb_observations_reach_the_policy_as_image_proprio_state_and_instruction(mani_skill):
    from mmrl.core.sampler import sampler_context
    from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
    from mmrl.train.run_config import AlgoConfig, PolicyConfig, TrainConfig

    instruction = "pick up the cube and move it to the goal"
    cfg = TrainConfig(
        env=ManiSkillEnvConfig(id="PickCube-v1", num_envs=2, obs_mode="rgb", image_size=32),
        policy=PolicyConfig(),
        sampler=EnvSamplerConfig(max_decisions=2),
        algo=AlgoConfig(group_size=2),
    )
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    policy = ImageRecorder()
    try:
        env = sampler.env
        space = env.single_observation_space
        assert isinstance(space, gymnasium.spaces.Dict)
        assert space["image"] == gymnasium.spaces.Box(0, 255, (32, 32, 3), np.uint8)
        # qpos 9 + qvel 9 + is_grasped 1 + tcp_pose 7 + goal_pos 3: proprioception and the goal, no cube pose
        assert space["state"].shape == (29,) and space["state"].dtype == np.float32
        assert env.get_attr("instructions") == ([instruction],) * 2
        obs, _ = env.reset(seed=[3, 3])
        assert obs["image"].shape == (2, 32, 32, 3) and obs["image"].dtype == np.uint8 and obs["image"].std() > 0
        assert np.array_equal(obs["image"][0], obs["image"][1]) and np.array_equal(obs["state"][0], obs["state"][1])
        assert list(obs["instruction"]) == [instruction] * 2
        assert space.contains({key: value[0] for key, value in obs.items()})
        spec = sampler.policy_spec()
        rollout = sampler.collect(policy, num_groups=1, group_size=2, step=0)
    finally:
        sampler.close()
    assert spec["image_shape"] == [32, 32, 3] and spec["state_dim"] == 29 and spec["instructions"] == [instruction]
    first, second = policy.seen
    assert first["image"].dtype == torch.uint8 and first["image"].shape == (2, 32, 32, 3)
    assert first["state"].dtype == torch.float32 and first["state"].shape == (2, 29)
    assert first["instruction"] == [instruction] * 2
    assert not torch.equal(first["image"], second["image"]) and not torch.equal(first["state"], second["state"])  # the arm moved
    assert rollout.replay["image"].shape == (2, 2, 32, 32, 3) and torch.equal(rollout.replay["image"][0, 0], rollout.replay["image"][1, 0])


def test_rgb_cameras_stack_to_k_images(mani_skill):
    cfg = ManiSkillEnvConfig(id="StackCube-v1", num_envs=1, obs_mode="rgb", image_size=16, kwargs={"robot_uids": "panda_wristcam"})
    env = ENVS.get("maniskill")(cfg, seed=0)
    try:
        obs, _ = env.reset(seed=0)
    finally:
        env.close()
    assert obs["image"].shape == (1, 2, 16, 16, 3)  # base_camera and hand_camera
    assert not np.array_equal(obs["image"][0, 0], obs["image"][0, 1])
    assert list(obs["instruction"]) == ["stack the red cube on the green cube"]


class FakeManiSkillEnv(gymnasium.Env):
    """The parts of a ManiSkill env the observation wrapper uses: a batched raw observation
    and ``update_obs_space``."""

    observation_space = gymnasium.spaces.Box(-1, 1, (1,))
    action_space = gymnasium.spaces.Box(-1, 1, (1,))

    def __init__(self):
        def frame(value):
            return torch.full((2, 4, 4, 3), value, dtype=torch.uint8)

        self._init_raw_obs = {
            "agent": {"qpos": torch.ones(2, 3), "qvel": torch.zeros(2, 3)},
            "extra": {"is_grasped": torch.tensor([True, False]), "goal_pos": torch.full((2, 3), 2.0)},
            "sensor_param": {"base": {"intrinsic_cv": torch.zeros(2, 3, 3)}},
            "sensor_data": {"base": {"rgb": frame(1)}, "hand": {"rgb": frame(2)}},
        }
        self.updated = None

    def update_obs_space(self, obs):
        self.updated = obs


def test_structured_observation_picks_cameras_by_name_and_flattens_agent_and_extra():
    from mmrl.envs.maniskill import StructuredObservation

    base = FakeManiSkillEnv()
    wrapper = StructuredObservation(base, ["hand", "base"])
    obs = base.updated  # what ManiSkill derives the observation space from
    assert obs["image"].shape == (2, 2, 4, 4, 3) and obs["image"][:, 0].eq(2).all() and obs["image"][:, 1].eq(1).all()
    assert obs["state"].dtype == torch.float32
    assert obs["state"].tolist() == [[1, 1, 1, 0, 0, 0, 1, 2, 2, 2], [1, 1, 1, 0, 0, 0, 0, 2, 2, 2]]
    assert torch.equal(wrapper.observation(base._init_raw_obs)["image"], obs["image"])
    assert StructuredObservation(base, None).observation(base._init_raw_obs)["image"][:, 0].eq(1).all()  # all cameras, in order
    with pytest.raises(ConfigError, match="sensor cameras of this task: base, hand") as err:
        StructuredObservation(base, ["wrist"])
    assert err.value.field == "env.cameras"


@pytest.mark.slow
def test_rgb_envs_run_in_spawned_async_workers(mani_skill):
    cfg = ManiSkillEnvConfig(id="PickCube-v1", num_envs=2, obs_mode="rgb", image_size=32, vectorization="async")
    env = ENVS.get("maniskill")(cfg, seed=0)
    try:
        assert isinstance(env, gymnasium.vector.AsyncVectorEnv)
        obs, _ = env.reset(seed=[5, 5])
        assert obs["image"].shape == (2, 32, 32, 3) and np.array_equal(obs["image"][0], obs["image"][1])
        assert list(obs["instruction"]) == ["pick up the cube and move it to the goal"] * 2
        obs, _, _, _, _ = env.step(np.zeros((2, 4), np.float32))
        assert obs["state"].shape == (2, 29)
    finally:
        env.close()


# ------------------------------------------------------------------ mmrl doctor


def test_doctor_says_how_to_install_lavapipe_when_maniskill_finds_no_vulkan_device(monkeypatch):
    from mmrl.commands import doctor

    monkeypatch.setattr(doctor, "_version", lambda dist: "3.0.1" if dist == "mani_skill" else None)
    monkeypatch.setattr(doctor, "_run", lambda code: (False, 'RuntimeError: Failed to find a supported physical device "cpu"'))
    monkeypatch.setattr(doctor, "_mesa_vulkan_version", lambda: "22.3.6-1+deb12u1")
    name, status, detail = doctor.maniskill_row()
    assert (name, status) == ("mani_skill", "NO-VULKAN")
    assert "22.3.6" in detail and "bookworm-backports" in detail and "mesa-vulkan-drivers libvulkan1" in detail
    monkeypatch.setattr(doctor, "_mesa_vulkan_version", lambda: None)
    assert "mesa-vulkan-drivers here: not installed" in doctor.maniskill_row()[2]


def test_doctor_rows_of_maniskill_when_missing_or_working(monkeypatch):
    from mmrl.commands import doctor

    monkeypatch.setattr(doctor, "_version", lambda dist: None)
    assert doctor.maniskill_row() == ("mani_skill", "missing", "pip install 'mmrl[maniskill]'")
    monkeypatch.setattr(doctor, "_version", lambda dist: "3.0.1")
    monkeypatch.setattr(doctor, "_run", lambda code: (True, ""))
    monkeypatch.setattr(doctor, "_mesa_vulkan_version", lambda: "25.0.7-2~bpo12+1")
    assert doctor.maniskill_row() == ("mani_skill", "ok", "3.0.1; Vulkan device found (mesa-vulkan-drivers 25.0.7-2~bpo12+1)")


def test_the_pushcube_expert_solves_every_episode_and_its_demonstrations_bootstrap_from_their_final_state(mani_skill, tmp_path):
    """`mmrl collect --config` on the shipped RLPD config: 8 scripted episodes, each solved
    and still solved at its 50-step limit, written with the state after the last action."""
    from mmrl.commands.collect import collect_from_config
    from mmrl.config import load_config
    from mmrl.demos import read_demos
    from mmrl.train.run_config import TrainConfig

    cfg = load_config(TrainConfig, "configs/maniskill_pushcube_rlpd.yaml", [])
    summary = collect_from_config(cfg, 8, tmp_path / "demos", seed=3)
    assert (summary["written"], summary["failed"], summary["steps"]) == (8, 0, 400)
    episodes = read_demos(tmp_path / "demos")
    assert [e.seed for e in episodes] == list(range(3, 11))
    for e in episodes:
        assert e.state.shape == (50, 35) and e.action.shape == (50, 4) and e.final_state.shape == (35,)
        assert e.step_success[-1] and not e.terminated  # ignore_terminations: the time limit ends it
        assert np.abs(e.action).max() <= 1.0


def test_the_pushcube_expert_reads_the_same_positions_from_the_state_observation_as_from_the_simulator(mani_skill):
    """The intervener's expert (observations [N, 35]) and the collector's (the simulator's
    poses) act alike along a scripted episode: the observation holds the same float32 poses,
    so the moves agree to float32 rounding of positions (~1e-7 m) over 0.05 m: 1e-5."""
    import gymnasium

    from mmrl.envs.maniskill import _push_cube_action, push_cube_expert

    env = gymnasium.make("PushCube-v1", obs_mode="state", control_mode="pd_ee_delta_pos", render_backend="none")
    try:
        obs, _ = env.reset(seed=5)
        moved = 0
        for _ in range(30):
            from_sim, from_obs = _push_cube_action(env), push_cube_expert(obs)
            assert from_obs.shape == (1, 4)
            np.testing.assert_allclose(from_obs[0], from_sim, atol=1e-5, rtol=0)
            moved += bool(np.abs(from_sim).max() > 0)
            obs, *_ = env.step(from_sim[None])
        assert moved >= 10
    finally:
        env.close()
    with pytest.raises(ValueError, match=r"\[N, 35\]"):
        push_cube_expert(np.zeros((2, 30)))


def test_collecting_a_config_whose_env_has_no_expert_exits_2_naming_the_field(tmp_path, write_config):
    import subprocess
    import sys

    from tests.conftest import point_reach_config

    config = write_config(point_reach_config())
    done = subprocess.run([sys.executable, "-m", "mmrl", "collect", "--config", str(config), "--out", str(tmp_path / "d")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "env.type" in done.stderr and "scripted expert" in done.stderr and "maniskill" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
