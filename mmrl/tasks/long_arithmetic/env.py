"""``mmrl/LongArithmetic-v0``: compute an expression of large integers exactly, in text.

A task that a calculator or a Python tool makes easy and mental arithmetic does not: at
reset ``terms`` integers of ``digits`` digits each and the operators between them (from
``operators``) are drawn from the reset seed, and the observation asks for the value. The
agent's one action is its answer: the last integer in the text (digit groups written with
``,`` or ``_`` are read as one number) must equal the value exactly. Reward 1 and
``info["success"]`` True when it does, 0 otherwise; either way the episode ends.

``env: {type: tools, id: mmrl/LongArithmetic-v0, tools: [calculator]}`` puts it behind the
tool env (envs/tool_env.py), whose turns call tools until the agent answers.
"""

from __future__ import annotations

import re

import gymnasium
from gymnasium import spaces

_INTEGER = re.compile(r"-?\d(?:[\d,_]*\d)?")
# printable ASCII: what the observations and the agent's answers may hold
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n"


def stated_answer(text: str) -> int | None:
    """The last integer in ``text`` (``1,234,567`` and ``1_234_567`` read as one); None without one."""
    found = _INTEGER.findall(str(text))
    return int(found[-1].replace(",", "").replace("_", "")) if found else None


class LongArithmeticEnv(gymnasium.Env):
    """Compute ``a op b op c ...`` of large integers exactly; one answer per episode."""

    metadata = {"render_modes": []}

    def __init__(self, digits: int = 12, terms: int = 3, operators: str = "+-*", max_text: int = 512):
        if digits < 1 or terms < 2:
            raise ValueError(f"need digits >= 1 and terms >= 2, got digits={digits}, terms={terms}")
        if not operators or set(operators) - set("+-*"):
            raise ValueError(f"operators must be drawn from '+-*', got {operators!r}")
        self.digits, self.terms, self.operators = digits, terms, operators
        self.observation_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.action_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.expression, self.value = "", 0

    def _number(self) -> int:
        first = int(self.np_random.integers(1, 10))
        rest = self.np_random.integers(0, 10, size=self.digits - 1)
        return int(str(first) + "".join(str(int(d)) for d in rest))

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        parts = [str(self._number())]
        for _ in range(self.terms - 1):
            parts += [self.operators[int(self.np_random.integers(len(self.operators)))], str(self._number())]
        self.expression = " ".join(parts)
        self.value = _evaluate(parts)
        return f"Compute {self.expression} exactly. Give the integer.", {"success": False}

    def step(self, action: str):
        success = stated_answer(action) == self.value
        return "Correct." if success else "Wrong.", float(success), True, False, {"success": success}


def _evaluate(parts: list[str]) -> int:
    """``a op b op c ...`` with * before + and - (parsed by hand: no eval)."""
    sums, sign, product = 0, 1, int(parts[0])
    for op, number in zip(parts[1::2], parts[2::2]):
        if op == "*":
            product *= int(number)
        else:
            sums += sign * product
            sign, product = (1 if op == "+" else -1), int(number)
    return sums + sign * product
