"""``wan_video``: Wan 2.x text-to-video (diffusers' ``WanPipeline``), denoising as an MDP.

Reference followed: ``diffusers.pipelines.wan.pipeline_wan.WanPipeline`` (diffusers 0.42),
step for step:

- the prompt: ``prompt_clean`` (the pipeline's own function), the tokenizer padding /
  truncating to ``max_sequence_length`` with its attention mask, ``UMT5EncoderModel(ids,
  mask).last_hidden_state``, each row cut at its real length and zero-padded back to
  ``max_sequence_length`` (``_get_t5_prompt_embeds``); the negative prompt (``""`` by
  default) the same way, for guidance;
- the latent: [C, (F − 1) / vae.scale_factor_temporal + 1, H / vae.scale_factor_spatial,
  W / vae.scale_factor_spatial] (``prepare_latents``), C the transformer's in_channels;
- the chain: the sigmas of ``FlowMatchEulerDiscreteScheduler(num_train_timesteps, shift)
  .set_timesteps(K)`` (σ_0 = 1 … σ_K = 0) with the shift of the directory's scheduler
  (``flow_shift`` of Wan's ``UniPCMultistepScheduler``, ``shift`` of a flow-matching Euler
  one), the transformer's timestep σ·num_train_timesteps, its output the velocity; mmrl
  steps it with its own flow transitions (:mod:`mmrl.denoising`: ``flow_ode`` is the Euler
  scheduler's step, ``flow_sde`` Flow-GRPO's, ``flow_cps``), so the deterministic chain is
  WanPipeline's with the Euler scheduler (UniPC, Wan's default sampler, is a multistep
  method mmrl does not sample with);
- guidance: for ``guidance_scale`` > 1, uncond + w·(cond − uncond), the unconditional pass on
  the negative prompt's states (run without grad here);
- the decode: z = latent / (1 / latents_std) + latents_mean, then ``vae.decode`` → frames
  in [-1, 1] → ``info["videos"]`` uint8 [N, F, H, W, 3] (round((x + 1)·127.5), clipped;
  the pipeline's ``np`` output is (x / 2 + 0.5) clipped, as float).

One decision is one stochastic denoising step of one whole video; the replay holds the chain
beside ``prompt_ids`` and ``prompt_mask`` [N, L], whose UMT5 states ``log_prob`` reads from
the prompt cache (each distinct prompt encoded once and alone, as the image policy does), so
the recompute sees the sampling pass's numbers. With ``lora.r > 0`` peft adapters on the
transformer are all that trains (VAE and UMT5 frozen), ``reference()`` is the transformer
with its adapters disabled, and saves also write the adapters in diffusers' format for
``WanPipeline.load_lora_weights`` (:func:`save_wan_lora`).

Not covered: Wan 2.2's two-expert ``transformer_2`` / ``boundary_ratio`` and its TI2V
``expand_timesteps``, image-to-video (``image_dim``), and guidance through both passes.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.core.rollout import Rollout
from mmrl.data.prompts import require_text_prompts
from mmrl.denoising import DenoisingPolicy
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import FlowTransition
from mmrl.errors import ConfigError
from mmrl.hub import pipeline_dir
from mmrl.policies.diffusers_common import PromptCache, class_name, leave_frozen_weights_unsaved, require_diffusers, videos_to_uint8, with_lora
from mmrl.policies.hf import require_transformers, save_tied_weights_once
from mmrl.policies.lora import adapters_disabled
from mmrl.policies.wan_video.config import WanVideoConfig
from mmrl.registry import POLICIES

FIELD = "policy.model_path"
TEXT_ENCODER_CLASSES = ("UMT5EncoderModel", "T5EncoderModel")


def _diffusers():
    return require_diffusers("the wan_video policy")


def _transformers():
    return require_transformers("text", "the wan_video policy's UMT5 text encoder")


# ------------------------------------------------------------------ building the parts


@dataclass
class _Parts:
    transformer: nn.Module
    vae: nn.Module
    text_encoder: nn.Module
    tokenizer: object
    scheduler: dict | None  # scheduler_config.json of the directory


def _tiny_parts(config: WanVideoConfig) -> _Parts:
    """A random Wan transformer, Wan VAE (dim_mult [1, 1, 1, 1]: 8x spatial; temporal
    downsampling in its last two levels: 4x) and UMT5 over mmrl's byte-level tokenizer."""
    diffusers, tf = _diffusers(), _transformers()
    from mmrl.policies.tiny_tokenizers import byte_tokenizer

    tiny = config.tiny
    tokenizer = byte_tokenizer()
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = config.max_sequence_length
    text_encoder = tf.UMT5EncoderModel(
        tf.UMT5Config(vocab_size=len(tokenizer), d_model=tiny.text_dim, d_kv=max(tiny.text_dim // tiny.text_heads, 1), d_ff=2 * tiny.text_dim,
                      num_layers=tiny.text_layers, num_heads=tiny.text_heads, relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id)
    )
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=tiny.heads, attention_head_dim=tiny.head_dim, in_channels=tiny.latent_channels,
        out_channels=tiny.latent_channels, text_dim=tiny.text_dim, freq_dim=32, ffn_dim=tiny.ffn_dim, num_layers=tiny.layers, rope_max_seq_len=32,
    )
    vae = diffusers.AutoencoderKLWan(
        base_dim=tiny.vae_base_dim, z_dim=tiny.latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * tiny.latent_channels, latents_std=[1.0] * tiny.latent_channels,
    )
    return _Parts(transformer, vae, text_encoder, tokenizer, None)


def _load_parts(config: WanVideoConfig) -> _Parts:
    """transformer/, vae/, text_encoder/ + tokenizer/ and scheduler/ of a WanPipeline directory."""
    diffusers, tf = _diffusers(), _transformers()
    root, value = pipeline_dir(config.model_path, FIELD), config.model_path
    names = {sub: class_name(root / sub) for sub in ("transformer", "vae", "text_encoder")}
    if names["transformer"] is None:
        raise ConfigError(FIELD, value, "expected a WanPipeline directory (written by save_pretrained): transformer/, vae/, text_encoder/ + tokenizer/, scheduler/")
    if (root / "transformer_2").is_dir():
        raise ConfigError(FIELD, value, "has transformer_2/ (Wan 2.2's two experts split by boundary_ratio); only single-transformer Wan (2.1, 2.2 TI2V without expand_timesteps) is supported")
    index_file = root / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    if index.get("expand_timesteps"):
        raise ConfigError(FIELD, value, "its pipeline sets expand_timesteps (Wan 2.2 TI2V's per-token timesteps), which is not supported")
    expected = {"transformer": ("WanTransformer3DModel",), "vae": ("AutoencoderKLWan",), "text_encoder": TEXT_ENCODER_CLASSES}
    for sub, allowed in expected.items():
        if names[sub] is None:
            raise ConfigError(FIELD, value, f"a Wan pipeline needs {sub}/ beside transformer/")
        if names[sub] not in allowed:
            raise ConfigError(FIELD, value, f"{sub}/ holds a {names[sub]}; supported there: {list(allowed)}")
    if not (root / "tokenizer").is_dir():
        raise ConfigError(FIELD, value, "text_encoder/ needs tokenizer/ beside it")
    transformer = diffusers.WanTransformer3DModel.from_pretrained(str(root / "transformer"))
    if transformer.config.image_dim is not None or transformer.config.added_kv_proj_dim is not None:
        raise ConfigError(FIELD, value, "the WanTransformer3DModel takes image embeddings (image-to-video); only text-to-video is supported")
    vae = diffusers.AutoencoderKLWan.from_pretrained(str(root / "vae"))
    # local_files_only: the directory is resolved (mmrl.hub); transformers must not look further
    text_encoder = getattr(tf, names["text_encoder"]).from_pretrained(str(root / "text_encoder"), local_files_only=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    tokenizer.padding_side = "right"  # _get_t5_prompt_embeds keeps the first seq_len states
    scheduler_file = root / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(scheduler_file.read_text()) if scheduler_file.is_file() else None
    return _Parts(transformer, vae, text_encoder, tokenizer, scheduler)


def _scheduler_shift(config: WanVideoConfig, scheduler: dict | None) -> tuple[float, int]:
    """(shift, num_train_timesteps) of the directory's flow-matching scheduler, checked
    against ``policy.denoising``; without one (the tiny model) those of ``denoising``."""
    options, path = config.denoising, "policy.denoising.time_shift"
    if scheduler is None:
        return options.time_shift, options.num_train_timesteps
    name = str(scheduler.get("_class_name", ""))
    if "FlowMatch" in name:
        if scheduler.get("use_dynamic_shifting"):
            raise ConfigError(path, options.time_shift, f"the pipeline's {name} shifts its sigmas by the video size (use_dynamic_shifting); only a fixed shift is supported")
        shift = float(scheduler.get("shift", 1.0))
    elif scheduler.get("use_flow_sigmas") or scheduler.get("prediction_type") == "flow_prediction":
        shift = float(scheduler.get("flow_shift", 1.0))  # Wan's UniPCMultistepScheduler
    else:
        raise ConfigError(FIELD, config.model_path, f"scheduler/ holds a {name or 'scheduler'} without flow-matching sigmas (use_flow_sigmas / flow_prediction); a Wan pipeline's is a flow-matching one")
    if shift != options.time_shift:
        raise ConfigError(path, options.time_shift, f"the pipeline's scheduler has shift {shift} (its flow_shift); set {shift}")
    return shift, int(scheduler.get("num_train_timesteps", 1000))


def scheduler_sigmas(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> Tensor:
    """σ_0 = 1 … σ_K = 0 [K + 1] (float32) of ``FlowMatchEulerDiscreteScheduler(num_train_timesteps,
    shift).set_timesteps(K)``: diffusers' own grid, so the transformer sees the pipeline's
    timesteps σ·num_train_timesteps to the bit."""
    scheduler = _diffusers().FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float().cpu()


# ------------------------------------------------------------------ LoRA in diffusers' format


def save_wan_lora(policy: "WanVideoPolicy", out_dir: str | os.PathLike) -> Path:
    """Write the transformer's LoRA adapters where ``WanPipeline.load_lora_weights(out_dir)``
    reads them: ``out_dir/pytorch_lora_weights.safetensors``, keys ``transformer.…`` (peft's
    ``get_peft_model_state_dict``, saved with ``WanPipeline.save_lora_weights`` and the
    adapter's ``LoraConfig`` as metadata, so the loader applies the same rank, alpha and
    target modules), as diffusers' Wan LoRA training scripts do. Written under a temporary
    name, then renamed into place."""
    lora = policy.config.lora
    if not lora.r:
        raise ConfigError("policy.lora.r", lora.r, "there are no adapters to export (LoRA is off)")
    diffusers = _diffusers()
    from peft.utils import get_peft_model_state_dict

    model = policy.transformer
    layers = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    metadata = model.peft_config["default"].to_dict()
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    diffusers.WanPipeline.save_lora_weights(str(tmp), transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata, safe_serialization=True)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------ the chain on diffusers' sigmas


class _SchedulerChain(DenoisingPolicy):
    """:class:`DenoisingPolicy` with its transitions on the scheduler's sigma grid
    (:func:`scheduler_sigmas`) instead of mmrl's evenly spaced one (the ``transition`` hook)."""

    def _sigmas(self, num_steps: int) -> Tensor:
        raise NotImplementedError

    def transition(self, options: DenoisingOptions, deterministic: bool = False, device=None) -> FlowTransition:
        name = "flow_ode" if deterministic else options.transition
        return FlowTransition(self._sigmas(options.num_inference_steps).to(device), name, options.noise_level, options.sde_diffusion)

    def flow_sigmas(self) -> Tensor:
        return self._sigmas(self.denoising.num_inference_steps)


class _AdapterDisabledReference(_SchedulerChain):
    """The KL reference of a LoRA policy: its own transformer with the adapters disabled,
    sharing the weights without registering them (the trainer freezing it leaves the policy
    alone); every call runs without grad."""

    def __init__(self, policy: "WanVideoPolicy"):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    @property
    def config(self) -> WanVideoConfig:
        return self.policy.config

    def _sigmas(self, num_steps: int) -> Tensor:
        return self.policy._sigmas(num_steps)

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
        "sampler": {"type": "prompt", "data": {"train": "examples/shapes_single_count/train.jsonl", "eval": "examples/shapes_single_count/eval.jsonl"}},
        "policy": {"type": "wan_video", "frames": 5, "height": 16, "width": 16, "max_sequence_length": 16, "guidance_scale": 2.0, "denoising": {"num_inference_steps": 3}},
        "rewards": [{"type": "temporal_consistency"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": (
        "the old log-probs are deferred (the trainer's ratio is exactly 1); the sampling pass's provisional numbers come from one "
        "transformer call per denoising step, log_prob's from one call over every step's latents (chunk_steps: null): float32 sums "
        "over another batch can differ by a few ulps of a step's mean log-prob (as for video_diffusion's UNet3D). Measured: 0 "
        "over seeds 0-4 on the CPU these tests ran on (ATEN default kernels); 0 by construction with chunk_steps: 1"
    ),
}


@POLICIES.register("wan_video", config=WanVideoConfig, contract=CONTRACT)
class WanVideoPolicy(_SchedulerChain):
    """Wan 2.x text-to-video from a local diffusers directory (or a tiny random one); each
    stochastic denoising step over the whole video latent is one decision."""

    keeps_sampling_graph = True
    shares_initial_noise = True

    def __init__(self, config: WanVideoConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        require_text_prompts(spec, "wan_video (text to video)")
        parts = _load_parts(config) if config.model_path else _tiny_parts(config)
        self.shift, self.num_train_timesteps = _scheduler_shift(config, parts.scheduler)
        self.transformer, self.vae, self.text_encoder, self.tokenizer = parts.transformer, parts.vae, parts.text_encoder, parts.tokenizer
        self.vae.requires_grad_(False)
        self.text_encoder.requires_grad_(False)
        where = config.model_path or "policy.tiny"
        model, vae = self.transformer.config, self.vae.config
        text_width = getattr(self.text_encoder.config, "d_model", None)
        if text_width != model.text_dim:
            raise ConfigError(FIELD, where, f"the text encoder is {text_width} wide but the transformer's text_dim is {model.text_dim}")
        if model.in_channels != vae.z_dim or (model.out_channels or model.in_channels) != vae.z_dim:
            raise ConfigError(FIELD, where, f"the transformer maps {model.in_channels} to {model.out_channels} channels; the VAE's latent has {vae.z_dim}")
        if len(vae.latents_mean) != vae.z_dim or len(vae.latents_std) != vae.z_dim:
            raise ConfigError(FIELD, where, f"the VAE's latents_mean / latents_std must have z_dim = {vae.z_dim} entries")
        # WanPipeline.__init__ / prepare_latents / check_inputs
        temporal, spatial = int(vae.scale_factor_temporal), int(vae.scale_factor_spatial)
        if (config.frames - 1) % temporal:
            raise ConfigError("policy.frames", config.frames, f"frames - 1 must be a multiple of the VAE's temporal factor {temporal} (e.g. {(config.frames - 1) // temporal * temporal + 1})")
        _, patch_h, patch_w = model.patch_size
        for name, size, patch in (("height", config.height, patch_h), ("width", config.width, patch_w)):
            if size % (spatial * patch):
                raise ConfigError(f"policy.{name}", size, f"must be a multiple of {spatial * patch} (the VAE's spatial factor {spatial} x the transformer's patch {patch})")
        self.latent_shape = (int(model.in_channels), (config.frames - 1) // temporal + 1, config.height // spatial, config.width // spatial)
        self.register_buffer("latents_mean", torch.tensor(vae.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("latents_std", torch.tensor(vae.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1), persistent=False)
        # RL compares passes over one chain (sampling, the recompute, the reference): no dropout
        for module in self.transformer.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        self._grids: dict[int, Tensor] = {}
        self._prompt_cache = PromptCache(config.prompt_cache) if config.prompt_cache > 0 else None
        if config.lora.r:
            with_lora(self.transformer, config.lora)
        self.train()
        # T5's input embedding is tied to its shared embedding: safetensors takes one name per tensor
        save_tied_weights_once(self)
        leave_frozen_weights_unsaved(self, config.save_frozen_weights)

    def train(self, mode: bool = True) -> "WanVideoPolicy":
        """Train mode for the transformer only: UMT5 and the VAE stay in eval mode."""
        super().train(mode)
        self.text_encoder.eval()
        self.vae.eval()
        return self

    def _sigmas(self, num_steps: int) -> Tensor:
        if num_steps not in self._grids:
            self._grids[num_steps] = scheduler_sigmas(num_steps, self.shift, self.num_train_timesteps)
        return self._grids[num_steps]

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    @contextmanager
    def adapters_disabled(self):
        """Within the block the transformer runs without its LoRA adapters (the base model)."""
        if not self.config.lora.r:
            yield
            return
        with adapters_disabled(self.transformer):
            yield

    def reference(self) -> nn.Module | None:
        """With LoRA, the transformer with its adapters disabled (no copy); otherwise None (the
        trainer keeps a frozen copy)."""
        return _AdapterDisabledReference(self) if self.config.lora.r else None

    # -------------------------------------------------------------- prompts

    def _tokenize(self, prompts: list[str]) -> dict[str, Tensor]:
        """``prompt_ids`` and ``prompt_mask`` [N, L] as ``_get_t5_prompt_embeds`` tokenizes
        (``prompt_clean`` first, padding / truncation to ``max_sequence_length``)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        out = self.tokenizer(
            [prompt_clean(p) for p in prompts], padding="max_length", max_length=self.config.max_sequence_length, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        return {"prompt_ids": out.input_ids.to(self.device), "prompt_mask": out.attention_mask.to(self.device)}

    def _encode_one(self, ids: Tensor, mask: Tensor) -> Tensor:
        """UMT5's states [1, L, D] of one prompt, zero past its real length (in the encoder's dtype)."""
        encoder_device = next(self.text_encoder.parameters()).device
        with torch.no_grad():
            states = self.text_encoder(ids.to(encoder_device), mask.to(encoder_device)).last_hidden_state[0]
        length = int(mask.gt(0).sum())
        return torch.cat([states[:length], states.new_zeros(states.shape[0] - length, states.shape[1])])[None]

    def _encode(self, ids: Tensor, mask: Tensor) -> Tensor:
        """The rows' prompt states [N, L, D] in the transformer's dtype: each distinct prompt
        encoded once and alone (its states never depend on the prompts it came with), from
        the prompt cache when it holds it."""
        cache = self._prompt_cache
        keys = [a.numpy().tobytes() + b.numpy().tobytes() for a, b in zip(ids.cpu(), mask.cpu())]
        entries: dict[bytes, Tensor] = {}
        for i, key in enumerate(keys):
            if key in entries:
                continue
            entry = cache.get(key) if cache is not None else None
            if entry is None:
                entry = self._encode_one(ids[i : i + 1], mask[i : i + 1])
                if cache is not None:
                    entry = entry.cpu()
                    cache.put(key, entry)
            entries[key] = entry
        return torch.cat([entries[k] for k in keys]).to(self.device, self.dtype)

    def _conditions(self, inputs) -> dict[str, Tensor]:
        if isinstance(inputs, Tensor) or not all(isinstance(p, str) for p in inputs):
            raise ConfigError(FIELD if self.config.model_path else "policy.type", self.config.model_path or "wan_video", f"takes prompt strings (a prompt sampler over texts), got {type(inputs).__name__}")
        return self._tokenize(list(inputs))

    # -------------------------------------------------------------- the denoiser

    @property
    def guided(self) -> bool:
        return self.config.guidance_scale > 1  # WanPipeline.do_classifier_free_guidance

    def _transformer(self, x: Tensor, timestep: Tensor, states: Tensor) -> Tensor:
        out = self.transformer(hidden_states=x.to(self.dtype), timestep=timestep, encoder_hidden_states=states, return_dict=False)[0]
        return out.float()

    def _denoiser(self, conditions: dict[str, Tensor]):
        """``(x, σ, rows) -> v`` for the chains of ``conditions``: the transformer at timestep
        σ·num_train_timesteps on the prompt states, guided by the negative prompt's."""
        states = self._encode(conditions["prompt_ids"], conditions["prompt_mask"])
        null = None
        if self.guided:
            negative = self._tokenize([self.config.negative_prompt])
            null = self._encode(negative["prompt_ids"], negative["prompt_mask"])
        w = self.config.guidance_scale

        def denoise(x: Tensor, time: Tensor, rows: Tensor) -> Tensor:
            timestep = time * self.num_train_timesteps
            out = self._transformer(x, timestep, states[rows])
            if null is not None:
                with torch.no_grad():
                    uncond = self._transformer(x, timestep, null.expand(x.shape[0], -1, -1))
                out = uncond + w * (out - uncond)
            return out

        return denoise

    def chain_denoiser(self, replay: dict):
        return self._denoiser(replay)

    def step_activation_bytes(self) -> int:
        """The transformer's tokens x its width per video, in bytes (the uncond pass of
        guidance carries no grad): the trainer's estimate for ``algo.micro_batches`` null."""
        model = self.transformer.config
        _, frames, height, width = self.latent_shape
        tokens = frames // model.patch_size[0] * (height // model.patch_size[1]) * (width // model.patch_size[2])
        return tokens * model.num_attention_heads * model.attention_head_dim * next(self.transformer.parameters()).element_size()

    # -------------------------------------------------------------- sampling and media

    def decode_latents(self, latents: Tensor) -> Tensor:
        """Latents [N, C, T, h, w] → frames [N, 3, F, H, W] in [-1, 1], as WanPipeline decodes:
        z = latent / (1 / latents_std) + latents_mean, then the VAE's decoder; no grad."""
        with torch.no_grad():
            z = latents.to(self.vae.dtype)
            mean, inv_std = self.latents_mean.to(z), 1.0 / self.latents_std.to(z)
            return self.vae.decode(z / inv_std + mean, return_dict=False)[0].float()

    def sample(
        self, inputs, generator: torch.Generator | None = None, deterministic: bool = False, keep_graph: bool = False, noise_group_size: int | None = None
    ) -> Sample:
        """One video per prompt string; ``deterministic`` takes the ODE (Euler) step everywhere
        (the initial noise is still drawn from ``generator``, on the CPU). ``keep_graph``: the
        log-probs keep the autograd graph. ``noise_group_size`` G: every G consecutive prompts
        start from one initial noise."""
        with torch.set_grad_enabled(keep_graph):
            conditions = self._conditions(inputs)
            x_init = self.initial_noise((len(inputs), *self.latent_shape), generator, noise_group_size).to(self.device)
            out = self.sample_chain(self._denoiser(conditions), x_init, generator, deterministic, keep_graph=keep_graph)
        videos = videos_to_uint8(self.decode_latents(out.final))
        info = {"videos": videos, "images": videos[:, 0].contiguous()}
        return Sample(output=out.final, logp=out.logp, replay={"chain": out.chain, **conditions}, mask=out.mask, entropy=out.entropy, info=info, logp_deferred=out.deferred)

    def media(self, rollout: Rollout) -> dict[str, Tensor]:
        """The sampled videos, to be written at evaluation (an mp4 and a PNG of the frames)."""
        return {"videos": rollout.info["videos"]}

    export_layouts = {"diffusers-lora": "the LoRA adapters as pytorch_lora_weights.safetensors, for WanPipeline.load_lora_weights(DIR)"}

    def export_formats(self) -> dict[str, str]:
        """``diffusers-lora`` with LoRA on the transformer."""
        return dict(self.export_layouts) if self.config.lora.r else {}

    def export(self, fmt: str, out: Path) -> None:
        save_wan_lora(self, out)

    def save_extra(self, directory) -> None:
        """With LoRA, the adapters also go to ``lora_diffusers/`` in diffusers' format
        (:func:`save_wan_lora`), beside every ``save_pretrained`` and checkpoint."""
        if self.config.lora.r:
            save_wan_lora(self, Path(directory) / "lora_diffusers")
