"""Config of the Wan 2.x text-to-video policy (``wan_video``)."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import FLOW_TRANSITIONS
from mmrl.errors import ConfigError
from mmrl.policies.diffusers_common import ImageLoraOptions

# what a Wan transformer's velocity can drive: flow_noise needs a learned noise head it has not
WAN_TRANSITIONS = tuple(t for t in FLOW_TRANSITIONS if t != "flow_noise")


@dataclass
class TinyWanConfig:
    """The ``tiny:`` section: a small random Wan model built in-process when ``model_path`` is
    null — a ``WanTransformer3DModel``, an ``AutoencoderKLWan`` (8x spatial, 4x temporal, as
    Wan's) and a ``UMT5EncoderModel`` over mmrl's byte-level tokenizer; nothing is downloaded."""

    layers: int = option(1, "transformer blocks", ge=1)
    heads: int = option(2, "attention heads of the transformer", ge=1)
    head_dim: int = option(12, "width of an attention head (a multiple of 6: Wan's 3-D rotary embedding splits it over frames, rows and columns)", ge=6)
    ffn_dim: int = option(32, "hidden width of the transformer's feed-forward layers", ge=1)
    latent_channels: int = option(4, "channels of the VAE latent (the transformer's in/out channels; Wan 2.1: 16)", ge=1)
    vae_base_dim: int = option(4, "base channels of the VAE's encoder and decoder (Wan 2.1: 96)", ge=1)
    text_dim: int = option(16, "width of the UMT5 text encoder (the transformer's text_dim)", ge=1)
    text_layers: int = option(1, "UMT5 encoder layers", ge=1)
    text_heads: int = option(2, "UMT5 attention heads", ge=1)

    def validate(self, path: str) -> None:
        if self.head_dim % 6:
            raise ConfigError(f"{path}.head_dim", self.head_dim, "must be a multiple of 6 (Wan's rotary embedding gives 2 x (head_dim // 6) to each spatial axis and the rest to time)")


@dataclass
class WanVideoConfig(PolicyConfig):
    """Wan 2.x text-to-video (``WanPipeline``) from a local diffusers directory, or a tiny random
    one: the UMT5 prompt states, the flow-matching chain over the Wan VAE's normalized latents
    [C, (F - 1) / 4 + 1, H / 8, W / 8] with classifier-free guidance, the VAE decode — as the
    pipeline runs them — with each stochastic denoising step an RL decision (Flow-GRPO's
    flow_sde, flow_cps; flow_ode has none)."""

    type: str = option("wan_video", "registered name of this component (see `mmrl list`)")
    model_path: str | None = option(
        None,
        "hub id (org/name[@revision]) or directory laid out as WanPipeline.save_pretrained writes it: transformer/ (WanTransformer3DModel, text-to-video), vae/ (AutoencoderKLWan), text_encoder/ (UMT5EncoderModel) + tokenizer/, scheduler/ (its shift sets the sigmas); null = the random model of `tiny`",
    )
    tiny: TinyWanConfig = option(factory=TinyWanConfig, doc="the random tiny model built when model_path is null")
    frames: int = option(81, "frames F of a generated video ((F - 1) a multiple of the VAE's temporal factor, 4; WanPipeline's num_frames)", ge=1)
    height: int = option(480, "height of the frames in pixels (a multiple of 8 x the transformer's patch, 16)", ge=1)
    width: int = option(832, "width of the frames in pixels (a multiple of 16)", ge=1)
    max_sequence_length: int = option(512, "UMT5 prompt tokens: padded / truncated to this many, the states past a prompt's real length zeroed (WanPipeline's max_sequence_length)", ge=1)
    guidance_scale: float = option(5.0, "classifier-free guidance w > 1: output = uncond + w (cond - uncond) with the negative prompt as uncond, when sampling and in log-probs (the uncond pass without grad); <= 1 = one pass, as the pipeline", ge=0)
    negative_prompt: str = option("", "the prompt of guidance's unconditional pass (WanPipeline's negative_prompt; Wan's examples use a long list of defects)")
    prompt_cache: int = option(
        4096,
        "prompt states kept in an LRU cache (CPU memory) keyed by the prompts' token ids and mask, so UMT5 runs once per distinct prompt for sampling and log_prob alike; the number of prompts kept; 0 = off",
        ge=0,
    )
    save_frozen_weights: bool = option(
        True,
        "checkpoints and save_pretrained hold every weight; false (with model_path): they leave out the frozen weights read from model_path (VAE, UMT5, the transformer's base under LoRA), which loading reads from model_path again",
    )
    lora: ImageLoraOptions = option(
        factory=ImageLoraOptions,
        doc="low-rank adapters on the transformer (r > 0): only they train, the KL reference is the transformer with its adapters disabled, and every save also writes them in diffusers' format (lora_diffusers/, for WanPipeline.load_lora_weights)",
    )
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(transition="flow_sde", num_inference_steps=10, noise_level=0.7, time_shift=3.0, logp_reduction="mean"),
        doc="the denoising chain: transition (flow_sde, flow_cps, flow_ode), steps, which are decisions, log-prob options; time_shift must equal the scheduler's shift (Wan2.1-T2V-1.3B: flow_shift 3.0)",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        self.tiny.validate(p + "tiny")
        self.lora.validate(p + "lora")
        self.denoising.validate(p + "denoising")
        if self.denoising.transition not in WAN_TRANSITIONS:
            raise ConfigError(p + "denoising.transition", self.denoising.transition, f"Wan predicts a flow velocity; use one of {list(WAN_TRANSITIONS)}")
        if not self.save_frozen_weights and (self.model_path is None or self.pretrained):
            why = "the tiny model's random weights exist only in the checkpoint" if self.model_path is None else "the frozen weights come from policy.pretrained, not from model_path"
            raise ConfigError(p + "save_frozen_weights", False, f"needs model_path and no pretrained: {why}")
