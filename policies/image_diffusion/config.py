"""Config of the image generator over ``diffusers`` denoisers (``image_diffusion``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.core.config import PolicyConfig
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import DIFFUSION_TRANSITIONS
from mmrl.errors import ConfigError

# What each family of transitions takes from the denoiser: an ε-prediction diffusion step
# converts epsilon / v_prediction / sample outputs to ε; a flow step takes the velocity.
DIFFUSION_PREDICTIONS = ("epsilon", "v_prediction", "sample")
FLOW_PREDICTIONS = ("velocity",)


@dataclass
class TinyDenoiserConfig:
    """The ``tiny:`` section: a small diffusers UNet with random weights in pixel space
    (and, for text prompts, a small CLIP text encoder with mmrl's byte-level tokenizer),
    built from configs; nothing is downloaded."""

    conditioning: Literal["class", "text", "none"] = option(
        "class",
        "class: UNet2DModel with a class embedding (the prompt sampler's condition ids, plus one null class for guidance); text: UNet2DConditionModel cross-attending to a CLIP text encoder; none: unconditional UNet2DModel",
    )
    resolution: int = option(16, "height and width of the generated RGB images in pixels (a multiple of 2^(len(block_out_channels) - 1))", ge=4)
    block_out_channels: list[int] = option(factory=lambda: [8, 16], doc="channels of the UNet's resolution levels (each a multiple of norm_num_groups)")
    layers_per_block: int = option(1, "residual blocks per UNet level", ge=1)
    norm_num_groups: int = option(4, "groups of the UNet's group norms", ge=1)
    attention_head_dim: int = option(4, "text: width of a cross-attention head", ge=1)
    text_hidden_size: int = option(16, "text: width of the CLIP text encoder (= the UNet's cross-attention dim)", ge=1)
    text_layers: int = option(1, "text: transformer layers of the text encoder", ge=1)
    text_heads: int = option(2, "text: attention heads of the text encoder (must divide text_hidden_size)", ge=1)
    max_prompt_tokens: int = option(16, "text: the tokenizer's model_max_length and the text encoder's positions", ge=1)
    text_injection: Literal["cross_attention", "pooled"] = option(
        "cross_attention",
        "text: how the UNet reads the prompt: cross_attention (cross-attention blocks at the first level) or pooled (the text states attention-pooled and added to the timestep embedding, diffusers' addition_embed_type text; no attention blocks, several times cheaper)",
    )
    pooling_heads: int = option(4, "text, pooled: heads of the attention pooling (must divide text_hidden_size)", ge=1)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if not self.block_out_channels or any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ConfigError(p + "block_out_channels", self.block_out_channels, f"expected one or more channel counts, each a multiple of norm_num_groups ({self.norm_num_groups})")
        if self.resolution % 2 ** (len(self.block_out_channels) - 1):
            raise ConfigError(p + "resolution", self.resolution, f"must be a multiple of {2 ** (len(self.block_out_channels) - 1)} (the UNet halves it between its levels)")
        if self.text_hidden_size % self.text_heads:
            raise ConfigError(p + "text_heads", self.text_heads, f"must divide text_hidden_size ({self.text_hidden_size})")
        if self.text_injection == "pooled" and self.text_hidden_size % self.pooling_heads:
            raise ConfigError(p + "pooling_heads", self.pooling_heads, f"must divide text_hidden_size ({self.text_hidden_size})")


@dataclass
class ImageDiffusionConfig(PolicyConfig):
    """An image generator over a diffusers UNet (class-, text- or un-conditioned), whose
    denoising steps are the RL decisions (DDPO with ddim/ddpm, Flow-GRPO with flow_sde)."""

    type: str = option("image_diffusion", "registered name of this component (see `mmrl list`)")
    model_path: str | None = option(
        None,
        "local directory laid out like a diffusers pipeline: unet/ (UNet2DModel or UNet2DConditionModel), text_encoder/ + tokenizer/ for text prompts, optional scheduler/ (its training schedule and prediction type are checked against denoising); null = the random tiny model of `tiny`",
    )
    tiny: TinyDenoiserConfig = option(factory=TinyDenoiserConfig, doc="the random tiny model built when model_path is null")
    prediction_type: Literal["epsilon", "v_prediction", "sample", "velocity"] | None = option(
        None,
        "what the UNet predicts: epsilon, v_prediction or sample (the clean image) for the diffusion transitions (ddim, ddpm; converted to ε), velocity (noise - image) for the flow ones; null = the scheduler's prediction_type in model_path, else epsilon (diffusion) or velocity (flow)",
    )
    flow_time_scale: float = option(1000.0, "flow transitions: the UNet's timestep is sigma times this (1000 as diffusers' flow-matching pipelines; 1 for a model trained on sigma itself)", gt=0)
    guidance_scale: float = option(1.0, "classifier-free guidance w: output = uncond + w (cond - uncond), when sampling and in log-probs; 1 = no guidance (one UNet pass)", ge=0)
    guidance_grad: Literal["detached", "both"] = option(
        "detached", "with guidance, whether the gradient flows through the conditional branch only (detached: the unconditional pass runs without grad) or through both"
    )
    condition_dropout: float = option(0.1, "sft_loss: probability of training a sample on the null condition (null class / empty prompt), which guidance needs", ge=0, le=1)
    max_prompt_tokens: int | None = option(None, "text: prompts are padded / truncated to this many tokens (at most the text encoder's positions); null = the tokenizer's model_max_length (77 for CLIP)", ge=1)
    train_text_encoder: bool = option(False, "text: also train the text encoder (default: frozen, only the UNet learns)")
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(transition="ddim", num_inference_steps=8, eta=1.0, min_std=0.01, beta_schedule="linear", clip_denoised=1.0),
        doc="the denoising chain: transition (ddim / ddpm for noise-predicting UNets, flow_* for velocity ones), steps, which steps are decisions, log-prob options",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        self.tiny.validate(p + "tiny")
        self.denoising.validate(p + "denoising")
        if self.prediction_type is not None:
            allowed = self.allowed_predictions
            if self.prediction_type not in allowed:
                raise ConfigError(p + "prediction_type", self.prediction_type, f"transition {self.denoising.transition} takes one of {list(allowed)}")
        if self.denoising.transition == "flow_noise":
            raise ConfigError(p + "denoising.transition", "flow_noise", "needs a learned noise head, which a diffusers UNet does not have; use flow_sde, flow_cps or flow_ode")

    @property
    def is_diffusion(self) -> bool:
        return self.denoising.transition in DIFFUSION_TRANSITIONS

    @property
    def allowed_predictions(self) -> tuple[str, ...]:
        return DIFFUSION_PREDICTIONS if self.is_diffusion else FLOW_PREDICTIONS
