"""``PluginReach-v0``: a point on a line moves to a target; the smallest useful gymnasium env.

- observation: ``[x, target - x]`` (float32)
- action: a velocity in ``[-1, 1]``; ``x`` moves by ``step_size * action`` within ``[-1, 1]``
- reward: ``-|target - x|`` after the move
- ``info["success"]``: within ``tolerance`` of the target; the episode then terminates, and
  is truncated after ``max_steps``

Start and target come from the reset seed, which is what mmrl needs so that the copies
of a group (reset with one seed) share their initial state.
"""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces


class PluginReachEnv(gymnasium.Env):
    """A point on [-1, 1] reaches a random target."""

    metadata = {"render_modes": []}

    def __init__(self, max_steps: int = 10, step_size: float = 0.3, tolerance: float = 0.1):
        self.max_steps, self.step_size, self.tolerance = max_steps, step_size, tolerance
        self.observation_space = spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self._x = self._target = 0.0
        self._t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._x, self._target - self._x], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._x, self._target = (float(v) for v in self.np_random.uniform(-1.0, 1.0, size=2))
        self._t = 0
        return self._obs(), {"success": False}

    def step(self, action):
        self._x = float(np.clip(self._x + self.step_size * float(np.clip(action[0], -1.0, 1.0)), -1.0, 1.0))
        self._t += 1
        distance = abs(self._target - self._x)
        success = distance < self.tolerance
        truncated = not success and self._t >= self.max_steps
        return self._obs(), -distance, success, truncated, {"success": success}
