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

This module holds the policy: its denoiser calls, guidance, latents and sampling. Building
the parts is :mod:`.build`, the conditioning :mod:`.conditioning`, the LoRA layout :mod:`.export`.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.data.prompts import require_text_prompts
from mmrl.denoising import DenoisingOptions, DenoisingPolicy, FlowTransition, alphas_cumprod, ddpm_betas, flow_sigmas, provisional_logp_why, resolution_shift, terminal_stretch
from mmrl.errors import ConfigError
from mmrl.policies.diffusers_common import (
    PromptCache,
    diffusion_target,
    epsilon_from_prediction,
    leave_frozen_weights_unsaved,
    pixels_to_uint8,
    uint8_to_pixels,
    with_lora,
)
from mmrl.policies.hf import save_tied_weights_once
from mmrl.policies.image_diffusion.build import check_scheduler, load_parts, tiny_parts
from mmrl.policies.image_diffusion.conditioning import QWEN_DROP, Conditioning, map_condition, map_condition_pair, read_prompt_files
from mmrl.policies.image_diffusion.config import ImageDiffusionConfig
from mmrl.policies.image_diffusion.export import LORA_EXPORTS, save_diffusers_lora
from mmrl.policies.lora import adapters_disabled
from mmrl.registry import POLICIES


FLUX_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size: the default image is this many latent pixels a side


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
class ImageDiffusionPolicy(Conditioning, DenoisingPolicy):
    """RGB images from a diffusers denoiser (a UNet, an SD3 transformer or a DiT), in pixel
    space or over a VAE's latents; each stochastic denoising step is one decision."""

    keeps_sampling_graph = True
    shares_initial_noise = True
    samples_final_only = True

    def __init__(self, config: ImageDiffusionConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        parts = load_parts(config) if config.model_path else tiny_parts(config, spec)
        if parts.scheduler is not None:
            check_scheduler(config, parts.scheduler, parts.kind)
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
        self._pending_prompts = read_prompt_files(config.prompt_files) if cached else []
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
            both = self._unet(cat(x, x), cat(timestep.expand(x.shape[0]), timestep.expand(x.shape[0])), map_condition_pair(cat, condition, null))
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
            cond = map_condition(lambda c: c[rows], condition) if condition is not None else None
            null_rows = map_condition(lambda c: c.expand(x.shape[0], *c.shape[1:]), null) if null is not None else None
            out = self._guided(x, self._unet_time(time), cond, null_rows)
            return self._transition_input(out, x, time)

        return denoise

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
            condition = map_condition_pair(lambda n, c: torch.where(drop.view(-1, *([1] * (c.ndim - 1))), n, c), null, condition)
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
