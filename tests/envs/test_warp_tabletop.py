"""The tabletop suite on MuJoCo Warp (env type tabletop_warp) against mmrl/Tabletop-v0: the
same tasks and initial states from the same seeds, states equal to float32 rounding until the
pusher touches a block, the scripted expert's success (for one family and for a task list
mixing all three), masked and same-step resets, costs, config errors, and the env sampler
on it.

MuJoCo Warp's kernels compile on first use (10-40 s on a CPU, then cached in warp's kernel
cache); the tests that step share one compiled batch (``batch``). They need the warp extra:
skipped without it, failed without it under ``MMRL_REQUIRE_WARP=1`` (.ci/run, whose set-up
installs every extra)."""

import os

import numpy as np
import pytest
import torch

from mmrl.envs.tabletop.env import PHYSICS_STEPS, TabletopEnv
from mmrl.envs.tabletop.expert import expert_action
from mmrl.errors import ConfigError

WORLDS = 16
MIXED = ["spatial", "object", "goal"]  # every task of every family, drawn by the seed
STEPS = 20
# Every state entry is at most ~1 in size (metres, m/s, cos and sin) and each MuJoCo step rounds
# it to float32 once (relative error <= eps32 = 1.19e-7); added up in the worst case over the
# 20 x PHYSICS_STEPS = 400 MuJoCo steps of 20 control steps: 400 * eps32 = 4.8e-5.
TOLERANCE = STEPS * PHYSICS_STEPS * float(np.finfo(np.float32).eps)


def require_warp():
    try:
        import mujoco_warp  # noqa: F401
    except ImportError as error:
        problem = f"the warp extra is not installed ({error}); pip install 'mmrl[warp]'"
        if os.environ.get("MMRL_REQUIRE_WARP") == "1":
            pytest.fail(problem + " (MMRL_REQUIRE_WARP=1)", pytrace=False)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def batch():
    """One compiled batch of WORLDS object-family worlds; each test resets it."""
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    env = TabletopBatchedEnv(WORLDS, task="object", autoreset="disabled", device="cpu")
    yield env
    env.close()


@pytest.fixture(scope="module")
def mixed():
    """WORLDS worlds of tasks of all three families: the object scene, as ``batch``, so the
    kernels ``batch`` compiled serve it too."""
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    env = TabletopBatchedEnv(WORLDS, task=MIXED, autoreset="disabled", device="cpu")
    yield env
    env.close()


def _cpu_envs(n, task="object", **kwargs):
    return [TabletopEnv(task=task, obs_mode="state", **kwargs) for _ in range(n)]


def _watch_the_pusher(env) -> list[bool]:
    """Make ``env`` (reset) run its MuJoCo steps one by one and set the returned flag once
    the pusher touches a block at any of them."""
    sim, touched = env._sim, [False]
    blocks = {int(g) for g in sim.block_geoms}

    def step(velocity):
        sim.data.ctrl[:] = velocity
        for _ in range(PHYSICS_STEPS):
            sim.mujoco.mj_step(sim.model, sim.data)
            touched[0] |= any(sim.pusher_geom in (c.geom1, c.geom2) and {int(c.geom1), int(c.geom2)} & blocks for c in sim.data.contact[: sim.data.ncon])

    sim.step = step
    return touched


def test_a_world_reset_with_a_seed_gets_the_task_and_initial_state_of_the_cpu_env():
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    env = TabletopBatchedEnv(8, task="spatial", device="cpu")  # four tasks: the seed draws the task too
    seeds = [100 + i for i in range(8)]
    obs, info = env.reset(seed=seeds)
    cpus = _cpu_envs(8, "spatial")
    expected = [cpu.reset(seed=s) for cpu, s in zip(cpus, seeds)]
    assert env.state_layout() == cpus[0].state_layout()
    assert info["task"] == [i["task"] for _, i in expected] and len(set(info["task"])) > 1
    assert list(obs["instruction"]) == [o["instruction"] for o, _ in expected]
    assert isinstance(obs["state"], torch.Tensor) and obs["state"].dtype == torch.float32
    np.testing.assert_allclose(obs["state"].numpy(), np.stack([o["state"] for o, _ in expected]), atol=1e-6)
    assert env.target.tolist() == [cpu.target for cpu in cpus]
    # one integer seed: world i gets seed + i, as gymnasium's vector envs do
    again, _ = env.reset(seed=100)
    assert torch.equal(again["state"], obs["state"])
    same, _ = env.reset(seed=[7] * 8)
    assert (same["state"] == same["state"][0]).all()


def _compare_until_the_first_touch(batch, task) -> float:
    """Step ``batch`` and CPU envs of ``task`` from seeds 0..WORLDS-1 with the CPU expert's
    actions (dense reward) for STEPS control steps; assert states, rewards, costs and flags
    agree to TOLERANCE in every world whose pusher has not touched a block yet; return the
    largest state gap seen there."""
    batch.reward_mode = "dense"
    try:
        batch.reset(seed=list(range(WORLDS)))
        cpus = _cpu_envs(WORLDS, task, reward_mode="dense")
        for i, cpu in enumerate(cpus):
            cpu.reset(seed=i)
        watched = [_watch_the_pusher(cpu) for cpu in cpus]
        untouched_steps, largest = 0, 0.0
        for _ in range(STEPS):
            actions = np.stack([expert_action(cpu) for cpu in cpus])
            expected = [cpu.step(action) for cpu, action in zip(cpus, actions)]
            obs, reward, terminated, _, info = batch.step(torch.from_numpy(actions))
            free = ~np.array([w[0] for w in watched]) & ~np.array([e[2] for e in expected])
            untouched_steps += int(free.sum())
            state = np.stack([e[0]["state"] for e in expected])
            gap = np.abs(obs["state"].numpy() - state)[free].max(initial=0.0)
            largest = max(largest, float(gap))
            assert gap <= TOLERANCE
            assert np.abs(reward.numpy() - np.array([e[1] for e in expected]))[free].max(initial=0.0) <= 10 * TOLERANCE
            path = np.array([e[4]["costs"]["path_length"] for e in expected])
            assert np.abs(info["costs"]["path_length"].numpy() - path)[free].max(initial=0.0) <= TOLERANCE
            assert (info["costs"]["steps"].numpy() == np.array([e[4]["costs"]["steps"] for e in expected])).all()
            assert (terminated.numpy() == np.array([e[2] for e in expected]))[free].all()
        assert untouched_steps >= WORLDS * 3  # the comparison covers the approach to the block
        return largest
    finally:
        batch.reward_mode = "sparse"


def _expert_success(batch, task) -> tuple[np.ndarray, np.ndarray]:
    """The scripted expert's success ``(cpu, warp)`` [WORLDS] bool over one episode from
    seeds 0..WORLDS-1, on CPU envs of ``task`` and on ``batch`` (60 steps, the time limit)."""
    from mmrl.envs.tabletop.batched import expert_actions

    batch.reset(seed=list(range(WORLDS)))
    cpus = _cpu_envs(WORLDS, task)
    cpu_success, warp_success = np.zeros(WORLDS, bool), np.zeros(WORLDS, bool)
    cpu_alive, warp_alive = np.ones(WORLDS, bool), np.ones(WORLDS, bool)
    for i, cpu in enumerate(cpus):
        cpu.reset(seed=i)
    for _ in range(60):
        _, _, terminated, truncated, info = batch.step(expert_actions(batch))
        warp_success |= info["success"].numpy() & warp_alive
        warp_alive &= ~(terminated | truncated).numpy()
        for i, cpu in enumerate(cpus):
            if cpu_alive[i]:
                _, _, term, trunc, step_info = cpu.step(expert_action(cpu))
                cpu_success[i] |= step_info["success"]
                cpu_alive[i] = not (term or trunc)
    assert not warp_alive.any() and not cpu_alive.any()  # the time limit ends them all
    return cpu_success, warp_success


def test_states_rewards_and_costs_match_the_cpu_env_to_float32_rounding_until_the_pusher_touches_a_block(batch):
    _compare_until_the_first_touch(batch, "object")


def test_the_scripted_expert_succeeds_where_it_succeeds_on_the_cpu_env(batch):
    cpu_success, warp_success = _expert_success(batch, "object")
    assert cpu_success.mean() >= 0.9
    assert (cpu_success == warp_success).sum() >= WORLDS - 1


def test_a_mixed_task_list_gives_each_world_the_cpu_envs_task_and_initial_state_and_parks_the_blocks_its_family_lacks(mixed):
    from mmrl.envs.tabletop.batched import PARK_X
    from mmrl.envs.tabletop.tasks import TASKS

    obs, info = mixed.reset(seed=list(range(WORLDS)))
    cpus = _cpu_envs(WORLDS, MIXED)
    expected = [cpu.reset(seed=i) for i, cpu in enumerate(cpus)]
    assert mixed.state_layout() == cpus[0].state_layout()
    assert info["task"] == [i["task"] for _, i in expected]
    families = [TASKS[t].family for t in info["task"]]
    assert set(families) == {"spatial", "object", "goal"}  # the seeds draw worlds of every family
    assert list(obs["instruction"]) == [o["instruction"] for o, _ in expected]
    np.testing.assert_allclose(obs["state"].numpy(), np.stack([o["state"] for o, _ in expected]), atol=1e-6)
    assert mixed.target.tolist() == [cpu.target for cpu in cpus]
    # three-block worlds park the object scene's fourth block off the table, and keep it there
    assert mixed.block_present.sum(1).tolist() == [4 if f == "object" else 3 for f in families]
    mixed.step(torch.ones(WORLDS, 2))
    parked = ~mixed.block_present
    np.testing.assert_allclose(mixed.block_positions()[parked].numpy(), np.tile([PARK_X + 0.3, 0.0], (int(parked.sum()), 1)), atol=1e-6)


def test_spatial_and_goal_tasks_share_the_spatial_scene_and_a_goal_world_parks_the_zone():
    require_warp()
    from mmrl.config import from_dict
    from mmrl.envs.tabletop.batched import PARK_X, TabletopBatchedEnv, TabletopWarpEnvConfig
    from mmrl.envs.tabletop.tasks import TASKS

    task = ["spatial", "goal"]
    from_dict(TabletopWarpEnvConfig, {"task": task}).validate("env")  # a list across families is a valid env section
    env = TabletopBatchedEnv(WORLDS, task=task, device="cpu")
    assert env.scene_family.name == "spatial" and env.num_blocks == 3 and not env.parks_blocks
    obs, info = env.reset(seed=list(range(WORLDS)))
    cpus = _cpu_envs(WORLDS, task)
    expected = [cpu.reset(seed=i) for i, cpu in enumerate(cpus)]
    assert info["task"] == [i["task"] for _, i in expected]
    np.testing.assert_allclose(obs["state"].numpy(), np.stack([o["state"] for o, _ in expected]), atol=1e-6)
    goal = torch.tensor([TASKS[t].family == "goal" for t in info["task"]])
    assert 0 < goal.sum() < WORLDS  # seeds 0-7 all draw goal tasks; 0-15 draw both
    zone = env.mocap_pos[:, env.zone_mocap, :2]
    assert (zone[goal, 0] >= PARK_X).all() and torch.equal(zone[~goal], env.zone[~goal].to(zone.dtype))


def test_a_mixed_task_list_matches_the_cpu_env_to_float32_rounding_until_the_pusher_touches_a_block(mixed):
    _compare_until_the_first_touch(mixed, MIXED)


def test_in_a_mixed_task_list_the_scripted_expert_succeeds_where_it_succeeds_on_the_cpu_env(mixed):
    cpu_success, warp_success = _expert_success(mixed, MIXED)
    assert cpu_success.mean() >= 0.9
    assert (cpu_success == warp_success).sum() >= WORLDS - 1


def test_a_masked_reset_resets_only_the_masked_worlds(batch):
    first, _ = batch.reset(seed=list(range(WORLDS)))
    batch.step(torch.full((WORLDS, 2), 0.5))
    moved = batch.observe()["state"].clone()
    mask = torch.arange(WORLDS) < 4
    obs, _ = batch.reset(seed=list(range(WORLDS)), options={"reset_mask": mask})
    assert torch.equal(obs["state"][:4], first["state"][:4])
    assert torch.equal(obs["state"][4:], moved[4:]) and not torch.equal(moved[4:], first["state"][4:])
    assert batch.elapsed.tolist() == [0] * 4 + [1] * (WORLDS - 4)


def test_same_step_autoreset_starts_each_finished_world_from_its_own_generator(batch):
    batch.autoreset, batch.max_episode_steps = "same_step", 2
    try:
        batch.reset(seed=list(range(WORLDS)))
        batch.step(torch.zeros(WORLDS, 2))
        obs, _, terminated, truncated, info = batch.step(torch.zeros(WORLDS, 2))
        assert truncated.all() and not terminated.any()
        assert info["_final"].all() and info["final_obs"]["state"].shape == obs["state"].shape
        assert batch.elapsed.tolist() == [0] * WORLDS
        cpus = _cpu_envs(WORLDS)
        for i, cpu in enumerate(cpus):
            cpu.reset(seed=i)
        second = np.stack([cpu.reset()[0]["state"] for cpu in cpus])  # the generator goes on
        np.testing.assert_allclose(obs["state"].numpy(), second, atol=1e-6)
    finally:
        batch.autoreset, batch.max_episode_steps = "disabled", 60


def test_the_collision_cost_counts_a_block_pinned_by_the_pusher_against_a_wall_as_the_cpu_env_does(batch):
    batch.reset(seed=list(range(WORLDS)))
    cpu = _cpu_envs(1)[0]
    cpu.reset(seed=0)
    other = (batch.target[0].item() + 1) % batch.num_blocks  # not the task's block
    y = float(batch.block_positions()[0, other, 1])
    adr = int(batch.block_qpos[other])
    batch.qpos[0, adr : adr + 7] = torch.tensor([0.215, y, 0.025, 1.0, 0.0, 0.0, 0.0])  # 1 cm from the right wall, square to it
    batch.qpos[0, batch.pusher_qpos] = torch.tensor([0.16, y])
    cpu._sim.data.qpos[:] = batch.qpos[0].double().numpy()
    cpu._sim.mujoco.mj_forward(cpu._sim.model, cpu._sim.data)
    actions = torch.zeros(WORLDS, 2)
    actions[0, 0] = 1.0  # push it into the wall
    for _ in range(3):
        _, _, _, _, info = batch.step(actions)
        _, _, _, _, cpu_info = cpu.step(actions[0].numpy())
    assert cpu_info["costs"]["collisions"] >= 1
    assert info["costs"]["collisions"][0].item() == cpu_info["costs"]["collisions"]
    assert info["costs"]["collisions"][1:].tolist() == [0] * (WORLDS - 1)


def test_the_env_sampler_collects_tensors_from_the_warp_tabletop(batch):
    from mmrl.config import from_dict
    from mmrl.core.sampler import sampler_context
    from mmrl.core.weights import build_policy
    from mmrl.samplers.env import EnvSampler
    from mmrl.train.run_config import TrainConfig

    cfg = from_dict(TrainConfig, {
        "env": {"type": "tabletop_warp", "num_envs": 4, "task": "object", "device": "cpu", "privileged_state": True},
        "policy": {"type": "gaussian_mlp", "hidden_sizes": [16]},
        "sampler": {"type": "env", "max_decisions": 3},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2},
    })
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    try:
        spec = sampler.policy_spec()
        assert spec["state_dim"] == len(sampler.env.state_layout()) and spec["privileged_dim"] == spec["state_dim"]
        assert spec["instructions"] == sampler.env.instructions
        torch.manual_seed(0)
        rollout = sampler.collect(build_policy(cfg.policy, spec), num_groups=2, group_size=2, step=0)
    finally:
        sampler.close()
    assert rollout.mask.shape[0] == 4 and rollout.mask.sum() > 0
    assert torch.equal(rollout.replay["privileged"][0::2, 0], rollout.replay["privileged"][1::2, 0])  # a group's copies share their start
    assert set(rollout.info["costs"]) == {"path_length", "steps", "collisions"}
    assert sampler.env_steps == 3 * 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"obs_mode": "rgb"}, "env.obs_mode"),
        ({"task": []}, "env.task"),
        ({"task": "push everything"}, "env.task"),
        ({"task": ["spatial", "object_red", "push everything"]}, "env.task"),
        ({"layout": "grid"}, "env.layout"),
        ({"reward_mode": "shaped"}, "env.reward_mode"),
        ({"device": "tpu"}, "device"),
        ({"autoreset": "next_step"}, "autoreset"),
        ({"num_envs": 0}, "num_envs"),
    ],
)
def test_bad_options_are_config_errors_naming_the_field(kwargs, field):
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    options = {"num_envs": 2, "device": "cpu", **kwargs}
    with pytest.raises(ConfigError) as error:
        TabletopBatchedEnv(options.pop("num_envs"), **options)
    assert error.value.field == field


def test_the_env_section_refuses_async_vectorization_and_wrappers():
    from mmrl.config import from_dict
    from mmrl.envs.tabletop.batched import TabletopWarpEnvConfig

    with pytest.raises(ConfigError, match="vectorization"):
        from_dict(TabletopWarpEnvConfig, {"vectorization": "async"}).validate("env")
    with pytest.raises(ConfigError, match="wrappers"):
        from_dict(TabletopWarpEnvConfig, {"wrappers": [{"type": "gymnasium.wrappers:ClipAction"}]}).validate("env")
    with pytest.raises(ConfigError, match="task"):
        from_dict(TabletopWarpEnvConfig, {"task": "no_such_task"}).validate("env")


def test_doctor_reports_mujoco_warp_and_names_the_extra_when_it_is_missing(monkeypatch):
    from mmrl import doctor

    monkeypatch.setattr(doctor, "_version", lambda dist: None)
    assert doctor.warp_row() == ("mujoco_warp", "missing", "pip install 'mmrl[warp]' (batched MuJoCo worlds: env type tabletop_warp)")


def test_a_missing_warp_extra_skips_here_and_fails_under_mmrl_require_warp(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mujoco_warp", None)  # import mujoco_warp raises ImportError
    monkeypatch.delenv("MMRL_REQUIRE_WARP", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"mmrl\[warp\]"):
        require_warp()
    monkeypatch.setenv("MMRL_REQUIRE_WARP", "1")
    with pytest.raises(pytest.fail.Exception, match="MMRL_REQUIRE_WARP=1"):
        require_warp()
    from mmrl.envs.batched_mujoco import import_warp
    from mmrl.errors import MissingExtraError

    with pytest.raises(MissingExtraError, match=r"pip install 'mmrl\[warp\]'"):
        import_warp()
