"""``mmrl/PointReach-v0``: move a point to a goal on the plane, in pure numpy.

A task small enough for tests and demos: a Gaussian MLP trained with GRPO reaches a high
success rate within a few dozen steps on a CPU.

- observation: ``[x, y, goal_x - x, goal_y - y]`` (float32)
- action: a velocity in ``[-1, 1]^2``; the point moves ``step_size * action`` and stays in
  the ``[-1, 1]^2`` square
- reward: ``-distance`` to the goal after the move (dense), or with ``sparse_reward`` 1 on
  success and 0 otherwise (an exploration problem: what demonstrations help with)
- ``info["success"]``: the point is within ``success_radius`` of the goal; the episode
  terminates on success and is truncated after ``max_steps`` steps
"""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces


class PointReachEnv(gymnasium.Env):
    """A point reaches a random goal; start and goal come from the reset seed."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        max_steps: int = 20,
        min_steps: int | None = None,
        step_size: float = 0.2,
        success_radius: float = 0.15,
        sparse_reward: bool = False,
    ):
        """``min_steps`` makes episode lengths vary independently of the policy: each
        episode's time limit is drawn uniformly from ``[min_steps, max_steps]`` at reset."""
        if min_steps is not None and not 1 <= min_steps <= max_steps:
            raise ValueError(f"min_steps must lie in [1, max_steps={max_steps}], got {min_steps}")
        if not 0 < success_radius < 1:
            # goals are drawn at least 2 radii from the start in [-1, 1]^2: beyond 1 that rarely or never happens
            raise ValueError(f"success_radius must lie in (0, 1), got {success_radius}")
        self.max_steps, self.min_steps = max_steps, min_steps
        self.step_size, self.success_radius = step_size, success_radius
        self.sparse_reward = sparse_reward
        self.observation_space = spaces.Box(-2.0, 2.0, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self._pos = np.zeros(2)
        self._goal = np.zeros(2)
        self._limit = max_steps
        self._t = 0

    def _obs(self) -> np.ndarray:
        return np.concatenate([self._pos, self._goal - self._pos]).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._pos = self.np_random.uniform(-1.0, 1.0, size=2)
        self._goal = self.np_random.uniform(-1.0, 1.0, size=2)
        while np.linalg.norm(self._goal - self._pos) < 2 * self.success_radius:
            self._goal = self.np_random.uniform(-1.0, 1.0, size=2)
        self._limit = self.max_steps if self.min_steps is None else int(self.np_random.integers(self.min_steps, self.max_steps + 1))
        self._t = 0
        return self._obs(), {"success": False}

    def step(self, action):
        velocity = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        self._pos = np.clip(self._pos + self.step_size * velocity, -1.0, 1.0)
        self._t += 1
        distance = float(np.linalg.norm(self._goal - self._pos))
        success = distance < self.success_radius
        truncated = not success and self._t >= self._limit
        reward = float(success) if self.sparse_reward else -distance
        return self._obs(), reward, success, truncated, {"success": success}


gymnasium.register(id="mmrl/PointReach-v0", entry_point=PointReachEnv)


def reach_goal(observations) -> np.ndarray:
    """The scripted expert: straight at the goal, each axis at full speed until the default
    ``step_size`` (0.2) would overshoot. ``observations`` [N, 4] → velocities [N, 2] (a
    scripted intervener's ``expert``, mmrl/interventions.py)."""
    return np.clip(np.asarray(observations, dtype=np.float32)[:, 2:] / 0.2, -1.0, 1.0)
