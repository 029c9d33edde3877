"""Spawned workers of a test run under ``MMRL_SHAPE_KERNELS=1`` enter the same mode
(``tests/kernel_emulation``); ``tests/conftest.py`` puts this folder on ``PYTHONPATH``."""

import os
import sys

if os.environ.get("MMRL_SHAPE_KERNELS") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.kernel_emulation import enable

    enable()
