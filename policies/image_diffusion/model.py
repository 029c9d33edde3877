"""``image_diffusion``: an image generator over a ``diffusers`` denoiser, denoising as an MDP.

One decision is one stochastic denoising step of an image's chain (DDPO with ``ddim`` η > 0
or ``ddpm``; Flow-GRPO with ``flow_sde``; CPS with ``flow_cps``), all from
:mod:`mmrl.denoising`: this module only says how the denoiser is conditioned and what it
predicts. The denoiser is a UNet (``UNet2DModel`` class-conditional or unconditional,
``UNet2DConditionModel`` under a CLIP text encoder, or SDXL's under two CLIPs with its added
conditions), an ``SD3Transformer2DModel`` (CLIP / T5 text encoders, pooled projections), a
``FluxTransformer2DModel`` (FLUX.1: CLIP pooled + T5 states, 2×2-packed latents, the guidance
embedding of guidance-distilled models, a resolution-dependent time shift; as
``FluxPipeline``), a ``QwenImageTransformer2DModel`` (Qwen-Image: Qwen2.5-VL's states under a
chat template, 2×2-packed latents of its own VAE, true CFG rescaled to the conditional norm;
as ``QwenImagePipeline``) or a ``DiTTransformer2DModel`` (class-conditional).
``sample`` takes the prompt sampler's inputs — a LongTensor of condition ids or a list of
prompt strings — and returns the chains in the replay layout beside the conditioning:

    chain              the latents, step indices and stochastic mask (mmrl.denoising.chain)
    condition [N]      class ids (class conditioning), or
    prompt_ids [N, L]  token ids (text conditioning; log_prob embeds them again, from the
                       prompt cache unless it is off), with prompt_ids_2 / prompt_ids_3
                       for SD3's and SDXL's second CLIP, FLUX's T5 and SD3's T5

The chain runs in pixel space, in [-1, 1], or over the latents of an ``AutoencoderKL``
(scaled as diffusers does); the final latent is decoded to ``info["images"]`` (uint8
[N, H, W, 3], RGB) for the image rewards, once per sample and without grad.

What the denoiser predicts (``prediction_type``) is converted to what the transition takes:
ε for diffusion steps (:func:`epsilon_from_prediction`), the velocity noise − image for flow
steps. Classifier-free guidance (``guidance_scale`` w) combines a conditional and an
unconditional pass, uncond + w (cond − uncond), in the denoiser's own output space, when
sampling and when recomputing log-probs, so the recomputed log-prob is that of the guided
step that was sampled; the unconditional pass uses the null condition (the last class id,
or the empty prompt).

With ``lora.r > 0`` peft LoRA layers are injected into the denoiser and only they train;
``reference()`` is then the policy itself with its adapters disabled, and every save also
writes the adapters in diffusers' LoRA format (``lora_diffusers/``, :func:`save_diffusers_lora`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.data.prompts import require_text_prompts
from mmrl.denoising import DenoisingOptions, DenoisingPolicy, FlowTransition, alphas_cumprod, ddpm_betas, flow_sigmas, provisional_logp_why, resolution_shift, terminal_stretch
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.hub import pipeline_dir
from mmrl.policies.diffusers_common import (
    PromptCache,
    diffusion_target,
    epsilon_from_prediction,
    leave_frozen_weights_unsaved,
    pixels_to_uint8,
    tiny_text_encoder,
    uint8_to_pixels,
    with_lora,
)
from mmrl.policies.hf import require_transformers, save_tied_weights_once
from mmrl.policies.image_diffusion.config import ImageDiffusionConfig
from mmrl.policies.lora import adapters_disabled
from mmrl.registry import POLICIES


FLUX_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size: the default image is this many latent pixels a side


def _diffusers():
    try:
        import diffusers
    except ImportError:
        raise MissingExtraError("diffusers", "image", "the image_diffusion policy") from None
    return diffusers


def _transformers():
    return require_transformers("text", "text prompts of the image_diffusion policy (a CLIP text encoder)")


# ------------------------------------------------------------------ building the parts

UNET_CLASSES = ("UNet2DModel", "UNet2DConditionModel")
TRANSFORMER_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel", "DiTTransformer2DModel")
VAE_CLASSES = ("AutoencoderKL", "AutoencoderKLQwenImage")
# QwenImagePipeline's prompt: its chat template, whose first 34 tokens' states are dropped, and
# its default max_sequence_length (at most 1024)
QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_DROP, QWEN_TOKENS, QWEN_MAX_TOKENS = 34, 512, 1024
TEXT_ENCODER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")


@dataclass
class _Parts:
    denoiser: nn.Module
    kind: str  # unet | sd3 | flux | qwen | dit
    conditioning: str  # class | text | none
    text_encoders: list = field(default_factory=list)  # up to three: CLIP, CLIP (SD3) or T5 (FLUX), T5 (SD3)
    tokenizers: list = field(default_factory=list)
    vae: nn.Module | None = None
    scheduler: dict | None = None  # the pipeline's scheduler_config.json
    sdxl: bool = False  # a UNet with SDXL's added conditions (pooled text embeds + time ids)
    zero_null_prompt: bool = False  # SDXL's force_zeros_for_empty_prompt: the null condition is zeros


def _kind(denoiser: nn.Module) -> str:
    kinds = {"SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux", "QwenImageTransformer2DModel": "qwen", "DiTTransformer2DModel": "dit"}
    return kinds.get(type(denoiser).__name__, "unet")


def _tiny_text(tiny, with_projection: bool):
    return tiny_text_encoder(tiny.text_hidden_size, tiny.text_layers, tiny.text_heads, tiny.max_prompt_tokens, with_projection, vocabulary=tiny.vocabulary)


def _tiny_vae(tiny):
    levels = len(tiny.vae_block_out_channels)
    return _diffusers().AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(tiny.vae_block_out_channels),
        layers_per_block=1,
        latent_channels=tiny.latent_channels,
        norm_num_groups=tiny.norm_num_groups,
        sample_size=tiny.resolution,
        scaling_factor=tiny.vae_scaling_factor,
        shift_factor=tiny.vae_shift_factor or None,
    )


def _num_conditions(spec: dict) -> int:
    num_prompts = spec.get("num_prompts")
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
        raise ConfigError(
            "policy.tiny.conditioning", "class", f"takes condition ids; use it with `sampler.type: prompt` over conditions (the sampler's spec gave num_prompts={num_prompts!r})"
        )
    return num_prompts


def _tiny_parts(config: ImageDiffusionConfig, spec: dict) -> _Parts:
    diffusers = _diffusers()
    tiny = config.tiny
    vae = _tiny_vae(tiny) if tiny.vae else None
    channels = tiny.latent_channels if tiny.vae else 3
    size = tiny.latent_resolution
    if tiny.denoiser == "sd3_transformer":
        text_encoder, tokenizer = _tiny_text(tiny, with_projection=True)
        width = tiny.transformer_heads * tiny.attention_head_dim
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=size,
            patch_size=tiny.patch_size,
            in_channels=channels,
            out_channels=channels,
            num_layers=tiny.transformer_layers,
            attention_head_dim=tiny.attention_head_dim,
            num_attention_heads=tiny.transformer_heads,
            joint_attention_dim=tiny.text_hidden_size,
            caption_projection_dim=width,
            pooled_projection_dim=tiny.text_hidden_size,
            pos_embed_max_size=size // tiny.patch_size,
        )
        return _Parts(transformer, "sd3", "text", [text_encoder], [tokenizer], vae)
    if tiny.denoiser == "dit_transformer":
        # num_embeds_ada_norm classes plus one more, the null class of classifier-free guidance
        transformer = diffusers.DiTTransformer2DModel(
            num_attention_heads=tiny.transformer_heads,
            attention_head_dim=tiny.attention_head_dim,
            in_channels=channels,
            out_channels=channels,
            num_layers=tiny.transformer_layers,
            sample_size=size,
            patch_size=tiny.patch_size,
            num_embeds_ada_norm=_num_conditions(spec),
        )
        return _Parts(transformer, "dit", "class", vae=vae)
    levels = len(tiny.block_out_channels)
    common = dict(
        sample_size=size,
        in_channels=channels,
        out_channels=channels,
        block_out_channels=tuple(tiny.block_out_channels),
        layers_per_block=tiny.layers_per_block,
        norm_num_groups=tiny.norm_num_groups,
    )
    if tiny.conditioning == "text":
        text_encoder, tokenizer = _tiny_text(tiny, with_projection=False)
        if tiny.text_injection == "pooled":
            # global conditioning: the prompt's states, attention-pooled, join the timestep embedding
            blocks = dict(
                down_block_types=("DownBlock2D",) * levels,
                up_block_types=("UpBlock2D",) * levels,
                mid_block_type="UNetMidBlock2D",
                addition_embed_type="text",
                addition_embed_type_num_heads=tiny.pooling_heads,
            )
        else:
            blocks = dict(
                down_block_types=("CrossAttnDownBlock2D",) + ("DownBlock2D",) * (levels - 1),
                up_block_types=("UpBlock2D",) * (levels - 1) + ("CrossAttnUpBlock2D",),
            )
        unet = diffusers.UNet2DConditionModel(**common, **blocks, cross_attention_dim=tiny.text_hidden_size, attention_head_dim=tiny.attention_head_dim)
        return _Parts(unet, "unet", "text", [text_encoder], [tokenizer], vae)
    blocks = dict(down_block_types=("DownBlock2D",) * levels, up_block_types=("UpBlock2D",) * levels)
    if tiny.conditioning == "none":
        return _Parts(diffusers.UNet2DModel(**common, **blocks), "unet", "none", vae=vae)
    # one more class than the sampler's conditions: the last is the null condition of guidance
    return _Parts(diffusers.UNet2DModel(**common, **blocks, num_class_embeds=_num_conditions(spec) + 1), "unet", "class", vae=vae)


def _class_name(directory: Path, config_file: str = "config.json") -> str | None:
    path = directory / config_file
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data.get("_class_name") or (data.get("architectures") or [None])[0]


def _load_text_encoders(root: Path, kind: str, sdxl: bool = False) -> tuple[list, list]:
    """The pipeline's text encoders and tokenizers by slot: text_encoder/ + tokenizer/ (a
    UNet2DConditionModel's CLIPTextModel; SD3's first CLIPTextModelWithProjection), for SDXL
    text_encoder_2/ + tokenizer_2/ (its CLIPTextModelWithProjection, required), and for SD3
    text_encoder_2/ + tokenizer_2/ (the second CLIP) and text_encoder_3/ + tokenizer_3/ (T5),
    each None when absent; for FLUX text_encoder/ (CLIPTextModel, its pooled output) and
    text_encoder_2/ (T5EncoderModel), both required, as FluxPipeline; for Qwen-Image
    text_encoder/ (Qwen2_5_VLForConditionalGeneration, its last states), required."""
    tf = _transformers()
    field_name, value = "policy.model_path", str(root)
    encoders, tokenizers = [], []
    for suffix in ("", "_2", "_3") if kind == "sd3" else ("", "_2") if sdxl or kind == "flux" else ("",):
        encoder_dir, tokenizer_dir = root / f"text_encoder{suffix}", root / f"tokenizer{suffix}"
        if not encoder_dir.is_dir():
            if suffix == "" or sdxl or kind == "flux":
                denoiser = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel", "qwen": "QwenImageTransformer2DModel"}.get(kind, "SDXL-style UNet2DConditionModel" if sdxl else "UNet2DConditionModel")
                raise ConfigError(field_name, value, f"a text-conditioned {denoiser} needs text_encoder{suffix}/ and tokenizer{suffix}/ beside it")
            encoders.append(None)
            tokenizers.append(None)
            continue
        if not tokenizer_dir.is_dir():
            raise ConfigError(field_name, value, f"text_encoder{suffix}/ needs tokenizer{suffix}/ beside it")
        class_name = _class_name(encoder_dir)
        if suffix == "_3" or (kind == "flux" and suffix == "_2"):
            allowed = ("T5EncoderModel",)
        elif kind == "sd3" or (sdxl and suffix == "_2"):
            allowed = ("CLIPTextModelWithProjection",)
        elif kind == "qwen":
            allowed = ("Qwen2_5_VLForConditionalGeneration",)
        else:
            allowed = ("CLIPTextModel",)
        if class_name not in allowed:
            raise ConfigError(field_name, value, f"text_encoder{suffix}/ holds a {class_name}; supported there: {list(allowed)}")
        # local_files_only: the directory is resolved (mmrl.hub); transformers must not look further
        encoders.append(getattr(tf, class_name).from_pretrained(str(encoder_dir), local_files_only=True))
        tokenizer = tf.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        tokenizer.padding_side = "right"
        tokenizers.append(tokenizer)
    return encoders, tokenizers


def _load_parts(config: ImageDiffusionConfig) -> _Parts:
    """The denoiser (+ VAE, text encoders and tokenizers) and scheduler config of a pipeline directory."""
    diffusers = _diffusers()
    field_name = "policy.model_path"
    root = pipeline_dir(config.model_path, field_name)
    unet_name, transformer_name = _class_name(root / "unet"), _class_name(root / "transformer")
    if unet_name is None and transformer_name is None:
        raise ConfigError(
            field_name, config.model_path, "expected a diffusers pipeline directory with unet/ or transformer/ (written by save_pretrained), and text_encoder/ + tokenizer/ for text prompts"
        )
    if unet_name is not None:
        sub, class_name, allowed = "unet", unet_name, UNET_CLASSES
    else:
        sub, class_name, allowed = "transformer", transformer_name, TRANSFORMER_CLASSES
    if class_name not in allowed:
        raise ConfigError(field_name, config.model_path, f"{sub}/ holds a {class_name}; supported denoisers: {list(UNET_CLASSES + TRANSFORMER_CLASSES)}")
    denoiser = getattr(diffusers, class_name).from_pretrained(str(root / sub))
    kind = _kind(denoiser)
    sdxl = class_name == "UNet2DConditionModel" and denoiser.config.addition_embed_type == "text_time"
    if class_name == "UNet2DConditionModel" and ((denoiser.config.addition_embed_type and not sdxl) or denoiser.config.class_embed_type):
        raise ConfigError(
            field_name, config.model_path,
            "the UNet2DConditionModel takes added conditions other than SDXL's (addition_embed_type text_time); supported: UNets conditioned on the text encoder's states, and SDXL's",
        )
    vae = None
    vae_name = _class_name(root / "vae")
    if vae_name is not None:
        if vae_name not in VAE_CLASSES:
            raise ConfigError(field_name, config.model_path, f"vae/ holds a {vae_name}; supported: {list(VAE_CLASSES)}")
        vae = getattr(diffusers, vae_name).from_pretrained(str(root / "vae"))
    if (vae_name == "AutoencoderKLQwenImage") != (kind == "qwen"):
        raise ConfigError(field_name, config.model_path, f"the {class_name} takes {'an AutoencoderKLQwenImage' if kind == 'qwen' else 'an AutoencoderKL'} in vae/, not a {vae_name}")
    channels = (vae.config.z_dim if kind == "qwen" else vae.config.latent_channels) if vae is not None else 3
    in_channels = denoiser.config.in_channels
    out_channels = denoiser.config.out_channels or in_channels
    if kind == "flux":
        # FluxPipeline packs 2 x 2 patches of the VAE's latent into one token: 4 x its channels
        if vae is None or in_channels != 4 * channels or out_channels != in_channels:
            where = f"4 x the VAE's {channels} latent channels (2 x 2 packed latents)" if vae is not None else "packed VAE latents, and vae/ beside it"
            raise ConfigError(field_name, config.model_path, f"the FluxTransformer2DModel has {in_channels} input and {out_channels} output channels; it must take {where}")
    elif kind == "qwen":
        # QwenImagePipeline packs 2 x 2 patches too; the transformer's out_channels are the VAE's, unpacked
        if vae is None or in_channels != 4 * channels or out_channels != channels:
            raise ConfigError(field_name, config.model_path, f"the QwenImageTransformer2DModel has {in_channels} input and {out_channels} output channels; it must take 4 x the VAE's {channels} latent channels and return {channels}")
        if denoiser.config.guidance_embeds or getattr(denoiser.config, "zero_cond_t", False) or getattr(denoiser.config, "use_additional_t_cond", False):
            raise ConfigError(field_name, config.model_path, "the QwenImageTransformer2DModel takes a guidance embedding or extra time conditions (guidance_embeds, zero_cond_t, use_additional_t_cond); supported: QwenImagePipeline's text-to-image transformer")
    elif in_channels != channels or out_channels not in (channels, 2 * channels):
        where = f"the VAE's {channels} latent channels" if vae is not None else "RGB pixels (3 channels; a latent-space model needs vae/ beside it)"
        raise ConfigError(field_name, config.model_path, f"the {class_name} has {in_channels} input and {out_channels} output channels; it must denoise {where}")
    scheduler_file = root / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(scheduler_file.read_text()) if scheduler_file.is_file() else None
    if class_name == "UNet2DModel":
        conditioning = "class" if denoiser.config.num_class_embeds else "none"
        return _Parts(denoiser, kind, conditioning, vae=vae, scheduler=scheduler)
    if class_name == "DiTTransformer2DModel":
        if not denoiser.config.num_embeds_ada_norm:
            raise ConfigError(field_name, config.model_path, "the DiTTransformer2DModel has no class embedding (num_embeds_ada_norm)")
        return _Parts(denoiser, kind, "class", vae=vae, scheduler=scheduler)
    encoders, tokenizers = _load_text_encoders(root, kind, sdxl)
    # StableDiffusionXLPipeline's force_zeros_for_empty_prompt (model_index.json; True by default)
    index_file = root / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    zero_null = sdxl and bool(index.get("force_zeros_for_empty_prompt", True))
    return _Parts(denoiser, kind, "text", encoders, tokenizers, vae, scheduler, sdxl=sdxl, zero_null_prompt=zero_null)


def _check_scheduler(config: ImageDiffusionConfig, scheduler: dict, kind: str = "unet") -> None:
    """The pipeline's scheduler must describe the schedule ``policy.denoising`` samples with.
    FLUX's may shift its sigmas by the resolution (``use_dynamic_shifting``; the policy then
    computes the shift itself, :meth:`ImageDiffusionPolicy.denoising`), but nothing else that
    FluxPipeline's Euler loop would do and the flow transitions do not."""
    options, path = config.denoising, "policy.denoising."
    is_flow = "FlowMatch" in str(scheduler.get("_class_name", ""))
    if is_flow == config.is_diffusion:
        kind_name = "a flow-matching" if is_flow else "a diffusion"
        allowed = "flow_sde, flow_cps or flow_ode" if is_flow else "ddim or ddpm"
        raise ConfigError(path + "transition", options.transition, f"the pipeline's scheduler ({scheduler.get('_class_name')}) is {kind_name} schedule; use {allowed}")
    if is_flow and kind in ("flux", "qwen"):
        unsupported = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas", "stochastic_sampling") if scheduler.get(k)]
        if unsupported:
            raise ConfigError("policy.model_path", config.model_path, f"the scheduler sets {unsupported}; the flow transitions take FluxPipeline's plain shifted Euler sigmas")
        if scheduler.get("time_shift_type", "exponential") not in ("exponential", "linear"):
            raise ConfigError("policy.model_path", config.model_path, f"the scheduler's time_shift_type {scheduler.get('time_shift_type')!r} is not exponential or linear")
        if scheduler.get("use_dynamic_shifting"):
            if options.time_shift != 1.0:
                raise ConfigError(path + "time_shift", options.time_shift, "the pipeline's scheduler shifts its sigmas by the image size (use_dynamic_shifting), which the policy follows; leave time_shift at 1")
            return
    if is_flow:
        if scheduler.get("use_dynamic_shifting"):
            raise ConfigError(path + "time_shift", options.time_shift, "the pipeline's scheduler shifts its sigmas by the image size (use_dynamic_shifting, FLUX-style); only a fixed shift is supported")
        shift = float(scheduler.get("shift", 1.0))
        if shift != options.time_shift:
            raise ConfigError(path + "time_shift", options.time_shift, f"the pipeline's scheduler has shift {shift}")
        return
    expected = {"num_train_timesteps": options.num_train_timesteps, "beta_schedule": options.beta_schedule}
    for key, value in expected.items():
        if key in scheduler and scheduler[key] != value:
            raise ConfigError(path + key, value, f"the pipeline's scheduler has {key} {scheduler[key]!r}")
    for key, value in (("beta_start", options.beta_start), ("beta_end", options.beta_end)):
        if key in scheduler and abs(float(scheduler[key]) - value) > 1e-12:
            raise ConfigError(path + key, value, f"the pipeline's scheduler has {key} {scheduler[key]} (Stable Diffusion: scaled_linear from 0.00085 to 0.012)")
    alpha_to_one = scheduler.get("set_alpha_to_one")
    if options.set_alpha_to_one is not None and alpha_to_one is not None and bool(alpha_to_one) != options.set_alpha_to_one:
        raise ConfigError(path + "set_alpha_to_one", options.set_alpha_to_one, f"the pipeline's scheduler has set_alpha_to_one {bool(alpha_to_one)}; set {str(bool(alpha_to_one)).lower()}, or null to follow it")
    if "clip_sample" in scheduler:
        clip = float(scheduler.get("clip_sample_range", 1.0)) if scheduler["clip_sample"] else None
        if clip != options.clip_denoised:
            raise ConfigError(path + "clip_denoised", options.clip_denoised, "the pipeline's scheduler " + (f"clips the predicted clean sample to +-{clip}; set {clip}" if clip else "does not clip the predicted clean sample (clip_sample false); set null"))


# ------------------------------------------------------------------ conditions as tensors or tuples
# A class id / text-state condition is one tensor; SD3's is a tuple (token states, pooled projection).


def _map(fn, condition):
    return tuple(fn(c) for c in condition) if isinstance(condition, tuple) else fn(condition)


def _map2(fn, a, b):
    return tuple(fn(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else fn(a, b)


class _AdapterDisabledReference(DenoisingPolicy):
    """The KL reference of a LoRA policy: the policy's own denoiser with its adapters disabled.

    It shares the policy's weights without registering them, so the trainer freezing it
    (``requires_grad_(False)``) or setting it to eval mode leaves the policy alone; every
    denoiser call runs without grad with the adapters off, then turns them back on."""

    def __init__(self, policy: "ImageDiffusionPolicy"):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    @property
    def config(self) -> ImageDiffusionConfig:
        return self.policy.config

    @property
    def denoising(self) -> DenoisingOptions:
        return self.policy.denoising

    def transition(self, options: DenoisingOptions, deterministic: bool = False, device=None):
        return self.policy.transition(options, deterministic, device)

    def chain_denoiser(self, replay: dict):
        inner = self.policy.chain_denoiser(replay)

        def denoise(x: Tensor, time: Tensor, rows: Tensor) -> Tensor:
            with torch.no_grad(), self.policy.adapters_disabled():
                return inner(x, time, rows)

        return denoise

    @torch.no_grad()
    def log_prob(self, replay: dict) -> Tensor:
        return super().log_prob(replay)

    def forward(self, replay: dict) -> Tensor:
        return self.log_prob(replay)


# the pipeline class whose save_lora_weights / load_lora_weights a denoiser's adapters follow
LORA_EXPORTS = {"UNet2DConditionModel": "unet", "SD3Transformer2DModel": "transformer", "FluxTransformer2DModel": "transformer"}


def save_diffusers_lora(policy: "ImageDiffusionPolicy", out_dir: str | os.PathLike) -> Path:
    """Write the policy's LoRA adapters where diffusers' LoRA loaders read them:
    ``out_dir/pytorch_lora_weights.safetensors``, which ``pipeline.load_lora_weights(out_dir)``
    of the user's pipeline (built from the same base directory) loads into its denoiser.

    Follows diffusers' LoRA training scripts (``train_text_to_image_lora.py``,
    ``train_dreambooth_lora_sdxl.py``, ``train_dreambooth_lora_sd3.py``): peft's
    ``get_peft_model_state_dict`` of the denoiser (diffusers' key names for a UNet,
    ``convert_state_dict_to_diffusers``), saved with the pipeline class's
    ``save_lora_weights`` — ``StableDiffusionPipeline`` (SD 1.x / 2.x) or
    ``StableDiffusionXLPipeline`` (SDXL), keys prefixed ``unet.``; ``StableDiffusion3Pipeline``
    or ``FluxPipeline`` (``train_dreambooth_lora_flux.py``), keys prefixed ``transformer.`` — with the adapter's ``LoraConfig`` as metadata, so the
    loader applies the same rank, alpha and target modules (scale alpha / r). The directory
    is written under a temporary name and renamed into place. A ``DiTTransformer2DModel`` or
    ``UNet2DModel`` has no diffusers LoRA loader: a config error (its adapters are in
    ``model.safetensors``)."""
    lora = policy.config.lora
    if not lora.r:
        raise ConfigError("policy.lora.r", lora.r, "there are no adapters to export (LoRA is off)")
    diffusers = _diffusers()
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    model = policy.denoiser_model
    slot = LORA_EXPORTS.get(type(model).__name__)
    if slot is None:
        raise ConfigError("policy.lora.r", lora.r, f"diffusers has no LoRA loader for a {type(model).__name__} (supported: {list(LORA_EXPORTS)}); its adapters are in model.safetensors")
    layers = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    metadata = model.peft_config["default"].to_dict()
    if slot == "unet":
        pipeline = diffusers.StableDiffusionXLPipeline if policy.sdxl else diffusers.StableDiffusionPipeline
        kwargs = {"unet_lora_layers": convert_state_dict_to_diffusers(layers), "unet_lora_adapter_metadata": metadata}
    else:
        pipeline = diffusers.FluxPipeline if policy.kind == "flux" else diffusers.StableDiffusion3Pipeline
        kwargs = {"transformer_lora_layers": layers, "transformer_lora_adapter_metadata": metadata}
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipeline.save_lora_weights(str(tmp), safe_serialization=True, **kwargs)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _read_prompt_files(paths: list[str]) -> list[str]:
    """The prompts of ``policy.prompt_files`` (read as the prompt sampler reads its sources)."""
    from mmrl.data.prompts import PromptDataConfig, read_records

    prompts = []
    for i, path in enumerate(paths):
        records = read_records(PromptDataConfig(train=path, answer_field=None, image_field=None), "train", f"policy.prompt_files[{i}]")
        prompts.extend(str(r.prompt) for r in records)
    return prompts


# ------------------------------------------------------------------ the policy


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {
        "sampler": {"type": "prompt", "data": {"num_prompts": 2}},
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "guidance_scale": 2.0, "denoising": {"num_inference_steps": 3}},
        "rewards": [{"type": "jpeg_compressibility"}],
    },
    "ratio_atol": 1e-2,
    "ratio_why": provisional_logp_why("up to 9.8e-4 (log-probs up to 624: 1 to 8 ulps) under MMRL_SHAPE_KERNELS=1 over seeds 0-2"),
}


@POLICIES.register("image_diffusion", config=ImageDiffusionConfig, contract=CONTRACT)
class ImageDiffusionPolicy(DenoisingPolicy):
    """RGB images from a diffusers denoiser (a UNet, an SD3 transformer or a DiT), in pixel
    space or over a VAE's latents; each stochastic denoising step is one decision."""

    keeps_sampling_graph = True
    shares_initial_noise = True
    samples_final_only = True

    def __init__(self, config: ImageDiffusionConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        parts = _load_parts(config) if config.model_path else _tiny_parts(config, spec)
        if parts.scheduler is not None:
            _check_scheduler(config, parts.scheduler, parts.kind)
        self.kind = parts.kind
        for name in ("resolution", "flux_guidance"):
            if getattr(config, name) is not None and self.kind not in (("flux", "qwen") if name == "resolution" else ("flux",)):
                takers = "a FLUX or Qwen-Image transformer" if name == "resolution" else "a FLUX transformer"
                raise ConfigError(f"policy.{name}", getattr(config, name), f"only {takers} takes it (the other denoisers generate at their sample_size, and guide with guidance_scale)")
        self.sdxl, self.zero_null_prompt = parts.sdxl, parts.zero_null_prompt
        # the UNet keeps its attribute (and state-dict prefix) ``unet``; transformers are ``transformer``
        if self.kind == "unet":
            self.unet = parts.denoiser
        else:
            self.transformer = parts.denoiser
        self.conditioning = parts.conditioning
        if self.conditioning == "text":
            require_text_prompts(spec, f"the text-conditioned pipeline at policy.model_path ({config.model_path})" if config.model_path else "policy.tiny.conditioning: text")
        encoders = parts.text_encoders + [None] * (3 - len(parts.text_encoders))
        tokenizers = parts.tokenizers + [None] * (3 - len(parts.tokenizers))
        self.text_encoder, self.text_encoder_2, self.text_encoder_3 = encoders
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = tokenizers
        self.vae = parts.vae
        if self.vae is not None:
            self.vae.requires_grad_(False)
            vae_config = self.vae.config
            if self.kind == "qwen":  # per-channel statistics: z = latent * std + mean, over a frame axis of 1
                self.vae_scale, self.vae_shift = 1.0, 0.0
                self.vae_factor = 2 ** len(vae_config.temperal_downsample)
                self.register_buffer("qwen_latents_mean", torch.tensor(vae_config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1), persistent=False)
                self.register_buffer("qwen_latents_std", torch.tensor(vae_config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1), persistent=False)
            else:
                self.vae_scale = float(vae_config.scaling_factor)
                self.vae_shift = float(vae_config.shift_factor or 0.0)
                self.vae_factor = 2 ** (len(vae_config.block_out_channels) - 1)
            if config.is_diffusion and config.denoising.clip_denoised is not None:
                raise ConfigError("policy.denoising.clip_denoised", config.denoising.clip_denoised, "clips the predicted clean sample to pixel range, but the chain runs over VAE latents, which are not in [-1, 1]; set null")
        self.prompt_lengths = []  # tokens of each encoder's prompts (None: no such encoder)
        for i, (encoder, tokenizer) in enumerate(zip(encoders, tokenizers)):
            if encoder is None:
                self.prompt_lengths.append(None)
                continue
            if not config.train_text_encoder:
                encoder.requires_grad_(False)
            self.prompt_lengths.append(self._prompt_length(i, encoder, tokenizer))
        self.prompt_tokens = self.prompt_lengths[0]  # the first (or only) text encoder's
        if self.kind == "sd3":
            self._check_sd3_widths()
        if self.sdxl:
            self._check_sdxl_widths()
        if self.kind == "flux":
            self._check_flux_widths()
        if self.kind == "qwen" and self.text_encoder.config.text_config.hidden_size != self.transformer.config.joint_attention_dim:
            raise ConfigError("policy.model_path", config.model_path, f"the text encoder is {self.text_encoder.config.text_config.hidden_size} wide; the QwenImageTransformer2DModel's joint_attention_dim is {self.transformer.config.joint_attention_dim}")
        self.prediction_type = config.prediction_type or self._default_prediction(parts.scheduler)
        if self.prediction_type not in config.allowed_predictions:
            raise ConfigError("policy.prediction_type", self.prediction_type, f"the pipeline's scheduler predicts it, but transition {config.denoising.transition} takes one of {list(config.allowed_predictions)}")
        if self.conditioning == "none" and config.guidance_scale != 1:
            raise ConfigError("policy.guidance_scale", config.guidance_scale, "needs a conditional denoiser (class or text); an unconditional one takes 1")
        model_config = self.denoiser_model.config
        if self.conditioning == "class":
            # the last class embedding is the null condition of classifier-free guidance
            if self.kind == "dit":
                self.null_class = int(model_config.num_embeds_ada_norm)
                self._no_label_dropout()
            else:
                self.null_class = int(model_config.num_class_embeds) - 1
            num_prompts = spec.get("num_prompts")
            if isinstance(num_prompts, int) and num_prompts > self.null_class:
                raise ConfigError("policy.model_path", config.model_path, f"the denoiser has {self.null_class} classes besides the null class (the last); the sampler has {num_prompts} conditions")
        self.flow_shift = None  # FLUX's resolution-dependent time shift (denoising.time_shift otherwise)
        self.shift_terminal = None  # the scheduler's shift_terminal: the last sigma before 0 (Qwen-Image: 0.02)
        # where the pipeline's DDIMScheduler ends the last step: alpha_bar 1, or alpha_bar_0 (set_alpha_to_one false)
        scheduler_alpha_to_one = (parts.scheduler or {}).get("set_alpha_to_one")
        self.alpha_to_one = bool(scheduler_alpha_to_one) if config.is_diffusion and config.denoising.set_alpha_to_one is None and scheduler_alpha_to_one is not None else None
        if self.kind in ("flux", "qwen"):
            self._setup_flux(parts.scheduler)
        else:
            sample_size = model_config.sample_size
            # what the chain denoises (the latent's height and width with a VAE), and the images' size
            self.resolution = tuple(sample_size) if isinstance(sample_size, (list, tuple)) else (sample_size, sample_size)
            self.image_resolution = tuple(r * self.vae_factor for r in self.resolution) if self.vae is not None else self.resolution
            self.channels = int(model_config.in_channels)
        if self.sdxl:  # StableDiffusionXLPipeline._get_add_time_ids: original_size + crops_coords_top_left + target_size
            original = tuple(config.sdxl_original_size or self.image_resolution)
            self.sdxl_time_ids = (*original, *config.sdxl_crops_coords_top_left, *self.image_resolution)
        # the prompt cache (frozen text encoders only); the prompts of prompt_files are read now, encoded at the first encoding
        cached = self.conditioning == "text" and config.prompt_cache > 0 and not config.train_text_encoder
        self._prompt_cache = PromptCache(config.prompt_cache) if cached else None
        self._pending_prompts = _read_prompt_files(config.prompt_files) if cached else []
        self._text_encoders_released = False
        options = config.denoising
        if config.is_diffusion:
            ab = alphas_cumprod(ddpm_betas(options.num_train_timesteps, options.beta_schedule, options.beta_start, options.beta_end)).float()
            self.register_buffer("alphas_cumprod", ab, persistent=False)
        if config.lora.r:
            with_lora(self.denoiser_model, config.lora)
        self.train()
        # T5's input embedding is tied to its shared embedding: safetensors takes one name per tensor
        save_tied_weights_once(self)
        # the frozen weights read from model_path, left out of saved weights on request
        leave_frozen_weights_unsaved(self, config.save_frozen_weights)

    def train(self, mode: bool = True) -> "ImageDiffusionPolicy":
        """Train mode for the denoiser only: the text encoders and the VAE stay in eval mode
        (T5's dropout would otherwise make two encodings of one prompt differ: ratio != 1)."""
        super().train(mode)
        for part in (self.text_encoder, self.text_encoder_2, self.text_encoder_3, self.vae):
            if part is not None:
                part.eval()
        return self

    def _prompt_length(self, slot: int, encoder: nn.Module, tokenizer) -> int:
        if self.kind == "qwen":  # the template's tokens, then the prompt's states (max_sequence_length)
            tokens = self.config.max_prompt_tokens or QWEN_TOKENS
            if tokens > QWEN_MAX_TOKENS:
                raise ConfigError("policy.max_prompt_tokens", tokens, f"QwenImagePipeline's max_sequence_length is at most {QWEN_MAX_TOKENS}")
            return QWEN_DROP + tokens
        if slot == 2 or (self.kind == "flux" and slot == 1):  # T5: relative positions, no limit of its own
            if self.kind == "flux" and self.config.max_t5_tokens > 512:
                raise ConfigError("policy.max_t5_tokens", self.config.max_t5_tokens, "FluxPipeline's max_sequence_length is at most 512")
            return self.config.max_t5_tokens
        positions = encoder.config.max_position_embeddings
        length = self.config.max_prompt_tokens or tokenizer.model_max_length
        if length > positions:
            raise ConfigError("policy.max_prompt_tokens", self.config.max_prompt_tokens, f"the text encoder has {positions} positions (the tokenizer's model_max_length is {tokenizer.model_max_length}); set at most {positions}")
        return length

    def _check_sd3_widths(self) -> None:
        clips = [e for e in (self.text_encoder, self.text_encoder_2) if e is not None]
        width = sum(e.config.hidden_size for e in clips)
        pooled = sum(e.config.projection_dim for e in clips)
        joint, pooled_dim = self.transformer.config.joint_attention_dim, self.transformer.config.pooled_projection_dim
        where = self.config.model_path or "policy.tiny"
        if width > joint or pooled != pooled_dim or (self.text_encoder_3 is not None and self.text_encoder_3.config.d_model != joint):
            raise ConfigError("policy.model_path", where, f"the text encoders (CLIP widths {width}, projections {pooled}) do not fit the SD3 transformer (joint_attention_dim {joint}, pooled_projection_dim {pooled_dim})")

    def _check_sdxl_widths(self) -> None:
        """SDXL's UNet takes the two CLIPs' states side by side (cross_attention_dim), and adds
        the second one's pooled projection and six time ids (projection_class_embeddings_input_dim)."""
        unet, first, second = self.unet.config, self.text_encoder.config, self.text_encoder_2.config
        width = first.hidden_size + second.hidden_size
        added = unet.addition_time_embed_dim * 6 + second.projection_dim
        if self.prompt_lengths[0] != self.prompt_lengths[1]:
            raise ConfigError("policy.max_prompt_tokens", self.config.max_prompt_tokens, f"SDXL's two tokenizers pad to {self.prompt_lengths[0]} and {self.prompt_lengths[1]} tokens; their states are joined token by token, so they must agree")
        if width != unet.cross_attention_dim or added != unet.projection_class_embeddings_input_dim:
            raise ConfigError(
                "policy.model_path", self.config.model_path,
                f"the text encoders (CLIP widths {first.hidden_size} + {second.hidden_size}, projection {second.projection_dim}) do not fit the SDXL UNet "
                f"(cross_attention_dim {unet.cross_attention_dim}, projection_class_embeddings_input_dim {unet.projection_class_embeddings_input_dim} = 6 x {unet.addition_time_embed_dim} + projection)",
            )

    def _check_flux_widths(self) -> None:
        """FLUX takes the CLIP's pooled output (pooled_projection_dim) and the T5's states
        (joint_attention_dim)."""
        flux, clip, t5 = self.transformer.config, self.text_encoder.config, self.text_encoder_2.config
        if clip.hidden_size != flux.pooled_projection_dim or t5.d_model != flux.joint_attention_dim:
            raise ConfigError(
                "policy.model_path", self.config.model_path,
                f"the text encoders (CLIP width {clip.hidden_size}, T5 width {t5.d_model}) do not fit the FLUX transformer (pooled_projection_dim {flux.pooled_projection_dim}, joint_attention_dim {flux.joint_attention_dim})",
            )

    def _setup_flux(self, scheduler: dict | None) -> None:
        """FLUX's geometry and schedule, as FluxPipeline: the chain denoises the VAE's latent
        [C, H / f, W / f] (f the VAE's downsampling), which the transformer sees as 2 x 2
        packed tokens (``_pack_latents``) at the latent image ids (row, column of each token);
        the text ids are zeros. With ``use_dynamic_shifting`` the sigmas are shifted by
        ``calculate_shift`` of the image's token count (:func:`~mmrl.denoising.resolution_shift`).
        The guidance embedding of a guidance-distilled transformer (``guidance_embeds``) takes
        ``flux_guidance``."""
        config = self.config
        default = FLUX_SAMPLE_SIZE * self.vae_factor  # FluxPipeline: default_sample_size x vae_scale_factor (1024 for FLUX.1)
        height, width = config.resolution or (default, default)
        multiple = 2 * self.vae_factor
        if height % multiple or width % multiple:
            raise ConfigError("policy.resolution", [height, width], f"each must be a multiple of {multiple} (the VAE's {self.vae_factor}x downsampling, then 2 x 2 packing)")
        self.image_resolution = (height, width)
        self.resolution = (height // self.vae_factor, width // self.vae_factor)
        self.channels = int(self.transformer.config.in_channels) // 4
        tokens_h, tokens_w = self.resolution[0] // 2, self.resolution[1] // 2
        ids = torch.zeros(tokens_h, tokens_w, 3)  # FluxPipeline._prepare_latent_image_ids
        ids[..., 1] += torch.arange(tokens_h)[:, None]
        ids[..., 2] += torch.arange(tokens_w)[None, :]
        self.register_buffer("flux_image_ids", ids.reshape(tokens_h * tokens_w, 3), persistent=False)
        if self.kind == "flux":
            self.register_buffer("flux_text_ids", torch.zeros(self.prompt_lengths[1], 3), persistent=False)
        distilled = self.kind == "flux" and bool(self.transformer.config.guidance_embeds)
        if config.flux_guidance is not None and not distilled:
            raise ConfigError("policy.flux_guidance", config.flux_guidance, "the FLUX transformer has no guidance embedding (guidance_embeds false); guide it with guidance_scale (true CFG) instead")
        self.flux_guidance = (3.5 if config.flux_guidance is None else float(config.flux_guidance)) if distilled else None
        scheduler = scheduler or {}
        if scheduler.get("shift_terminal"):
            self.shift_terminal = float(scheduler["shift_terminal"])
        if scheduler.get("use_dynamic_shifting"):
            seq_lens = scheduler.get("base_image_seq_len", 256), scheduler.get("max_image_seq_len", 4096)
            shifts = scheduler.get("base_shift", 0.5), scheduler.get("max_shift", 1.15)
            try:
                self.flow_shift = resolution_shift(tokens_h * tokens_w, *seq_lens, *shifts, scheduler.get("time_shift_type", "exponential"))
            except ValueError as e:
                raise ConfigError(
                    "policy.resolution", config.resolution or [height, width],
                    f"{tokens_h * tokens_w} image tokens give no time shift under the scheduler's dynamic shifting (image_seq_len {list(seq_lens)}, shift {list(shifts)}): {e}; "
                    f"choose a resolution nearer {default} x {default} (FluxPipeline's default for this VAE)",
                ) from None

    def transition(self, options: DenoisingOptions, deterministic: bool = False, device=None):
        """mmrl's transition, on sigmas stretched to the scheduler's ``shift_terminal`` where it
        sets one (:func:`~mmrl.denoising.terminal_stretch`, as FlowMatchEulerDiscreteScheduler)."""
        transition = super().transition(options, deterministic, device)
        if self.shift_terminal is None:
            return transition
        sigmas = terminal_stretch(flow_sigmas(options.num_inference_steps, options.time_shift), self.shift_terminal)
        return FlowTransition(sigmas.to(device), transition.name, options.noise_level, options.sde_diffusion)

    @property
    def denoising(self) -> DenoisingOptions:
        """``config.denoising``, with what it leaves to the pipeline's scheduler: FLUX's
        resolution-dependent shift as its ``time_shift`` when the scheduler shifts dynamically,
        and the scheduler's ``set_alpha_to_one`` where the option is null."""
        followed = {"time_shift": self.flow_shift, "set_alpha_to_one": self.alpha_to_one}
        followed = {k: v for k, v in followed.items() if v is not None}
        return dataclasses.replace(self.config.denoising, **followed) if followed else self.config.denoising

    def _no_label_dropout(self) -> None:
        """DiT drops class labels at random in train mode (its own CFG training); RL compares
        two passes over the same chain, so the labels are always kept (sft_loss drops them itself)."""
        for module in self.transformer.modules():
            if type(module).__name__ == "LabelEmbedding":
                module.dropout_prob = 0.0

    def _default_prediction(self, scheduler: dict | None) -> str:
        if not self.config.is_diffusion:
            return "velocity"
        return (scheduler or {}).get("prediction_type", "epsilon")

    @property
    def denoiser_model(self) -> nn.Module:
        """The diffusers denoiser: ``unet`` or ``transformer``."""
        return self.unet if self.kind == "unet" else self.transformer

    @property
    def device(self) -> torch.device:
        return next(self.denoiser_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The denoiser's dtype; text states and VAE latents of other parts are cast to it."""
        return next(self.denoiser_model.parameters()).dtype

    @contextmanager
    def adapters_disabled(self):
        """Within the block the denoiser runs without its LoRA adapters (the base model)."""
        if not self.config.lora.r:
            yield
            return
        with adapters_disabled(self.denoiser_model):
            yield

    def reference(self) -> nn.Module | None:
        """With LoRA, the denoiser with its adapters disabled (shares the base weights, no copy);
        otherwise None (the trainer keeps a frozen copy of the initial weights)."""
        return _AdapterDisabledReference(self) if self.config.lora.r else None

    # -------------------------------------------------------------- conditioning

    @property
    def _conditioning_field(self) -> tuple[str, str]:
        """The config field that chose the conditioning, and its value, for input errors."""
        if self.config.model_path:
            return "policy.model_path", self.config.model_path
        return "policy.tiny.conditioning", self.conditioning

    @property
    def _prompt_keys(self) -> list[str]:
        """Replay keys of the token ids of each text encoder present: prompt_ids, prompt_ids_2, prompt_ids_3."""
        encoders = (self.text_encoder, self.text_encoder_2, self.text_encoder_3)
        return [key for key, e in zip(("prompt_ids", "prompt_ids_2", "prompt_ids_3"), encoders) if e is not None]

    def _conditions(self, inputs) -> dict[str, Tensor]:
        """The replay's conditioning of the sampler's inputs: ``condition`` class ids [N], or
        token ids ``prompt_ids`` [N, L] (and ``prompt_ids_2`` / ``_3`` for SD3's other encoders)."""
        if self.conditioning == "class":
            if not isinstance(inputs, Tensor) or inputs.dtype != torch.long:
                raise ConfigError(*self._conditioning_field, f"takes condition ids (a LongTensor from a prompt sampler over conditions), got {type(inputs).__name__}")
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.null_class):
                raise ValueError(f"condition ids must lie in [0, {self.null_class}), got {inputs.tolist()}")
            return {"condition": inputs.to(self.device)}
        if self.conditioning == "text":
            if isinstance(inputs, Tensor) or not all(isinstance(p, str) for p in inputs):
                raise ConfigError(*self._conditioning_field, f"takes prompt strings (a prompt sampler over texts), got {type(inputs).__name__}")
            return self._tokenize(list(inputs))
        return {}

    def _tokenize(self, prompts: list[str]) -> dict[str, Tensor]:
        tokenizers = dict(zip(("prompt_ids", "prompt_ids_2", "prompt_ids_3"), zip((self.tokenizer, self.tokenizer_2, self.tokenizer_3), self.prompt_lengths)))
        out = {}
        for key in self._prompt_keys:
            tokenizer, length = tokenizers[key]
            texts = [QWEN_TEMPLATE.format(p) for p in prompts] if self.kind == "qwen" else prompts
            out[key] = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids.to(self.device)
        return out

    def _encode(self, ids: dict[str, Tensor]):
        """Text embeddings the denoiser attends to (no grad unless the encoders train), in the
        denoiser's dtype and on its device: the CLIP states [N, L, D] for an SD 1.x / 2.x UNet;
        for SD3 and SDXL as diffusers' pipelines build them (:meth:`_encode_texts`).

        Each distinct prompt of the batch is encoded once and alone (a batch of one), and its
        rows share that embedding: a prompt's embedding never depends on the prompts it came
        with (a linear layer's float32 result can differ in the last bit between a batch of
        one and of several), so sampling, ``log_prob`` on any minibatch and the prompt cache
        all see the same numbers. With the prompt cache the embeddings also outlive the call
        (:meth:`_cached_entries`), and the encoders run once per distinct prompt in all."""
        keys, entries = self._cached_entries(ids)
        rows = [entries[key] for key in keys]
        if isinstance(rows[0], tuple):
            return tuple(torch.cat([r[j] for r in rows]).to(self.device, self.dtype) for j in range(len(rows[0])))
        return torch.cat(rows).to(self.device, self.dtype)

    def _encode_texts(self, ids: dict[str, Tensor]):
        """The text encoders' conditioning of token ids, in the encoders' dtype: the CLIP's
        last states [N, L, D] for an SD 1.x / 2.x UNet; for SD3 as StableDiffusion3Pipeline's
        ``encode_prompt``, the tuple (token states [N, L, joint_dim], pooled [N, P]) — the
        CLIPs' penultimate states side by side, zero-padded to joint_attention_dim, then the
        T5 states (when there is a T5 encoder) after them; the CLIPs' pooled projections side
        by side; for SDXL as StableDiffusionXLPipeline's ``encode_prompt`` (no clip_skip), the
        tuple (states [N, L, D1 + D2], pooled [N, P], time ids [N, 6]) — both CLIPs'
        penultimate states side by side, text_encoder_2's pooled projection, and the
        micro-conditioning (original_size, crops_coords_top_left, target_size) of
        ``_get_add_time_ids``; for FLUX as FluxPipeline's ``encode_prompt``, the tuple (T5
        states [N, L, joint_dim], the CLIP's pooled output [N, P]). Token ids go to each encoder's device (the CPU once released)."""

        def run(encoder, key, **kwargs):
            return encoder(ids[key].to(next(encoder.parameters()).device), **kwargs)

        if self.kind == "qwen":
            return self._qwen_states(ids["prompt_ids"])
        if self.kind == "flux":  # FluxPipeline.encode_prompt: the T5's last states, the CLIP's pooled output
            pooled = run(self.text_encoder, "prompt_ids", output_hidden_states=False).pooler_output
            states = run(self.text_encoder_2, "prompt_ids_2", output_hidden_states=False)[0]
            return states, pooled.to(states.device)
        if self.kind != "sd3" and not self.sdxl:
            return run(self.text_encoder, "prompt_ids").last_hidden_state
        if self.sdxl:
            first = run(self.text_encoder, "prompt_ids", output_hidden_states=True)
            second = run(self.text_encoder_2, "prompt_ids_2", output_hidden_states=True)
            states = torch.cat([first.hidden_states[-2], second.hidden_states[-2].to(first.hidden_states[-2].device)], dim=-1)
            pooled = second.text_embeds.to(states.device)
            time_ids = torch.tensor([self.sdxl_time_ids], dtype=states.dtype, device=states.device).expand(states.shape[0], -1)
            return states, pooled, time_ids
        states, pooled = [], []
        for key, encoder in (("prompt_ids", self.text_encoder), ("prompt_ids_2", self.text_encoder_2)):
            if encoder is not None:
                out = run(encoder, key, output_hidden_states=True)
                states.append(out.hidden_states[-2])
                pooled.append(out.text_embeds)
        clip = torch.cat(states, dim=-1)
        joint = self.transformer.config.joint_attention_dim
        clip = nn.functional.pad(clip, (0, joint - clip.shape[-1]))
        if self.text_encoder_3 is not None:
            clip = torch.cat([clip, run(self.text_encoder_3, "prompt_ids_3").last_hidden_state.to(clip.device)], dim=-2)
        return clip, torch.cat(pooled, dim=-1)

    def _qwen_states(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """QwenImagePipeline's ``encode_prompt`` of templated token ids [N, 34 + T]: each row's
        tokens up to its padding through Qwen2.5-VL, its last states without the template's
        first 34, zero-padded to T (always T, so a prompt's conditioning never depends on its
        batch), and the mask of the real ones [N, T]."""
        device = next(self.text_encoder.parameters()).device
        tokens = ids.shape[1] - QWEN_DROP
        states, masks = [], []
        for row in ids.to(device):
            length = int((row != self.tokenizer.pad_token_id).sum())
            hidden = self.text_encoder(input_ids=row[None, :length], attention_mask=torch.ones(1, length, dtype=torch.long, device=device), output_hidden_states=True).hidden_states[-1]
            kept = hidden[:, QWEN_DROP:]
            states.append(nn.functional.pad(kept, (0, 0, 0, tokens - kept.shape[1])))
            masks.append((torch.arange(tokens, device=device) < kept.shape[1]).to(kept.dtype)[None])
        return torch.cat(states), torch.cat(masks)

    # -------------------------------------------------------------- the prompt cache

    def _cache_keys(self, ids: dict[str, Tensor]) -> list[bytes]:
        """One key per row: the bytes of its token ids of every tokenizer, side by side (a
        function of the prompt's text, and what the replay keeps of it)."""
        rows = torch.cat([ids[key] for key in self._prompt_keys], dim=-1).cpu()
        return [row.numpy().tobytes() for row in rows]

    def _cached_entries(self, ids: dict[str, Tensor]) -> tuple[list[bytes], dict[bytes, object]]:
        """The rows' keys and the embedding of each distinct one (in the encoders' dtype): from
        the prompt cache when it holds it, else encoded alone — with grad when the encoders
        train — and, with the cache, stored in CPU memory (the least recently used entry
        making room)."""
        cache = self._prompt_cache
        if cache is not None:
            self._fill_pending_prompts()
        grad = torch.is_grad_enabled() and self.config.train_text_encoder
        keys, entries = self._cache_keys(ids), {}
        for i, key in enumerate(keys):
            if key in entries:
                continue
            entry = cache.get(key) if cache is not None else None
            if entry is None:
                with torch.set_grad_enabled(grad):
                    entry = self._encode_texts({k: ids[k][i : i + 1] for k in self._prompt_keys})
                if cache is not None:
                    entry = _map(lambda c: c.detach().cpu(), entry)
                    cache.put(key, entry)
            entries[key] = entry
        return keys, entries

    def cache_prompts(self, prompts: list[str], batch_size: int = 64) -> int:
        """Encode ``prompts`` into the prompt cache (each distinct prompt once; the empty
        prompt too when guidance needs it) and return how many distinct prompts it holds for
        them. With ``release_text_encoders`` the text encoders then move to the CPU
        (:meth:`release_text_encoders`). The cache must hold them all."""
        cache = self._prompt_cache
        if cache is None:
            why = "the text encoders train (train_text_encoder)" if self.config.train_text_encoder else "the policy takes no text prompts" if self.conditioning != "text" else "it is off"
            raise ConfigError("policy.prompt_cache", self.config.prompt_cache, f"cannot cache prompts: {why}")
        distinct = list(dict.fromkeys(str(p) for p in prompts))
        if self.config.guidance_scale != 1 and not self.zero_null_prompt and "" not in distinct:
            distinct.append("")
        if len(distinct) > cache.size:
            raise ConfigError("policy.prompt_cache", cache.size, f"holds fewer prompts than the {len(distinct)} distinct prompts to cache (the empty one included)")
        self._pending_prompts = []
        for start in range(0, len(distinct), batch_size):
            self._cached_entries(self._tokenize(distinct[start : start + batch_size]))
        if self.config.release_text_encoders:
            self.release_text_encoders()
        return len(distinct)

    def _fill_pending_prompts(self) -> None:
        """The prompts of ``prompt_files``, encoded at the first encoding (when the policy is
        on its device)."""
        if self._pending_prompts:
            prompts, self._pending_prompts = self._pending_prompts, []
            self.cache_prompts(prompts)

    def release_text_encoders(self) -> None:
        """Move the text encoders to the CPU and keep them there: moving the policy (``to``,
        ``cuda``, ``half``) leaves them, so they no longer take accelerator memory. Their
        weights stay in ``state_dict`` (checkpoints are unchanged); a prompt missing from the
        cache is encoded on the CPU, its embedding then moved to the denoiser's device."""
        for encoder in (self.text_encoder, self.text_encoder_2, self.text_encoder_3):
            if encoder is not None:
                encoder.to("cpu")
        self._text_encoders_released = True

    def _apply(self, fn, recurse: bool = True):
        if not getattr(self, "_text_encoders_released", False):
            return super()._apply(fn, recurse)
        held = {name: self._modules[name] for name in ("text_encoder", "text_encoder_2", "text_encoder_3") if self._modules.get(name) is not None}
        for name in held:  # None keeps each module's place in the state dict's order
            self._modules[name] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules.update(held)

    def _null(self, n: int):
        """The null condition for n rows: the null class, or the empty prompt's embedding
        (for SDXL with the pipeline's ``force_zeros_for_empty_prompt``, zero states and pooled
        embeddings beside the same time ids, as StableDiffusionXLPipeline's negative prompt)."""
        if self.conditioning == "class":
            return torch.full((n,), self.null_class, dtype=torch.long, device=self.device)
        if self.zero_null_prompt:
            unet = self.unet.config
            states = torch.zeros(n, self.prompt_lengths[0], unet.cross_attention_dim, device=self.device, dtype=self.dtype)
            pooled = torch.zeros(n, self.text_encoder_2.config.projection_dim, device=self.device, dtype=self.dtype)
            return states, pooled, torch.tensor([self.sdxl_time_ids], device=self.device, dtype=self.dtype).expand(n, -1)
        return _map(lambda c: c.expand(n, *c.shape[1:]), self._encode(self._tokenize([""])))

    # -------------------------------------------------------------- the denoiser

    def _unet(self, x: Tensor, timestep: Tensor, condition) -> Tensor:
        """The denoiser's output for ``x`` (named for the UNet it first was; any denoiser)."""
        if self.kind == "sd3":
            states, pooled = condition
            return self.transformer(x, encoder_hidden_states=states, pooled_projections=pooled, timestep=timestep.expand(x.shape[0])).sample
        if self.kind == "flux":
            return self._flux(x, timestep, condition)
        if self.kind == "qwen":
            return self._qwen(x, timestep, condition)
        if self.kind == "dit":
            out = self.transformer(x, timestep=timestep.expand(x.shape[0]), class_labels=condition).sample
        elif self.conditioning == "class":
            out = self.unet(x, timestep, class_labels=condition).sample
        elif self.conditioning == "text" and self.sdxl:
            states, pooled, time_ids = condition
            out = self.unet(x, timestep, encoder_hidden_states=states, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        elif self.conditioning == "text":
            out = self.unet(x, timestep, encoder_hidden_states=condition).sample
        else:
            out = self.unet(x, timestep).sample
        # a model that learns its variance (DiT) outputs it after the prediction; the chain's std is the transition's
        return out[:, : self.channels] if out.shape[1] == 2 * self.channels else out

    def _flux(self, x: Tensor, timestep: Tensor, condition) -> Tensor:
        """One FluxPipeline transformer call on the latents ``x`` [B, C, H, W]: packed into
        2 x 2 patches (``_pack_latents``), the timestep divided by 1000 (the transformer
        multiplies it back), the guidance embedding's value when the model is distilled,
        the output unpacked (``_unpack_latents``) to the velocity in the latent's layout."""
        states, pooled = condition
        b, c, h, w = x.shape
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        guidance = None if self.flux_guidance is None else torch.full((b,), self.flux_guidance, device=x.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=packed, timestep=timestep.expand(b) / 1000, guidance=guidance, pooled_projections=pooled, encoder_hidden_states=states,
            txt_ids=self.flux_text_ids, img_ids=self.flux_image_ids,
        ).sample
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def _qwen(self, x: Tensor, timestep: Tensor, condition) -> Tensor:
        """One QwenImagePipeline transformer call on the latents ``x`` [B, C, H, W]: 2 x 2
        packed as FLUX's, σ as the timestep, the text states with their mask, the image's
        token grid as ``img_shapes``; the output unpacked to the velocity."""
        states, mask = condition
        b, c, h, w = x.shape
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
        out = self.transformer(
            hidden_states=packed, timestep=timestep.expand(b) / 1000, encoder_hidden_states=states, encoder_hidden_states_mask=mask.bool(),
            img_shapes=[(1, h // 2, w // 2)] * b,
        ).sample
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def step_activation_bytes(self) -> int:
        """The widest feature map of one denoiser evaluation per latent, in bytes: the UNet's
        first level (block_out_channels[0] x height x width), a transformer's patch tokens x
        its width; twice that under classifier-free guidance with both passes in one batch
        (``guidance_grad: both``). The trainer's estimate for ``algo.micro_batches`` null."""
        model = self.denoiser_model
        height, width = self.resolution
        if self.kind == "unet":
            elements = model.config.block_out_channels[0] * height * width
        elif self.kind in ("flux", "qwen"):  # 2 x 2 packed tokens (and the text tokens beside them)
            text = self.prompt_lengths[1] if self.kind == "flux" else self.prompt_lengths[0] - QWEN_DROP
            elements = ((height // 2) * (width // 2) + text) * model.config.num_attention_heads * model.config.attention_head_dim
        else:
            patch = model.config.patch_size
            elements = (height // patch) * (width // patch) * model.config.num_attention_heads * model.config.attention_head_dim
        joint = self.config.guidance_scale != 1 and self.config.guidance_grad != "detached"
        return elements * next(model.parameters()).element_size() * (2 if joint else 1)

    def _guided(self, x: Tensor, timestep: Tensor, condition, null) -> Tensor:
        """The denoiser's output under classifier-free guidance: uncond + w (cond − uncond)."""
        w = self.config.guidance_scale
        if w == 1:
            return self._unet(x, timestep, condition)
        if self.config.guidance_grad == "detached":
            cond = self._unet(x, timestep, condition)
            with torch.no_grad():
                uncond = self._unet(x, timestep, null)
        else:
            cat = lambda a, b: torch.cat([a, b])  # noqa: E731
            both = self._unet(cat(x, x), cat(timestep.expand(x.shape[0]), timestep.expand(x.shape[0])), _map2(cat, condition, null))
            cond, uncond = both.chunk(2)
        guided = uncond + w * (cond - uncond)
        if self.kind == "qwen":  # QwenImagePipeline: rescaled to the conditional output's norm, per 2 x 2 packed token
            norm = lambda v: v.unflatten(2, (-1, 2)).unflatten(4, (-1, 2)).square().sum((1, 3, 5), keepdim=True).sqrt()  # noqa: E731
            guided = (guided.unflatten(2, (-1, 2)).unflatten(4, (-1, 2)) * (norm(cond) / norm(guided))).flatten(4).flatten(2, 3)
        return guided

    def _transition_input(self, out: Tensor, x: Tensor, time: Tensor) -> Tensor:
        if not self.config.is_diffusion:
            return out
        alpha_bar = self.alphas_cumprod[time.long()].view(-1, *([1] * (x.ndim - 1)))
        return epsilon_from_prediction(out, x, alpha_bar, self.prediction_type)

    def _unet_time(self, time: Tensor) -> Tensor:
        """The transition's time (a training timestep, or σ) → the denoiser's timestep."""
        return time if self.config.is_diffusion else time * self.config.flow_time_scale

    def _denoiser(self, condition):
        """``(x, t, rows) -> ε or v`` for the chains of ``condition`` (class ids or embeddings)."""
        guided = self.config.guidance_scale != 1
        null = self._null(1) if guided else None

        def denoise(x: Tensor, time: Tensor, rows: Tensor) -> Tensor:
            cond = _map(lambda c: c[rows], condition) if condition is not None else None
            null_rows = _map(lambda c: c.expand(x.shape[0], *c.shape[1:]), null) if null is not None else None
            out = self._guided(x, self._unet_time(time), cond, null_rows)
            return self._transition_input(out, x, time)

        return denoise

    def _embedded(self, conditions: dict[str, Tensor]):
        """The replay's conditioning → what the denoiser takes (class ids, or text embeddings)."""
        if self.conditioning == "text":
            return self._encode(conditions)
        return conditions.get("condition")

    def chain_denoiser(self, replay: dict):
        return self._denoiser(self._embedded(replay))

    # -------------------------------------------------------------- latents and pixels

    def encode_images(self, pixels: Tensor) -> Tensor:
        """Pixels [N, 3, H, W] in [-1, 1] → what the chain denoises: the pixels themselves, or
        the VAE latent (z − shift_factor)·scaling_factor with z drawn from the encoder's
        posterior (as diffusers' training scripts do); no grad."""
        if self.vae is None:
            return pixels
        if self.kind == "qwen":  # a video VAE: one frame; z normalized by the per-channel statistics
            with torch.no_grad():
                z = self.vae.encode(pixels[:, :, None].to(self.vae.dtype)).latent_dist.sample().float()
            return ((z - self.qwen_latents_mean) / self.qwen_latents_std)[:, :, 0].to(self.dtype)
        with torch.no_grad():
            z = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.sample().to(self.dtype)
        return (z - self.vae_shift) * self.vae_scale

    def decode_latents(self, latents: Tensor) -> Tensor:
        """The chain's final latents → pixels [N, 3, H, W] (the VAE decodes z = latent /
        scaling_factor + shift_factor); no grad, once per sample."""
        if self.vae is None:
            return latents
        if self.kind == "qwen":  # QwenImagePipeline: z = latent / (1 / std) + mean, one frame
            with torch.no_grad():
                z = latents[:, :, None].float() / (1.0 / self.qwen_latents_std) + self.qwen_latents_mean
                return self.vae.decode(z.to(self.vae.dtype)).sample[:, :, 0].float()
        with torch.no_grad():
            return self.vae.decode((latents / self.vae_scale + self.vae_shift).to(self.vae.dtype)).sample.float()

    # -------------------------------------------------------------- sampling and SFT

    def sample(
        self, inputs, generator: torch.Generator | None = None, deterministic: bool = False, keep_graph: bool = False, noise_group_size: int | None = None,
        final_only: bool = False,
    ) -> Sample:
        """One image per input (condition id or prompt string); ``deterministic`` takes the
        deterministic update at every step (the initial noise is still drawn from ``generator``).
        ``keep_graph``: the log-probs keep the autograd graph (``keeps_sampling_graph``); the
        conditioning is then embedded with grad too, as ``log_prob`` embeds it.
        ``noise_group_size`` G: every G consecutive inputs start from one initial noise.
        ``final_only``: the replay keeps the final latent, not the chain (``samples_final_only``)."""
        with torch.set_grad_enabled(keep_graph):
            conditions = self._conditions(inputs)
            n = len(inputs)
            x_init = self.initial_noise((n, self.channels, *self.resolution), generator, noise_group_size).to(self.device)
            out = self.sample_chain(self._denoiser(self._embedded(conditions)), x_init, generator, deterministic, keep_graph=keep_graph, final_only=final_only)
        replay = {"chain": out.chain, **conditions}
        with torch.no_grad():
            images = pixels_to_uint8(self.decode_latents(out.final))
        return Sample(output=out.final, logp=out.logp, replay=replay, mask=out.mask, entropy=out.entropy, info={"images": images}, logp_deferred=out.deferred)

    def save_extra(self, directory) -> None:
        """With LoRA on a denoiser diffusers has a LoRA loader for (a UNet2DConditionModel, an
        SD3Transformer2DModel, a FluxTransformer2DModel), the adapters also go to ``lora_diffusers/`` in diffusers'
        format (:func:`save_diffusers_lora`), beside every ``save_pretrained`` and checkpoint,
        for ``pipeline.load_lora_weights``."""
        if self.config.lora.r and type(self.denoiser_model).__name__ in LORA_EXPORTS:
            save_diffusers_lora(self, Path(directory) / "lora_diffusers")

    export_layouts = {"diffusers-lora": "the LoRA adapters as pytorch_lora_weights.safetensors, for pipeline.load_lora_weights(DIR)"}

    def export_formats(self) -> dict[str, str]:
        """``diffusers-lora`` with LoRA on a denoiser diffusers has a LoRA loader for."""
        if self.config.lora.r and type(self.denoiser_model).__name__ in LORA_EXPORTS:
            return dict(self.export_layouts)
        return {}

    def export(self, fmt: str, out: Path) -> None:
        save_diffusers_lora(self, out)

    def media(self, rollout) -> dict[str, Tensor]:
        """The generated images, written at evaluation as a PNG grid (and to TensorBoard)."""
        return {"images": rollout.info["images"]}

    def sft_loss(self, batch: dict) -> Tensor:
        """The denoising loss of diffusion models (‖target − D(x_t, t, c)‖², with t uniform
        over the training timesteps and the target of ``prediction_type``), or flow matching's
        (‖(ε − x0) − D(x_σ, σ, c)‖² with x_σ = (1 − σ)·x0 + σ·ε, σ ~ U(0, 1)), on a batch
        ``{"images": uint8 [B, H, W, 3], "condition": LongTensor [B] | "prompt": [str]}``;
        x0 is the images' VAE latent when there is a VAE. A ``condition_dropout`` fraction of
        the samples is trained on the null condition."""
        x0 = self.encode_images(uint8_to_pixels(batch["images"]).to(self.device))
        b = x0.shape[0]
        inputs = batch.get("condition", batch.get("prompt"))
        condition = self._embedded(self._conditions(inputs)) if self.conditioning != "none" else None
        if condition is not None and self.config.condition_dropout > 0:
            drop = torch.rand(b, device=self.device) < self.config.condition_dropout
            null = self._null(b)
            condition = _map2(lambda n, c: torch.where(drop.view(-1, *([1] * (c.ndim - 1))), n, c), null, condition)
        noise = torch.randn_like(x0)
        if self.config.is_diffusion:
            t = torch.randint(0, self.config.denoising.num_train_timesteps, (b,), device=self.device)
            alpha_bar = self.alphas_cumprod[t].view(-1, 1, 1, 1)
            x_t = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise
            prediction = self._unet(x_t, t.float(), condition)
            target = diffusion_target(x0, noise, alpha_bar, self.prediction_type)
        else:
            sigma = torch.rand(b, device=self.device)
            s = sigma.view(-1, 1, 1, 1)
            prediction = self._unet((1 - s) * x0 + s * noise, self._unet_time(sigma), condition)
            target = noise - x0
        return torch.mean((prediction - target) ** 2)
