"""``image_diffusion``: an image generator over a ``diffusers`` UNet, denoising as an MDP.

One decision is one stochastic denoising step of an image's chain (DDPO with ``ddim`` η > 0
or ``ddpm``; Flow-GRPO with ``flow_sde``; CPS with ``flow_cps``), all from
:mod:`mmrl.denoising`: this module only says how the UNet is conditioned and what it
predicts. ``sample`` takes the prompt sampler's inputs — a LongTensor of condition ids (a
class-conditional UNet2DModel) or a list of prompt strings (a UNet2DConditionModel under a
CLIP text encoder) — and returns the chains in the replay layout beside the conditioning:

    chain            the latents, step indices and stochastic mask (mmrl.denoising.chain)
    condition [N]    class ids (class conditioning), or
    prompt_ids [N, L] token ids (text conditioning; the encoder runs again in log_prob)

The images live in pixel space, in [-1, 1]; the final latent is decoded to
``info["images"]`` (uint8 [N, H, W, 3], RGB) for the image rewards.

What the UNet predicts (``prediction_type``) is converted to what the transition takes:
ε for diffusion steps (:func:`epsilon_from_prediction`), the velocity noise − image for flow
steps. Classifier-free guidance (``guidance_scale`` w) combines a conditional and an
unconditional pass, uncond + w (cond − uncond), in the UNet's own output space, when
sampling and when recomputing log-probs, so the recomputed log-prob is that of the guided
step that was sampled; the unconditional pass uses the null condition (the last class id,
or the empty prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.denoising import DenoisingPolicy, alphas_cumprod, ddpm_betas
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.policies.image_diffusion.config import ImageDiffusionConfig
from mmrl.registry import POLICIES

UNET_CLASSES = ("UNet2DModel", "UNet2DConditionModel")


def _diffusers():
    try:
        import diffusers
    except ImportError:
        raise MissingExtraError("diffusers", "image", "the image_diffusion policy") from None
    return diffusers


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", "text", "text prompts of the image_diffusion policy (a CLIP text encoder)") from None
    return transformers


# ------------------------------------------------------------------ pure conversions


def epsilon_from_prediction(output: Tensor, x: Tensor, alpha_bar: Tensor, prediction_type: str) -> Tensor:
    """ε̂ from a diffusion UNet's output at x_t = sqrt(ᾱ)·x0 + sqrt(1 − ᾱ)·ε:

        epsilon:       ε̂ = output
        v_prediction:  ε̂ = sqrt(ᾱ)·v̂ + sqrt(1 − ᾱ)·x_t      (v = sqrt(ᾱ)·ε − sqrt(1 − ᾱ)·x0; Salimans & Ho 2022)
        sample:        ε̂ = (x_t − sqrt(ᾱ)·x̂0) / sqrt(1 − ᾱ)

    ``alpha_bar`` broadcasts against ``x`` ([B, 1, 1, 1])."""
    if prediction_type == "epsilon":
        return output
    if prediction_type == "v_prediction":
        return alpha_bar.sqrt() * output + (1 - alpha_bar).sqrt() * x
    if prediction_type == "sample":
        return (x - alpha_bar.sqrt() * output) / (1 - alpha_bar).sqrt()
    raise ValueError(f"prediction_type must be epsilon, v_prediction or sample, got {prediction_type!r}")


def diffusion_target(x0: Tensor, noise: Tensor, alpha_bar: Tensor, prediction_type: str) -> Tensor:
    """The regression target of the denoising loss at x_t = sqrt(ᾱ)·x0 + sqrt(1 − ᾱ)·ε
    (Ho et al. 2020 for ε): ε, v = sqrt(ᾱ)·ε − sqrt(1 − ᾱ)·x0, or x0."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * x0
    if prediction_type == "sample":
        return x0
    raise ValueError(f"prediction_type must be epsilon, v_prediction or sample, got {prediction_type!r}")


def pixels_to_uint8(x: Tensor) -> Tensor:
    """Images [N, 3, H, W] in [-1, 1] → uint8 [N, H, W, 3]: round((x + 1)·127.5), clipped."""
    return ((x.detach().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def uint8_to_pixels(images: Tensor) -> Tensor:
    """uint8 [N, H, W, 3] → float [N, 3, H, W] in [-1, 1]: x = u / 127.5 − 1."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1


# ------------------------------------------------------------------ building the parts


@dataclass
class _Parts:
    unet: nn.Module
    conditioning: str  # class | text | none
    text_encoder: nn.Module | None = None
    tokenizer: object = None
    scheduler: dict | None = None  # the pipeline's scheduler_config.json


def _tiny_parts(config: ImageDiffusionConfig, spec: dict) -> _Parts:
    diffusers = _diffusers()
    tiny = config.tiny
    levels = len(tiny.block_out_channels)
    common = dict(
        sample_size=tiny.resolution,
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(tiny.block_out_channels),
        layers_per_block=tiny.layers_per_block,
        norm_num_groups=tiny.norm_num_groups,
    )
    if tiny.conditioning == "text":
        tf = _transformers()
        from mmrl.policies.text_lm.tokenizer import byte_tokenizer

        tokenizer = byte_tokenizer()
        tokenizer.padding_side = "right"
        tokenizer.model_max_length = tiny.max_prompt_tokens
        text_config = tf.CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=tiny.text_hidden_size,
            intermediate_size=2 * tiny.text_hidden_size,
            num_hidden_layers=tiny.text_layers,
            num_attention_heads=tiny.text_heads,
            max_position_embeddings=tiny.max_prompt_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.pad_token_id,
        )
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
        return _Parts(unet, "text", tf.CLIPTextModel(text_config), tokenizer)
    blocks = dict(down_block_types=("DownBlock2D",) * levels, up_block_types=("UpBlock2D",) * levels)
    if tiny.conditioning == "none":
        return _Parts(diffusers.UNet2DModel(**common, **blocks), "none")
    num_prompts = spec.get("num_prompts")
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
        raise ConfigError(
            "policy.tiny.conditioning", "class", f"takes condition ids; use it with `sampler.type: prompt` over conditions (the sampler's spec gave num_prompts={num_prompts!r})"
        )
    # one more class than the sampler's conditions: the last is the null condition of guidance
    return _Parts(diffusers.UNet2DModel(**common, **blocks, num_class_embeds=num_prompts + 1), "class")


def _load_parts(config: ImageDiffusionConfig) -> _Parts:
    """The UNet (+ text encoder and tokenizer) and scheduler config of a pipeline directory."""
    diffusers = _diffusers()
    root = Path(config.model_path)
    field = "policy.model_path"
    unet_config = root / "unet" / "config.json"
    if not unet_config.is_file():
        raise ConfigError(field, config.model_path, "expected a local diffusers pipeline directory with unet/ (written by save_pretrained), and text_encoder/ + tokenizer/ for text prompts")
    class_name = json.loads(unet_config.read_text()).get("_class_name")
    if class_name not in UNET_CLASSES:
        raise ConfigError(field, config.model_path, f"unet/ holds a {class_name}; supported denoisers: {list(UNET_CLASSES)}")
    unet = getattr(diffusers, class_name).from_pretrained(str(root / "unet"))
    if unet.config.in_channels != 3 or unet.config.out_channels != 3:
        raise ConfigError(field, config.model_path, f"the UNet has {unet.config.in_channels} input channels; this policy denoises RGB pixels (3 channels); latent-space (VAE) models are not supported yet")
    scheduler_file = root / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(scheduler_file.read_text()) if scheduler_file.is_file() else None
    if class_name == "UNet2DModel":
        conditioning = "class" if unet.config.num_class_embeds else "none"
        return _Parts(unet, conditioning, scheduler=scheduler)
    if not (root / "text_encoder").is_dir() or not (root / "tokenizer").is_dir():
        raise ConfigError(field, config.model_path, "a UNet2DConditionModel needs text_encoder/ and tokenizer/ beside unet/")
    tf = _transformers()
    # local_files_only: a directory name that looks like a hub id must never start a download
    text_encoder = tf.CLIPTextModel.from_pretrained(str(root / "text_encoder"), local_files_only=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    tokenizer.padding_side = "right"
    return _Parts(unet, "text", text_encoder, tokenizer, scheduler)


def _check_scheduler(config: ImageDiffusionConfig, scheduler: dict) -> None:
    """The pipeline's scheduler must describe the schedule ``policy.denoising`` samples with."""
    options, path = config.denoising, "policy.denoising."
    is_flow = "FlowMatch" in str(scheduler.get("_class_name", ""))
    if is_flow == config.is_diffusion:
        kind = "a flow-matching" if is_flow else "a diffusion"
        allowed = "flow_sde, flow_cps or flow_ode" if is_flow else "ddim or ddpm"
        raise ConfigError(path + "transition", options.transition, f"the pipeline's scheduler ({scheduler.get('_class_name')}) is {kind} schedule; use {allowed}")
    if is_flow:
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


# ------------------------------------------------------------------ the policy


@POLICIES.register("image_diffusion", config=ImageDiffusionConfig)
class ImageDiffusionPolicy(DenoisingPolicy):
    """RGB images from a diffusers UNet; each stochastic denoising step is one decision."""

    def __init__(self, config: ImageDiffusionConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        parts = _load_parts(config) if config.model_path else _tiny_parts(config, spec)
        if parts.scheduler is not None:
            _check_scheduler(config, parts.scheduler)
        self.unet = parts.unet
        self.conditioning = parts.conditioning
        self.text_encoder = parts.text_encoder
        self.tokenizer = parts.tokenizer
        if self.text_encoder is not None:
            if not config.train_text_encoder:
                self.text_encoder.requires_grad_(False)
            positions = self.text_encoder.config.max_position_embeddings
            self.prompt_tokens = config.max_prompt_tokens or self.tokenizer.model_max_length
            if self.prompt_tokens > positions:
                raise ConfigError("policy.max_prompt_tokens", config.max_prompt_tokens, f"the text encoder has {positions} positions (the tokenizer's model_max_length is {self.tokenizer.model_max_length}); set at most {positions}")
        self.prediction_type = config.prediction_type or self._default_prediction(parts.scheduler)
        if self.prediction_type not in config.allowed_predictions:
            raise ConfigError("policy.prediction_type", self.prediction_type, f"the pipeline's scheduler predicts it, but transition {config.denoising.transition} takes one of {list(config.allowed_predictions)}")
        if self.conditioning == "none" and config.guidance_scale != 1:
            raise ConfigError("policy.guidance_scale", config.guidance_scale, "needs a conditional UNet (class or text); an unconditional one takes 1")
        if self.conditioning == "class":
            # the last class embedding is the null condition of classifier-free guidance
            self.null_class = int(self.unet.config.num_class_embeds) - 1
            num_prompts = spec.get("num_prompts")
            if isinstance(num_prompts, int) and num_prompts > self.null_class:
                raise ConfigError("policy.model_path", config.model_path, f"the UNet has {self.null_class} classes besides the null class (the last); the sampler has {num_prompts} conditions")
        sample_size = self.unet.config.sample_size
        self.resolution = tuple(sample_size) if isinstance(sample_size, (list, tuple)) else (sample_size, sample_size)
        options = config.denoising
        if config.is_diffusion:
            ab = alphas_cumprod(ddpm_betas(options.num_train_timesteps, options.beta_schedule, options.beta_start, options.beta_end)).float()
            self.register_buffer("alphas_cumprod", ab, persistent=False)

    def _default_prediction(self, scheduler: dict | None) -> str:
        if not self.config.is_diffusion:
            return "velocity"
        return (scheduler or {}).get("prediction_type", "epsilon")

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    # -------------------------------------------------------------- conditioning

    @property
    def _conditioning_field(self) -> tuple[str, str]:
        """The config field that chose the conditioning, and its value, for input errors."""
        if self.config.model_path:
            return "policy.model_path", self.config.model_path
        return "policy.tiny.conditioning", self.conditioning

    def _conditions(self, inputs) -> Tensor | None:
        """The replay's conditioning of the sampler's inputs: class ids [N] or token ids [N, L]."""
        if self.conditioning == "class":
            if not isinstance(inputs, Tensor) or inputs.dtype != torch.long:
                raise ConfigError(*self._conditioning_field, f"takes condition ids (a LongTensor from a prompt sampler over conditions), got {type(inputs).__name__}")
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.null_class):
                raise ValueError(f"condition ids must lie in [0, {self.null_class}), got {inputs.tolist()}")
            return inputs.to(self.device)
        if self.conditioning == "text":
            if isinstance(inputs, Tensor) or not all(isinstance(p, str) for p in inputs):
                raise ConfigError(*self._conditioning_field, f"takes prompt strings (a prompt sampler over texts), got {type(inputs).__name__}")
            return self._tokenize(list(inputs))
        return None

    def _tokenize(self, prompts: list[str]) -> Tensor:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.prompt_tokens, truncation=True, return_tensors="pt").input_ids
        return ids.to(self.device)

    def _encode(self, prompt_ids: Tensor) -> Tensor:
        """Text embeddings [N, L, D] the UNet cross-attends to (no grad unless the encoder trains)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.config.train_text_encoder):
            return self.text_encoder(prompt_ids).last_hidden_state

    def _null(self, n: int) -> Tensor:
        """The null condition for n rows: the null class, or the empty prompt's embedding."""
        if self.conditioning == "class":
            return torch.full((n,), self.null_class, dtype=torch.long, device=self.device)
        return self._encode(self._tokenize([""])).expand(n, -1, -1)

    # -------------------------------------------------------------- the denoiser

    def _unet(self, x: Tensor, timestep: Tensor, condition: Tensor | None) -> Tensor:
        if self.conditioning == "class":
            return self.unet(x, timestep, class_labels=condition).sample
        if self.conditioning == "text":
            return self.unet(x, timestep, encoder_hidden_states=condition).sample
        return self.unet(x, timestep).sample

    def _guided(self, x: Tensor, timestep: Tensor, condition: Tensor | None, null: Tensor | None) -> Tensor:
        """The UNet's output under classifier-free guidance: uncond + w (cond − uncond)."""
        w = self.config.guidance_scale
        if w == 1:
            return self._unet(x, timestep, condition)
        if self.config.guidance_grad == "detached":
            cond = self._unet(x, timestep, condition)
            with torch.no_grad():
                uncond = self._unet(x, timestep, null)
        else:
            both = self._unet(torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([condition, null]))
            cond, uncond = both.chunk(2)
        return uncond + w * (cond - uncond)

    def _transition_input(self, out: Tensor, x: Tensor, time: Tensor) -> Tensor:
        if not self.config.is_diffusion:
            return out
        alpha_bar = self.alphas_cumprod[time.long()].view(-1, *([1] * (x.ndim - 1)))
        return epsilon_from_prediction(out, x, alpha_bar, self.prediction_type)

    def _unet_time(self, time: Tensor) -> Tensor:
        """The transition's time (a training timestep, or σ) → the UNet's timestep."""
        return time if self.config.is_diffusion else time * self.config.flow_time_scale

    def _denoiser(self, condition: Tensor | None):
        """``(x, t, rows) -> ε or v`` for the chains of ``condition`` (class ids or embeddings)."""
        guided = self.config.guidance_scale != 1
        null = self._null(1) if guided else None

        def denoise(x: Tensor, time: Tensor, rows: Tensor) -> Tensor:
            cond = condition[rows] if condition is not None else None
            null_rows = null.expand(x.shape[0], *null.shape[1:]) if null is not None else None
            out = self._guided(x, self._unet_time(time), cond, null_rows)
            return self._transition_input(out, x, time)

        return denoise

    def _embedded(self, condition: Tensor | None) -> Tensor | None:
        return self._encode(condition) if self.conditioning == "text" else condition

    def chain_denoiser(self, replay: dict):
        key = {"class": "condition", "text": "prompt_ids"}.get(self.conditioning)
        return self._denoiser(self._embedded(replay[key]) if key else None)

    # -------------------------------------------------------------- sampling and SFT

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """One image per input (condition id or prompt string); ``deterministic`` takes the
        deterministic update at every step (the initial noise is still drawn from ``generator``)."""
        condition = self._conditions(inputs)
        n = len(inputs)
        x_init = torch.randn((n, 3, *self.resolution), generator=generator).to(self.device)
        out = self.sample_chain(self._denoiser(self._embedded(condition)), x_init, generator, deterministic)
        replay = {"chain": out.chain}
        if self.conditioning == "class":
            replay["condition"] = condition
        elif self.conditioning == "text":
            replay["prompt_ids"] = condition
        return Sample(output=out.final, logp=out.logp, replay=replay, mask=out.mask, entropy=out.entropy, info={"images": pixels_to_uint8(out.final)})

    def media(self, rollout) -> dict[str, Tensor]:
        """The generated images, written at evaluation as a PNG grid (and to TensorBoard)."""
        return {"images": rollout.info["images"]}

    def sft_loss(self, batch: dict) -> Tensor:
        """The denoising loss of diffusion models (‖target − UNet(x_t, t, c)‖², with t uniform
        over the training timesteps and the target of ``prediction_type``), or flow matching's
        (‖(ε − x0) − UNet(x_σ, σ, c)‖² with x_σ = (1 − σ)·x0 + σ·ε, σ ~ U(0, 1)), on a batch
        ``{"images": uint8 [B, H, W, 3], "condition": LongTensor [B] | "prompt": [str]}``.
        A ``condition_dropout`` fraction of the samples is trained on the null condition."""
        x0 = uint8_to_pixels(batch["images"]).to(self.device)
        b = x0.shape[0]
        inputs = batch.get("condition", batch.get("prompt"))
        condition = self._embedded(self._conditions(inputs)) if self.conditioning != "none" else None
        if condition is not None and self.config.condition_dropout > 0:
            drop = torch.rand(b, device=self.device) < self.config.condition_dropout
            null = self._null(b)
            condition = torch.where(drop.view(-1, *([1] * (condition.ndim - 1))), null, condition)
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
