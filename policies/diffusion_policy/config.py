"""Config of the diffusion policy (DPPO style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.train.config import PolicyConfig


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
    num_train_timesteps: int = option(100, "DDPM training timesteps T", ge=1)
    beta_schedule: Literal["cosine", "linear", "scaled_linear"] = option("cosine", "DDPM noise schedule (cosine: Nichol & Dhariwal 2021, DPPO's default)")
    sampler: Literal["ddim", "ddpm"] = option("ddim", "denoising steps: DDIM with stochasticity eta, or ancestral DDPM posterior steps")
    num_denoising_steps: int = option(10, "denoising steps K of a sampled chain (trailing timestep spacing)", ge=1)
    ft_denoising_steps: int = option(5, "the last K' denoising steps are stochastic and trained (DPPO); each is one decision, the earlier ones are deterministic DDIM", ge=1)
    eta: float = option(1.0, "DDIM stochasticity of the stochastic steps (1: the DDPM posterior variance)", gt=0)
    min_logprob_std: float = option(0.1, "floor of the std of stochastic steps, when sampling and in log-probs (DPPO); the last step's std is 0 without it", gt=0)
    clip_denoised: float | None = option(1.0, "clip the predicted clean chunk x0 to +-this (normalized action units) inside each step; null: no clipping", gt=0)
    logp_reduction: Literal["sum", "mean"] = option("sum", "per-step log-prob summed over the chunk's C x A numbers, or averaged (DPPO; wants a much smaller clip range)")
    logp_element_clamp: list[float] | None = option(None, "clamp per-element log-densities to [lo, hi] before the reduction (DPPO uses [-5, 2]); null: no clamp")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.num_denoising_steps > self.num_train_timesteps:
            raise ConfigError(p + "num_denoising_steps", self.num_denoising_steps, f"must be <= num_train_timesteps ({self.num_train_timesteps})")
        if self.ft_denoising_steps > self.num_denoising_steps:
            raise ConfigError(p + "ft_denoising_steps", self.ft_denoising_steps, f"must be <= num_denoising_steps ({self.num_denoising_steps})")
        if self.hidden_size % 2:
            raise ConfigError(p + "hidden_size", self.hidden_size, "must be even (sinusoidal time features)")
        if not self.vision_channels or any(c < 1 for c in self.vision_channels):
            raise ConfigError(p + "vision_channels", self.vision_channels, "expected a non-empty list of positive channel counts")
        clamp = self.logp_element_clamp
        if clamp is not None and (len(clamp) != 2 or not clamp[0] < clamp[1]):
            raise ConfigError(p + "logp_element_clamp", clamp, "expected [lo, hi] with lo < hi, or null")
