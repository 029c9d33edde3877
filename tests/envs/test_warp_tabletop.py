"""The tabletop suite on MuJoCo Warp (env type tabletop_warp) against mmrl/Tabletop-v0: the
same tasks and initial states from the same seeds, states equal to float32 rounding until the
pusher touches a block, the scripted expert's success (for one family and for a task list
mixing all three), masked and same-step resets, costs, config errors, the env sampler
on it, and ``obs_mode: rgb``: what a policy sees in MuJoCo Warp's ray-traced images against
the CPU env's OpenGL ones.

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
from mmrl.envs.tabletop.tasks import TASKS
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


def test_a_captured_physics_graph_steps_every_world_as_launching_each_kernel_does_across_resets():
    """The captured graph replays the same kernels on the same arrays, so what it steps is
    bit for bit what launching each kernel from Python steps, also after resets write the state
    through the torch views and after a per-world model field replaces an array. Exact on any
    CPU: both sides run the same compiled kernels on the same arrays, each on one thread in one
    order (warp's CPU backend), so only the launching differs."""
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    envs = [TabletopBatchedEnv(4, task="spatial", reward_mode="dense", max_episode_steps=6, device="cpu", capture_graph=c) for c in (True, False)]
    for env in envs:
        env.reset(seed=[5, 6, 7, 8])
    actions = torch.rand(14, 4, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
    finals = 0
    for t, action in enumerate(actions):
        if t == 9:  # a new array for a model field (the pushers' damping): the graph is captured again
            for env in envs:
                env.per_world("dof_damping")[1:, :2] *= 4
        (a, ra, ta, ua, ia), (b, rb, tb, ub, ib) = (env.step(action) for env in envs)
        assert torch.equal(a["state"], b["state"]) and torch.equal(ra, rb) and torch.equal(ta, tb) and torch.equal(ua, ub)
        assert all(torch.equal(ia["costs"][k], ib["costs"][k]) for k in ia["costs"])
        finals += int(ia["_final"].sum()) if "_final" in ia else 0
    assert finals >= 4  # every world was reset inside the batch at least once
    assert envs[0]._graph is not None and envs[1]._graph is None
    assert torch.equal(envs[0].qpos, envs[1].qpos) and torch.equal(envs[0].qvel, envs[1].qvel)
    with pytest.raises(ConfigError) as error:
        TabletopBatchedEnv(1, device="cpu", capture_graph="yes")
    assert error.value.field == "capture_graph"


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
        ({"obs_mode": "depth"}, "env.obs_mode"),
        ({"obs_mode": "rgb", "cameras": ["top", "side"]}, "env.cameras"),
        ({"obs_mode": "rgb", "cameras": []}, "env.cameras"),
        ({"obs_mode": "rgb", "image_size": 4}, "env.image_size"),
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
    from mmrl.commands import doctor

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


# ------------------------------------------------------------------ obs_mode: rgb


@pytest.fixture(scope="module")
def rgb():
    """``mixed`` with ``obs_mode: rgb`` and both cameras: the same worlds, rendered."""
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    env = TabletopBatchedEnv(WORLDS, task=MIXED, obs_mode="rgb", cameras=["top", "front"], privileged_state=True, autoreset="disabled", device="cpu")
    yield env
    env.close()


# What a policy sees, compared by colour segmentation (tests below). Both renderers draw the same
# state through the same pinhole cameras and sample each pixel once, at its centre (OpenGL
# without multisampling fills a pixel whose centre a triangle covers; the ray tracer shoots its
# ray through the centre), with the same flat material colours, lights and headlight and no
# shadows. So their masks can differ only in pixels whose centre lies within rounding of an
# outline (float32 on both sides; 1/256 px in GL's fixed-point rasterizer). Allowed: one whole
# row of such pixels along one side of a mask of area A (side ~ sqrt(A)), in one image and not
# the other. That moves the mask's centroid by at most half a pixel and leaves IoU >= A / (A +
# sqrt(A)) = sqrt(A) / (sqrt(A) + 1): 0.75 at the smallest mask compared (MIN_AREA = 9, 3 x 3),
# 0.86 at a 64-pixel block's ~36 px from the top camera.
CENTROID_TOLERANCE = 0.5  # pixels
MIN_AREA = 9  # pixels: smaller masks (a block hidden behind another) are checked for being small in both
# A mask's dominant colour (the CPU image's most frequent pixel value in it, and the warp image's
# at those pixels: one face of the object) is Lambert shading of one material: headlight ambient
# + headlight diffuse + the sun's diffuse, each rounded to 8 bits its own way by each renderer
# (at most a level each).
COLOUR_TOLERANCE = 3  # 8-bit levels per channel
RGB_STEPS = 12  # scripted expert steps before the second comparison: blocks have been pushed


def _material_labels(image: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """Each pixel's material: the index of the nearest shaded colour ``k * rgb`` (k in
    [0.3, 2], clipped at 1, as light scales a flat colour) among ``colours`` [M, 3]; -1 for
    the black background."""
    scales = np.linspace(0.3, 2.0, 35)
    shaded = np.clip(colours[:, None, :] * scales[None, :, None], 0.0, 1.0).reshape(-1, 3) * 255
    shaded = np.concatenate([shaded, np.zeros((1, 3))])
    nearest = ((image[..., None, :].astype(np.float64) - shaded) ** 2).sum(-1).argmin(-1)
    return np.where(nearest == len(shaded) - 1, -1, nearest // len(scales))


def _dominant_colour(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    values, counts = np.unique(image[mask], axis=0, return_counts=True)
    return values[counts.argmax()].astype(int)


def _compare_what_a_policy_sees(cpu_images: np.ndarray, warp_images: np.ndarray, sim, objects: list[str]) -> list[tuple]:
    """Per camera and per object (a block colour, the pusher, the zone): the masks of the
    object's material in the two images; asserts the tolerances above and returns
    ``(centroid error, IoU, dominant colour difference)`` of each mask compared."""
    model = sim.model
    names = [model.material(i).name for i in range(model.nmat)]
    colours = model.mat_rgba[:, :3].astype(np.float64)
    figures = []
    for camera, (cpu, warp) in enumerate(zip(cpu_images, warp_images)):
        cpu_labels, warp_labels = _material_labels(cpu, colours), _material_labels(warp, colours)
        rows, cols = np.indices(cpu.shape[:2])
        for name in objects:
            a, b = cpu_labels == names.index(name), warp_labels == names.index(name)
            where = f"camera {camera}, {name}: CPU {a.sum()} px, warp {b.sum()} px"
            if a.sum() < MIN_AREA:
                assert b.sum() < MIN_AREA + np.sqrt(MIN_AREA), where
                continue
            assert b.sum() > 0, where
            centroid = lambda m: np.array([rows[m].mean(), cols[m].mean()])  # noqa: E731
            error = float(np.abs(centroid(a) - centroid(b)).max())
            iou = float((a & b).sum() / (a | b).sum())
            assert error <= CENTROID_TOLERANCE, f"{where}: centroids {centroid(a)} and {centroid(b)}"
            assert iou >= np.sqrt(a.sum()) / (np.sqrt(a.sum()) + 1), f"{where}: IoU {iou:.3f}"
            # the CPU mask's most frequent colour, and the warp image's at those pixels (the same face)
            dominant_cpu = _dominant_colour(cpu, a & b)
            dominant_warp = _dominant_colour(warp, a & b & (cpu == dominant_cpu).all(-1))
            assert np.abs(dominant_cpu - dominant_warp).max() <= COLOUR_TOLERANCE, f"{where}: {dominant_cpu} and {dominant_warp}"
            for dominant in (dominant_cpu, dominant_warp):  # the colour a policy sees there is the block's
                assert _material_labels(dominant[None].astype(np.uint8), colours)[0] == names.index(name), f"{where}: {dominant}"
            figures.append((error, iou, int(np.abs(dominant_cpu - dominant_warp).max())))
    return figures


def _cpu_scene_objects(env: TabletopEnv) -> list[str]:
    from mmrl.envs.tabletop.tasks import FAMILIES

    family = FAMILIES[env.task.family]
    return sorted(set(family.colours)) + ["pusher"] + (["green"] if family.zone else [])


def _put_warp_state(env: TabletopEnv, batch, w: int) -> None:
    """Give the CPU env world ``w``'s state (pusher, its family's blocks, the zone)."""
    sim, qpos = env._sim, batch.qpos[w].double().cpu().numpy()
    sim.data.qpos[sim.pusher_qpos] = qpos[batch.pusher_qpos.cpu().numpy()]
    for i, adr in enumerate(sim.block_qpos):
        start = int(batch.block_qpos[i])
        sim.data.qpos[adr : adr + 7] = qpos[start : start + 7]
    if sim.zone_mocap is not None:
        sim.data.mocap_pos[sim.zone_mocap] = batch.mocap_pos[w, batch.zone_mocap].double().cpu().numpy()
    sim.mujoco.mj_forward(sim.model, sim.data)


def test_rgb_observations_have_the_cpu_envs_entries_as_tensors_on_the_simulators_device(rgb):
    obs, _ = rgb.reset(seed=list(range(WORLDS)))
    cpu = TabletopEnv(task=MIXED, cameras=["top", "front"], privileged_state=True)
    cpu_obs, _ = cpu.reset(seed=0)
    assert set(obs) == set(cpu_obs) == set(rgb.single_observation_space.spaces)
    assert obs["image"].shape == (WORLDS, 2, 64, 64, 3) and obs["image"].dtype == torch.uint8 and obs["image"].device == rgb.device
    assert rgb.single_observation_space["image"] == cpu.observation_space["image"]
    assert obs["state"].shape == (WORLDS, 4) and torch.equal(obs["state"], torch.cat([rgb.pusher_position(), rgb.pusher_velocity()], 1))
    assert torch.equal(obs["privileged"], rgb.full_state()) and obs["instruction"][0] == cpu_obs["instruction"]
    np.testing.assert_allclose(obs["state"][0].numpy(), cpu_obs["state"], atol=1e-6)
    cpu.close()


def test_rendering_leaves_the_physics_as_the_state_batch_steps_it(rgb, mixed):
    actions = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (5, WORLDS, 2)).astype(np.float32))
    for env in (rgb, mixed):
        env.reset(seed=list(range(WORLDS)))
        for a in actions:
            env.step(a)
    assert torch.equal(rgb.qpos, mixed.qpos) and torch.equal(rgb.qvel, mixed.qvel)


def test_what_a_policy_sees_in_warps_images_agrees_with_the_cpu_envs(rgb):
    """Every world of a mixed batch (all three families; a spatial world's blocks white, as in
    its own scene), at the reset (the CPU env's own observation) and after RGB_STEPS scripted
    steps (the warp world's state given to the CPU env), both cameras at 64 px: per block
    colour, the pusher and the zone, mask centroids within CENTROID_TOLERANCE and IoU above
    sqrt(A) / (sqrt(A) + 1), dominant colours within COLOUR_TOLERANCE and of the block's material.
    Measured (mujoco_warp 3.17.0 on warp's CPU backend against MuJoCo 3 on EGL, 279 masks):
    at most 0.16 px between centroids, IoU at least 0.93 (one pixel of a 14-pixel mask),
    dominant colours at most 1 level apart; 269 of the 279 masks pixel for pixel equal."""
    seeds = list(range(WORLDS))
    obs, _ = rgb.reset(seed=seeds)
    cpu = TabletopEnv(task=MIXED, cameras=["top", "front"])
    assert {TASKS[name].family for name in rgb.world_tasks} == {"spatial", "object", "goal"}
    figures, start = [], rgb.block_positions().clone()
    for w, seed in enumerate(seeds):
        cpu_obs, _ = cpu.reset(seed=seed)
        figures += _compare_what_a_policy_sees(cpu_obs["image"], obs["image"][w].numpy(), cpu._sim, _cpu_scene_objects(cpu))
    from mmrl.envs.tabletop.batched import expert_actions

    for _ in range(RGB_STEPS):
        obs, *_ = rgb.step(expert_actions(rgb))
    moved = torch.linalg.vector_norm(rgb.block_positions() - start, dim=-1).amax(-1) > 0.01
    assert moved.sum() >= WORLDS // 4  # the expert has pushed blocks in many worlds
    for w, seed in enumerate(seeds):
        cpu.reset(seed=seed)
        _put_warp_state(cpu, rgb, w)
        cpu_images = cpu._sim.render(cpu.cameras, cpu.image_size, cpu.image_size)
        figures += _compare_what_a_policy_sees(cpu_images, obs["image"][w].numpy(), cpu._sim, _cpu_scene_objects(cpu))
    cpu.close()
    assert len(figures) >= 2 * WORLDS * 2 * 4  # two times, two cameras, >= 4 objects a world


def test_one_camera_gives_images_of_one_camera_per_world():
    require_warp()
    from mmrl.envs.tabletop.batched import TabletopBatchedEnv

    env = TabletopBatchedEnv(2, task="goal", obs_mode="rgb", cameras="front", image_size=32, device="cpu")
    obs, _ = env.reset(seed=[5, 6])
    assert obs["image"].shape == (2, 32, 32, 3) and env.single_observation_space["image"].shape == (32, 32, 3)
    assert not torch.equal(obs["image"][0], obs["image"][1])  # each world its own scene
    env.close()


def test_the_env_sampler_collects_images_from_the_warp_tabletop_for_a_vla():
    require_warp()
    from mmrl.config import from_dict
    from mmrl.core.sampler import sampler_context
    from mmrl.core.weights import build_policy
    from mmrl.samplers.env import EnvSampler
    from mmrl.train.run_config import TrainConfig

    cfg = from_dict(TrainConfig, {
        "env": {"type": "tabletop_warp", "num_envs": 4, "task": "object", "device": "cpu", "obs_mode": "rgb", "image_size": 32},
        "policy": {"type": "flow_vla", "action_chunk": 2, "backbone": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 16], "patch_grid": 4}},
        "sampler": {"type": "env", "max_decisions": 2},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2},
    })
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    try:
        spec = sampler.policy_spec()
        assert spec["image_shape"] == [32, 32, 3]
        torch.manual_seed(0)
        rollout = sampler.collect(build_policy(cfg.policy, spec), num_groups=2, group_size=2, step=0)
    finally:
        sampler.close()
    assert rollout.mask.shape[0] == 4 and rollout.mask.sum() > 0
    assert sampler.env_steps == 2 * 2 * 4


def test_the_throughput_benchmark_compares_larger_batches_with_the_cpu_envs_rate_at_its_cap():
    """benchmarks/warp_tabletop.py throughput --cpu-max-worlds: above the cap the CPU vector
    env is not built (at GPU batch sizes it would not fit in memory) and the ratio is taken
    against its rate at the largest count measured; a cap below every count is refused."""
    import re
    import subprocess
    import sys

    require_warp()
    from tests.conftest import ROOT

    script = [sys.executable, str(ROOT / "benchmarks" / "warp_tabletop.py"), "throughput", "--steps", "1"]
    done = subprocess.run([*script, "--worlds", "4", "2", "--cpu-max-worlds", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| ([\d,]+)( \(at 2\))? \| ([\d,]+) \| ([\d.]+) \|$", done.stdout, re.M)
    assert [(n, at) for n, _, at, _, _ in rows] == [("2", ""), ("4", " (at 2)")]
    assert rows[0][1] == rows[1][1]  # the same CPU rate stands for both
    refused = subprocess.run([*script, "--worlds", "4", "--cpu-max-worlds", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode != 0 and "--cpu-max-worlds 2" in refused.stderr


def test_the_rollout_overhead_benchmark_steps_the_warp_worlds_by_hand_as_the_env_sampler_does():
    """benchmarks/rollout_overhead.py --env tabletop_warp:TASK: the hand loop steps the same
    worlds on the state tensor until every episode has ended, so both sides of the ratio count
    the same env steps for the same groups (here every episode runs to its 3-step limit)."""
    import importlib.util

    require_warp()
    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("rollout_overhead", ROOT / "benchmarks" / "rollout_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sampler, policy = bench.build("tabletop_warp:spatial", 8, 4, max_episode_steps=3)
    try:
        seeds = [s for g in range(2) for s in [1000 + g] * 4]
        assert bench.hand_loop(sampler.env, policy, seeds, sampler.action_low, sampler.action_high) == 8 * 3
        before = sampler.env_steps
        sampler.collect(policy, 2, 4, 0)
        assert sampler.env_steps - before == 8 * 3
        rate_sampler, rate_hand = bench.interleaved_rates(sampler, policy, bench.hand_loop, 2, 4, rounds=1)
        assert rate_sampler > 0 and rate_hand > 0
    finally:
        sampler.close()
