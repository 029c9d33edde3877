"""Config of the DSRL policy: a small noise policy steering a frozen flow or diffusion policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.errors import ConfigError


@dataclass
class DSRLConfig(PolicyConfig):
    """A tanh-Gaussian MLP choosing the initial noise of a frozen flow or diffusion policy (DSRL, Wagenmaker et al. 2025)."""

    type: str = option("dsrl", "registered name of this component (see `mmrl list`)")
    policy: PolicyConfig = option(
        factory=PolicyConfig,
        doc="the frozen policy it steers: a policy section of a family that can act from a given noise (flow_vla, diffusion_policy, smolvla, pi0, pi05), its weights from its own pretrained or checkpoint",
    )
    inputs: Literal["features", "state", "features_and_state"] = option(
        "features_and_state",
        "what the noise policy and its critic read: the frozen policy's pooled features of the observation (computed in its decoding pass), the env's state vector, or both",
    )
    critic_privileged: bool = option(
        False, "the critic also reads the env's privileged observation (the simulator's state: mmrl/Tabletop-v0's env.kwargs.privileged_state), which the noise policy never sees (asymmetric actor-critic)"
    )
    hidden_sizes: list[int] = option(factory=lambda: [256, 256], doc="widths of the noise policy's hidden layers (ReLU)")
    noise_bound: float = option(1.5, "the chosen noise is noise_bound * tanh(u), u ~ N(mu(o), sigma(o)^2): within this many standard deviations of the base's N(0, I) (DSRL's action_magnitude)", gt=0)
    init_log_std: float = option(0.0, "initial log std of u (the head's bias): at 0 the first noises spread much as the base's own draws")
    min_log_std: float = option(-5.0, "lower clamp of the log std of u")
    max_log_std: float = option(2.0, "upper clamp of the log std of u")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if not self.policy.type:
            raise ConfigError(p + "policy.type", self.policy.type, "required: the frozen flow or diffusion policy to steer (a policy section with its type and weights)")
        if self.policy.type == "dsrl":
            raise ConfigError(p + "policy.type", "dsrl", "a DSRL policy steers a flow or diffusion policy, not another DSRL policy")
        if self.min_log_std > self.max_log_std:
            raise ConfigError(p + "min_log_std", self.min_log_std, f"must be <= max_log_std ({self.max_log_std})")
        if any(width < 1 for width in self.hidden_sizes):
            raise ConfigError(p + "hidden_sizes", self.hidden_sizes, "every width must be >= 1")
