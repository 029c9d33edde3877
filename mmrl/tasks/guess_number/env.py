"""``mmrl/GuessNumber-v0``: guess a hidden number from "higher"/"lower" feedback, in text.

A language agent's first env (docs/agents.md): the observation and the action are text, one
action is one turn of the agent. At reset a number is drawn uniformly from [low, high] (from
the reset seed); the first observation asks for it. Each turn the first integer in the
agent's text is its guess:

- right: "Correct!", reward 1, the episode ends (``info["success"]`` True);
- too low / too high: "Higher." / "Lower.", reward 0;
- no integer, or one outside [low, high]: a reminder of the range, reward 0.

The time limit (``max_episode_steps``, 6 by default at registration, so that binary search
over 1..16 always fits) truncates an episode that has not found the number. Credit spans the
turns: only the last turn is rewarded, and it is right only if the earlier guesses narrowed
the range. ``info["guesses"]`` counts valid guesses so far.
"""

from __future__ import annotations

import re

import gymnasium
from gymnasium import spaces

_INTEGER = re.compile(r"-?\d+")
# printable ASCII: what the observations and the agent's turns may hold
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n"


class GuessNumberEnv(gymnasium.Env):
    """Find a number in [low, high] from higher/lower feedback; text in, text out."""

    metadata = {"render_modes": []}

    def __init__(self, low: int = 1, high: int = 16, max_text: int = 256):
        if high <= low:
            raise ValueError(f"high ({high}) must exceed low ({low})")
        self.low, self.high = int(low), int(high)
        self.observation_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.action_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.secret = self.low
        self.guesses = 0

    @property
    def instruction(self) -> str:
        return f"I am thinking of a number between {self.low} and {self.high}. Guess it."

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.low, self.high + 1))
        self.guesses = 0
        return self.instruction, {"success": False, "guesses": 0}

    def step(self, action: str):
        found = _INTEGER.search(str(action))
        guess = int(found.group()) if found else None
        if guess is None or not self.low <= guess <= self.high:
            return f"Say one number between {self.low} and {self.high}.", 0.0, False, False, {"success": False, "guesses": self.guesses}
        self.guesses += 1
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {"success": True, "guesses": self.guesses}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, False, {"success": False, "guesses": self.guesses}
