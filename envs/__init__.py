"""Environments: tasks that ship with mmrl and adapters for external simulators.

Importing this package imports every module in it, and each registers what it defines: the
env adapters (``gym``, ``maniskill``, ``libero``, ...) and mmrl's gymnasium ids
(``mmrl/PointReach-v0``, ``mmrl/Tabletop-v0``), so a new env is its module or folder alone.
Simulators are imported only when an env is built.
"""

from mmrl.registry import import_all

import_all(__name__)
