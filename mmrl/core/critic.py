"""The critic of a learned value baseline (``critic:``; ``algo.advantage.type: gae``).

Two kinds:

- ``mlp``: a network of its own over the policy's critic inputs (``policy.critic_inputs(replay)``
  → [B, T, D]; by default the replay's ``obs`` or ``state``, as the policy stored them, e.g.
  normalized), as ManiSkill's and CleanRL's PPO keep actor and critic apart; or, with
  ``inputs: privileged``, over the env's ``"privileged"`` observation that the env sampler
  keeps in the replay beside the policy's (asymmetric actor-critic, Pinto et al. 2017: a
  critic that sees the simulator's state while the policy sees pixels);
- ``value_head``: one linear layer on the policy's own features (``policy.value_features(replay)``
  → [B, T, F], with their gradient: the trunk is shared), as RLinf's ``add_value_head`` puts
  one on a VLA's backbone.

:class:`ActorCritic` holds the policy and the critic as one module, so that the distributed
wrapper, the optimizer (one, with the critic's parameters beside the policy's) and gradient
clipping see both; ``forward(replay, value=True)`` returns the policy's output and the values
from one call. The critic's weights are saved in the checkpoint's state, not with the
policy's: a saved policy stays loadable without it, and rollout workers receive the policy
alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mmrl.config import option
from mmrl.errors import ConfigError

PRIVILEGED = "privileged"  # the replay entry of an env's critic-only observation (mmrl.samplers.env keeps it)


@dataclass
class CriticConfig:
    """The ``critic:`` section: the value network of ``algo.advantage.type: gae``."""

    type: Literal["none", "mlp", "value_head"] = option(
        "none", "none; mlp = a separate network over the policy's critic inputs (its observations); value_head = a linear head on the policy's own features (shared trunk)"
    )
    inputs: Literal["policy", "privileged"] = option(
        "policy",
        "mlp: what the network reads; policy = the policy's critic inputs (its observations); privileged = the env's \"privileged\" observation, which the env sampler keeps for the critic and never shows the policy (asymmetric actor-critic: e.g. the simulator's state beside a VLA that sees pixels; mmrl/Tabletop-v0's env.kwargs.privileged_state)",
    )
    hidden_sizes: list[int] = option(factory=lambda: [256, 256], doc="mlp: widths of the hidden layers")
    activation: Literal["tanh", "relu"] = option("tanh", "mlp: activation between hidden layers")
    value_coef: float = option(0.5, "weight of the value loss beside the policy loss (one optimizer step updates both)", ge=0)
    lr: float | None = option(
        None, "learning rate of the critic's own parameters, on optim's schedule (null = optim.lr): a critic often learns faster than a pretrained policy may move (e.g. 1e-3 beside 1e-4)", gt=0
    )
    warmup_steps: int = option(
        0, "training steps at the start of a run that train the critic only: the policy's gradients are dropped and self-imitation waits (verl's critic_warmup), so that a pretrained policy is not moved by the advantages of an untrained critic",
        ge=0,
    )
    value_clip: float | None = option(None, "clip the value's change from its value at sampling time to ±this in the loss (PPO's clipped value loss; null = unclipped)", gt=0)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if any(width < 1 for width in self.hidden_sizes):
            raise ConfigError(p + "hidden_sizes", self.hidden_sizes, "every width must be >= 1")
        if self.inputs == "privileged" and self.type == "value_head":
            raise ConfigError(p + "inputs", self.inputs, "a value head reads the policy's own features; privileged inputs need type: mlp")


class MLPCritic(nn.Module):
    """V(s) from the policy's critic inputs [B, T, D] → [B, T]."""

    def __init__(self, input_dim: int, cfg: CriticConfig):
        super().__init__()
        self.privileged = cfg.inputs == "privileged"
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[cfg.activation]
        layers: list[nn.Module] = []
        width = input_dim
        for hidden in cfg.hidden_sizes:
            layers += [nn.Linear(width, hidden), act()]
            width = hidden
        head = nn.Linear(width, 1)
        self.net = nn.Sequential(*layers, head)
        for layer in self.net:  # PPO's init: orthogonal, a unit-gain value head
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, gain=1.0 if layer is head else math.sqrt(2))
                nn.init.zeros_(layer.bias)

    def forward(self, policy, replay: dict[str, Any]) -> Tensor:
        inputs = replay[PRIVILEGED] if self.privileged else policy.critic_inputs(replay)
        return self.net(inputs.detach()).squeeze(-1)


class ValueHead(nn.Module):
    """V(s) = w·features + b on the policy's own features [B, T, F] → [B, T]."""

    def __init__(self, feature_dim: int):
        super().__init__()
        self.head = nn.Linear(feature_dim, 1)
        nn.init.orthogonal_(self.head.weight, gain=1.0)
        nn.init.zeros_(self.head.bias)

    def forward(self, policy, replay: dict[str, Any]) -> Tensor:
        return self.head(policy.value_features(replay)).squeeze(-1)


def build_critic(cfg: CriticConfig, policy) -> nn.Module:
    """The critic of ``cfg`` for ``policy``; a one-line error when the policy cannot feed it."""
    if cfg.type == "mlp" and cfg.inputs == "privileged":
        dim = (getattr(policy, "spec", None) or {}).get("privileged_dim")
        if dim is None:
            raise ConfigError("critic.inputs", "privileged", f"the env gives no {PRIVILEGED!r} observation (a Dict entry the env sampler keeps for the critic; on mmrl/Tabletop-v0 set env.kwargs.privileged_state: true)")
        return MLPCritic(int(dim), cfg)
    if cfg.type == "mlp":
        dim = policy.critic_input_dim
        if dim is None:
            raise ConfigError("critic.type", "mlp", f"policy {policy.config.type!r} gives no critic inputs (critic_inputs, critic_input_dim); use value_head if it has value_features")
        return MLPCritic(int(dim), cfg)
    if cfg.type == "value_head":
        dim = policy.value_feature_dim
        if dim is None:
            raise ConfigError("critic.type", "value_head", f"policy {policy.config.type!r} exposes no features for a value head (value_features, value_feature_dim); use mlp")
        return ValueHead(int(dim))
    raise ConfigError("critic.type", cfg.type, "allowed: mlp, value_head")


class ActorCritic(nn.Module):
    """The policy and its critic as one trained module (module docstring)."""

    def __init__(self, policy: nn.Module, critic: nn.Module):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, replay: dict[str, Any], mode: str = "log_prob", value: bool = False, **kwargs):
        if mode == "value":
            return self.critic(self.policy, replay)
        out = self.policy(replay, mode=mode, **kwargs)
        return (out, self.critic(self.policy, replay)) if value else out

