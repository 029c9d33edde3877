"""``BatchedMujocoEnv``: N worlds of one MJCF model stepped together by MuJoCo Warp.

A gymnasium vector env whose worlds live in one ``mujoco_warp`` batch on one warp device
(``cpu`` through warp's CPU backend, or ``cuda:K``). Every world's state is a row of a
torch tensor that views warp's memory (``wp.to_torch``, no copy): ``self.qpos [N, nq]``,
``qvel``, ``ctrl``, ``mocap_pos`` ... A task subclasses it and writes four things over
tensors of all worlds at once:

- :meth:`reset_worlds` — the initial state of the worlds being reset (a long tensor of world
  indices); each world has its own seeded ``numpy.random.Generator`` in ``world_rngs``
  (seeded as gymnasium seeds ``Env.reset(seed=s)``, so a world reset with seed s draws what a
  single env reset with seed s draws);
- :meth:`apply_action` — actions [N, A] on the simulator's device into ``self.ctrl``;
- :meth:`observe` — the observation of every world (a tensor, or a dict of them);
- :meth:`evaluate` — the step's reward [N] and success [N] (which terminates the episode).

The base runs ``physics_steps`` MuJoCo steps per control step, counts each world's steps for
the time limit, and resets finished worlds inside the batch (``autoreset``: ``same_step``,
gymnasium's SAME_STEP mode, whose info holds the finished worlds' ``final_obs``; or
``disabled``, where a finished world keeps stepping until the caller resets it, as the env
sampler does with its waves). ``reset(options={"reset_mask": mask})`` resets only the
masked worlds. Observations, rewards and flags are torch tensors on the simulator's device.
A reset writes state only (``qpos``, ``qvel``, ``mocap_*`` ...): what MuJoCo derives from it
(body poses, contacts) is refreshed by the next step, so ``observe`` reads the state.

Images: ``cameras=[names]`` (with ``image_width``/``image_height``) builds a MuJoCo Warp
render context for those cameras of the model, and :meth:`render_images` ray-traces every
camera in every world in one launch (``mujoco_warp.render``) into uint8 ``[N, K, H, W, 3]`` on
the simulator's device, for a task's :meth:`observe`. It renders the current state (it runs
the kinematics first, so a world just reset shows its new state), with the model's lights and
headlight, no shadows and one sample per pixel, as MuJoCo's OpenGL renderer draws a model
with ``shadowsize=0`` and ``offsamples=0``. :meth:`per_world` gives a model field one row per
world (e.g. ``geom_matid``: each world's own materials).

From the second control step on, the physics replays as one captured warp graph
(``capture_graph``): a CUDA graph on CUDA, warp's C++ replay on the CPU, bit for bit what
launching each kernel from Python steps. A model field made per-world (:meth:`per_world`) is
a new array, so the graph is captured again.

Warp's kernels compile on first use (about 10-40 s on a CPU) into warp's kernel cache
(``~/.cache/warp``) and load from there afterwards. ``warp-lang`` and ``mujoco-warp`` come
with ``pip install 'mmrl[warp]'``; examples/batched_cartpole.py is a whole task in a few
dozen lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium.utils import seeding
from torch import Tensor

from mmrl.errors import ConfigError, MissingExtraError

AUTORESET_MODES = ("same_step", "disabled")


def import_warp():
    """``(warp, mujoco, mujoco_warp)``, or a MissingExtraError naming the ``warp`` extra."""
    try:
        import mujoco
        import mujoco_warp
        import warp
    except ImportError:
        raise MissingExtraError("mujoco-warp", "warp", "a batched MuJoCo Warp env") from None
    warp.config.log_level = warp.LOG_WARNING  # a banner and one line per loaded kernel module otherwise
    return warp, mujoco, mujoco_warp


def warp_device(device: str | None, field: str = "device") -> str:
    """The warp device to simulate on: ``device`` (``cpu``, ``cuda`` or ``cuda:K``), or for
    None ``cuda`` where warp finds a CUDA device and ``cpu`` elsewhere."""
    wp, _, _ = import_warp()
    if device is None:
        return "cuda:0" if wp.get_cuda_device_count() > 0 else "cpu"
    known = ["cpu"] + [f"cuda:{i}" for i in range(wp.get_cuda_device_count())]
    name = "cuda:0" if device == "cuda" else device
    if name not in known:
        raise ConfigError(field, device, f"expected one of {', '.join(known)} (the devices warp finds here), or null for the first CUDA device, else the CPU")
    return name


def load_model(model: Any):
    """A ``mujoco.MjModel`` from a model, an MJCF file path or an MJCF string."""
    _, mujoco, _ = import_warp()
    if isinstance(model, mujoco.MjModel):
        return model
    if isinstance(model, Path) or (isinstance(model, str) and not model.lstrip().startswith("<")):
        return mujoco.MjModel.from_xml_path(str(model))
    return mujoco.MjModel.from_xml_string(model)


class BatchedMujocoEnv(gymnasium.vector.VectorEnv):
    """N worlds of one MuJoCo model in one MuJoCo Warp batch; see the module docstring."""

    def __init__(
        self,
        model: Any,
        num_envs: int,
        single_observation_space: gymnasium.Space,
        single_action_space: gymnasium.Space,
        physics_steps: int = 1,
        max_episode_steps: int | None = None,
        terminate_on_success: bool = True,
        autoreset: str = "same_step",
        device: str | None = None,
        nconmax: int | None = None,
        njmax: int | None = None,
        cameras: Sequence[str] | None = None,
        image_width: int = 64,
        image_height: int = 64,
        capture_graph: bool = True,
    ):
        """``model``: a ``mujoco.MjModel``, an MJCF path or an MJCF string; ``num_envs``: the
        worlds; ``physics_steps``: MuJoCo steps per control step; ``max_episode_steps``:
        control steps before an episode is truncated (None: never); ``terminate_on_success``:
        false runs episodes to the time limit, success or not; ``autoreset``:
        ``same_step`` or ``disabled``; ``device``: warp device (None: CUDA if found, else
        the CPU); ``nconmax``/``njmax``: contacts and constraint rows allocated per world
        (None: mujoco_warp's defaults); ``cameras``: names of the model's cameras that
        :meth:`render_images` renders (None: no rendering), each ``image_width`` x
        ``image_height`` pixels; ``capture_graph``: replay a control step's physics as one
        captured warp graph from the second step on (a CUDA graph on CUDA, warp's C++ replay
        on the CPU: the same kernels on the same arrays, without a Python launch per kernel)."""
        wp, mujoco, mjw = import_warp()
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
            raise ConfigError("num_envs", num_envs, "expected an integer >= 1 (worlds in the batch)")
        if autoreset not in AUTORESET_MODES:
            raise ConfigError("autoreset", autoreset, f"expected one of {', '.join(AUTORESET_MODES)}")
        self.wp, self.mujoco, self.mjw = wp, mujoco, mjw
        self.mj_model = load_model(model)
        self.warp_device = warp_device(device)
        self.device = torch.device(self.warp_device)
        self.num_envs, self.physics_steps, self.max_episode_steps = num_envs, physics_steps, max_episode_steps
        self.autoreset, self.terminate_on_success = autoreset, terminate_on_success
        self.metadata = {"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP if autoreset == "same_step" else gymnasium.vector.AutoresetMode.DISABLED}
        self.single_observation_space, self.single_action_space = single_observation_space, single_action_space
        self.observation_space = gymnasium.vector.utils.batch_space(single_observation_space, num_envs)
        self.action_space = gymnasium.vector.utils.batch_space(single_action_space, num_envs)
        data = mujoco.MjData(self.mj_model)
        mujoco.mj_forward(self.mj_model, data)
        with wp.ScopedDevice(self.warp_device):
            self.model = mjw.put_model(self.mj_model)
            self.data = mjw.put_data(self.mj_model, data, nworld=num_envs, nconmax=nconmax, njmax=njmax)
        view = lambda array: wp.to_torch(array)  # noqa: E731  (shares warp's memory)
        d = self.data
        self.qpos, self.qvel, self.ctrl, self.act = view(d.qpos), view(d.qvel), view(d.ctrl), view(d.act)
        self.qacc_warmstart, self.qfrc_applied, self.xfrc_applied = view(d.qacc_warmstart), view(d.qfrc_applied), view(d.xfrc_applied)
        self.mocap_pos, self.mocap_quat, self.time = view(d.mocap_pos), view(d.mocap_quat), view(d.time)
        self.qpos0 = torch.as_tensor(self.mj_model.qpos0, dtype=self.qpos.dtype, device=self.device)
        mocap_bodies = np.flatnonzero(self.mj_model.body_mocapid >= 0)
        order = np.argsort(self.mj_model.body_mocapid[mocap_bodies])
        self.mocap_pos0 = torch.as_tensor(self.mj_model.body_pos[mocap_bodies[order]], dtype=self.qpos.dtype, device=self.device)
        self.mocap_quat0 = torch.as_tensor(self.mj_model.body_quat[mocap_bodies[order]], dtype=self.qpos.dtype, device=self.device)
        self.elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.world_rngs = [seeding.np_random(None)[0] for _ in range(num_envs)]
        self.all_worlds = torch.arange(num_envs, device=self.device)
        if not isinstance(capture_graph, bool):
            raise ConfigError("capture_graph", capture_graph, "expected true or false")
        self.capture_graph = capture_graph
        self._graph = None  # the physics steps as a warp graph, captured on the second step
        self._stepped = False
        self.cameras: tuple[str, ...] = ()
        self.render_context = None
        if cameras is not None:
            self._build_renderer(cameras, image_width, image_height)

    # ------------------------------------------------------------------ the task's part

    def reset_worlds(self, worlds: Tensor) -> None:
        """Write the initial state of ``worlds`` (long [k]); the base has already put them
        at the model's ``qpos0`` at rest. Draw from ``self.world_rngs[w]``."""

    def apply_action(self, action: Tensor) -> None:
        """Actions [N, A] (on the simulator's device) into ``self.ctrl``."""
        self.ctrl[:] = action.to(self.ctrl.dtype)

    def observe(self) -> Tensor | dict:
        """The observation of every world."""
        raise NotImplementedError

    def evaluate(self) -> tuple[Tensor, Tensor]:
        """``(reward [N], success [N] bool)`` after the physics of a control step."""
        raise NotImplementedError

    def step_info(self) -> dict:
        """Extra info entries of a step (before finished worlds reset)."""
        return {}

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        """Reset every world, or the worlds of ``options["reset_mask"]`` ([N] bool). ``seed``:
        one seed (world i gets seed + i, as gymnasium's vector envs do), a list of one per
        world, or None (each world's generator goes on)."""
        mask = (options or {}).get("reset_mask")
        worlds = self.all_worlds if mask is None else torch.as_tensor(mask, device=self.device).bool().nonzero().flatten()
        if seed is not None:
            seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else list(seed)
            if len(seeds) != self.num_envs:
                raise ConfigError("seed", seed, f"expected one seed per world ({self.num_envs}), an integer or null")
            for w in worlds.tolist():
                self.world_rngs[w] = seeding.np_random(int(seeds[w]))[0]
        self._reset(worlds)
        return self.observe(), {}

    def step(self, actions):
        action = torch.as_tensor(actions, device=self.device)
        self.apply_action(action.reshape(self.num_envs, -1))
        self._physics()
        self.elapsed += 1
        reward, success = self.evaluate()
        terminated = success.clone() if self.terminate_on_success else torch.zeros_like(success)
        truncated = self.elapsed >= self.max_episode_steps if self.max_episode_steps is not None else torch.zeros_like(terminated)
        info = {"success": success, **self.step_info()}
        obs = self.observe()
        if self.autoreset == "same_step":
            done = terminated | truncated
            if bool(done.any()):
                info["final_obs"], info["final_info"], info["_final"] = obs, {k: v for k, v in info.items()}, done
                self._reset(done.nonzero().flatten())
                obs = self.observe()
        return obs, reward, terminated, truncated, info

    def close(self, **kwargs):
        self._graph = None

    # ------------------------------------------------------------------ images and per-world model fields

    def render_images(self) -> Tensor:
        """Every camera of ``cameras`` in every world: uint8 ``[N, K, H, W, 3]`` (K cameras
        in the order given, rows from the image's top) on the simulator's device, rendered in
        one batch from the worlds' current state."""
        if self.render_context is None:
            raise RuntimeError("this env renders nothing: build it with cameras=[...] to render images")
        mjw, rc = self.mjw, self.render_context
        with self._warp_stream():
            # A reset writes qpos only and a step leaves the poses of its last physics step's
            # start: the kinematics put every geom, camera and light where qpos says.
            mjw.kinematics(self.model, self.data)
            mjw.com_pos(self.model, self.data)
            mjw.camlight(self.model, self.data)
            mjw.refit_bvh(self.model, self.data, rc)
            mjw.render(self.model, self.data, rc)
        # each pixel a little-endian uint32 0xAARRGGBB: its bytes are b, g, r, a
        packed = self._rgb_bytes.view(self.num_envs, -1, 4)
        h, w = self.image_height, self.image_width
        images = [packed[:, a : a + h * w, :3].flip(-1).reshape(self.num_envs, h, w, 3) for a in self._rgb_adr]
        return torch.stack(images, 1)

    def per_world(self, field: str) -> Tensor:
        """A torch view [N, ...] of the model field ``field`` (one whose first dimension
        MuJoCo Warp batches, e.g. ``geom_matid``, ``geom_rgba``, ``mat_rgba``), first given one
        row per world, each a copy of the shared one. Writes to it change that world alone."""
        wp = self.wp
        array = getattr(self.model, field)
        if array.shape[0] != self.num_envs:
            if array.shape[0] != 1:
                raise ValueError(f"model field {field} has {array.shape[0]} rows, neither 1 nor one per world")
            rows = np.repeat(array.numpy(), self.num_envs, axis=0)
            setattr(self.model, field, wp.array(rows, dtype=array.dtype, device=self.warp_device))
            self._graph = None  # a captured graph holds the old array
        return wp.to_torch(getattr(self.model, field))

    # ------------------------------------------------------------------ internals

    def _build_renderer(self, cameras: Sequence[str], width: int, height: int) -> None:
        names = [cameras] if isinstance(cameras, str) else list(cameras)
        known = [self.mj_model.camera(i).name for i in range(self.mj_model.ncam)]
        if not names or any(name not in known for name in names) or len(set(names)) != len(names):
            raise ConfigError("cameras", cameras, f"expected a list of distinct camera names of the model ({', '.join(known) or 'it has none'})")
        for field, value in (("image_width", width), ("image_height", height)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
                raise ConfigError(field, value, "expected an integer in [1, 4096] (pixels)")
        self.cameras, self.image_width, self.image_height = tuple(names), width, height
        with self.wp.ScopedDevice(self.warp_device):
            self.render_context = self.mjw.create_render_context(
                self.mj_model, nworld=self.num_envs, cam_res=(width, height), cam_active=[known.index(name) for name in names], render_rgb=True,
                render_depth=False, render_seg=False, use_shadows=False, samples_per_pixel=1,
            )
        self._rgb_adr = [int(a) for a in self.render_context.rgb_adr.numpy()]  # where each camera's pixels start, in the order given
        self._rgb_bytes = self.wp.to_torch(self.render_context.rgb_data).view(torch.uint8)

    @contextmanager
    def _warp_stream(self):
        """Run warp work on the simulator's device, ordered after torch's work before it and
        before torch's work after it (on CUDA the two have their own streams)."""
        wp = self.wp
        with wp.ScopedDevice(self.warp_device):
            if self.device.type == "cuda":  # torch wrote the actions on its stream: warp's waits for it
                torch_stream = wp.stream_from_torch(torch.cuda.current_stream(self.device))
                wp.get_stream().wait_stream(torch_stream)
            yield
            if self.device.type == "cuda":
                torch_stream.wait_stream(wp.get_stream())

    def _reset(self, worlds: Tensor) -> None:
        if len(worlds) == 0:
            return
        self.qpos[worlds] = self.qpos0
        for state in (self.qvel, self.ctrl, self.act, self.qacc_warmstart, self.qfrc_applied, self.xfrc_applied):
            state[worlds] = 0
        if self.mocap_pos.shape[1]:
            self.mocap_pos[worlds] = self.mocap_pos0
            self.mocap_quat[worlds] = self.mocap_quat0
        self.time[worlds] = 0
        self.elapsed[worlds] = 0
        self.reset_worlds(worlds)

    def _physics(self) -> None:
        wp = self.wp
        with self._warp_stream():
            if self._graph is not None:
                wp.capture_launch(self._graph)
            elif self.capture_graph and self._stepped:  # the kernels are loaded: capture
                with wp.ScopedCapture() as capture:
                    self._run_physics()
                self._graph = capture.graph
                wp.capture_launch(self._graph)
            else:
                self._run_physics()
        self._stepped = True

    def _run_physics(self) -> None:
        for _ in range(self.physics_steps):
            self.mjw.step(self.model, self.data)
