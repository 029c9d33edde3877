"""Config of the image generator over ``diffusers`` denoisers (``image_diffusion``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import DIFFUSION_TRANSITIONS
from mmrl.errors import ConfigError
from mmrl.policies.diffusers_common import DIFFUSION_PREDICTIONS, FLOW_PREDICTIONS, ImageLoraOptions

@dataclass
class TinyDenoiserConfig:
    """The ``tiny:`` section: a small diffusers denoiser with random weights — a UNet, an
    SD3-style transformer or a DiT — in pixel space or over a small VAE's latents (and, for
    text prompts, a small CLIP text encoder with mmrl's byte-level tokenizer), built from
    configs; nothing is downloaded."""

    denoiser: Literal["unet", "sd3_transformer", "dit_transformer"] = option(
        "unet",
        "unet: UNet2DModel / UNet2DConditionModel; sd3_transformer: SD3Transformer2DModel (text conditioning: joint attention to the prompt's token states, pooled projection of the prompt); dit_transformer: DiTTransformer2DModel (class conditioning, adaLN-zero)",
    )

    conditioning: Literal["class", "text", "none"] = option(
        "class",
        "class: UNet2DModel with a class embedding (the prompt sampler's condition ids, plus one null class for guidance); text: UNet2DConditionModel cross-attending to a CLIP text encoder; none: unconditional UNet2DModel",
    )
    resolution: int = option(16, "height and width of the generated RGB images in pixels (a multiple of 2^(len(block_out_channels) - 1))", ge=4)
    block_out_channels: list[int] = option(factory=lambda: [8, 16], doc="channels of the UNet's resolution levels (each a multiple of norm_num_groups)")
    layers_per_block: int = option(1, "residual blocks per UNet level", ge=1)
    norm_num_groups: int = option(4, "groups of the UNet's group norms", ge=1)
    attention_head_dim: int = option(4, "width of an attention head (the text UNet's cross-attention, the transformers' attention)", ge=1)
    transformer_heads: int = option(2, "sd3_transformer / dit_transformer: attention heads (the transformer's width is heads x attention_head_dim)", ge=1)
    transformer_layers: int = option(1, "sd3_transformer / dit_transformer: transformer blocks", ge=1)
    patch_size: int = option(2, "sd3_transformer / dit_transformer: side of the square patches of the latent that are the transformer's tokens", ge=1)
    vae: bool = option(False, "denoise in the latent space of a small random AutoencoderKL (the final latent is decoded to the images); false = pixel space")
    vae_block_out_channels: list[int] = option(factory=lambda: [8, 16], doc="vae: channels of the VAE's levels (each level after the first halves the resolution)")
    latent_channels: int = option(4, "vae: channels of the latent", ge=1)
    vae_scaling_factor: float = option(1.0, "vae: the denoiser's latent is (z - vae_shift_factor) * vae_scaling_factor of the VAE's z (diffusers' scaling_factor, 0.18215 for SD, 1.5305 for SD3)", gt=0)
    vae_shift_factor: float = option(0.0, "vae: diffusers' shift_factor (0.0609 for SD3; 0 = none)")
    text_hidden_size: int = option(16, "text: width of the CLIP text encoder (= the UNet's cross-attention dim)", ge=1)
    text_layers: int = option(1, "text: transformer layers of the text encoder (0: the token and position embeddings only)", ge=0)
    text_heads: int = option(2, "text: attention heads of the text encoder (must divide text_hidden_size)", ge=1)
    max_prompt_tokens: int = option(16, "text: the tokenizer's model_max_length and the text encoder's positions", ge=1)
    vocabulary: list[str] = option(
        factory=list,
        doc="text: the words of a word-level tokenizer (one token per word, lower-cased, split on whitespace and punctuation; other words become <unk>); empty = mmrl's byte-level tokenizer (one token per UTF-8 byte)",
    )
    text_injection: Literal["cross_attention", "pooled"] = option(
        "cross_attention",
        "text: how the UNet reads the prompt: cross_attention (cross-attention blocks at the first level) or pooled (the text states attention-pooled and added to the timestep embedding, diffusers' addition_embed_type text; no attention blocks, several times cheaper)",
    )
    pooling_heads: int = option(4, "text, pooled: heads of the attention pooling (must divide text_hidden_size)", ge=1)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if not self.block_out_channels or any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ConfigError(p + "block_out_channels", self.block_out_channels, f"expected one or more channel counts, each a multiple of norm_num_groups ({self.norm_num_groups})")
        if self.vae:
            if not self.vae_block_out_channels or any(c % self.norm_num_groups for c in self.vae_block_out_channels):
                raise ConfigError(p + "vae_block_out_channels", self.vae_block_out_channels, f"expected one or more channel counts, each a multiple of norm_num_groups ({self.norm_num_groups})")
            vae_factor = 2 ** (len(self.vae_block_out_channels) - 1)
            if self.resolution % vae_factor:
                raise ConfigError(p + "resolution", self.resolution, f"must be a multiple of {vae_factor} (the VAE halves it between its levels)")
        latent = self.latent_resolution
        if self.denoiser == "unet" and latent % 2 ** (len(self.block_out_channels) - 1):
            raise ConfigError(p + "resolution", self.resolution, f"the denoised resolution {latent} must be a multiple of {2 ** (len(self.block_out_channels) - 1)} (the UNet halves it between its levels)")
        if self.denoiser != "unet" and latent % self.patch_size:
            raise ConfigError(p + "patch_size", self.patch_size, f"must divide the denoised resolution ({latent})")
        needs = {"sd3_transformer": "text", "dit_transformer": "class"}.get(self.denoiser)
        if needs and self.conditioning != needs:
            raise ConfigError(p + "conditioning", self.conditioning, f"tiny.denoiser {self.denoiser} takes {needs} conditioning")
        if self.text_hidden_size % self.text_heads:
            raise ConfigError(p + "text_heads", self.text_heads, f"must divide text_hidden_size ({self.text_hidden_size})")
        words = [w.lower() for w in self.vocabulary]
        bad = [w for w in self.vocabulary if not w or not w.isalnum()]
        if bad or len(set(words)) != len(words):
            raise ConfigError(p + "vocabulary", self.vocabulary, "expected distinct words of letters and digits (no spaces or punctuation; case is ignored)")
        if self.text_injection == "pooled" and self.text_hidden_size % self.pooling_heads:
            raise ConfigError(p + "pooling_heads", self.pooling_heads, f"must divide text_hidden_size ({self.text_hidden_size})")

    @property
    def latent_resolution(self) -> int:
        """Height and width of what the denoiser denoises: the images, or the VAE's latents."""
        return self.resolution // 2 ** (len(self.vae_block_out_channels) - 1) if self.vae else self.resolution


@dataclass
class ImageDiffusionConfig(PolicyConfig):
    """An image generator over a diffusers denoiser (UNet, SD3 or FLUX transformer, or DiT; class-,
    text- or un-conditioned; in pixel space or over VAE latents), whose denoising steps are
    the RL decisions (DDPO with ddim/ddpm, Flow-GRPO with flow_sde)."""

    type: str = option("image_diffusion", "registered name of this component (see `mmrl list`)")
    model_path: str | None = option(
        None,
        "hub id (org/name[@revision]) or directory of a diffusers pipeline: unet/ (UNet2DModel or UNet2DConditionModel, SD 1.x/2.x or SDXL shaped) or transformer/ (SD3Transformer2DModel, FluxTransformer2DModel or DiTTransformer2DModel), optional vae/ (AutoencoderKL: the chain runs over its latents; FLUX needs it), text_encoder/ + tokenizer/ (and _2 for SDXL and FLUX's T5, _2 and _3 for SD3) for text prompts, optional scheduler/ (its training schedule and prediction type are checked against denoising); null = the random tiny model of `tiny`",
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
    max_prompt_tokens: int | None = option(None, "text: prompts are padded / truncated to this many tokens (at most the text encoder's positions); null = the tokenizer's model_max_length (77 for CLIP); Qwen-Image: the states kept after its chat template, QwenImagePipeline's max_sequence_length (null = 512, at most 1024)", ge=1)
    train_text_encoder: bool = option(False, "text: also train the text encoder(s) (default: frozen, only the denoiser learns)")
    max_t5_tokens: int = option(256, "SD3 with a T5 encoder (text_encoder_3/), FLUX (text_encoder_2/): prompts are padded / truncated to this many T5 tokens (StableDiffusion3Pipeline's and FluxPipeline's max_sequence_length: 256 for SD3 and FLUX.1-schnell, 512 (the most) for FLUX.1-dev)", ge=1)
    resolution: list[int] | None = option(
        None,
        "FLUX and Qwen-Image: [height, width] of the generated images in pixels, each a multiple of twice the VAE's downsampling (16 for FLUX.1: 8x VAE, 2x2 latent packing); null = the pipeline's default, 128 x the VAE's downsampling a side (1024 x 1024 for FLUX.1). Other denoisers generate at their sample_size and take null",
    )
    flux_guidance: float | None = option(
        None,
        "FLUX guidance-distilled transformers (guidance_embeds: FLUX.1-dev): the guidance value embedded beside the timestep (FluxPipeline's guidance_scale; one pass, no doubling); null = 3.5 as FluxPipeline; other models take null (classifier-free guidance is guidance_scale, FluxPipeline's true_cfg_scale with the empty negative prompt)",
        ge=0,
    )
    sdxl_original_size: list[int] | None = option(
        None, "SDXL (a UNet with added time conditions): the original_size (height, width) of its micro-conditioning time ids; null = the generated image's size, as StableDiffusionXLPipeline's default"
    )
    sdxl_crops_coords_top_left: list[int] = option(factory=lambda: [0, 0], doc="SDXL: the crops_coords_top_left (top, left) of its time ids ((0, 0) as the pipeline's default)")
    prompt_cache: int = option(
        4096,
        "text: prompt embeddings kept in an LRU cache (CPU memory) keyed by the prompts' token ids, so the frozen text encoders run once per distinct prompt, for sampling, log_prob and sft_loss alike; the number of prompts kept; 0 = off (also off while train_text_encoder)",
        ge=0,
    )
    prompt_files: list[str] = option(
        factory=list,
        doc="text: prompt files (.jsonl / .csv / a dataset saved with save_to_disk, read by their `prompt` field: the sampler's train and eval files) encoded into the prompt cache before the first text encoding",
    )
    release_text_encoders: bool = option(
        False,
        "text: once the cache holds every prompt of prompt_files (or of a cache_prompts call), move the text encoders to the CPU and keep them there (moving the policy leaves them), freeing accelerator memory; a prompt not in the cache is then encoded on the CPU",
    )
    save_frozen_weights: bool = option(
        True,
        "checkpoints and save_pretrained hold every weight; false (with model_path): they leave out the frozen weights read from model_path (VAE, text encoders, the denoiser's base under LoRA), which loading reads from model_path again — megabytes instead of gigabytes per checkpoint of a real pipeline",
    )
    lora: ImageLoraOptions = option(factory=ImageLoraOptions, doc="low-rank adapters on the denoiser (r > 0): only they train, and the KL reference is the denoiser with its adapters disabled; checkpoints and save_pretrained also write them in diffusers' LoRA format (lora_diffusers/, for pipeline.load_lora_weights) for a UNet2DConditionModel, SD3Transformer2DModel or FluxTransformer2DModel")
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(transition="ddim", num_inference_steps=8, eta=1.0, min_std=0.01, beta_schedule="linear", clip_denoised=1.0),
        doc="the denoising chain: transition (ddim / ddpm for noise-predicting UNets, flow_* for velocity ones), steps, which steps are decisions, log-prob options",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        self.tiny.validate(p + "tiny")
        self.lora.validate(p + "lora")
        if self.sdxl_original_size is not None and (len(self.sdxl_original_size) != 2 or min(self.sdxl_original_size) < 1):
            raise ConfigError(p + "sdxl_original_size", self.sdxl_original_size, "expected [height, width] in pixels")
        if self.resolution is not None and (len(self.resolution) != 2 or min(self.resolution) < 1):
            raise ConfigError(p + "resolution", self.resolution, "expected [height, width] in pixels")
        if len(self.sdxl_crops_coords_top_left) != 2 or min(self.sdxl_crops_coords_top_left) < 0:
            raise ConfigError(p + "sdxl_crops_coords_top_left", self.sdxl_crops_coords_top_left, "expected [top, left], each >= 0")
        if self.release_text_encoders and (self.train_text_encoder or not self.prompt_cache):
            why = "the text encoders train (train_text_encoder)" if self.train_text_encoder else "there is no prompt cache (prompt_cache: 0)"
            raise ConfigError(p + "release_text_encoders", True, f"needs the prompt cache to hold the prompts' embeddings, but {why}")
        if self.prompt_files and (self.train_text_encoder or not self.prompt_cache):
            raise ConfigError(p + "prompt_files", self.prompt_files, "fills the prompt cache, which is off (prompt_cache: 0, or train_text_encoder)")
        if self.lora.r and self.train_text_encoder:
            raise ConfigError(p + "train_text_encoder", True, "LoRA trains adapters on the denoiser only (the KL reference is the adapter-disabled model); set lora.r: 0 to train the text encoder too")
        self.denoising.validate(p + "denoising")
        if not self.save_frozen_weights and (self.model_path is None or self.pretrained):
            why = "the tiny model's random weights exist only in the checkpoint" if self.model_path is None else "the frozen weights come from policy.pretrained, not from model_path"
            raise ConfigError(p + "save_frozen_weights", False, f"needs model_path and no pretrained: {why}")
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
