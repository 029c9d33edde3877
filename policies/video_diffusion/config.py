"""Config of the video generator over a ``diffusers`` UNet3D (``video_diffusion``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import DIFFUSION_TRANSITIONS
from mmrl.errors import ConfigError
from mmrl.policies.diffusers_common import DIFFUSION_PREDICTIONS, FLOW_PREDICTIONS


@dataclass
class TinyVideoDenoiserConfig:
    """The ``tiny:`` section: a small diffusers ``UNet3DConditionModel`` with random weights
    over RGB pixels, cross-attending to a learned embedding of the condition or to a small
    CLIP text encoder's states; nothing is downloaded."""

    conditioning: Literal["class", "text", "none"] = option(
        "class",
        "class: one learned condition embedding per prompt-sampler condition id (plus one null condition for guidance) that the UNet cross-attends to; text: a small frozen CLIP text encoder over prompt strings (mmrl's byte-level tokenizer); none: a single learned embedding for every sample",
    )
    frames: int = option(4, "frames F of a generated video", ge=1)
    resolution: int = option(8, "height and width of the frames in pixels (a multiple of 2^(len(block_out_channels) - 1))", ge=4)
    block_out_channels: list[int] = option(factory=lambda: [8, 16], doc="channels of the UNet's resolution levels (each a multiple of norm_num_groups and of attention_heads)")
    layers_per_block: int = option(1, "residual blocks per UNet level", ge=1)
    norm_num_groups: int = option(4, "groups of the UNet's group norms", ge=1)
    attention_heads: int = option(4, "heads of the spatial cross-attention and of the temporal attention layers (diffusers' UNet3DConditionModel takes it as attention_head_dim)", ge=1)
    condition_dim: int = option(16, "width of the condition embedding or of the text encoder (the UNet's cross-attention dim)", ge=1)
    text_layers: int = option(1, "text: transformer layers of the text encoder", ge=1)
    text_heads: int = option(2, "text: attention heads of the text encoder (must divide condition_dim)", ge=1)
    max_prompt_tokens: int = option(16, "text: prompts are padded / truncated to this many tokens (the text encoder's positions)", ge=1)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        channels = self.block_out_channels
        if not channels or any(c % self.norm_num_groups for c in channels):
            raise ConfigError(p + "block_out_channels", channels, f"expected one or more channel counts, each a multiple of norm_num_groups ({self.norm_num_groups})")
        if any(c % self.attention_heads for c in channels):
            raise ConfigError(p + "attention_heads", self.attention_heads, f"must divide every entry of block_out_channels ({channels})")
        if self.conditioning == "text" and self.condition_dim % self.text_heads:
            raise ConfigError(p + "text_heads", self.text_heads, f"must divide condition_dim ({self.condition_dim})")
        if self.resolution % 2 ** (len(channels) - 1):
            raise ConfigError(p + "resolution", self.resolution, f"must be a multiple of {2 ** (len(channels) - 1)} (the UNet halves it between its levels)")


@dataclass
class VideoDiffusionConfig(PolicyConfig):
    """A short-video generator over a diffusers UNet3D (class-, text- or un-conditioned) whose
    denoising steps over the whole video latent are the RL decisions (DDPO with ddim/ddpm,
    Flow-GRPO with flow_sde), on the same denoising core as ``image_diffusion``."""

    type: str = option("video_diffusion", "registered name of this component (see `mmrl list`)")
    tiny: TinyVideoDenoiserConfig = option(factory=TinyVideoDenoiserConfig, doc="the random tiny model")
    prediction_type: Literal["epsilon", "v_prediction", "sample", "velocity"] | None = option(
        None,
        "what the UNet predicts: epsilon, v_prediction or sample (the clean video) for the diffusion transitions (ddim, ddpm; converted to ε), velocity (noise - video) for the flow ones; null = epsilon (diffusion) or velocity (flow)",
    )
    flow_time_scale: float = option(1000.0, "flow transitions: the UNet's timestep is sigma times this", gt=0)
    guidance_scale: float = option(1.0, "classifier-free guidance w: output = uncond + w (cond - uncond) on the null condition, when sampling and in log-probs (the unconditional pass runs without grad); 1 = no guidance", ge=0)
    condition_dropout: float = option(0.1, "sft_loss: probability of training a sample on the null condition, which guidance needs", ge=0, le=1)
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(transition="ddim", num_inference_steps=8, eta=1.0, min_std=0.01, beta_schedule="linear", clip_denoised=1.0),
        doc="the denoising chain: transition (ddim / ddpm for noise-predicting UNets, flow_sde / flow_cps / flow_ode for velocity ones), steps, which steps are decisions, log-prob options",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        self.tiny.validate(p + "tiny")
        self.denoising.validate(p + "denoising")
        if self.prediction_type is not None and self.prediction_type not in self.allowed_predictions:
            raise ConfigError(p + "prediction_type", self.prediction_type, f"transition {self.denoising.transition} takes one of {list(self.allowed_predictions)}")
        if self.denoising.transition == "flow_noise":
            raise ConfigError(p + "denoising.transition", "flow_noise", "needs a learned noise head, which a diffusers UNet does not have; use flow_sde, flow_cps or flow_ode")
        if self.tiny.conditioning == "none" and self.guidance_scale != 1:
            raise ConfigError(p + "guidance_scale", self.guidance_scale, "needs conditioning (tiny.conditioning: class or text); an unconditional model takes 1")

    @property
    def is_diffusion(self) -> bool:
        return self.denoising.transition in DIFFUSION_TRANSITIONS

    @property
    def allowed_predictions(self) -> tuple[str, ...]:
        return DIFFUSION_PREDICTIONS if self.is_diffusion else FLOW_PREDICTIONS
