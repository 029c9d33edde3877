"""The tabletop suite in N worlds at once on MuJoCo Warp: ``env: {type: tabletop_warp}``.

The same scenes (MJCF), tasks, instructions, initial states, success predicates, rewards
(``sparse``, ``dense``), costs and observations (``state``, ``rgb``) as ``mmrl/Tabletop-v0``
(:mod:`mmrl.envs.tabletop.env`), computed over tensors of all worlds on the simulator's
device (:class:`~mmrl.envs.batched_mujoco.BatchedMujocoEnv`). What differs:

- one MJCF model per batch: a task list across families runs every world in the scene of
  its families with the most blocks (and a zone, if one needs it: ``object`` for any list with
  an object task, else ``spatial`` for spatial and goal tasks mixed); a world whose family
  has fewer blocks parks the extra ones off the table (:data:`PARK_X`), held at rest there
  and zero in its state vector, as the CPU env pads them, and a world without a zone parks
  the zone's (visual-only) mocap body beside them;
- ``obs_mode: rgb`` ray-traces every camera of every world in one batch (MuJoCo Warp's
  renderer, :meth:`~mmrl.envs.batched_mujoco.BatchedMujocoEnv.render_images`) with the
  scene's lights and headlight and no shadows, as the CPU env's OpenGL frames (which have no
  shadows or multisampling either); the pixels differ slightly, what a policy sees (each
  block's colour, place and outline) agrees (tests/envs/test_warp_tabletop.py measures it).
  Each world's blocks wear its own family's colours (a spatial world's blocks are white in a
  batch whose scene is the object family's); ``image_every`` is not offered;
- observations, rewards, flags and costs are torch tensors on the simulator's device, the
  instruction a tuple of N strings;
- float32 physics: before the pusher first touches a block the worlds match the CPU env to
  float32 rounding; after, MuJoCo Warp puts the pusher's contact points on a block elsewhere
  than CPU MuJoCo does, and pushes drift apart by millimetres to centimetres; the scripted
  expert's success agrees (docs/tabletop.md, "On MuJoCo Warp").

World w reset with seed s draws its task and initial state from the generator that
``TabletopEnv.reset(seed=s)`` draws from, so equal seeds give the CPU env's task and state.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium
import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import EnvConfig
from mmrl.envs.batched_mujoco import BatchedMujocoEnv, import_warp
from mmrl.envs.tabletop.env import (
    BLOCK_HALF_DIAGONAL, CAMERAS, BLOCK_Z, DENSE_SCALE, INSTRUCTION_CHARSET, MAX_INSTRUCTION_LENGTH, MAX_SPEED, PHYSICS_STEPS, REWARD_MODES, scene_path,
)
from mmrl.envs.tabletop.tasks import (
    CORNER, CORNER_AIM, FAMILIES, LAYOUTS, NEXT_TO, NEXT_TO_AIM, PUSHER_RADIUS, TASKS, ZONE_HALF, Corner, NextTo, Zone, resolve_tasks, sample_scene,
)
from mmrl.errors import ConfigError
from mmrl.registry import ENVS

_ZONE, _CORNER, _NEXT_TO = 0, 1, 2
# float32 rounds 0.025 up, which lifts a block 4e-10 m off the table: MuJoCo Warp then finds no
# contact at the first step and every block drops for 5 ms and lands (twisting some by ~3 mrad).
# Rounded down, the blocks rest on the table from the start, as in the CPU env.
_BLOCK_Z = float(np.nextafter(np.float32(BLOCK_Z), np.float32(0))) if float(np.float32(BLOCK_Z)) > BLOCK_Z else BLOCK_Z
# Blocks a world's family lacks wait here, at x = PARK_X + 0.1 * i, y = 0, 0.3 m beyond the
# walls (which end at 0.29 m): nothing is near enough for a contact.
PARK_X = 0.6
OBS_MODES = ("state", "rgb")


class TabletopBatchedEnv(BatchedMujocoEnv):
    """N tabletop worlds on MuJoCo Warp, of one family or several; see the module docstring."""

    def __init__(
        self,
        num_envs: int,
        task: str | list[str] = "object",
        layout: str = "random",
        layout_noise: float = 0.03,
        terminate_on_success: bool = True,
        reward_mode: str = "sparse",
        obs_mode: str = "state",
        privileged_state: bool = False,
        image_size: int = 64,
        cameras: str | list[str] = "top",
        max_episode_steps: int | None = 60,
        autoreset: str = "same_step",
        device: str | None = None,
        capture_graph: bool = True,
        field: str = "env",
    ):
        """The options of ``mmrl/Tabletop-v0`` but ``image_every`` and the ``render()``
        frames (see :class:`~mmrl.envs.tabletop.env.TabletopEnv`), plus ``num_envs``, ``autoreset``,
        ``device`` and ``capture_graph`` (:class:`~mmrl.envs.batched_mujoco.BatchedMujocoEnv`); ``field`` prefixes
        the names in config errors."""
        self.task_names = resolve_tasks(task, f"{field}.task")
        families = [FAMILIES[f] for f in dict.fromkeys(TASKS[name].family for name in self.task_names)]
        if layout not in LAYOUTS:
            raise ConfigError(f"{field}.layout", layout, f"expected one of {', '.join(LAYOUTS)}")
        if isinstance(layout_noise, bool) or not isinstance(layout_noise, (int, float)) or not 0.0 <= layout_noise <= 0.05:
            raise ConfigError(f"{field}.layout_noise", layout_noise, "expected a number of metres in [0, 0.05]")
        if reward_mode not in REWARD_MODES:
            raise ConfigError(f"{field}.reward_mode", reward_mode, f"expected one of {', '.join(REWARD_MODES)}")
        if obs_mode not in OBS_MODES:
            raise ConfigError(f"{field}.obs_mode", obs_mode, f"expected one of {', '.join(OBS_MODES)}")
        camera_names = [cameras] if isinstance(cameras, str) else list(cameras) if isinstance(cameras, (list, tuple)) else None
        if not camera_names or any(c not in CAMERAS for c in camera_names) or len(set(camera_names)) != len(camera_names):
            raise ConfigError(f"{field}.cameras", cameras, f"expected one or a list of {', '.join(CAMERAS)}")
        if not isinstance(image_size, int) or isinstance(image_size, bool) or not 8 <= image_size <= 2048:
            raise ConfigError(f"{field}.image_size", image_size, "expected an integer in [8, 2048]")
        for name, value in (("terminate_on_success", terminate_on_success), ("privileged_state", privileged_state)):
            if not isinstance(value, bool):
                raise ConfigError(f"{field}.{name}", value, "expected true or false")
        # The scenes differ only in their blocks (count, colour) and whether they have the zone,
        # so the one with the most blocks, and the zone where a tie allows, holds every world.
        self.scene_family = max(families, key=lambda f: (len(f.colours), f.zone))
        self.layout, self.layout_noise, self.reward_mode = layout, float(layout_noise), reward_mode
        self.privileged_state, self.obs_mode = privileged_state, obs_mode
        self.instructions = list(dict.fromkeys(TASKS[name].instruction for name in self.task_names))
        self.num_blocks = self.max_blocks = len(self.scene_family.colours)
        self.parks_blocks = any(len(f.colours) < self.num_blocks for f in families)
        text = spaces.Text(MAX_INSTRUCTION_LENGTH, charset=INSTRUCTION_CHARSET)
        full = spaces.Box(-np.inf, np.inf, (len(self.state_layout()),), np.float32)
        if obs_mode == "state":
            observed = {"state": full, "instruction": text}
        else:
            shape = (image_size, image_size, 3) if len(camera_names) == 1 else (len(camera_names), image_size, image_size, 3)
            observed = {"image": spaces.Box(0, 255, shape, np.uint8), "state": spaces.Box(-np.inf, np.inf, (4,), np.float32), "instruction": text}
        if privileged_state:
            observed["privileged"] = full
        _, mujoco, _ = import_warp()
        model = mujoco.MjModel.from_xml_path(str(scene_path(self.scene_family.name)))
        # 16 block-table contacts, a few more per push or block-block touch; 3 rows each (elliptic cones)
        super().__init__(
            model, num_envs, spaces.Dict(observed), spaces.Box(-1.0, 1.0, (2,), np.float32), physics_steps=PHYSICS_STEPS,
            max_episode_steps=max_episode_steps, terminate_on_success=terminate_on_success, autoreset=autoreset, device=device, nconmax=48, njmax=160,
            capture_graph=capture_graph,
            cameras=camera_names if obs_mode == "rgb" else None, image_width=image_size, image_height=image_size,
        )
        m = self.mj_model
        self.block_qpos = torch.tensor([m.joint(f"block_{i}").qposadr[0] for i in range(self.num_blocks)], device=self.device)
        self.pusher_qpos = torch.tensor([m.joint(n).qposadr[0] for n in ("pusher_x", "pusher_y")], device=self.device)
        self.pusher_qvel = torch.tensor([m.joint(n).dofadr[0] for n in ("pusher_x", "pusher_y")], device=self.device)
        self.block_qvel = torch.tensor([m.joint(f"block_{i}").dofadr[0] for i in range(self.num_blocks)], device=self.device)
        self.zone_mocap = int(m.body("zone").mocapid[0]) if self.scene_family.zone else None
        park = np.zeros((self.num_blocks, 7))
        park[:, 0], park[:, 2], park[:, 3] = PARK_X + 0.1 * np.arange(self.num_blocks), _BLOCK_Z, 1.0
        self.park_qpos = torch.as_tensor(park, dtype=self.qpos.dtype, device=self.device)  # [n, 7]: x, y, z, quaternion
        # each geom's block index (-1 for other geoms), and which geoms are walls or the pusher
        block_of = np.full(m.ngeom, -1)
        block_of[[m.geom(f"block_{i}").id for i in range(self.num_blocks)]] = np.arange(self.num_blocks)
        self.block_of_geom = torch.as_tensor(block_of, device=self.device)
        wall = np.zeros(m.ngeom, dtype=bool)
        wall[[m.geom(f"wall_{side}").id for side in ("top", "bottom", "left", "right")]] = True
        self.wall_geom = torch.as_tensor(wall, device=self.device)
        self.pusher_geom = m.geom("pusher").id
        self.block_geoms = np.array([m.geom(f"block_{i}").id for i in range(self.num_blocks)])
        d = self.data
        self.contact_geom, self.contact_world, self.nacon = self.wp.to_torch(d.contact.geom), self.wp.to_torch(d.contact.worldid), self.wp.to_torch(d.nacon)
        n, dev = num_envs, self.device
        self.task_index = torch.zeros(n, dtype=torch.long, device=dev)  # index into task_names
        self.target = torch.zeros(n, dtype=torch.long, device=dev)
        self.zone = torch.zeros(n, 2, device=dev)
        self.goal_kind = torch.zeros(n, dtype=torch.long, device=dev)
        self.corner_sign = torch.zeros(n, 2, device=dev)
        self.other = torch.zeros(n, dtype=torch.long, device=dev)
        self.costs = {"path_length": torch.zeros(n, device=dev), "steps": torch.zeros(n, dtype=torch.long, device=dev), "collisions": torch.zeros(n, dtype=torch.long, device=dev)}
        self.world_tasks = [self.task_names[0]] * n
        self.block_present = torch.ones(n, self.num_blocks, dtype=torch.bool, device=dev)  # False: parked (the world's family lacks it)
        self._potential = torch.zeros(n, device=dev)
        self._pusher_before = torch.zeros(n, 2, device=dev)
        # rgb: where a task's family colours its blocks unlike the scene, each world its own
        # block materials ([T, n] material of each block per task; parked blocks keep theirs)
        self._geom_matid = None
        materials = np.array([[m.geom_matid[m.geom(f"block_{i}").id] for i in range(self.num_blocks)]] * len(self.task_names))
        for t, name in enumerate(self.task_names):
            for i, colour in enumerate(FAMILIES[TASKS[name].family].colours):
                materials[t, i] = m.material(colour).id
        if obs_mode == "rgb" and ((materials != materials[:1]).any() or (materials[0] != m.geom_matid[self.block_geoms]).any()):
            self._geom_matid = self.per_world("geom_matid")
            self._task_materials = torch.as_tensor(materials, dtype=self._geom_matid.dtype, device=dev)

    # ------------------------------------------------------------------ the task

    def state_layout(self) -> list[str]:
        """The name of each entry of the state vector (as the CPU env's)."""
        names = ["pusher_x", "pusher_y", "pusher_vx", "pusher_vy"]
        for i in range(self.max_blocks):
            names += [f"block{i}_x", f"block{i}_y", f"block{i}_cos4yaw", f"block{i}_sin4yaw"]
        return names + ["zone_x", "zone_y"] + [f"task_{name}" for name in self.task_names]

    def reset_worlds(self, worlds: Tensor) -> None:
        """Seed → task → initial state per world, as ``TabletopEnv.reset`` draws them (each
        from its task's family's distribution), then written into all reset worlds at once;
        blocks the family lacks are parked, and so is the zone of a family without one."""
        ids = worlds.tolist()
        k, nb = len(ids), self.num_blocks
        blocks = self.park_qpos.cpu().numpy()[None].repeat(k, 0)  # [k, nb, 7]
        pusher, present, zone_mocap = np.zeros((k, 2)), np.zeros((k, nb), bool), np.zeros((k, 2))
        zone, task_index, target, kind, sign, other = np.zeros((k, 2)), np.zeros(k, int), np.zeros(k, int), np.zeros(k, int), np.zeros((k, 2)), np.zeros(k, int)
        for j, w in enumerate(ids):
            rng = self.world_rngs[w]
            t = int(rng.integers(len(self.task_names))) if len(self.task_names) > 1 else 0
            task = TASKS[self.task_names[t]]
            scene = sample_scene(FAMILIES[task.family], task, rng, layout=self.layout, noise=self.layout_noise)
            half, count = scene.yaw / 2, len(scene.blocks)
            pusher[j], present[j, :count] = scene.pusher, True
            blocks[j, :count] = np.concatenate([scene.blocks, np.full((count, 1), _BLOCK_Z), np.cos(half)[:, None], np.zeros((count, 2)), np.sin(half)[:, None]], 1)
            task_index[j], target[j] = t, task.target_of(scene.blocks)
            if scene.zone is not None:
                zone[j] = zone_mocap[j] = scene.zone
            else:
                zone_mocap[j] = (PARK_X + 0.1 * nb, 0.0)
            goal = task.goal
            if isinstance(goal, Zone):
                kind[j] = _ZONE
            elif isinstance(goal, Corner):
                kind[j], sign[j] = _CORNER, (goal.sign_x, goal.sign_y)
            elif isinstance(goal, NextTo):
                kind[j], other[j] = _NEXT_TO, goal.other
            else:
                raise TypeError(f"the batched tabletop has no tensor form of the goal {goal!r}")
            self.world_tasks[w] = task.name
        tensor = lambda x, dtype=torch.float32: torch.as_tensor(x, dtype=dtype, device=self.device)  # noqa: E731
        columns = torch.cat([self.pusher_qpos, (self.block_qpos[:, None] + torch.arange(7, device=self.device)).reshape(-1)])
        self.qpos[worlds[:, None], columns] = tensor(np.concatenate([pusher, blocks.reshape(k, -1)], 1), self.qpos.dtype)
        if self.zone_mocap is not None:
            self.mocap_pos[worlds, self.zone_mocap, :2] = tensor(zone_mocap, self.mocap_pos.dtype)
        self.block_present[worlds] = tensor(present, torch.bool)
        self.zone[worlds], self.task_index[worlds], self.target[worlds] = tensor(zone), tensor(task_index, torch.long), tensor(target, torch.long)
        self.goal_kind[worlds], self.corner_sign[worlds], self.other[worlds] = tensor(kind, torch.long), tensor(sign), tensor(other, torch.long)
        for cost in self.costs.values():
            cost[worlds] = 0
        if self._geom_matid is not None:
            self._geom_matid[worlds[:, None], torch.as_tensor(self.block_geoms, device=self.device)] = self._task_materials[self.task_index[worlds]]

    def apply_action(self, action: Tensor) -> None:
        self._pusher_before = self.pusher_position()
        if self.reward_mode == "dense":
            self._potential = self.potential()
        self.ctrl[:] = action.to(self.ctrl.dtype).clamp(-1.0, 1.0) * MAX_SPEED

    def evaluate(self) -> tuple[Tensor, Tensor]:
        self._park()
        pusher = self.pusher_position()
        self.costs["path_length"] += torch.linalg.vector_norm(pusher - self._pusher_before, dim=-1)
        self.costs["steps"] = self.elapsed.clone()
        self.costs["collisions"] += self.collisions()
        success = self.success()
        reward = success.to(torch.float32)
        if self.reward_mode == "dense":
            reward = reward + self.potential() - self._potential
        return reward, success

    def step_info(self) -> dict:
        return {"task": list(self.world_tasks), "costs": {name: value.clone() for name, value in self.costs.items()}}

    def reset(self, *, seed=None, options=None):
        obs, _ = super().reset(seed=seed, options=options)
        return obs, {"success": torch.zeros(self.num_envs, dtype=torch.bool, device=self.device), **self.step_info()}

    def _park(self) -> None:
        """Put parked blocks back at rest at their place after a control step's physics:
        there is no floor under them, and they fall 5 cm in a control step."""
        if not self.parks_blocks:
            return
        parked = ~self.block_present[..., None]
        q = self.block_qpos[:, None] + torch.arange(7, device=self.device)  # [n, 7]
        v = self.block_qvel[:, None] + torch.arange(6, device=self.device)
        self.qpos[:, q] = torch.where(parked, self.park_qpos, self.qpos[:, q])
        self.qvel[:, v] = torch.where(parked, 0.0, self.qvel[:, v])

    # ------------------------------------------------------------------ tensors of all worlds

    def pusher_position(self) -> Tensor:
        return self.qpos[:, self.pusher_qpos]

    def pusher_velocity(self) -> Tensor:
        return self.qvel[:, self.pusher_qvel]

    def block_positions(self) -> Tensor:
        """Block centres [N, n, 2] (``n`` blocks of the batch's scene; where
        ``block_present`` is False, the parking place)."""
        return self.qpos[:, self.block_qpos[:, None] + torch.arange(2, device=self.device)]

    def _target_block(self, blocks: Tensor) -> Tensor:
        return blocks[self.all_worlds, self.target]

    def goal_point(self) -> Tensor:
        """Where each world's target block should go now [N, 2]."""
        blocks = self.block_positions()
        other = blocks[self.all_worlds, self.other]
        away = self._target_block(blocks) - other
        beside = other + away / torch.linalg.vector_norm(away, dim=-1, keepdim=True).clamp(min=1e-9) * NEXT_TO_AIM
        corner = self.corner_sign * CORNER_AIM
        kind = self.goal_kind[:, None]
        return torch.where(kind == _ZONE, self.zone, torch.where(kind == _CORNER, corner, beside))

    def success(self) -> Tensor:
        """Each world's success predicate [N] bool (the task's goal ``reached``)."""
        blocks = self.block_positions()
        block = self._target_block(blocks)
        in_zone = ((block - self.zone).abs() <= ZONE_HALF).all(-1)
        in_corner = ((self.corner_sign * block) >= CORNER).all(-1)
        next_to = torch.linalg.vector_norm(block - blocks[self.all_worlds, self.other], dim=-1) < NEXT_TO
        return torch.where(self.goal_kind == _ZONE, in_zone, torch.where(self.goal_kind == _CORNER, in_corner, next_to))

    def potential(self) -> Tensor:
        """Φ of the dense reward per world (``TabletopEnv.potential``)."""
        block = self._target_block(self.block_positions())
        to_goal = torch.linalg.vector_norm(block - self.goal_point(), dim=-1)
        gap = (torch.linalg.vector_norm(self.pusher_position() - block, dim=-1) - (BLOCK_HALF_DIAGONAL + PUSHER_RADIUS)).clamp(min=0.0)
        return -(to_goal + 0.5 * gap) / DENSE_SCALE

    def collisions(self) -> Tensor:
        """[N] long: 1 where a contact of the last physics step is the pusher on a block other
        than the target, or a block on a wall."""
        valid = torch.arange(len(self.contact_world), device=self.device) < self.nacon[0]
        world = self.contact_world.long().clamp(0, self.num_envs - 1)
        g1, g2 = self.contact_geom[:, 0].long(), self.contact_geom[:, 1].long()
        b1, b2 = self.block_of_geom[g1], self.block_of_geom[g2]
        target = self.target[world]
        other_block = lambda b: (b >= 0) & (b != target)  # noqa: E731
        bad = ((g1 == self.pusher_geom) & other_block(b2)) | ((g2 == self.pusher_geom) & other_block(b1))
        bad |= ((b1 >= 0) & self.wall_geom[g2]) | ((b2 >= 0) & self.wall_geom[g1])
        hits = torch.zeros(self.num_envs, dtype=torch.long, device=self.device).index_add_(0, world, (bad & valid).long())
        return (hits > 0).long()

    def full_state(self) -> Tensor:
        """The ``state`` observation [N, D] float32 (``TabletopEnv._full_state``)."""
        q = self.qpos[:, self.block_qpos[:, None] + torch.tensor([0, 1, 3, 6], device=self.device)]  # x, y, qw, qz
        yaw = 2.0 * torch.atan2(q[..., 3], q[..., 2])
        blocks = torch.stack([q[..., 0], q[..., 1], torch.cos(4 * yaw), torch.sin(4 * yaw)], -1)
        blocks = torch.where(self.block_present[..., None], blocks, 0.0).reshape(self.num_envs, -1)  # parked: zero, as the CPU env pads
        task = torch.nn.functional.one_hot(self.task_index, len(self.task_names)).to(torch.float32)
        return torch.cat([self.pusher_position(), self.pusher_velocity(), blocks, self.zone, task], 1).to(torch.float32)

    def observe(self) -> dict:
        """``state``: the state vector and the instruction; ``rgb``: the images of every
        camera ([N, H, W, 3] uint8, or [N, K, H, W, 3] for K cameras), the pusher's
        [x, y, vx, vy] and the instruction (``TabletopEnv``'s observation, per world)."""
        instruction = tuple(TASKS[name].instruction for name in self.world_tasks)
        state = self.full_state() if self.obs_mode == "state" or self.privileged_state else None
        if self.obs_mode == "state":
            obs = {"state": state, "instruction": instruction}
        else:
            images = self.render_images()
            pusher = torch.cat([self.pusher_position(), self.pusher_velocity()], 1).to(torch.float32)
            obs = {"image": images[:, 0] if len(self.cameras) == 1 else images, "state": pusher, "instruction": instruction}
        if self.privileged_state:
            obs["privileged"] = state.clone()
        return obs


@dataclass
class TabletopWarpEnvConfig(EnvConfig):
    """The tabletop suite in one batch of worlds on MuJoCo Warp (state or rgb observations)."""

    type: str = option("tabletop_warp", "registered name of this component (see `mmrl list`)")
    num_envs: int = option(64, "worlds in the batch", ge=1)
    task: str | list[str] = option("object", "a task, a family (spatial, object, goal), all, or a list of these")
    layout: str = option("random", "initial-state distribution", choices=LAYOUTS)
    layout_noise: float = option(0.03, "nominal layout: metres of jitter per coordinate", ge=0.0, le=0.05)
    reward_mode: str = option("sparse", "sparse (1 at success) or dense (plus potential-based shaping)", choices=REWARD_MODES)
    obs_mode: str = option(
        "state", "state (the simulator's state and a task one-hot), or rgb (every camera of every world ray-traced in one batch by MuJoCo Warp: "
        "images uint8 [N, H, W, 3], [N, K, H, W, 3] for K cameras, the pusher's [x, y, vx, vy] and the instruction, as mmrl/Tabletop-v0 gives them)",
        choices=OBS_MODES,
    )
    image_size: int = option(64, "rgb: side of the observed images in pixels", ge=8, le=2048)
    cameras: str | list[str] = option("top", "rgb: top (straight down), front (angled), or a list of both (images [N, K, H, W, 3])")
    privileged_state: bool = option(False, "also give the state vector as the observation's privileged entry (a critic's input)")
    terminate_on_success: bool = option(True, "end an episode at success (false: run it to the time limit)")
    device: str | None = option(None, "warp device: cpu, cuda or cuda:K (null: CUDA if warp finds one, else the CPU)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        resolve_tasks(self.task, p + "task")
        if self.wrappers:
            raise ConfigError(p + "wrappers", [w.type for w in self.wrappers], "wrappers wrap single envs; tabletop_warp is one batch of worlds")
        if self.vectorization != "sync":
            raise ConfigError(p + "vectorization", self.vectorization, "expected sync: the worlds step in one batch")


@ENVS.register("tabletop_warp", config=TabletopWarpEnvConfig)
def make_vector_env(cfg: TabletopWarpEnvConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """The tabletop suite in one batch of MuJoCo Warp worlds (state or rgb observations).

    Finished worlds keep stepping until the next reset: the env sampler resets each wave
    itself and reads each episode's final observation at its end."""
    cfg.validate("env")
    env = TabletopBatchedEnv(
        cfg.num_envs, task=cfg.task, layout=cfg.layout, layout_noise=cfg.layout_noise, terminate_on_success=cfg.terminate_on_success,
        reward_mode=cfg.reward_mode, obs_mode=cfg.obs_mode, privileged_state=cfg.privileged_state, image_size=cfg.image_size, cameras=cfg.cameras,
        max_episode_steps=cfg.max_episode_steps or 60, autoreset="disabled", device=cfg.device,
    )
    env.action_space.seed(seed)
    return env



class _World:
    """One world of a batch as the scripted expert reads an env (NumPy, float64)."""

    def __init__(self, state: dict, w: int):
        self.unwrapped, self._state, self._w = self, state, w
        self.target = int(state["target"][w])

    def pusher_position(self) -> np.ndarray:
        return self._state["pusher"][self._w]

    def block_positions(self) -> np.ndarray:
        return self._state["blocks"][self._w][self._state["present"][self._w]]  # parked blocks are no obstacles

    def goal_point(self) -> np.ndarray:
        return self._state["goal"][self._w]


def expert_actions(env: TabletopBatchedEnv) -> Tensor:
    """The scripted expert's actions [N, 2] for every world of ``env``
    (:func:`mmrl.envs.tabletop.expert.expert_action` world by world, on the host)."""
    from mmrl.envs.tabletop.expert import expert_action

    state = {
        "pusher": env.pusher_position().double().cpu().numpy(), "blocks": env.block_positions().double().cpu().numpy(),
        "goal": env.goal_point().double().cpu().numpy(), "target": env.target.cpu().numpy(),
        "present": env.block_present.cpu().numpy(),
    }
    actions = np.stack([expert_action(_World(state, w)) for w in range(env.num_envs)])
    return torch.from_numpy(actions).to(env.device)
