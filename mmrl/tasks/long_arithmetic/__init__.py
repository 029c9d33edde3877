"""Arithmetic with large numbers, answered exactly (``mmrl/LongArithmetic-v0``): a text task for
agents with a calculator, the task of the tool env's tests and docs. Importing this package
registers the gymnasium id; the env is built from env.py."""

import gymnasium

gymnasium.register(id="mmrl/LongArithmetic-v0", entry_point="mmrl.tasks.long_arithmetic.env:LongArithmeticEnv")
