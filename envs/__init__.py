"""Environments: tasks that ship with mmrl and adapters for external simulators.

Importing this package registers mmrl's gymnasium ids (``mmrl/PointReach-v0``,
``mmrl/Tabletop-v0``) and the env adapters (``gym``, ``maniskill``, ``libero``). Simulators are
imported only when an env is built.
"""

from mmrl.envs import gym, maniskill, point_reach, tabletop  # noqa: F401  (registration)
from mmrl.envs import libero  # noqa: F401  (registration)
