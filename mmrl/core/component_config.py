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
from mmrl.errors import ConfigError


@dataclass
class SuccessModelConfig:
    """``env.success_model``: P(success) of each decision's observation from a trained
    ``learned_success`` classifier; an episode succeeds once P >= threshold on ``debounce``
    consecutive decisions (mmrl/samplers/success.py)."""

    path: str = option("", "the classifier: a run directory of `mmrl train-reward` (its latest checkpoint) or a checkpoint / weights directory")
    threshold: float = option(0.5, "a decision counts as a success when P(success) >= threshold", gt=0.0, lt=1.0)
    debounce: int = option(2, "consecutive decisions at or above the threshold before the episode counts as a success", ge=1)
    terminates: bool = option(False, "in training, the decision where the learned success fires ends the episode (as an env whose success terminates)")
    batch_size: int = option(256, "observations scored per forward pass", ge=1)

    def validate(self, path: str) -> None:
        if not self.path:
            raise ConfigError(f"{path}.path" if path else "path", self.path, "required: a run directory of `mmrl train-reward` with a learned_success model, or its checkpoint directory")


@dataclass
class EnvConfig(Component):
    """Base of env sections; the ``type`` picks an adapter from ``mmrl list envs``."""

    id: str = option("", "environment id (a gymnasium id, or the simulator's own task id)")
    num_envs: int = option(8, "parallel environments in the vector env", ge=1)
    vectorization: Literal["sync", "async"] = option("sync", "gymnasium vector env kind (async = one process per env)")
    max_episode_steps: int | None = option(None, "override of the env's time limit (null keeps the env's own)", ge=1)
    success_key: str | None = option(None, "info key of the env's per-step success flag (null = the first the env reports of: success, is_success, succeed)")
    hide_success: bool = option(False, "training never reads the env's success flag (rewards see the learned success of success_model, or none); evaluation still counts it")
    success_model: SuccessModelConfig | None = option(None, "a learned_success classifier as the success that training reads (docs/learned_success.md); null = the env's flag")
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
