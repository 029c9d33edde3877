"""Config of the Gaussian MLP policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.core.component_config import PolicyConfig


@dataclass
class GaussianMLPConfig(PolicyConfig):
    """A Gaussian policy whose mean is an MLP of the (flat) observation."""

    type: str = option("gaussian_mlp", "registered name of this component (see `mmrl list`)")
    hidden_sizes: list[int] = option(factory=lambda: [64, 64], doc="widths of the hidden layers of the mean MLP")
    activation: Literal["tanh", "relu"] = option("tanh", "activation between hidden layers")
    init_log_std: float = option(-0.5, "initial log standard deviation of every action dimension (normalized action space)")
    min_log_std: float = option(-5.0, "lower clamp of the log standard deviation")
    max_log_std: float = option(1.0, "upper clamp of the log standard deviation")
    action_chunk: int = option(1, "actions emitted per decision (an action chunk; the env executes them in turn)", ge=1)
    squash: Literal["none", "tanh"] = option(
        "none",
        "tanh: a tanh-squashed Gaussian (SAC, Brax PPO): the normalized action is tanh of the Gaussian sample, inside the env's bounds without clipping, its log-prob with the change of variables; none: the sample as it is (the env sampler clips it)",
    )
    state_dependent_std: bool = option(False, "the MLP also outputs the log std (otherwise one learned log std per action dimension)")
    obs_norm: bool = option(False, "normalize observations by running mean/std (updated while sampling stochastically, saved with the weights)")
    obs_norm_update: Literal["auto", "always", "never"] = option(
        "auto",
        "when obs_norm's statistics take in new observations: always; never (kept as loaded); auto = always, except for a policy that starts from pretrained weights, whose network was fitted to its loaded statistics (they stay fixed, as LeRobot's dataset statistics do)",
    )
    final_log_std: float | None = option(None, "anneal the exploration noise: cap the log std at a value going linearly from init_log_std to this over log_std_anneal_decisions sampled decisions (null = no cap)")
    log_std_anneal_decisions: int = option(200_000, "decisions sampled stochastically in training mode (env steps for chunk 1, summed over this process's envs) over which the log std cap reaches final_log_std", ge=1)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.min_log_std > self.max_log_std:
            raise ConfigError(p + "min_log_std", self.min_log_std, f"must be <= max_log_std ({self.max_log_std})")
        if self.final_log_std is not None and self.final_log_std > self.init_log_std:
            raise ConfigError(p + "final_log_std", self.final_log_std, f"must be <= init_log_std ({self.init_log_std}): the cap anneals the noise down")
        if any(width < 1 for width in self.hidden_sizes):
            raise ConfigError(p + "hidden_sizes", self.hidden_sizes, "every width must be >= 1")
