"""``mmrl/GuessNumber-v0``: guess a hidden number from "higher"/"lower" feedback, in text.

A language agent's first env (docs/agents.md): the observation and the action are text, one
action is one turn of the agent. At reset a number is drawn uniformly from [low, high] (from
the reset seed); the first observation asks for it. A turn is a guess when its text is one
integer and nothing else (surrounding whitespace aside), so that random text with a digit in
it is not a guess (with the first integer anywhere counting, random bytes guess at random,
which finds a number in 1..8 within 4 turns 41% of the time):

- right: "Correct!", reward 1, the episode ends (``info["success"]`` True);
- too low / too high: "Higher." / "Lower.", reward 0;
- anything else, or a number outside [low, high]: a reminder of the range, reward 0.

With ``consistent_reward`` r > 0 a valid guess inside the range the feedback so far still
allows (above every "Higher." guess, below every "Lower." one) earns r on its turn: a per-turn
reward for using the feedback (credit per turn; with ``algo.advantage.step_reward_gate`` it
counts only in episodes that find the number).

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

    def __init__(self, low: int = 1, high: int = 16, max_text: int = 256, consistent_reward: float = 0.0):
        if high <= low:
            raise ValueError(f"high ({high}) must exceed low ({low})")
        self.low, self.high = int(low), int(high)
        self.observation_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.action_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.secret = self.low
        self.guesses = 0
        self.consistent_reward = float(consistent_reward)
        self.allowed = (self.low, self.high)  # the range the feedback so far leaves

    @property
    def instruction(self) -> str:
        return f"I am thinking of a number between {self.low} and {self.high}. Guess it."

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.low, self.high + 1))
        self.guesses = 0
        self.allowed = (self.low, self.high)
        return self.instruction, {"success": False, "guesses": 0}

    def step(self, action: str):
        found = _INTEGER.fullmatch(str(action).strip())
        guess = int(found.group()) if found else None
        if guess is None or not self.low <= guess <= self.high:
            return f"Say one number between {self.low} and {self.high}.", 0.0, False, False, {"success": False, "guesses": self.guesses}
        self.guesses += 1
        lo, hi = self.allowed
        shaped = self.consistent_reward if lo <= guess <= hi else 0.0
        if guess == self.secret:
            return "Correct!", 1.0 + shaped, True, False, {"success": True, "guesses": self.guesses}
        self.allowed = (max(lo, guess + 1), hi) if guess < self.secret else (lo, min(hi, guess - 1))
        return ("Higher." if guess < self.secret else "Lower."), shaped, False, False, {"success": False, "guesses": self.guesses}
