"""Config of the diffusion policy (DPPO style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import DIFFUSION_TRANSITIONS
from mmrl.errors import ConfigError
from mmrl.core.component_config import PolicyConfig


@dataclass
class DiffusionPolicyConfig(PolicyConfig):
    """A DDPM noise-prediction policy over action chunks, fine-tuned on its last denoising steps (DPPO)."""

    type: str = option("diffusion_policy", "registered name of this component (see `mmrl list`)")
    action_chunk: int = option(4, "actions emitted per decision (the denoised chunk is action_chunk x action_dim)", ge=1)
    hidden_size: int = option(128, "width of the observation encoding and of the denoiser MLP", ge=2)
    num_layers: int = option(3, "residual blocks of the denoiser MLP", ge=1)
    vision_channels: list[int] = option(factory=lambda: [16, 32], doc="output channels of the image CNN's stride-2 3x3 convs (each halves H and W)")
    image_pooling: Literal["grid", "spatial_softmax"] = option("grid", "how the CNN feature map becomes a vector: average-pooled to an image_grid x image_grid grid, or the expected coordinates of learned keypoints (spatial softmax)")
    image_grid: int = option(8, "image_pooling grid: cells per side of the average-pooled feature map", ge=1)
    keypoints: int = option(32, "image_pooling spatial_softmax: learned keypoints (each gives an x, y)", ge=1)
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(
            transition="ddim",
            num_inference_steps=10,
            num_train_timesteps=100,
            beta_schedule="cosine",
            eta=1.0,
            clip_denoised=1.0,
            stochastic_steps="last",
            window_size=5,
            min_std=0.1,
        ),
        doc="the denoising chain (ddim or ddpm over a DDPM schedule): steps, which of them are the decisions (DPPO: the last 5 of 10), log-prob options",
    )
    compile_denoiser: bool = option(False, "sampling (no grad) runs the denoiser step network through torch.compile at fixed shapes (CUDA graphs on CUDA; one compile per batch size, ~20 s on a CPU): fewer launches per step; log_prob's recompute stays eager, so it needs denoising.old_logp: deferred (ratios of exactly 1)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.denoising.transition not in DIFFUSION_TRANSITIONS:
            allowed = ", ".join(DIFFUSION_TRANSITIONS)
            raise ConfigError(p + "denoising.transition", self.denoising.transition, f"diffusion_policy predicts the noise (epsilon); allowed: {allowed}")
        if self.compile_denoiser and self.denoising.old_logp != "deferred":
            raise ConfigError(p + "compile_denoiser", True, "the compiled sampling pass rounds otherwise than log_prob's eager recompute: it needs denoising.old_logp: deferred (ratios of exactly 1)")
        self.denoising.validate(p + "denoising")
        if self.hidden_size % 2:
            raise ConfigError(p + "hidden_size", self.hidden_size, "must be even (sinusoidal time features)")
        if not self.vision_channels or any(c < 1 for c in self.vision_channels):
            raise ConfigError(p + "vision_channels", self.vision_channels, "expected a non-empty list of positive channel counts")
