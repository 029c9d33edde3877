import os
import signal
import sys
import time

import gymnasium
import numpy as np
import pytest

import mmrl.envs  # noqa: F401  (registers mmrl/PointReach-v0)
from mmrl.config import from_dict
from mmrl.envs.gym import GymEnvConfig
from mmrl.errors import ConfigError
from mmrl.registry import ENVS

# ------------------------------------------------------------------ PointReach


def test_point_reach_start_and_goal_come_from_the_reset_seed():
    env = gymnasium.make("mmrl/PointReach-v0")
    a, _ = env.reset(seed=3)
    b, _ = env.reset(seed=3)
    c, _ = env.reset(seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert env.observation_space.contains(a)


def test_point_reach_reward_is_minus_the_distance_and_success_terminates():
    env = gymnasium.make("mmrl/PointReach-v0")
    obs, _ = env.reset(seed=0)
    for _ in range(30):
        # head straight for the goal at most one step_size per step
        obs, reward, terminated, truncated, info = env.step(np.clip(obs[2:] / 0.2, -1, 1))
        assert reward == pytest.approx(-np.linalg.norm(obs[2:]), abs=1e-6)
        if terminated or truncated:
            break
    assert terminated and not truncated and info["success"]


def test_point_reach_truncates_at_its_time_limit_and_min_steps_varies_it():
    env = gymnasium.make("mmrl/PointReach-v0", max_steps=12, min_steps=3)
    lengths = set()
    for seed in range(12):
        env.reset(seed=seed)
        for t in range(1, 20):
            _, _, terminated, truncated, _ = env.step(np.zeros(2, np.float32))  # standing still never succeeds
            if terminated or truncated:
                break
        assert truncated and not terminated and 3 <= t <= 12
        lengths.add(t)
    assert len(lengths) > 3


# ------------------------------------------------------------------ gym adapter


def test_gym_adapter_builds_a_mujoco_vector_env_with_no_specific_code():
    env = ENVS.get("gym")(GymEnvConfig(id="Reacher-v5", num_envs=2), seed=0)
    obs, _ = env.reset(seed=[1, 1])
    assert obs.shape == (2, 10) and np.array_equal(obs[0], obs[1])
    for _ in range(3):
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
    assert reward.shape == (2,) and np.isfinite(reward).all()
    env.close()


def test_async_env_workers_leave_sigint_and_sigterm_to_the_trainer():
    """A signal to the process group reaches the workers; they ignore it so the trainer can
    finish its step and checkpoint (it closes the workers itself)."""
    cfg = GymEnvConfig(id="mmrl/PointReach-v0", num_envs=2, vectorization="async", context="fork")
    env = ENVS.get("gym")(cfg, seed=0)
    try:
        env.reset(seed=[1, 2])
        for proc in env.processes:
            os.kill(proc.pid, signal.SIGINT)
            os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert all(proc.is_alive() for proc in env.processes)
        obs, reward, _, _, _ = env.step(np.zeros((2, 2), np.float32))
        assert obs.shape == (2, 4) and np.isfinite(reward).all()
    finally:
        env.close()
    assert not any(proc.is_alive() for proc in env.processes)


def test_gym_adapter_async_vector_env_passes_kwargs_and_time_limit():
    cfg = GymEnvConfig(id="mmrl/PointReach-v0", num_envs=2, vectorization="async", max_episode_steps=2, kwargs={"step_size": 0.0})
    env = ENVS.get("gym")(cfg, seed=0)
    assert isinstance(env, gymnasium.vector.AsyncVectorEnv)
    first, _ = env.reset(seed=[5, 6])
    obs, _, _, _, _ = env.step(np.ones((2, 2), np.float32))
    assert np.array_equal(obs, first)  # step_size 0 from kwargs: the point does not move
    _, _, terminated, truncated, _ = env.step(np.ones((2, 2), np.float32))
    assert truncated.all() and not terminated.any()
    env.close()


def test_unknown_gym_id_is_a_config_error_naming_env_id_with_close_matches():
    with pytest.raises(ConfigError, match="Reacher-v5") as err:
        from_dict(GymEnvConfig, {"type": "gym", "id": "Reacher-v55"}, "env")
    assert err.value.field == "env.id" and err.value.value == "Reacher-v55"


def test_gym_id_with_an_unimportable_module_prefix_is_a_config_error():
    with pytest.raises(ConfigError, match="no_such_package") as err:
        from_dict(GymEnvConfig, {"type": "gym", "id": "no_such_package:Thing-v0"}, "env")
    assert err.value.field == "env.id"


@pytest.fixture
def fresh_modules():
    """Forgets the modules a test imported, so that another test imports them anew."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _registering_module(tmp_path, monkeypatch, module: str, env_id: str) -> None:
    """A module ``module`` on sys.path that registers ``env_id`` (PointReach) when imported."""
    (tmp_path / f"{module}.py").write_text(
        "import gymnasium\n"
        f"gymnasium.register(id={env_id!r}, entry_point='mmrl.envs.point_reach:PointReachEnv', max_episode_steps=5)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(gymnasium.registry, env_id, raising=False)


def test_a_namespaced_id_imports_its_namespace_module_to_register_it(tmp_path, monkeypatch, fresh_modules):
    _registering_module(tmp_path, monkeypatch, "mmrl_ns_plugin", "mmrl_ns_plugin/Reach-v0")
    cfg = from_dict(GymEnvConfig, {"type": "gym", "id": "mmrl_ns_plugin/Reach-v0", "num_envs": 2}, "env")
    env = ENVS.get("gym")(cfg, seed=0)
    try:
        obs, _ = env.reset(seed=[1, 1])
        assert obs.shape == (2, 4) and np.array_equal(obs[0], obs[1])
        assert env.envs[0].spec.id == "mmrl_ns_plugin/Reach-v0" and env.envs[0].spec.max_episode_steps == 5
    finally:
        env.close()
    monkeypatch.delitem(gymnasium.registry, "mmrl_ns_plugin/Reach-v0")
    # gymnasium's own module:id form keeps working
    _registering_module(tmp_path, monkeypatch, "mmrl_other_module", "OtherNamespace/Reach-v0")
    from_dict(GymEnvConfig, {"type": "gym", "id": "mmrl_other_module:OtherNamespace/Reach-v0"}, "env")


def test_namespaced_id_async_workers_import_the_namespace_module(tmp_path, monkeypatch, fresh_modules):
    # spawned workers start with mmrl's ids only: they must be told to import the module
    _registering_module(tmp_path, monkeypatch, "mmrl_ns_async", "mmrl_ns_async/Reach-v0")
    cfg = GymEnvConfig(id="mmrl_ns_async/Reach-v0", num_envs=2, vectorization="async")
    env = ENVS.get("gym")(cfg, seed=0)
    try:
        obs, _ = env.reset(seed=[3, 3])
        assert obs.shape == (2, 4) and np.array_equal(obs[0], obs[1])
    finally:
        env.close()


@pytest.mark.parametrize(
    ("module", "registers", "says"),
    [
        (None, None, "importing its namespace 'mmrl_no_ns' as a module failed"),
        ("mmrl_no_ns", "mmrl_no_ns/Other-v0", "importing the module 'mmrl_no_ns' did not register it"),
    ],
)
def test_a_namespaced_id_still_unknown_suggests_the_module_colon_id_form(tmp_path, monkeypatch, fresh_modules, module, registers, says):
    if module is not None:
        _registering_module(tmp_path, monkeypatch, module, registers)
    with pytest.raises(ConfigError) as err:
        from_dict(GymEnvConfig, {"type": "gym", "id": "mmrl_no_ns/Reach-v0"}, "env")
    assert err.value.field == "env.id" and says in str(err.value)
    assert "name the package first: 'package:mmrl_no_ns/Reach-v0'" in str(err.value)


def test_an_unknown_namespaced_id_names_the_same_env_registered_without_its_namespace(tmp_path, monkeypatch, fresh_modules):
    _registering_module(tmp_path, monkeypatch, "mmrl_plain_ids", "PlainReach-v0")
    with pytest.raises(ConfigError, match="close matches: PlainReach-v0"):
        from_dict(GymEnvConfig, {"type": "gym", "id": "mmrl_plain_ids/PlainReach-v0"}, "env")
