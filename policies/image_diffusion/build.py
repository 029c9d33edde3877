"""The parts of an ``image_diffusion`` policy: a tiny pipeline built from ``policy.tiny``, or a
diffusers pipeline directory read and checked (denoiser, VAE, text encoders, scheduler).

Apart from the policy because building and checking the parts is done once, before the
policy exists, and reads nothing of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from mmrl.errors import ConfigError
from mmrl.hub import pipeline_dir
from mmrl.policies.diffusers_common import class_name as config_class_name
from mmrl.policies.diffusers_common import require_diffusers as require_diffusers_for
from mmrl.policies.diffusers_common import tiny_text_encoder
from mmrl.policies.hf import require_transformers
from mmrl.policies.image_diffusion.config import ImageDiffusionConfig


def require_diffusers():
    return require_diffusers_for("the image_diffusion policy")


def _transformers():
    return require_transformers("text", "text prompts of the image_diffusion policy (a CLIP text encoder)")


# ------------------------------------------------------------------ building the parts

UNET_CLASSES = ("UNet2DModel", "UNet2DConditionModel")
TRANSFORMER_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel", "DiTTransformer2DModel")
VAE_CLASSES = ("AutoencoderKL", "AutoencoderKLQwenImage")


@dataclass
class Parts:
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
    return require_diffusers().AutoencoderKL(
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


def tiny_parts(config: ImageDiffusionConfig, spec: dict) -> Parts:
    diffusers = require_diffusers()
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
        return Parts(transformer, "sd3", "text", [text_encoder], [tokenizer], vae)
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
        return Parts(transformer, "dit", "class", vae=vae)
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
        return Parts(unet, "unet", "text", [text_encoder], [tokenizer], vae)
    blocks = dict(down_block_types=("DownBlock2D",) * levels, up_block_types=("UpBlock2D",) * levels)
    if tiny.conditioning == "none":
        return Parts(diffusers.UNet2DModel(**common, **blocks), "unet", "none", vae=vae)
    # one more class than the sampler's conditions: the last is the null condition of guidance
    return Parts(diffusers.UNet2DModel(**common, **blocks, num_class_embeds=_num_conditions(spec) + 1), "unet", "class", vae=vae)


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
        class_name = config_class_name(encoder_dir)
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


def load_parts(config: ImageDiffusionConfig) -> Parts:
    """The denoiser (+ VAE, text encoders and tokenizers) and scheduler config of a pipeline directory."""
    diffusers = require_diffusers()
    field_name = "policy.model_path"
    root = pipeline_dir(config.model_path, field_name)
    unet_name, transformer_name = config_class_name(root / "unet"), config_class_name(root / "transformer")
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
    vae_name = config_class_name(root / "vae")
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
        return Parts(denoiser, kind, conditioning, vae=vae, scheduler=scheduler)
    if class_name == "DiTTransformer2DModel":
        if not denoiser.config.num_embeds_ada_norm:
            raise ConfigError(field_name, config.model_path, "the DiTTransformer2DModel has no class embedding (num_embeds_ada_norm)")
        return Parts(denoiser, kind, "class", vae=vae, scheduler=scheduler)
    encoders, tokenizers = _load_text_encoders(root, kind, sdxl)
    # StableDiffusionXLPipeline's force_zeros_for_empty_prompt (model_index.json; True by default)
    index_file = root / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    zero_null = sdxl and bool(index.get("force_zeros_for_empty_prompt", True))
    return Parts(denoiser, kind, "text", encoders, tokenizers, vae, scheduler, sdxl=sdxl, zero_null_prompt=zero_null)


def check_scheduler(config: ImageDiffusionConfig, scheduler: dict, kind: str = "unet") -> None:
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

