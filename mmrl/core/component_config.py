"""Base sections of the component configs (``env``, ``policy``, ``sampler``, each reward).

A component's own config subclasses one of these and is registered with the component, so
``type:`` in YAML picks both. They live in the core so that envs, policies, samplers and
rewards never import the training package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import Component, option
from mmrl.env_wrappers import WrapperConfig


@dataclass
class EnvConfig(Component):
    """Base of env sections; the ``type`` picks an adapter from ``mmrl list envs``."""

    id: str = option("", "environment id (a gymnasium id, or the simulator's own task id)")
    num_envs: int = option(8, "parallel environments in the vector env", ge=1)
    vectorization: Literal["sync", "async"] = option("sync", "gymnasium vector env kind (async = one process per env)")
    max_episode_steps: int | None = option(None, "override of the env's time limit (null keeps the env's own)", ge=1)
    success_key: str | None = option(None, "info key of the env's per-step success flag (null = the first the env reports of: success, is_success, succeed)")
    wrappers: list[WrapperConfig] = option(
        factory=list, doc="gymnasium wrappers applied to each single env before vectorization, first innermost: [{type: 'package.module:Class', kwargs: {...}}]"
    )


@dataclass
class PolicyConfig(Component):
    """Base of policy sections; the ``type`` picks a family from ``mmrl list policies``."""

    pretrained: str | None = option(None, "local directory of saved weights (config.yaml + model.safetensors) to start from")


@dataclass
class SamplerConfig(Component):
    """Base of sampler sections: ``env`` (simulators) or ``prompt`` (prompts/conditions)."""


@dataclass
class RewardConfig(Component):
    """Base of reward components; the ``type`` picks one from ``mmrl list rewards``."""

    weight: float = option(1.0, "weight of this component in the reward aggregation")
    device: str | None = option(None, "device of a model-backed reward (null = the training device)")
