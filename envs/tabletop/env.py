"""``mmrl/Tabletop-v0``: language-conditioned pushing on a MuJoCo table, rendered on the CPU.

A floating cylindrical pusher (two slide joints, velocity actuators) pushes 5 cm blocks
(free bodies) on a walled table; flat coloured zones are visual only. The tasks, their
instructions, initial-state distributions and success predicates are in
:mod:`mmrl.envs.tabletop.tasks`.

- action: ``Box(-1, 1, (2,), float32)``, the pusher's planar velocity command as a fraction
  of ``MAX_SPEED`` (0.4 m/s); one control step lasts ``CONTROL_DT`` (0.1 s = 20 physics
  steps of 5 ms), so the pusher moves at most 4 cm per step.
- observation (``obs_mode``, ManiSkill's names): ``rgb`` (the default), ``Dict(image=uint8
  (H, W, 3) or (K, H, W, 3) for K cameras, state=float32 [x, y, vx, vy] of the pusher,
  instruction=Text)``; block positions are not in the state, so the policy sees the blocks
  only in the image. ``state``: ``Dict(state=float32 [D], instruction=Text)``, no image (and
  no rendering): the pusher's [x, y, vx, vy], then for each block [x, y, cos 4θ, sin 4θ] (θ its
  yaw; a square looks the same every quarter turn), the zone's centre (0, 0 in a family
  without one), and a one-hot of the episode's task among the env's tasks (the instruction as
  a state policy can read it). Blocks are padded with zeros to the most any of the env's
  families has, so every task of a multi-family env gives the same D (``state_layout()``
  names each entry). ``privileged_state=True`` adds that vector as ``"privileged"`` to either
  mode's observation: the env sampler keeps it for a critic that reads it (asymmetric
  actor-critic) and never shows it to the policy.
- reward (``reward_mode``, ManiSkill's names): ``sparse`` (the default), 1 on the step that
  solves the task, else 0; ``dense``, that plus potential-based shaping (Ng et al., 1999)
  F = Φ(s') − Φ(s) with Φ = −(‖block − goal‖ + ½·max(‖pusher − block‖ − contact, 0)) /
  ``DENSE_SCALE``: the named block's distance to the task's goal point and the pusher's gap
  to that block, so pushing the right block towards its goal pays as it happens. The shaping
  telescopes over an episode (a policy cannot farm it) and is 0 at the reset.
  ``info["success"]`` every step and ``info["task"]`` the task's name.
- costs: ``info["costs"]`` every step, the episode's so far (GRAPE's trajectory costs):
  ``path_length``, metres the pusher travelled (the sum of its displacement over control
  steps); ``steps``, control steps taken; ``collisions``, control steps that ended with the
  pusher touching a block other than the task's target or a block touching a wall (contacts
  as MuJoCo reports them after the step's last physics step). The episode terminates on success and is
  truncated at the time limit (60 steps unless ``max_episode_steps`` says otherwise).
- reset seed → task (when the env has several) and initial state, so equal seeds give equal
  tasks, states and observations. ``reset(options={"task": name})`` picks the task (one of
  the env's) instead of the seed; the state then depends on the seed only, as in an env of
  that single task.

MuJoCo is imported when the first env is built (``pip install 'mmrl[mujoco]'``), after
:mod:`mmrl.envs.render` has chosen an offscreen GL backend.
"""

from __future__ import annotations

import atexit
import string
import weakref
from pathlib import Path

import gymnasium
import numpy as np
from gymnasium import spaces

from mmrl.envs.tabletop.tasks import BLOCK_HALF, FAMILIES, LAYOUTS, PUSHER_RADIUS, TASKS, Scene, Task, resolve_tasks, sample_scene
from mmrl.errors import ConfigError, MissingExtraError

MAX_SPEED = 0.4  # m/s at |action| = 1
PHYSICS_STEPS = 20  # per control step; with the 5 ms timestep of the scenes, CONTROL_DT = 0.1 s
CONTROL_DT = 0.1
BLOCK_Z = 0.025
CAMERAS = ("top", "front")
REWARD_MODES = ("sparse", "dense")
OBS_MODES = ("rgb", "state")
BLOCK_HALF_DIAGONAL = float(np.sqrt(2.0) * BLOCK_HALF)
DENSE_SCALE = 0.2  # metres of potential per unit of reward: a typical push (~0.2 m) is worth about the success
INSTRUCTION_CHARSET = string.ascii_letters + string.digits + " -,.'"
MAX_INSTRUCTION_LENGTH = 128


def _import_mujoco():
    from mmrl.envs.render import select_gl_backend

    select_gl_backend()
    try:
        import mujoco
    except ImportError:
        raise MissingExtraError("mujoco", "mujoco", "env mmrl/Tabletop-v0") from None
    return mujoco


def scene_path(family: str) -> Path:
    """The MJCF file of a family's scene (package data of ``mmrl.assets``)."""
    import mmrl.assets

    return Path(mmrl.assets.__file__).parent / "tabletop" / FAMILIES[family].scene


_live_simulations: "weakref.WeakSet[_Simulation]" = weakref.WeakSet()
_exit_hook = False


def _close_live_simulations() -> None:
    for sim in list(_live_simulations):
        sim.close()


class _Simulation:
    """One family's MuJoCo model and data, and a renderer per image size in use."""

    def __init__(self, family: str):
        mujoco = self.mujoco = _import_mujoco()
        self.model = mujoco.MjModel.from_xml_path(str(scene_path(family)))
        self.model.vis.quality.shadowsize = 0  # shadows and multisampling cost most of a CPU frame
        self.model.vis.quality.offsamples = 0
        self.data = mujoco.MjData(self.model)
        self.num_blocks = len(FAMILIES[family].colours)
        joints = [self.model.joint(f"block_{i}") for i in range(self.num_blocks)]
        self.block_qpos = np.array([j.qposadr[0] for j in joints])
        self.pusher_qpos = np.array([self.model.joint(n).qposadr[0] for n in ("pusher_x", "pusher_y")])
        self.pusher_qvel = np.array([self.model.joint(n).dofadr[0] for n in ("pusher_x", "pusher_y")])
        self.zone_mocap = int(self.model.body("zone").mocapid[0]) if FAMILIES[family].zone else None
        self.pusher_geom = self.model.geom("pusher").id
        self.block_geoms = np.array([self.model.geom(f"block_{i}").id for i in range(self.num_blocks)])
        self.wall_geoms = {self.model.geom(f"wall_{side}").id for side in ("top", "bottom", "left", "right")}
        self.renderers: dict[tuple[int, int], object] = {}
        _live_simulations.add(self)

    def reset(self, scene: Scene) -> None:
        mujoco, data = self.mujoco, self.data
        mujoco.mj_resetData(self.model, data)
        data.qpos[self.pusher_qpos] = scene.pusher
        for i, adr in enumerate(self.block_qpos):
            half = scene.yaw[i] / 2
            data.qpos[adr : adr + 7] = [*scene.blocks[i], BLOCK_Z, np.cos(half), 0.0, 0.0, np.sin(half)]
        if self.zone_mocap is not None:
            data.mocap_pos[self.zone_mocap, :2] = scene.zone
        mujoco.mj_forward(self.model, data)

    def step(self, velocity: np.ndarray) -> None:
        self.data.ctrl[:] = velocity
        self.mujoco.mj_step(self.model, self.data, nstep=PHYSICS_STEPS)

    def blocks(self) -> np.ndarray:
        return np.stack([self.data.qpos[adr : adr + 2] for adr in self.block_qpos])

    def collision(self, target: int) -> bool:
        """Whether a current contact is the pusher on a block other than ``target``, or a
        block on a wall."""
        others = {int(g) for i, g in enumerate(self.block_geoms) if i != target}
        blocks = {int(g) for g in self.block_geoms}
        for contact in self.data.contact[: self.data.ncon]:
            pair = {int(contact.geom1), int(contact.geom2)}
            if self.pusher_geom in pair and pair & others:
                return True
            if pair & blocks and pair & self.wall_geoms:
                return True
        return False

    def render(self, cameras: tuple[str, ...], height: int, width: int) -> np.ndarray:
        global _exit_hook
        renderer = self.renderers.get((height, width))
        if renderer is None:
            vis = self.model.vis.global_
            vis.offwidth, vis.offheight = max(vis.offwidth, width), max(vis.offheight, height)
            renderer = self.renderers[(height, width)] = self.mujoco.Renderer(self.model, height, width)
            if not _exit_hook:
                # EGL registers the termination of its display at exit when the first
                # context is made; renderers still open after that fail noisily in
                # __del__. Registered later, this hook runs earlier and closes them.
                atexit.register(_close_live_simulations)
                _exit_hook = True
        frames = []
        for camera in cameras:
            renderer.update_scene(self.data, camera=camera)
            frames.append(renderer.render())
        return np.stack(frames)

    def close(self) -> None:
        for renderer in self.renderers.values():
            renderer.close()
        self.renderers.clear()


class TabletopEnv(gymnasium.Env):
    """Language-conditioned planar pushing; see the module docstring."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": int(1 / CONTROL_DT)}

    def __init__(
        self,
        task: str | list[str] = "all",
        image_size: int = 64,
        cameras: str | list[str] = "top",
        render_mode: str | None = None,
        render_size: int = 256,
        layout: str = "random",
        layout_noise: float = 0.03,
        image_every: int = 1,
        terminate_on_success: bool = True,
        reward_mode: str = "sparse",
        obs_mode: str = "rgb",
        privileged_state: bool = False,
    ):
        """``task``: a task name, a family (spatial, object, goal), ``all``, or a list of
        these; ``image_size``: side of the observed images; ``cameras``: one camera name or a
        list (``top``, ``front``); ``render_size``: side of ``render()`` frames (all cameras
        side by side); ``layout``: the initial-state distribution, ``random`` (anywhere on the
        table) or ``nominal`` (each coordinate within ``layout_noise`` metres of one fixed
        arrangement per scene, LIBERO-style); see :mod:`mmrl.envs.tabletop.tasks`;
        ``image_every``: render the observed images only on every N-th control step since
        the reset (and at the reset), repeating the last frame in between — set it to the
        policy's action chunk when the policy looks only at the observation that starts each
        chunk, and the env skips (N-1)/N of its rendering (state and instruction stay fresh);
        ``terminate_on_success``: false lets an episode go on after success until its time
        limit (``info["success"]`` says each step whether the task is solved then), as an env
        that reports no success must when a learned success detector watches it;
        ``reward_mode``: ``sparse`` (1 at success) or ``dense`` (plus potential-based shaping
        towards the goal, see the module docstring); ``obs_mode``: ``rgb`` (images, the
        pusher's state and the instruction) or ``state`` (the full simulator state and a task
        one-hot instead of images; nothing is rendered), see the module docstring;
        ``privileged_state``: also return that state vector as the observation's
        ``"privileged"`` entry, which the env sampler keeps for a critic (``critic.inputs:
        privileged``, asymmetric actor-critic) and never hands to the policy."""
        self.task_names = resolve_tasks(task, "env.kwargs.task")
        names = [cameras] if isinstance(cameras, str) else list(cameras)
        if not names or any(c not in CAMERAS for c in names):
            raise ConfigError("env.kwargs.cameras", cameras, f"expected one or a list of {', '.join(CAMERAS)}")
        for field, value in (("image_size", image_size), ("render_size", render_size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 8 <= value <= 2048:
                raise ConfigError(f"env.kwargs.{field}", value, "expected an integer in [8, 2048]")
        if layout not in LAYOUTS:
            raise ConfigError("env.kwargs.layout", layout, f"expected one of {', '.join(LAYOUTS)}")
        if isinstance(layout_noise, bool) or not isinstance(layout_noise, (int, float)) or not 0.0 <= layout_noise <= 0.05:
            raise ConfigError("env.kwargs.layout_noise", layout_noise, "expected a number of metres in [0, 0.05]")
        self.layout, self.layout_noise = layout, float(layout_noise)
        if not isinstance(image_every, int) or isinstance(image_every, bool) or not 1 <= image_every <= 1000:
            raise ConfigError("env.kwargs.image_every", image_every, "expected an integer in [1, 1000] (control steps between rendered images)")
        self.image_every = image_every
        if not isinstance(terminate_on_success, bool):
            raise ConfigError("env.kwargs.terminate_on_success", terminate_on_success, "expected true or false")
        self.terminate_on_success = terminate_on_success
        if reward_mode not in REWARD_MODES:
            raise ConfigError("env.kwargs.reward_mode", reward_mode, f"expected one of {', '.join(REWARD_MODES)}")
        self.reward_mode = reward_mode
        if obs_mode not in OBS_MODES:
            raise ConfigError("env.kwargs.obs_mode", obs_mode, f"expected one of {', '.join(OBS_MODES)}")
        self.obs_mode = obs_mode
        if not isinstance(privileged_state, bool):
            raise ConfigError("env.kwargs.privileged_state", privileged_state, "expected true or false")
        self.privileged_state = privileged_state
        self._elapsed = 0
        self._images: np.ndarray | None = None
        if render_mode not in (None, "rgb_array"):
            raise ConfigError("render_mode", render_mode, "expected null or 'rgb_array'")
        _import_mujoco()  # fail at make, not at the first reset, when the extra is missing
        self.cameras = tuple(names)
        self.image_size, self.render_size, self.render_mode = image_size, render_size, render_mode
        self.instructions = list(dict.fromkeys(TASKS[name].instruction for name in self.task_names))
        image_shape = (image_size, image_size, 3) if len(names) == 1 else (len(names), image_size, image_size, 3)
        self.max_blocks = max(len(FAMILIES[TASKS[name].family].colours) for name in self.task_names)
        text = spaces.Text(MAX_INSTRUCTION_LENGTH, charset=INSTRUCTION_CHARSET)
        full = spaces.Box(-np.inf, np.inf, (len(self.state_layout()),), np.float32)
        if obs_mode == "state":
            observed = {"state": full, "instruction": text}
        else:
            observed = {"image": spaces.Box(0, 255, image_shape, np.uint8), "state": spaces.Box(-np.inf, np.inf, (4,), np.float32), "instruction": text}
        if privileged_state:
            observed["privileged"] = full
        self.observation_space = spaces.Dict(observed)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._scenes: dict[str, _Simulation] = {}
        self._sim: _Simulation | None = None
        self.task: Task = TASKS[self.task_names[0]]
        self.target = 0
        self.zone: np.ndarray | None = None
        self.costs: dict[str, float] = {}

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        name = (options or {}).get("task")
        if name is not None:
            if name not in self.task_names:
                raise ConfigError("options.task", name, f"not a task of this env; its tasks: {', '.join(self.task_names)}")
        elif len(self.task_names) > 1:
            name = self.task_names[int(self.np_random.integers(len(self.task_names)))]
        else:
            name = self.task_names[0]
        self.task = TASKS[name]
        scene = sample_scene(FAMILIES[self.task.family], self.task, self.np_random, layout=self.layout, noise=self.layout_noise)
        if self.task.family not in self._scenes:
            self._scenes[self.task.family] = _Simulation(self.task.family)
        self._sim = self._scenes[self.task.family]
        self._sim.reset(scene)
        self.target = self.task.target_of(scene.blocks)
        self.zone = scene.zone
        self._elapsed = 0
        self.costs = {"path_length": 0.0, "steps": 0, "collisions": 0}
        return self._observation(), {"success": False, "task": name, "costs": dict(self.costs)}

    def step(self, action):
        if self._sim is None:
            raise RuntimeError("call reset() before step()")
        command = np.clip(np.asarray(action, dtype=np.float64).reshape(2), -1.0, 1.0)
        before = self.pusher_position()
        potential = self.potential() if self.reward_mode == "dense" else 0.0
        self._sim.step(command * MAX_SPEED)
        self._elapsed += 1
        self.costs = {
            "path_length": self.costs["path_length"] + float(np.linalg.norm(self.pusher_position() - before)),
            "steps": self._elapsed,
            "collisions": self.costs["collisions"] + int(self._sim.collision(self.target)),
        }
        success = self.task.success(self._sim.blocks(), self.target, self.zone)
        reward = float(success)
        if self.reward_mode == "dense":
            reward += self.potential() - potential
        return self._observation(), reward, success and self.terminate_on_success, False, {"success": success, "task": self.task.name, "costs": dict(self.costs)}

    def render(self):
        if self.render_mode != "rgb_array" or self._sim is None:
            return None
        frames = self._sim.render(self.cameras, self.render_size, self.render_size)
        return np.concatenate(list(frames), axis=1)

    def close(self):
        for sim in self._scenes.values():
            sim.close()
        self._scenes.clear()
        self._sim = None

    # ------------------------------------------------------------------ observations and privileged state

    def state_layout(self) -> list[str]:
        """The name of each entry of the ``obs_mode: state`` vector."""
        names = ["pusher_x", "pusher_y", "pusher_vx", "pusher_vy"]
        for i in range(self.max_blocks):
            names += [f"block{i}_x", f"block{i}_y", f"block{i}_cos4yaw", f"block{i}_sin4yaw"]
        return names + ["zone_x", "zone_y"] + [f"task_{name}" for name in self.task_names]

    def _full_state(self) -> np.ndarray:
        """The ``obs_mode: state`` vector (privileged: block poses and the zone)."""
        sim = self._sim
        blocks = np.zeros((self.max_blocks, 4))
        for i, adr in enumerate(sim.block_qpos):
            w, z = sim.data.qpos[adr + 3], sim.data.qpos[adr + 6]
            yaw = 2.0 * np.arctan2(z, w)
            blocks[i] = [sim.data.qpos[adr], sim.data.qpos[adr + 1], np.cos(4 * yaw), np.sin(4 * yaw)]
        zone = np.zeros(2) if self.zone is None else np.asarray(self.zone, dtype=np.float64)
        task = np.zeros(len(self.task_names))
        task[self.task_names.index(self.task.name)] = 1.0
        return np.concatenate([self.pusher_position(), self.pusher_velocity(), blocks.reshape(-1), zone, task]).astype(np.float32)

    def _observation(self) -> dict:
        full = self._full_state() if self.obs_mode == "state" or self.privileged_state else None
        if self.obs_mode == "state":
            obs = {"state": full, "instruction": self.task.instruction}
        else:
            if self._images is None or self._elapsed % self.image_every == 0:
                images = self._images = self._sim.render(self.cameras, self.image_size, self.image_size)
            else:
                images = self._images.copy()  # every observation is its own array (gymnasium's contract)
            obs = {
                "image": images[0] if len(self.cameras) == 1 else images,
                "state": np.concatenate([self.pusher_position(), self.pusher_velocity()]).astype(np.float32),
                "instruction": self.task.instruction,
            }
        if self.privileged_state:
            obs["privileged"] = full.copy()  # every observation is its own array
        return obs

    def pusher_position(self) -> np.ndarray:
        return self._sim.data.qpos[self._sim.pusher_qpos].copy()

    def pusher_velocity(self) -> np.ndarray:
        return self._sim.data.qvel[self._sim.pusher_qvel].copy()

    def block_positions(self) -> np.ndarray:
        """Centres ``[n, 2]`` of the scene's blocks (privileged: not in the observation)."""
        return self._sim.blocks()

    def potential(self) -> float:
        """Φ of the dense reward: −(the named block's distance to the goal point + half the
        pusher's gap to that block beyond contact) / ``DENSE_SCALE`` (privileged state)."""
        block = self._sim.blocks()[self.target]
        to_goal = float(np.linalg.norm(block - self.goal_point()))
        gap = max(float(np.linalg.norm(self.pusher_position() - block)) - (BLOCK_HALF_DIAGONAL + PUSHER_RADIUS), 0.0)
        return -(to_goal + 0.5 * gap) / DENSE_SCALE

    def goal_point(self) -> np.ndarray:
        """Where the target block should go now (the scripted expert's aim)."""
        return self.task.goal_point(self._sim.blocks(), self.target, self.zone)
