"""Reward functions ``(rollout, cfg) -> Tensor[B]`` and reward models, registered by name.

Each module registers its rewards (``@REWARDS.register``); the registry imports every module
of this package (and of :mod:`mmrl.tasks`, whose demo worlds keep their own rewards) on
first lookup, so a new reward is its module alone.
"""
