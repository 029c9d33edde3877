"""Adapter for ManiSkill3 tasks: ``env: {type: maniskill, id: PushCube-v1, num_envs: 8}``.

Two backends:

- CPU (``sim_backend: physx_cpu``): ManiSkill's CPU simulation holds one env per scene, so
  each env is ``gym.make(id, num_envs=1)`` behind ManiSkill's ``CPUGymWrapper`` (numpy,
  unbatched), vectorized by gymnasium. ``vectorization: async`` runs one worker process
  per env, started with spawn: after fork the simulator hangs.
- GPU (``sim_backend: gpu``): ManiSkill's own batched env with ``num_envs`` scenes,
  wrapped in ManiSkill's ``ManiSkillVectorEnv``.

Either way, envs reset with equal seeds start from equal states, which is what lets the
G copies of a group share their initial state.

Some tasks ask on stdin to download assets on first use; PushCube, PickCube, StackCube
and most cube/peg tasks need none.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import gymnasium

from mmrl.config import option
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import ENVS
from mmrl.train.config import EnvConfig

_GPU_BACKENDS = ("gpu", "physx_cuda")


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
    obs_mode: str = option("state", "ManiSkill observation mode (state, state_dict, rgb, rgbd, pointcloud ...)")
    control_mode: str = option("pd_ee_delta_pos", "robot controller (pd_ee_delta_pos, pd_ee_delta_pose, pd_joint_delta_pos ...)")
    reward_mode: str = option("normalized_dense", "reward of each step", choices=("normalized_dense", "dense", "sparse", "none"))
    sim_backend: str = option("physx_cpu", "physx_cpu / cpu (gymnasium-vectorized) or gpu / physx_cuda (batched)", choices=("physx_cpu", "cpu", "gpu", "physx_cuda"))
    ignore_terminations: bool = option(False, "run every episode to its time limit instead of ending it on success (success is then 'success once')")
    kwargs: dict[str, Any] = option(factory=dict, doc="extra keyword arguments of gymnasium.make (e.g. robot_uids)")

    def validate(self, path: str) -> None:
        check_maniskill_id(self.id, f"{path}.id" if path else "id")


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


def _make_cpu_env(env_id: str, max_episode_steps: int | None, ignore_terminations: bool, kwargs: dict) -> gymnasium.Env:
    # Runs in spawned workers too: import mani_skill there to register its tasks.
    _import_maniskill()
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    env = gymnasium.make(env_id, num_envs=1, max_episode_steps=max_episode_steps, **kwargs)
    return CPUGymWrapper(env, ignore_terminations=ignore_terminations)


def _make_gpu_env(cfg: ManiSkillEnvConfig, kwargs: dict) -> gymnasium.vector.VectorEnv:
    import torch
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

    env = gymnasium.make(cfg.id, num_envs=cfg.num_envs, max_episode_steps=cfg.max_episode_steps, **kwargs)
    # The sampler resets every wave of episodes itself and ignores what a finished env
    # returns, so ManiSkill's partial auto-resets would only cost time.
    return SeedSharingVectorEnv(env, cfg.num_envs, auto_reset=False, ignore_terminations=cfg.ignore_terminations)


def _index_tree(tree, index):
    if isinstance(tree, dict):
        return {k: _index_tree(v, index) for k, v in tree.items()}
    return tree[index]


@ENVS.register("maniskill", config=ManiSkillEnvConfig)
def make_vector_env(cfg: ManiSkillEnvConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """ManiSkill3 task: gymnasium-vectorized CPU envs, or ManiSkill's batched GPU env.

    ``seed`` seeds the action space's sampler; episodes are seeded by the sampler at every
    reset.
    """
    cfg.validate("env")
    kwargs = dict(obs_mode=cfg.obs_mode, control_mode=cfg.control_mode, reward_mode=cfg.reward_mode, sim_backend=cfg.sim_backend, **cfg.kwargs)
    if cfg.sim_backend in _GPU_BACKENDS:
        env = _make_gpu_env(cfg, kwargs)
    else:
        make_one = partial(_make_cpu_env, cfg.id, cfg.max_episode_steps, cfg.ignore_terminations, kwargs)
        if cfg.vectorization == "async":
            env = gymnasium.vector.AsyncVectorEnv([make_one] * cfg.num_envs, context="spawn")
        else:
            env = gymnasium.vector.SyncVectorEnv([make_one] * cfg.num_envs)
    env.action_space.seed(seed)
    return env
