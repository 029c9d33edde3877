"""A MuJoCo task of your own in N worlds at once: a planar two-link reacher on MuJoCo Warp.

    python examples/batched_reacher.py [--worlds 64] [--device cpu|cuda]

Subclass :class:`mmrl.envs.batched_mujoco.BatchedMujocoEnv` with an MJCF model and write the
reset, the action, the observation, the reward and the success over tensors of all worlds.
Here a Jacobian-transpose controller drives every arm to its own target in one batch.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from gymnasium import spaces

from mmrl.envs.batched_mujoco import BatchedMujocoEnv

LINK = 0.1  # metres, each of the two links
REACHER = f"""
<mujoco model="reacher">
  <option timestep="0.01"/>
  <worldbody>
    <body name="upper">
      <joint name="shoulder" type="hinge" axis="0 0 1" damping="0.02"/>
      <geom type="capsule" fromto="0 0 0 {LINK} 0 0" size="0.01" mass="0.1"/>
      <body name="fore" pos="{LINK} 0 0">
        <joint name="elbow" type="hinge" axis="0 0 1" damping="0.02"/>
        <geom type="capsule" fromto="0 0 0 {LINK} 0 0" size="0.01" mass="0.1"/>
      </body>
    </body>
    <body name="target" mocap="true"><geom type="sphere" size="0.01" contype="0" conaffinity="0" rgba="1 0 0 1"/></body>
  </worldbody>
  <actuator>
    <motor joint="shoulder" gear="0.05" ctrlrange="-1 1"/>
    <motor joint="elbow" gear="0.05" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""


class BatchedReacher(BatchedMujocoEnv):
    """Reach a random target with the fingertip; success within 1 cm."""

    def __init__(self, num_envs: int, device: str | None = None):
        observation = spaces.Box(-np.inf, np.inf, (6,), np.float32)  # joint angles, joint velocities, target
        super().__init__(REACHER, num_envs, observation, spaces.Box(-1, 1, (2,), np.float32), physics_steps=5, max_episode_steps=100, device=device)

    def reset_worlds(self, worlds):
        radius = [self.world_rngs[w].uniform(0.05, 0.18) for w in worlds.tolist()]
        angle = [self.world_rngs[w].uniform(-np.pi, np.pi) for w in worlds.tolist()]
        r, a = torch.tensor(radius, device=self.device), torch.tensor(angle, device=self.device)
        self.mocap_pos[worlds, 0, :2] = torch.stack([r * torch.cos(a), r * torch.sin(a)], -1)

    def fingertip(self):
        q1, q12 = self.qpos[:, 0], self.qpos[:, 0] + self.qpos[:, 1]
        return LINK * torch.stack([torch.cos(q1) + torch.cos(q12), torch.sin(q1) + torch.sin(q12)], -1)

    def observe(self):
        return torch.cat([self.qpos, self.qvel, self.mocap_pos[:, 0, :2]], 1)

    def evaluate(self):
        distance = torch.linalg.vector_norm(self.fingertip() - self.mocap_pos[:, 0, :2], dim=-1)
        return -distance, distance < 0.01


def controller(env: BatchedReacher) -> torch.Tensor:
    """Jacobian-transpose control towards each target, with damping: actions [N, 2]."""
    q1, q12 = env.qpos[:, 0], env.qpos[:, 0] + env.qpos[:, 1]
    error = env.mocap_pos[:, 0, :2] - env.fingertip()
    jacobian = LINK * torch.stack([torch.stack([-torch.sin(q1) - torch.sin(q12), -torch.sin(q12)], -1), torch.stack([torch.cos(q1) + torch.cos(q12), torch.cos(q12)], -1)], -2)
    torque = 300.0 * (jacobian.transpose(1, 2) @ error[:, :, None])[:, :, 0] - 0.1 * env.qvel
    return torque.clamp(-1.0, 1.0)


def main(worlds: int = 64, device: str | None = None, steps: int = 100) -> float:
    """Runs the controller in every world; returns the share of worlds that reached their target."""
    env = BatchedReacher(worlds, device=device)
    env.reset(seed=0)
    reached = torch.zeros(worlds, dtype=torch.bool, device=env.device)
    for _ in range(steps):
        _, _, terminated, _, _ = env.step(controller(env))
        reached |= terminated
    print(f"{int(reached.sum())} of {worlds} reachers reached their target on {env.warp_device}")
    return reached.float().mean().item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, default=64)
    parser.add_argument("--device", default=None, help="warp device (default: CUDA if warp finds one, else the CPU)")
    args = parser.parse_args()
    main(args.worlds, args.device)
