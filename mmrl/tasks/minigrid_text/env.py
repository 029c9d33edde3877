"""``mmrl/MiniGridText-v0``: a MiniGrid level played in words, seen in pictures.

An env for a vision-language agent (``policies/vlm_agent``, docs/agents_vlm.md): each
observation is a ``Dict`` of

- ``"text"``: feedback on the last action followed by the mission (the first observation:
  the mission and the action words), e.g. ``"You moved forward. Mission: get to the green
  goal square."``;
- ``"image"``: the agent's partial view (MiniGrid's ``get_pov_render``: the 7×7 cells in
  front of the agent, the agent at the bottom centre facing up), ``tile_size`` pixels per
  cell, uint8 [7·tile_size, 7·tile_size, 3] (56×56 at the default 8).

The action is text: one of the words ``left``, ``right``, ``forward``, ``pickup``, ``drop``,
``toggle``, ``done`` (surrounding whitespace, case and a final period tolerated), MiniGrid's
seven actions. Anything else is a no-op: the level does not step (its own step count, which
the reward and its ``max_steps`` read, does not move) and the observation reminds the agent
of the valid words; it still counts against the time limit of the registration
(``max_episode_steps``, 20 by default).

The reward is MiniGrid's (``1 − 0.9 · steps / max_steps`` on reaching the goal, else 0) and
``info["success"]`` is true on the step that reaches it (the level terminates with a positive
reward). The level is any MiniGrid id (``level``, default ``MiniGrid-Empty-5x5-v0``);
``level_kwargs`` go to its ``gymnasium.make``. Resets are deterministic by seed (MiniGrid's
own ``np_random``). ``minigrid`` is imported only when the env is built.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from mmrl.errors import MissingExtraError

ACTIONS = ("left", "right", "forward", "pickup", "drop", "toggle", "done")
# printable ASCII: what the observations and the agent's turns may hold
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n"
REMINDER = "Say one of: " + ", ".join(ACTIONS) + "."


def parse_action(text: str) -> int | None:
    """The MiniGrid action index of a turn (one action word; whitespace, case and a final
    period tolerated), or None."""
    word = str(text).strip().lower().rstrip(".").strip()
    return ACTIONS.index(word) if word in ACTIONS else None


def _name(obj) -> str:
    return f"{obj.color} {obj.type}" if getattr(obj, "color", None) else str(obj.type)


class MiniGridTextEnv(gymnasium.Env):
    """A MiniGrid level: text actions, observations of text feedback and the agent's view."""

    metadata = {"render_modes": []}

    def __init__(self, level: str = "MiniGrid-Empty-5x5-v0", tile_size: int = 8, max_text: int = 512, level_kwargs: dict[str, Any] | None = None):
        try:
            import minigrid  # noqa: F401  (registers the MiniGrid-* ids)
        except ImportError:
            raise MissingExtraError("minigrid", "minigrid", "mmrl/MiniGridText-v0") from None
        if tile_size < 1:
            raise ValueError(f"tile_size must be >= 1, got {tile_size}")
        self.level, self.tile_size, self.max_text = level, int(tile_size), int(max_text)
        # the level itself, without gymnasium.make's time limit: MiniGrid truncates at its max_steps
        self.grid_env = gymnasium.make(level, disable_env_checker=True, **(level_kwargs or {})).unwrapped
        side = self.grid_env.agent_view_size * self.tile_size
        self.observation_space = spaces.Dict({
            "text": spaces.Text(max_length=self.max_text, charset=CHARSET),
            "image": spaces.Box(0, 255, (side, side, 3), dtype=np.uint8),
        })
        self.action_space = spaces.Text(max_length=self.max_text, charset=CHARSET)
        self.mission = ""

    def _observation(self, text: str) -> dict:
        return {"text": text[: self.max_text], "image": self.grid_env.get_pov_render(self.tile_size)}

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        obs, _ = self.grid_env.reset(seed=seed)
        self.mission = str(obs["mission"])
        return self._observation(f"Mission: {self.mission}. {REMINDER}"), {"success": False}

    def step(self, action: str):
        index = parse_action(action)
        if index is None:
            return self._observation(f"Not an action. {REMINDER} Mission: {self.mission}."), 0.0, False, False, {"success": False}
        env = self.grid_env
        word = ACTIONS[index]
        position, carrying, front = tuple(env.agent_pos), env.carrying, env.grid.get(*env.front_pos)
        _, reward, terminated, truncated, _ = env.step(index)
        success = bool(terminated and reward > 0)
        if word in ("left", "right"):
            feedback = f"You turned {word}."
        elif word == "forward":
            feedback = "You moved forward." if tuple(env.agent_pos) != position else "You cannot move there."
            if front is not None and front.type == "lava":
                feedback = "You walked into lava."
        elif word == "pickup":
            feedback = f"You picked up the {_name(env.carrying)}." if env.carrying is not None and carrying is None else "There is nothing to pick up."
        elif word == "drop":
            feedback = f"You dropped the {_name(carrying)}." if carrying is not None and env.carrying is None else "You cannot drop anything here."
        elif word == "toggle":
            feedback = f"You toggled the {_name(front)}." if front is not None else "There is nothing to toggle."
        else:
            feedback = "You said done."
        if success:
            feedback += " You reached the goal!"
        return self._observation(f"{feedback} Mission: {self.mission}."), float(reward), bool(terminated), bool(truncated), {"success": success}

    def close(self):
        self.grid_env.close()

    def shortest_actions(self) -> list[str]:
        """The action words of a shortest walk from the agent's state to a goal cell (turns
        and moves through empty or walkable cells; breadth-first over position and
        direction), or [] when no goal is reachable that way. Demonstrations and tests walk it."""
        from collections import deque

        env = self.grid_env
        moves = ((1, 0), (0, 1), (-1, 0), (0, -1))  # MiniGrid's directions 0..3: right, down, left, up
        start = (*map(int, env.agent_pos), int(env.agent_dir))
        came: dict[tuple, tuple | None] = {start: None}
        queue = deque([start])
        while queue:
            state = queue.popleft()
            x, y, d = state
            cell = env.grid.get(x, y)
            if cell is not None and cell.type == "goal":
                path = []
                while came[state] is not None:
                    state, word = came[state]
                    path.append(word)
                return path[::-1]
            dx, dy = moves[d]
            ahead = env.grid.get(x + dx, y + dy)
            walkable = ahead is None or (ahead.can_overlap() and ahead.type != "lava")
            for word, nxt in (("left", (x, y, (d - 1) % 4)), ("right", (x, y, (d + 1) % 4)), ("forward", (x + dx, y + dy, d) if walkable else None)):
                if nxt is not None and nxt not in came:
                    came[nxt] = (state, word)
                    queue.append(nxt)
        return []
