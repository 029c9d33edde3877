"""Config of the flow-matching VLA policy (π0 style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import FLOW_TRANSITIONS
from mmrl.errors import ConfigError
from mmrl.policies.vla.backbone import VLABackboneConfig
from mmrl.core.component_config import PolicyConfig


@dataclass
class FlowVLAConfig(PolicyConfig):
    """A vision-language backbone + a flow-matching action expert emitting action chunks (π0 style; RL as πRL)."""

    type: str = option("flow_vla", "registered name of this component (see `mmrl list`)")
    backbone: VLABackboneConfig = option(factory=VLABackboneConfig, doc="image encoder, instruction embeddings and transformer decoder")
    action_chunk: int = option(4, "actions emitted per decision (the denoised chunk is action_chunk x action_dim)", ge=1)
    expert_layers: int = option(2, "transformer layers of the action expert (self-attention over the chunk, cross-attention to the backbone's prefix)", ge=1)
    expert_heads: int = option(4, "attention heads of the action expert (must divide its width)", ge=1)
    expert_hidden_size: int | None = option(
        None, "width of the action expert; null = the backbone's. A pretrained VLM's expert is usually narrower (pi0: a 300M expert beside a 3B VLM); its cross-attention then projects the VLM's states", ge=2
    )
    expert_intermediate_size: int | None = option(None, "width of the action expert's MLP; null = backbone.intermediate_size for the miniature, twice the expert's width on a pretrained VLM", ge=1)
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(transition="flow_sde", num_inference_steps=5, noise_level=0.5, logp_granularity="chain"),
        doc="the action expert's denoising chain (a flow transition): steps, noise, which steps are stochastic, what one decision is (default: one per action chunk)",
    )
    time_sampling: Literal["beta", "uniform"] = option("beta", "flow-matching training times: sigma = 0.001 + 0.999 u with u ~ Beta(1.5, 1) (pi0, weighting noisy times) or u ~ U(0, 1)")
    compile_denoiser: bool = option(False, "sampling (no grad) runs the denoiser step network through torch.compile at fixed shapes (CUDA graphs on CUDA; one compile per batch size, ~20 s on a CPU): fewer launches per step; log_prob's recompute stays eager, so it needs denoising.old_logp: deferred (ratios of exactly 1)")
    compile_prefix: bool = option(False, "sampling (no grad) runs the backbone's pass over the prefix through torch.compile at fixed shapes (CUDA graphs on CUDA; one compile per batch size): fewer launches per chunk; log_prob's recompute stays eager, so it needs denoising.old_logp: deferred (ratios of exactly 1)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.denoising.transition not in FLOW_TRANSITIONS:
            allowed = ", ".join(FLOW_TRANSITIONS)
            raise ConfigError(p + "denoising.transition", self.denoising.transition, f"flow_vla's action expert predicts a velocity; allowed: {allowed}")
        for field in ("compile_denoiser", "compile_prefix"):
            if getattr(self, field) and self.denoising.old_logp != "deferred":
                raise ConfigError(p + field, True, "the compiled sampling pass rounds otherwise than log_prob's eager recompute: it needs denoising.old_logp: deferred (ratios of exactly 1)")
        self.denoising.validate(p + "denoising")
        width = self.expert_hidden_size or self.backbone.hidden_size
        if self.backbone.vlm_path is None or self.expert_hidden_size is not None:  # else the VLM's width, checked when it loads
            if width % self.expert_heads:
                raise ConfigError(p + "expert_heads", self.expert_heads, f"must divide the expert's width ({width})")
        if self.expert_hidden_size is not None and self.expert_hidden_size % 2:
            raise ConfigError(p + "expert_hidden_size", self.expert_hidden_size, "must be even (sinusoidal time features)")
        if self.backbone.vlm_path is None and self.backbone.hidden_size % 2:
            raise ConfigError(p + "backbone.hidden_size", self.backbone.hidden_size, "must be even (sinusoidal time features)")
        self.backbone.validate(p + "backbone")
