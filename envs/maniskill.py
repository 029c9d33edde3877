"""Adapter for ManiSkill3 tasks: ``env: {type: maniskill, id: PushCube-v1, num_envs: 8}``.

Observations:

- ``obs_mode: state``: ManiSkill's flat state vector (robot proprioception plus the task's
  privileged object state), as a float32 Box.
- ``obs_mode: rgb``: structured observations ``{"image", "state", "instruction"}``:
  ``image`` is the sensor camera's uint8 ``(H, W, 3)`` frame, or ``(K, H, W, 3)`` for K
  cameras (``image_size`` sets H = W; ``cameras`` picks and orders them); ``state`` is the
  flattened ``agent`` and ``extra`` parts ManiSkill gives in this mode (joint positions and
  velocities, TCP pose, goal position ... but no object poses); ``instruction`` is a fixed
  sentence per task ("push the cube to the goal"), also listed in the env's
  ``instructions`` attribute so a policy can build its vocabulary offline.

Two backends:

- CPU (``sim_backend: physx_cpu``): ManiSkill's CPU simulation holds one env per scene, so
  each env is ``gym.make(id, num_envs=1)`` behind ManiSkill's ``CPUGymWrapper`` (numpy,
  unbatched), vectorized by gymnasium. ``vectorization: async`` runs one worker process
  per env, started with spawn: after fork the simulator hangs.
- GPU (``sim_backend: gpu``): ManiSkill's own batched env with ``num_envs`` scenes,
  wrapped in ManiSkill's ``ManiSkillVectorEnv``.

Either way, envs reset with equal seeds start from equal states, which is what lets the
G copies of a group share their initial state.

``env.wrappers`` wrap each CPU env (after ``CPUGymWrapper``: numpy, unbatched). The GPU
backend has no single envs to wrap, so wrappers are a config error there.

Rendering: SAPIEN renders on CUDA by default and, on a machine without CUDA, warns once per
env that it falls back to the CPU (64 lines for 64 envs). ``render_backend: null`` asks for
the CPU renderer directly when torch sees no CUDA device.

Some tasks ask on stdin to download assets on first use; PushCube, PickCube, StackCube
and most cube/peg tasks need none.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import gymnasium

from mmrl.config import option
from mmrl.env_wrappers import WrapperConfig, apply_wrappers, async_vector_env
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import ENVS
from mmrl.core.component_config import EnvConfig

_GPU_BACKENDS = ("gpu", "physx_cuda")

# Fixed instructions of tasks that need no asset download, written from each task's
# description in ManiSkill; other ids get their name in words ("TurnFaucet-v1" -> "turn faucet").
INSTRUCTIONS = {
    "PushCube-v1": "push the cube to the goal",
    "PullCube-v1": "pull the cube to the goal",
    "PickCube-v1": "pick up the cube and move it to the goal",
    "StackCube-v1": "stack the red cube on the green cube",
    "PokeCube-v1": "poke the cube with the peg to push it to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "roll the ball to the goal",
    "PushT-v1": "push the t block onto the t goal",
    "PullCubeTool-v1": "use the tool to pull the cube",
    "StackPyramid-v1": "stack the cubes into a pyramid",
    "LiftPegUpright-v1": "lift the peg upright",
    "PegInsertionSide-v1": "insert the peg into the hole",
    "PlugCharger-v1": "plug the charger into the receptacle",
}


@dataclass
class ManiSkillEnvConfig(EnvConfig):
    """A ManiSkill3 task on the CPU (gymnasium-vectorized) or GPU (batched) simulator."""

    type: str = option("maniskill", "registered name of this component (see `mmrl list`)")
    id: str = option("PushCube-v1", "ManiSkill task id (PushCube-v1, PickCube-v1, StackCube-v1, ...)")
    # sync is the default: measured on 2 CPU cores (PushCube-v1, state, EnvSampler with a
    # Gaussian MLP, waves of seeded episodes), sync ran 400-480 env steps/s against 245-270
    # for async, whose N spawned workers also take 30-40 s to start (8 envs) against ~3 s.
    # Bare stepping with random actions was a tie (sync 450-550, async 420-780, noisy).
    vectorization: Literal["sync", "async"] = option("sync", "CPU backend: sync (one process) or async (one spawned process per env)")
    obs_mode: str = option("state", "state: ManiSkill's flat state vector; rgb: {image, state (proprioception), instruction}", choices=("state", "rgb"))
    image_size: int | None = option(None, "rgb: side of the square sensor camera images (null = the task's own, 128 for most)", ge=8)
    cameras: list[str] | None = option(None, "rgb: sensor cameras to stack as the image, in this order (null = all the task's)")
    instruction: str | None = option(None, "rgb: the instruction given with every observation (null = the task's built-in sentence)")
    control_mode: str = option("pd_ee_delta_pos", "robot controller (pd_ee_delta_pos, pd_ee_delta_pose, pd_joint_delta_pos ...)")
    reward_mode: str = option("normalized_dense", "reward of each step", choices=("normalized_dense", "dense", "sparse", "none"))
    sim_backend: str = option("physx_cpu", "physx_cpu / cpu (gymnasium-vectorized) or gpu / physx_cuda (batched)", choices=("physx_cpu", "cpu", "gpu", "physx_cuda"))
    render_backend: str | None = option(
        None, "SAPIEN renderer: cpu / sapien_cpu, gpu / sapien_cuda, or none (no rendering; rgb needs one); null = gpu if torch sees CUDA, else cpu",
        choices=("cpu", "sapien_cpu", "gpu", "sapien_cuda", "none"),
    )
    ignore_terminations: bool = option(False, "run every episode to its time limit instead of ending it on success (success is then 'success once')")
    kwargs: dict[str, Any] = option(factory=dict, doc="extra keyword arguments of gymnasium.make (e.g. robot_uids)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        check_maniskill_id(self.id, p + "id")
        if self.cameras is not None and not self.cameras:
            raise ConfigError(p + "cameras", self.cameras, "name at least one sensor camera, or null for all")
        if self.instruction is not None and not self.instruction.strip():
            raise ConfigError(p + "instruction", self.instruction, "a sentence, or null for the task's built-in one")
        if self.wrappers and self.sim_backend in _GPU_BACKENDS:
            raise ConfigError(p + "wrappers", [w.type for w in self.wrappers], f"wrappers wrap single envs; sim_backend {self.sim_backend!r} is ManiSkill's batched env (use physx_cpu)")
        if self.obs_mode == "rgb" and self.render_backend == "none":
            raise ConfigError(p + "render_backend", self.render_backend, "rgb observations need a renderer: cpu, gpu or null")
        for key in ("render_backend", "sim_backend"):
            if key in self.kwargs:
                raise ConfigError(f"{p}kwargs.{key}", self.kwargs[key], f"set env.{key} instead")


def task_instruction(env_id: str) -> str:
    """The fixed instruction of a ManiSkill task: from :data:`INSTRUCTIONS`, else its id in words."""
    if env_id in INSTRUCTIONS:
        return INSTRUCTIONS[env_id]
    name = re.sub(r"-v\d+$", "", env_id).replace("-", " ")
    return " ".join(re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)).lower() or env_id


class StructuredObservation(gymnasium.ObservationWrapper):
    """ManiSkill's rgb observations (batched torch, inside the simulator's env) as
    ``{"image": uint8 [n, (K,) H, W, 3], "state": float32 [n, D]}``.

    ``state`` concatenates every leaf of ``agent`` and ``extra`` in ManiSkill's order (booleans
    such as ``is_grasped`` become 0/1). Camera parameters are dropped.
    """

    def __init__(self, env: gymnasium.Env, cameras: list[str] | None):
        super().__init__(env)
        raw = self.env.unwrapped._init_raw_obs
        available = list(raw["sensor_data"])
        missing = [c for c in cameras or () if c not in available]
        if missing:
            raise ConfigError("env.cameras", cameras, f"sensor cameras of this task: {', '.join(available)}")
        self.cameras = list(cameras or available)
        # ManiSkill derives its observation spaces from one observation; give it ours.
        self.env.unwrapped.update_obs_space(self.observation(raw))

    def observation(self, observation: dict) -> dict:
        import torch

        frames = [observation["sensor_data"][c]["rgb"] for c in self.cameras]
        image = frames[0] if len(frames) == 1 else torch.stack(frames, dim=1)
        leaves = []
        for part in ("agent", "extra"):
            _collect_leaves(observation.get(part, {}), leaves)
        n = image.shape[0]
        state = torch.cat([leaf.reshape(n, -1).to(torch.float32) for leaf in leaves], dim=1) if leaves else image.new_zeros((n, 0), dtype=torch.float32)
        return {"image": image.to(torch.uint8), "state": state}


def _collect_leaves(tree, out: list) -> None:
    if isinstance(tree, dict):
        for value in tree.values():
            _collect_leaves(value, out)
    else:
        out.append(tree)


def _text_space(texts: list[str]) -> gymnasium.spaces.Text:
    # A sorted string, not a set: async workers send text as indices into the charset, and
    # a set's order changes with each process's string hashing.
    return gymnasium.spaces.Text(max_length=max(len(t) for t in texts), min_length=0, charset="".join(sorted(set("".join(texts)))))


class WithInstruction(gymnasium.ObservationWrapper):
    """Adds the task's fixed ``instruction`` to a (single, numpy) structured observation."""

    def __init__(self, env: gymnasium.Env, instruction: str):
        super().__init__(env)
        self.instructions = [instruction]
        self.observation_space = gymnasium.spaces.Dict({**env.observation_space.spaces, "instruction": _text_space(self.instructions)})

    def observation(self, observation: dict) -> dict:
        return {**observation, "instruction": self.instructions[0]}


def _import_maniskill():
    try:
        import mani_skill.envs  # noqa: F401  (registers the ManiSkill tasks with gymnasium)
        from mani_skill.utils.registration import REGISTERED_ENVS
    except ImportError:
        raise MissingExtraError("mani_skill", "maniskill", "env type 'maniskill'") from None
    return REGISTERED_ENVS


def check_maniskill_id(env_id: str, field: str) -> None:
    """Raise a ConfigError naming ``field`` unless ``env_id`` is a ManiSkill task."""
    registered = _import_maniskill()
    if env_id in registered:
        return
    close = difflib.get_close_matches(env_id, list(registered), n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else "e.g. PushCube-v1, PickCube-v1, StackCube-v1"
    raise ConfigError(field, env_id, f"not a ManiSkill task; {hint}")


def render_backend(requested: str | None) -> str:
    """The SAPIEN render backend to ask for: ``requested``, or for null the CUDA renderer
    where torch sees a CUDA device and the CPU renderer elsewhere (ManiSkill's own default
    asks for CUDA and warns, for every env, when it has to fall back)."""
    if requested is not None:
        return requested
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _make_cpu_env(
    env_id: str, max_episode_steps: int | None, ignore_terminations: bool, kwargs: dict, structured: dict | None = None, wrappers: list[WrapperConfig] = ()
) -> gymnasium.Env:
    """One CPU env; ``structured`` = {"cameras", "instruction"} for rgb observations."""
    # Runs in spawned workers too: import mani_skill there to register its tasks.
    _import_maniskill()
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    env = gymnasium.make(env_id, num_envs=1, max_episode_steps=max_episode_steps, **kwargs)
    if structured is not None:
        env = StructuredObservation(env, structured["cameras"])
    env = CPUGymWrapper(env, ignore_terminations=ignore_terminations)
    if structured is not None:
        env = WithInstruction(env, structured["instruction"])
    return apply_wrappers(env, wrappers)


def _make_gpu_env(cfg: ManiSkillEnvConfig, kwargs: dict, structured: dict | None) -> gymnasium.vector.VectorEnv:
    import torch
    from gymnasium.vector.utils import batch_space
    from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

    class SeedSharingVectorEnv(ManiSkillVectorEnv):
        """Batched GPU tasks draw initial states from one torch RNG stream seeded by the first
        env's seed, so equal per-env seeds do not give equal states by themselves: after the
        seeded reset, every env is reset again to the state of the first env that got its seed."""

        def reset(self, *, seed=None, options=None):
            obs, info = super().reset(seed=seed, options=options)
            if not isinstance(seed, (list, tuple)) or options:
                return obs, info
            first = {}
            source = torch.tensor([first.setdefault(s, i) for i, s in enumerate(seed)], device=self.device)
            states = _index_tree(self.base_env.get_state_dict(), source)
            return super().reset(seed=list(seed), options={"reset_to_env_states": {"env_states": states}})

    class InstructedVectorEnv(SeedSharingVectorEnv):
        """Structured observations of the batched env plus the fixed instruction of every env."""

        def __init__(self, env, num_envs, instruction, **kwargs):
            super().__init__(env, num_envs, **kwargs)
            self.instructions = [instruction]
            self.single_observation_space = gymnasium.spaces.Dict({**self.single_observation_space.spaces, "instruction": _text_space(self.instructions)})
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)

        def _instructed(self, obs):
            return {**obs, "instruction": tuple(self.instructions * self.num_envs)}

        def reset(self, *, seed=None, options=None):
            obs, info = super().reset(seed=seed, options=options)
            return self._instructed(obs), info

        def step(self, actions):
            obs, *rest = super().step(actions)
            return (self._instructed(obs), *rest)

    env = gymnasium.make(cfg.id, num_envs=cfg.num_envs, max_episode_steps=cfg.max_episode_steps, **kwargs)
    # The sampler resets every wave of episodes itself and ignores what a finished env
    # returns, so ManiSkill's partial auto-resets would only cost time.
    options = dict(auto_reset=False, ignore_terminations=cfg.ignore_terminations)
    if structured is None:
        return SeedSharingVectorEnv(env, cfg.num_envs, **options)
    env = StructuredObservation(env, structured["cameras"])
    return InstructedVectorEnv(env, cfg.num_envs, structured["instruction"], **options)


def _index_tree(tree, index):
    if isinstance(tree, dict):
        return {k: _index_tree(v, index) for k, v in tree.items()}
    return tree[index]


def _push_cube_moves(tcp: "np.ndarray", cube: "np.ndarray", goal: "np.ndarray", cube_size: float = 0.02) -> "np.ndarray":
    """PushCube-v1's scripted expert in ``pd_ee_delta_pos`` (normalized: 1 = 0.1 m) for
    positions [N, 3]: above and behind the cube, down to the cube's height, then a slow push
    (at most 0.03 m per step, so the cube does not slide past) to the goal's far side, and
    still once the cube is within 3 cm of the goal's centre. Returns the moves [N, 3]."""
    import numpy as np

    tcp, cube, goal = (np.asarray(x, dtype=np.float64).reshape(-1, 3) for x in (tcp, cube, goal))
    aligned = (np.abs(tcp[:, 1] - cube[:, 1]) < 0.01) & (tcp[:, 0] < cube[:, 0] - cube_size)
    pushing = aligned & (tcp[:, 2] < 2 * cube_size)
    behind = np.stack([cube[:, 0] - 2.5 * cube_size, cube[:, 1], np.where(aligned, cube_size, 4 * cube_size)], axis=1)
    target = np.where(pushing[:, None], np.stack([goal[:, 0] - cube_size, goal[:, 1], np.full(len(goal), cube_size)], axis=1), behind)
    limit = np.where(pushing, 0.3, 1.0)[:, None]
    move = np.clip((target - tcp) / 0.05, -limit, limit)
    done = np.linalg.norm(cube[:, :2] - goal[:, :2], axis=1) < 0.03
    return np.where(done[:, None], 0.0, move)


def _push_cube_action(env, cube_size: float = 0.02) -> "np.ndarray":
    """The expert's action (:func:`_push_cube_moves`) for the one env of ``env.unwrapped``,
    read from the simulator's poses."""
    import numpy as np

    u = env.unwrapped
    tcp, cube, goal = (np.asarray(x.pose.p[0].cpu(), dtype=np.float64) for x in (u.agent.tcp, u.obj, u.goal_region))
    move = _push_cube_moves(tcp, cube, goal, cube_size)[0]
    return np.concatenate([move, np.zeros(env.action_space.shape[-1] - 3)]).astype(np.float32)


# where PushCube-v1's state observation (35 numbers) holds the positions the expert reads:
# the Panda's qpos (9) and qvel (9), then tcp_pose (7), goal_pos (3), obj_pose (7)
_PUSH_CUBE_STATE = {"tcp": slice(18, 21), "goal": slice(25, 28), "cube": slice(28, 31)}


def push_cube_expert(observations) -> "np.ndarray":
    """PushCube-v1's scripted expert (:func:`_push_cube_moves`) from the vector env's state
    observations [N, 35] (``obs_mode: state``): the actions [N, 4] of ``pd_ee_delta_pos``
    with the gripper still. The scripted intervener's expert for PushCube::

        sampler: {intervener: {type: scripted, kwargs: {expert: "mmrl.envs.maniskill:push_cube_expert"}}}
    """
    import numpy as np

    obs = np.asarray(observations.cpu() if hasattr(observations, "cpu") else observations, dtype=np.float64)
    if obs.ndim != 2 or obs.shape[1] != 35:
        raise ValueError(f"push_cube_expert reads PushCube-v1's state observations [N, 35]; got shape {tuple(obs.shape)}")
    tcp, goal, cube = (obs[:, _PUSH_CUBE_STATE[k]] for k in ("tcp", "goal", "cube"))
    move = _push_cube_moves(tcp, cube, goal)
    return np.concatenate([move, np.zeros((len(obs), 1))], axis=1).astype(np.float32)


_EXPERTS = {"PushCube-v1": _push_cube_action}


def scripted_expert(cfg: "ManiSkillEnvConfig"):
    """(one CPU env of ``cfg``, its scripted expert ``act(env) -> action``) for ``mmrl
    collect --config``; tasks with an expert: :data:`_EXPERTS` (``pd_ee_delta_pos``)."""
    cfg.validate("env")
    if cfg.id not in _EXPERTS:
        raise ConfigError("env.id", cfg.id, f"has no scripted expert; tasks with one: {', '.join(_EXPERTS)}")
    if cfg.control_mode != "pd_ee_delta_pos":
        raise ConfigError("env.control_mode", cfg.control_mode, f"{cfg.id}'s expert acts in pd_ee_delta_pos")
    if cfg.sim_backend in _GPU_BACKENDS or cfg.obs_mode != "state":
        raise ConfigError("env.obs_mode" if cfg.obs_mode != "state" else "env.sim_backend", cfg.obs_mode if cfg.obs_mode != "state" else cfg.sim_backend,
                          "demonstrations are collected from the state of one CPU env: obs_mode state, sim_backend physx_cpu")
    kwargs = dict(obs_mode=cfg.obs_mode, control_mode=cfg.control_mode, reward_mode=cfg.reward_mode, sim_backend=cfg.sim_backend,
                  render_backend="none", **cfg.kwargs)
    env = _make_cpu_env(cfg.id, cfg.max_episode_steps, cfg.ignore_terminations, kwargs, None, list(cfg.wrappers))
    return env, _EXPERTS[cfg.id]


@ENVS.register("maniskill", config=ManiSkillEnvConfig, scripted_expert=scripted_expert)
def make_vector_env(cfg: ManiSkillEnvConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """ManiSkill3 task: gymnasium-vectorized CPU envs, or ManiSkill's batched GPU env.

    ``seed`` seeds the action space's sampler; episodes are seeded by the sampler at every
    reset.
    """
    cfg.validate("env")
    kwargs = dict(
        obs_mode=cfg.obs_mode, control_mode=cfg.control_mode, reward_mode=cfg.reward_mode, sim_backend=cfg.sim_backend,
        render_backend=render_backend(cfg.render_backend), **cfg.kwargs,
    )
    structured = None
    if cfg.obs_mode == "rgb":
        structured = {"cameras": cfg.cameras, "instruction": cfg.instruction if cfg.instruction is not None else task_instruction(cfg.id)}
        if cfg.image_size is not None:
            kwargs["sensor_configs"] = {**kwargs.get("sensor_configs", {}), "width": cfg.image_size, "height": cfg.image_size}
    if cfg.sim_backend in _GPU_BACKENDS:
        env = _make_gpu_env(cfg, kwargs, structured)
    else:
        make_one = partial(_make_cpu_env, cfg.id, cfg.max_episode_steps, cfg.ignore_terminations, kwargs, structured, list(cfg.wrappers))
        if cfg.vectorization == "async":
            # gymnasium reads Text observations out of shared memory only once, at start-up
            # (the instruction would stay blank): structured observations go through pipes.
            env = async_vector_env(make_one, cfg.num_envs, context="spawn", shared_memory=structured is None)
        else:
            env = gymnasium.vector.SyncVectorEnv([make_one] * cfg.num_envs)
    env.action_space.seed(seed)
    return env
