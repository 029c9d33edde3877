"""Registers ``mmrl/LongArithmetic-v0`` (mmrl/tasks/long_arithmetic): arithmetic on numbers too
long to do in the head, the text task of the tool env's tests and docs."""

import gymnasium

gymnasium.register(id="mmrl/LongArithmetic-v0", entry_point="mmrl.tasks.long_arithmetic.env:LongArithmeticEnv")
