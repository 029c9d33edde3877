"""mmrl/Tabletop-v0: spaces, determinism, task selection, success predicates, experts,
rendering backend selection."""

import os
import subprocess
import sys

import gymnasium
import numpy as np
import pytest

import mmrl.envs  # noqa: F401  (registers mmrl/Tabletop-v0)
from mmrl.envs.gym import GymEnvConfig
from mmrl.envs.tabletop.expert import expert_action
from mmrl.envs.tabletop.tasks import FAMILIES, TASKS, family_tasks, nominal_scene, resolve_tasks
from mmrl.errors import ConfigError
from mmrl.registry import ENVS

ID = "mmrl/Tabletop-v0"


def _run_expert(env, seed, task=None, noise=0.0):
    """Roll the expert out; returns (actions, last info, terminated, steps)."""
    env.reset(seed=seed, options={"task": task} if task else None)
    rng = np.random.default_rng(seed)
    actions = []
    while True:
        action = expert_action(env, noise=noise, rng=rng)
        actions.append(action)
        _, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return actions, info, terminated, reward


def _subprocess(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**environ, **(env or {})})


@pytest.fixture(scope="module")
def env():
    env = gymnasium.make(ID, task="all")
    yield env
    env.close()


# ------------------------------------------------------------------ tasks


def test_suite_has_at_least_12_tasks_in_three_families_with_distinct_instructions():
    assert len(TASKS) >= 12
    assert set(FAMILIES) == {"spatial", "object", "goal"}
    for family in FAMILIES:
        assert len(family_tasks(family)) >= 4
    instructions = [t.instruction for t in TASKS.values()]
    assert len(set(instructions)) == len(instructions)


def test_resolve_tasks_expands_families_and_rejects_unknown_names_with_the_field():
    assert resolve_tasks("spatial") == family_tasks("spatial")
    assert resolve_tasks(["object_red", "goal", "object_red"]) == ["object_red", *family_tasks("goal")]
    assert resolve_tasks("all") == list(TASKS)
    with pytest.raises(ConfigError, match="spatial_left") as err:
        resolve_tasks(["spatial_lft"], "env.kwargs.task")
    assert err.value.field == "env.kwargs.task" and err.value.value == "spatial_lft"


def test_success_predicates_count_only_the_named_block():
    spatial = TASKS["spatial_left"]
    zone = np.array([0.0, 0.1])
    blocks = np.array([[-0.15, -0.1], [0.0, -0.1], [0.15, -0.1]])
    left = spatial.target_of(blocks)
    assert left == 0 and TASKS["spatial_right"].target_of(blocks) == 2
    wrong = blocks.copy()
    wrong[2] = zone  # the right block, moved into the zone
    right = blocks.copy()
    right[0] = zone + 0.04
    assert not spatial.success(wrong, left, zone) and spatial.success(right, left, zone)
    goal = TASKS["goal_blue_top_left"]  # blue is block 1 of the goal scene
    scene = np.array([[0.0, 0.0], [-0.2, 0.2], [0.1, 0.1]])
    assert goal.success(scene, 1, None) and not TASKS["goal_red_bottom_right"].success(scene, 0, None)
    near = TASKS["goal_red_next_to_yellow"]
    assert near.success(np.array([[0.1, 0.05], [0.0, -0.2], [0.1, 0.1]]), 0, None)
    assert not near.success(np.array([[0.1, -0.05], [0.0, -0.2], [0.1, 0.1]]), 0, None)


# ------------------------------------------------------------------ env API


def test_observation_holds_image_state_and_instruction_of_the_spaces(env):
    obs, info = env.reset(seed=0)
    space = env.observation_space
    assert space.contains(obs)
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (4,) and obs["state"].dtype == np.float32
    assert obs["instruction"] == TASKS[info["task"]].instruction
    assert env.unwrapped.instructions == [t.instruction for t in TASKS.values()]
    assert env.action_space.shape == (2,) and env.action_space.dtype == np.float32
    assert env.spec.max_episode_steps == 60
    assert obs["image"].std() > 10  # a real rendered scene, not a blank frame


def test_two_cameras_give_k_images_and_image_size_is_configurable():
    env = gymnasium.make(ID, task="object_red", image_size=32, cameras=["top", "front"])
    obs, _ = env.reset(seed=1)
    assert obs["image"].shape == (2, 32, 32, 3) and env.observation_space["image"].shape == (2, 32, 32, 3)
    assert not np.array_equal(obs["image"][0], obs["image"][1])
    env.close()


def test_state_is_the_pusher_only_and_moves_with_the_action(env):
    obs, _ = env.reset(seed=2, options={"task": "object_blue"})
    before = obs["state"][:2].copy()
    for _ in range(3):
        obs, *_ = env.step(np.array([1.0, 0.0], np.float32) * -np.sign(before[0]))
    moved = obs["state"][:2] - before
    assert abs(moved[0]) > 0.05 and abs(moved[1]) < 0.01
    assert np.allclose(obs["state"][:2], env.unwrapped.pusher_position(), atol=1e-6)


def test_equal_seeds_give_equal_tasks_states_and_observations():
    a = gymnasium.make(ID, task="all")
    b = gymnasium.make(ID, task="all")
    actions = np.random.default_rng(0).uniform(-1, 1, size=(5, 2)).astype(np.float32)
    obs_a, info_a = a.reset(seed=123)
    obs_b, info_b = b.reset(seed=123)
    assert info_a["task"] == info_b["task"]
    for action in actions:
        assert np.array_equal(obs_a["image"], obs_b["image"]) and np.array_equal(obs_a["state"], obs_b["state"])
        obs_a, *_ = a.step(action)
        obs_b, *_ = b.step(action)
    obs_c, _ = a.reset(seed=124)
    assert not np.array_equal(obs_c["image"], b.reset(seed=123)[0]["image"])
    a.close()
    b.close()


def test_the_task_is_drawn_from_the_seed_and_forcing_it_matches_a_single_task_env(env):
    tasks = {env.reset(seed=s)[1]["task"] for s in range(40)}
    assert len(tasks) >= 8
    single = gymnasium.make(ID, task="goal_red_next_to_yellow")
    forced, info = env.reset(seed=7, options={"task": "goal_red_next_to_yellow"})
    alone, _ = single.reset(seed=7)
    assert info["task"] == "goal_red_next_to_yellow" and np.array_equal(forced["image"], alone["image"])
    single.close()
    with pytest.raises(ConfigError, match="options.task"):
        gymnasium.make(ID, task="spatial").reset(seed=0, options={"task": "object_red"})


def test_a_family_shares_its_layout_so_only_the_instruction_names_the_block(env):
    left, _ = env.reset(seed=5, options={"task": "spatial_left"})
    right, _ = env.reset(seed=5, options={"task": "spatial_right"})
    assert np.array_equal(left["image"], right["image"]) and left["instruction"] != right["instruction"]


def test_pushing_the_wrong_block_never_succeeds(env):
    """Replay the expert of "the block on the right" on the same scene asked for "the block on
    the left": the right block ends in the zone, and that is no success."""
    actions, info, terminated, _ = _run_expert(env, 11, "spatial_right")
    assert terminated and info["success"]
    env.reset(seed=11, options={"task": "spatial_left"})
    for action in actions:
        _, _, terminated, _, info = env.step(action)
        assert not info["success"] and not terminated


def test_success_terminates_with_reward_one_and_the_time_limit_truncates():
    env = gymnasium.make(ID, task="goal", max_episode_steps=7)
    env.reset(seed=3)
    for t in range(7):
        _, reward, terminated, truncated, info = env.step(np.zeros(2, np.float32))
        assert reward == 0.0 and not terminated and not info["success"]
    assert truncated and t == 6
    env.close()
    env = gymnasium.make(ID, task="goal")
    _, info, terminated, reward = _run_expert(env, 3)
    assert terminated and info["success"] and reward == 1.0
    env.close()


@pytest.mark.parametrize("task", ["object_blue", "goal_red_bottom_right", "spatial_left"])
def test_dense_reward_is_the_success_plus_a_potential_difference_the_expert_climbs(task):
    """The dense reward telescopes: its episode sum is the success plus Φ(end) − Φ(start),
    the step rewards besides the success equal the step's change of Φ, and the expert's
    solution climbs Φ by about its push (block and pusher end at the goal)."""
    env = gymnasium.make(ID, task=task, reward_mode="dense")
    sparse = gymnasium.make(ID, task=task)
    env.reset(seed=5)
    sparse.reset(seed=5)
    start = env.unwrapped.potential()
    rng = np.random.default_rng(5)
    total = 0.0
    while True:
        action = expert_action(env, rng=rng)
        before = env.unwrapped.potential()
        _, reward, terminated, truncated, info = env.step(action)
        _, sparse_reward, *_ = sparse.step(action)
        assert reward - sparse_reward == pytest.approx(env.unwrapped.potential() - before, abs=1e-12)
        total += reward
        if terminated or truncated:
            break
    assert info["success"] and terminated
    assert total == pytest.approx(1.0 + env.unwrapped.potential() - start, abs=1e-9)
    assert env.unwrapped.potential() - start > 0.3  # the block moved ≥ 6 cm closer (or the pusher came to it)
    env.close()
    sparse.close()


def test_dense_reward_pays_nothing_for_a_pusher_that_stands_still_and_less_for_the_wrong_block(env):
    """Standing still earns 0; the expert of another block in the same scene earns less
    shaping than the named block's expert, and no success."""
    dense = gymnasium.make(ID, task="spatial", reward_mode="dense")
    dense.reset(seed=11, options={"task": "spatial_left"})
    for _ in range(3):
        assert dense.step(np.zeros(2, np.float32))[1] == pytest.approx(0.0, abs=1e-6)
    actions, info, terminated, _ = _run_expert(env, 11, "spatial_right")
    returns = {}
    for task in ("spatial_left", "spatial_right"):
        dense.reset(seed=11, options={"task": task})
        returns[task] = sum(dense.step(a)[1] for a in actions)
    assert returns["spatial_right"] > 2.0 and returns["spatial_left"] < 1.0  # measured 2.85 and 0.62
    dense.close()


def test_render_returns_a_larger_frame_of_every_camera():
    env = gymnasium.make(ID, task="object", cameras=["top", "front"], render_mode="rgb_array", render_size=96)
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (96, 192, 3) and frame.dtype == np.uint8
    env.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"task": "stack_blocks"}, "env.kwargs.task"),
        ({"cameras": "side"}, "env.kwargs.cameras"),
        ({"image_size": 0}, "env.kwargs.image_size"),
        ({"layout": "grid"}, "env.kwargs.layout"),
        ({"layout": "nominal", "layout_noise": 0.2}, "env.kwargs.layout_noise"),
        ({"image_every": 0}, "env.kwargs.image_every"),
        ({"reward_mode": "normalized_dense"}, "env.kwargs.reward_mode"),
        ({"obs_mode": "rgbd"}, "env.kwargs.obs_mode"),
    ],
)
def test_bad_kwargs_are_config_errors_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        gymnasium.make(ID, **kwargs)
    assert err.value.field == field


def test_state_obs_mode_holds_the_simulators_state_and_a_task_one_hot_and_renders_nothing():
    env = gymnasium.make(ID, task="object", obs_mode="state")
    base = env.unwrapped
    assert set(env.observation_space.spaces) == {"state", "instruction"}
    assert env.observation_space["state"].shape == (4 + 4 * 4 + 2 + 4,) == (len(base.state_layout()),)
    obs, info = env.reset(seed=3)
    for _ in range(5):
        obs, *_ = env.step(np.array([0.6, -0.3], np.float32))
    state = dict(zip(base.state_layout(), obs["state"].tolist()))
    blocks = base.block_positions()
    for i in range(4):
        np.testing.assert_allclose([state[f"block{i}_x"], state[f"block{i}_y"]], blocks[i], atol=1e-6)
        assert state[f"block{i}_cos4yaw"] ** 2 + state[f"block{i}_sin4yaw"] ** 2 == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose([state["pusher_x"], state["pusher_y"]], base.pusher_position(), atol=1e-6)
    np.testing.assert_allclose([state["pusher_vx"], state["pusher_vy"]], base.pusher_velocity(), atol=1e-5)
    np.testing.assert_allclose([state["zone_x"], state["zone_y"]], base.zone, atol=1e-6)
    assert [state[f"task_{name}"] for name in base.task_names] == [float(name == info["task"]) for name in base.task_names]
    assert obs["instruction"] == TASKS[info["task"]].instruction
    assert all(not sim.renderers for sim in base._scenes.values())  # no frame was rendered
    env.close()


def test_state_obs_mode_has_one_size_for_every_family_of_the_env():
    # the goal scene has 3 blocks and no zone: padded to the object scene's 4 blocks, zone (0, 0)
    env = gymnasium.make(ID, task="all", obs_mode="state")
    base, dim = env.unwrapped, env.observation_space["state"].shape[0]
    assert dim == 4 + 4 * 4 + 2 + len(TASKS)
    obs, info = env.reset(options={"task": "goal_red_next_to_yellow"}, seed=0)
    state = dict(zip(base.state_layout(), obs["state"].tolist()))
    assert obs["state"].shape == (dim,) and state["block3_x"] == state["zone_x"] == state["zone_y"] == 0.0
    assert state["task_goal_red_next_to_yellow"] == 1.0 and sum(obs["state"][-len(TASKS):]) == 1.0
    env.close()


def test_state_obs_mode_leaves_the_episode_as_rgb_plays_it():
    # the same seed and actions give the same physics and rewards: only the observation differs
    runs = []
    for mode in ("rgb", "state"):
        env = gymnasium.make(ID, task="spatial", obs_mode=mode, reward_mode="dense")
        actions, info, terminated, reward = _run_expert(env, seed=5)
        runs.append((actions, env.unwrapped.block_positions(), info["success"], reward))
        env.close()
    np.testing.assert_array_equal(np.stack(runs[0][0]), np.stack(runs[1][0]))
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2] is True and runs[0][3] == runs[1][3]


def test_gym_adapter_vectorizes_it_and_equal_seeds_share_the_initial_state():
    env = ENVS.get("gym")(GymEnvConfig(id=ID, num_envs=2, kwargs={"task": "spatial", "image_size": 32}), seed=0)
    obs, _ = env.reset(seed=[9, 9])
    assert obs["image"].shape == (2, 32, 32, 3) and obs["state"].shape == (2, 4)
    assert np.array_equal(obs["image"][0], obs["image"][1]) and obs["instruction"][0] == obs["instruction"][1]
    obs, reward, terminated, truncated, info = env.step(np.zeros((2, 2), np.float32))
    assert list(info["success"]) == [False, False] and reward.shape == (2,)
    env.close()


def test_async_workers_send_every_instruction_not_only_the_first():
    # gymnasium's shared memory reads Text observations once; the adapter must use pipes.
    cfg = GymEnvConfig(id=ID, num_envs=2, vectorization="async", kwargs={"image_size": 16})
    env = ENVS.get("gym")(cfg, seed=0)
    single = gymnasium.make(ID, image_size=16)
    try:
        for seeds in ([1, 2], [3, 4], [5, 6]):
            obs, _ = env.reset(seed=seeds)
            expected = [single.reset(seed=s)[0]["instruction"] for s in seeds]
            assert list(obs["instruction"]) == expected
    finally:
        env.close()
        single.close()


# ------------------------------------------------------------------ experts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_nominal_layout_jitters_one_arrangement_by_at_most_the_noise(family):
    """LIBERO-style initial states: every object within ``layout_noise`` of the family's
    nominal arrangement (per task in the goal family), the states still differ by seed and
    the expert still solves them; the random layout spreads objects over the table."""
    noise = 0.03
    nominal = gymnasium.make(ID, task=family, layout="nominal", layout_noise=noise).unwrapped
    spread = gymnasium.make(ID, task=family).unwrapped
    offsets, random_blocks = [], []
    for seed in range(12):
        nominal.reset(seed=seed)
        center = nominal_scene(FAMILIES[family], nominal.task)
        offsets.append(nominal.block_positions() - center.blocks)
        assert np.abs(nominal.pusher_position() - center.pusher).max() <= noise + 1e-6
        spread.reset(seed=seed)
        random_blocks.append(spread.block_positions())
    offsets = np.stack(offsets)
    assert np.abs(offsets).max() <= noise + 1e-6
    assert np.ptp(offsets, axis=0).max() > noise  # the jitter is real
    assert np.ptp(np.stack(random_blocks), axis=0).max() > 0.15
    wins = [_run_expert(nominal, seed)[1]["success"] for seed in range(6)]
    assert np.mean(wins) >= 0.95


def _expert_success_rate(task: str, seeds) -> float:
    env = gymnasium.make(ID, task=task)
    wins = [_run_expert(env, seed)[1]["success"] for seed in seeds]
    env.close()
    return float(np.mean(wins))


@pytest.mark.parametrize("task", list(TASKS))
def test_expert_solves_every_task(task):
    assert _expert_success_rate(task, range(10)) >= 0.95


def test_noisy_expert_still_solves_the_tasks(env):
    wins = [_run_expert(env, seed, noise=0.3)[1]["success"] for seed in range(13)]
    assert np.mean(wins) >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("task", list(TASKS))
def test_expert_solves_every_task_over_100_seeds(task):
    assert _expert_success_rate(task, range(1000, 1100)) >= 0.95


# ------------------------------------------------------------------ import and rendering backend


def test_import_is_light_and_building_without_mujoco_names_the_extra():
    code = (
        "import sys\n"
        "import mmrl.envs, gymnasium\n"
        "assert 'mujoco' not in sys.modules, 'mujoco imported by mmrl.envs'\n"
        "sys.modules['mujoco'] = None  # as if not installed\n"
        "from mmrl.errors import MissingExtraError\n"
        "try:\n"
        "    gymnasium.make('mmrl/Tabletop-v0')\n"
        "except MissingExtraError as e:\n"
        "    print(e)\n"
    )
    proc = _subprocess(code, {"MUJOCO_GL": "egl"})
    assert proc.returncode == 0, proc.stderr
    assert "mmrl[mujoco]" in proc.stdout


def test_gl_backend_is_chosen_when_unset_and_kept_when_set():
    code = (
        "import os\n"
        "from mmrl.envs.render import select_gl_backend, chosen_backend\n"
        "backend, how = select_gl_backend()\n"
        "assert os.environ['MUJOCO_GL'] == backend and chosen_backend() == (backend, how)\n"
        "import gymnasium, mmrl.envs\n"
        "env = gymnasium.make('mmrl/Tabletop-v0', image_size=16)\n"
        "obs, _ = env.reset(seed=0)\n"
        "print(backend, obs['image'].shape)\n"
    )
    proc = _subprocess(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] in ("egl", "osmesa") and "(16, 16, 3)" in proc.stdout
    proc = _subprocess("from mmrl.envs.render import select_gl_backend\nprint(select_gl_backend())", {"MUJOCO_GL": "osmesa"})
    assert "osmesa" in proc.stdout and "was set" in proc.stdout


def test_exit_without_close_is_quiet():
    code = "import gymnasium, mmrl.envs\nenv = gymnasium.make('mmrl/Tabletop-v0', render_mode='rgb_array')\nenv.reset(seed=0)\nenv.render()\n"
    proc = _subprocess(code, {"MUJOCO_GL": "egl"})
    assert proc.returncode == 0 and "Exception ignored" not in proc.stderr, proc.stderr


def test_image_every_renders_on_chunk_starts_and_repeats_the_frame_in_between():
    """``image_every: N`` renders at the reset and every N-th step; in between the last
    frame repeats while the state stays fresh — the frames a chunked policy looks at are
    those of an env rendering every step."""
    every, sparse = gymnasium.make(ID, task="object_red", image_size=32), gymnasium.make(ID, task="object_red", image_size=32, image_every=3)
    a, _ = every.reset(seed=5)
    b, _ = sparse.reset(seed=5)
    assert np.array_equal(a["image"], b["image"])
    last = b["image"].copy()
    rng = np.random.default_rng(0)
    for t in range(1, 10):
        action = rng.uniform(-1, 1, 2).astype(np.float32)
        a, *_ = every.step(action)
        b, *_ = sparse.step(action)
        assert np.array_equal(a["state"], b["state"])
        if t % 3 == 0:
            assert np.array_equal(a["image"], b["image"]), t
            last = b["image"].copy()
        else:
            assert np.array_equal(b["image"], last), t
    every.close()
    sparse.close()


def test_a_chunked_policy_samples_the_same_rollout_with_image_every_set_to_its_chunk():
    pytest.importorskip("transformers")
    import torch

    from mmrl.config import from_dict
    from mmrl.core.weights import build_policy
    from mmrl.core.sampler import sampler_context
    from mmrl.samplers.env import EnvSampler
    from mmrl.train.run_config import TrainConfig

    rollouts = []
    for every in (1, 3):
        cfg = from_dict(TrainConfig, {
            "name": "t", "env": {"type": "gym", "id": ID, "num_envs": 4, "max_episode_steps": 9, "kwargs": {"task": "object", "image_size": 24, "image_every": every}},
            "sampler": {"type": "env"}, "rewards": [{"type": "success"}],
            "policy": {"type": "token_vla", "action_chunk": 3, "backbone": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 8]}},
            "log": {"progress": False, "tensorboard": False},
        })
        sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
        torch.manual_seed(0)
        policy = build_policy(cfg.policy, sampler.policy_spec())
        rollouts.append(sampler.collect(policy, num_groups=2, group_size=2, step=0))
        sampler.close()
    dense, sparse = rollouts
    torch.testing.assert_close(sparse.old_logp, dense.old_logp)

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from leaves(value, prefix + key + ".")
            elif isinstance(value, torch.Tensor):
                yield prefix + key, value

    dense_leaves, sparse_leaves = dict(leaves(dense.replay)), dict(leaves(sparse.replay))
    assert any(v.dtype == torch.uint8 for v in dense_leaves.values())  # the images are in the replay
    for key, value in dense_leaves.items():
        assert torch.equal(sparse_leaves[key], value), key


def test_costs_count_the_pushers_travel_the_steps_and_the_collisions_so_far():
    env = gymnasium.make("mmrl/Tabletop-v0", task="spatial_left", image_size=16)
    seen_collision = False
    for seed in range(4):
        _, info = env.reset(seed=seed)
        assert info["costs"] == {"path_length": 0.0, "steps": 0, "collisions": 0}
        rng = np.random.default_rng(seed)
        travelled, previous = 0.0, info["costs"]
        position = env.unwrapped.pusher_position()
        for t in range(1, 40):
            _, _, terminated, truncated, info = env.step(rng.uniform(-1, 1, 2).astype(np.float32))
            travelled += float(np.linalg.norm(env.unwrapped.pusher_position() - position))
            position = env.unwrapped.pusher_position()
            costs = info["costs"]
            assert costs["steps"] == t and costs["path_length"] == pytest.approx(travelled, rel=1e-12)
            assert costs["collisions"] - previous["collisions"] in (0, 1)
            previous = costs
            if terminated or truncated:
                break
        seen_collision |= previous["collisions"] > 0
    assert seen_collision  # random pushing drives some block into a wall or the pusher into a non-target block
    env.close()
