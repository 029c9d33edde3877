"""Config of the flow-matching VLA policy (π0 style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.policies.vla.backbone import VLABackboneConfig
from mmrl.train.config import PolicyConfig


@dataclass
class FlowVLAConfig(PolicyConfig):
    """A vision-language backbone + a flow-matching action expert emitting action chunks (π0 style; RL as πRL)."""

    type: str = option("flow_vla", "registered name of this component (see `mmrl list`)")
    backbone: VLABackboneConfig = option(factory=VLABackboneConfig, doc="image encoder, instruction embeddings and transformer decoder")
    action_chunk: int = option(4, "actions emitted per decision (the denoised chunk is action_chunk x action_dim)", ge=1)
    expert_layers: int = option(2, "transformer layers of the action expert (self-attention over the chunk, cross-attention to the backbone's prefix)", ge=1)
    expert_heads: int = option(4, "attention heads of the action expert (must divide backbone.hidden_size)", ge=1)
    num_denoising_steps: int = option(5, "Euler steps K from noise (sigma = 1) to the action chunk (sigma = 0)", ge=1)
    time_shift: float = option(1.0, "SD3 time shift of the sigma schedule (> 1 spends more steps at high noise)", gt=0)
    noise_method: Literal["flow_sde", "flow_noise"] = option("flow_sde", "how stochastic steps get their noise: the flow's SDE with noise_level (Flow-SDE), or a learned noise head (Flow-Noise)")
    noise_level: float = option(0.5, "Flow-SDE noise level a: sigma_t = a * sqrt(sigma / (1 - sigma))", gt=0)
    sde_steps: Literal["all", "one"] = option("all", "stochastic steps of a chunk: all of them (joint log-prob), or one chosen at random per chunk (the others ODE; the choice is kept in the replay)")
    sde_first_steps: int | None = option(None, "only the first N denoising steps (the high-noise ones) may be stochastic, the rest are ODE (a window as in MixGRPO / Flow-GRPO-Fast); null = any step", ge=1)
    noise_std_range: list[float] = option(factory=lambda: [0.05, 0.3], doc="Flow-Noise: the learned std of every action number lies in [lo, hi] (log-uniform squashing)")
    time_sampling: Literal["beta", "uniform"] = option("beta", "flow-matching training times: sigma = 0.001 + 0.999 u with u ~ Beta(1.5, 1) (pi0, weighting noisy times) or u ~ U(0, 1)")
    logp_granularity: Literal["chunk", "step"] = option("chunk", "what one RL decision is: the whole chunk (joint log-likelihood of its denoising chain, one ratio per chunk) or every denoising step (a ratio per step, clipped separately, as Flow-GRPO and DPPO)")
    logp_reduction: Literal["sum", "mean"] = option("sum", "per-step log-prob summed over the chunk's C x A numbers, or averaged (wants a much smaller clip range)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.backbone.hidden_size % self.expert_heads:
            raise ConfigError(p + "expert_heads", self.expert_heads, f"must divide backbone.hidden_size ({self.backbone.hidden_size})")
        if self.backbone.hidden_size % 2:
            raise ConfigError(p + "backbone.hidden_size", self.backbone.hidden_size, "must be even (sinusoidal time features)")
        lo_hi = self.noise_std_range
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
            raise ConfigError(p + "noise_std_range", lo_hi, "expected [lo, hi] with 0 < lo <= hi")
        if self.sde_first_steps is not None and not 1 <= self.sde_first_steps <= self.num_denoising_steps:
            raise ConfigError(p + "sde_first_steps", self.sde_first_steps, f"must be in [1, num_denoising_steps = {self.num_denoising_steps}] or null")
        self.backbone.validate(p + "backbone")
