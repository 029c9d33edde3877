"""``video_diffusion``: a short-video generator over a ``diffusers`` UNet3D, denoising as an MDP.

The chain is the image policy's chain over a bigger latent: one decision is one stochastic
denoising step of a whole video (all F frames at once), with the transitions of
:mod:`mmrl.denoising` (DDPO's ``ddim`` η > 0 or ``ddpm``; Flow-GRPO's ``flow_sde``; CPS's
``flow_cps``). The latent is the video in pixel space, [3, F, H, W] in [-1, 1] — the layout
``UNet3DConditionModel`` takes — so a stored chain is ``latents`` [N, W + 1, 3, F, H, W].

The denoiser is a ``UNet3DConditionModel`` (spatial convolutions and cross-attention per
frame, temporal convolutions and temporal self-attention across frames), which needs
``encoder_hidden_states``: a learned embedding [1, D] of the prompt sampler's condition id
(``tiny.conditioning: class``, one more row for the null condition of guidance), the states
[L, D] of a small frozen CLIP text encoder over the prompt string (``text``, the empty
prompt as null condition), or one learned embedding for every sample (``none``). The
replay holds the chain beside ``condition`` [N] (class ids) or ``prompt_ids`` [N, L] (the
text encoder runs again in ``log_prob``). What the UNet predicts is converted to what the transition
takes with the image policy's conversions (:func:`epsilon_from_prediction`).

``sample`` returns ``info["videos"]`` (uint8 [N, F, H, W, 3], RGB) for video rewards and
``info["images"]`` (the first frame, uint8 [N, H, W, 3]) so that image rewards apply too;
``media`` gives the videos to write at evaluation (:mod:`mmrl.media`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmrl.core.policy import Sample
from mmrl.core.rollout import Rollout
from mmrl.data.prompts import require_text_prompts
from mmrl.denoising import DenoisingPolicy, alphas_cumprod, ddpm_betas
from mmrl.errors import ConfigError
from mmrl.policies.diffusers_common import diffusion_target, epsilon_from_prediction, require_diffusers, tiny_text_encoder, uint8_to_pixels, videos_to_uint8
from mmrl.policies.video_diffusion.config import VideoDiffusionConfig
from mmrl.registry import POLICIES


def _diffusers():
    return require_diffusers("the video_diffusion policy")


def uint8_to_videos(videos: Tensor) -> Tensor:
    """uint8 [N, F, H, W, 3] → float [N, 3, F, H, W] in [-1, 1]."""
    n, f, h, w, _ = videos.shape
    return uint8_to_pixels(videos.flatten(0, 1)).view(n, f, 3, h, w).transpose(1, 2)


def _tiny_text_encoder(config: VideoDiffusionConfig):
    tiny = config.tiny
    return tiny_text_encoder(tiny.condition_dim, tiny.text_layers, tiny.text_heads, tiny.max_prompt_tokens, user="video_diffusion")


def _tiny_unet(config: VideoDiffusionConfig) -> nn.Module:
    tiny = config.tiny
    levels = len(tiny.block_out_channels)
    return _diffusers().UNet3DConditionModel(
        sample_size=tiny.resolution,
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(tiny.block_out_channels),
        layers_per_block=tiny.layers_per_block,
        norm_num_groups=tiny.norm_num_groups,
        down_block_types=("CrossAttnDownBlock3D",) + ("DownBlock3D",) * (levels - 1),
        up_block_types=("UpBlock3D",) * (levels - 1) + ("CrossAttnUpBlock3D",),
        cross_attention_dim=tiny.condition_dim,
        # UNet3DConditionModel reads attention_head_dim as the number of heads
        attention_head_dim=tiny.attention_heads,
    )


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {
        "sampler": {"type": "prompt", "data": {"num_prompts": 2}},
        "policy": {"type": "video_diffusion", "tiny": {"frames": 2, "resolution": 8, "block_out_channels": [8]}, "denoising": {"num_inference_steps": 3}},
        "rewards": [{"type": "temporal_consistency"}],
    },
    "ratio_atol": 5e-3,
    "ratio_why": (
        "the old log-probs are deferred (the trainer's ratio is exactly 1); the sampling pass's provisional numbers come from one "
        "UNet3D call per denoising step, log_prob's from one call over every step's latents (chunk_steps: null): float32 sums over "
        "another batch differ by a few ulps of a step's log-prob, a sum of 3 x 2 x 8 x 8 pixel terms (about 1.2e3 on the last "
        "step, whose std is floored at min_std 0.01). Measured: 1.2e-4 to 4.9e-4 (1 to 4 ulps) over seeds 0-4 under "
        "ATEN_CPU_CAPABILITY default, avx2 and avx512; 0 with chunk_steps: 1"
    ),
}


@POLICIES.register("video_diffusion", config=VideoDiffusionConfig, contract=CONTRACT)
class VideoDiffusionPolicy(DenoisingPolicy):
    """RGB videos from a diffusers UNet3D; each stochastic denoising step is one decision."""

    keeps_sampling_graph = True
    shares_initial_noise = True

    def __init__(self, config: VideoDiffusionConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        tiny = config.tiny
        self.conditioning = tiny.conditioning
        self.text_encoder = self.tokenizer = None
        if self.conditioning == "class":
            num_prompts = spec.get("num_prompts")
            if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
                raise ConfigError(
                    "policy.tiny.conditioning", "class", f"takes condition ids; use it with `sampler.type: prompt` over conditions (the sampler's spec gave num_prompts={num_prompts!r})"
                )
            # one more row than the sampler's conditions: the last is the null condition of guidance
            self.null_class = num_prompts
            self.condition_embedding = nn.Embedding(num_prompts + 1, tiny.condition_dim)
            nn.init.normal_(self.condition_embedding.weight, std=1.0)
        elif self.conditioning == "text":
            require_text_prompts(spec, "policy.tiny.conditioning: text")
            self.text_encoder, self.tokenizer = _tiny_text_encoder(config)
            self.text_encoder.requires_grad_(False)
        else:
            self.condition_embedding = nn.Embedding(1, tiny.condition_dim)
            nn.init.normal_(self.condition_embedding.weight, std=1.0)
        self.unet = _tiny_unet(config)
        # diffusers' 3-D blocks put dropout 0.1 into their temporal convolutions; RL compares
        # passes over one chain (sampling, the recompute, the reference), which a fresh
        # dropout mask per pass would make disagree (ratio != 1), so dropout is off
        for module in self.unet.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        self.frames, self.resolution = tiny.frames, (tiny.resolution, tiny.resolution)
        self.prediction_type = config.prediction_type or ("epsilon" if config.is_diffusion else "velocity")
        options = config.denoising
        if config.is_diffusion:
            ab = alphas_cumprod(ddpm_betas(options.num_train_timesteps, options.beta_schedule, options.beta_start, options.beta_end)).float()
            self.register_buffer("alphas_cumprod", ab, persistent=False)

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (3, self.frames, *self.resolution)

    # -------------------------------------------------------------- conditioning

    def _conditions(self, inputs) -> Tensor:
        """The replay's conditioning of the sampler's inputs: class ids [N] (zeros without
        conditioning) or prompt token ids [N, L]."""
        if self.conditioning == "none":
            return torch.zeros(len(inputs), dtype=torch.long, device=self.device)
        if self.conditioning == "text":
            if isinstance(inputs, Tensor) or not all(isinstance(p, str) for p in inputs):
                raise ConfigError("policy.tiny.conditioning", "text", f"takes prompt strings (a prompt sampler over texts), got {type(inputs).__name__}")
            return self._tokenize(list(inputs))
        if not isinstance(inputs, Tensor) or inputs.dtype != torch.long:
            raise ConfigError("policy.tiny.conditioning", "class", f"takes condition ids (a LongTensor from a prompt sampler over conditions), got {type(inputs).__name__}")
        if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.null_class):
            raise ValueError(f"condition ids must lie in [0, {self.null_class}), got {inputs.tolist()}")
        return inputs.to(self.device)

    def _tokenize(self, prompts: list[str]) -> Tensor:
        length = self.config.tiny.max_prompt_tokens
        return self.tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids.to(self.device)

    def _context(self, conditions: Tensor) -> Tensor:
        """encoder_hidden_states [N, L, D] of a replay's conditioning: the learned embedding
        of class ids [N] (L = 1), or the frozen text encoder's states of token ids [N, L]."""
        if self.conditioning == "text":
            with torch.no_grad():
                return self.text_encoder(conditions).last_hidden_state
        return self.condition_embedding(conditions)[:, None, :]

    def _null_context(self, n: int) -> Tensor:
        """The null condition's states for n rows: the null class, or the empty prompt."""
        if self.conditioning == "text":
            return self._context(self._tokenize([""])).expand(n, -1, -1)
        return self._context(torch.full((n,), self.null_class, dtype=torch.long, device=self.device))

    # -------------------------------------------------------------- the denoiser

    def _unet(self, x: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
        return self.unet(x, timestep, encoder_hidden_states=context).sample

    def _denoiser(self, conditions: Tensor):
        """``(x, t, rows) -> ε or v`` for the chains of ``conditions`` (class ids [N] or token
        ids [N, L]); class embeddings are looked up per call so that they get a gradient."""
        w = self.config.guidance_scale
        text_states = self._context(conditions) if self.conditioning == "text" else None

        def denoise(x: Tensor, time: Tensor, rows: Tensor) -> Tensor:
            timestep = time if self.config.is_diffusion else time * self.config.flow_time_scale
            context = text_states[rows] if text_states is not None else self._context(conditions[rows])
            out = self._unet(x, timestep, context)
            if w != 1:
                with torch.no_grad():
                    uncond = self._unet(x, timestep, self._null_context(x.shape[0]))
                out = uncond + w * (out - uncond)
            if not self.config.is_diffusion:
                return out
            alpha_bar = self.alphas_cumprod[time.long()].view(-1, *([1] * (x.ndim - 1)))
            return epsilon_from_prediction(out, x, alpha_bar, self.prediction_type)

        return denoise

    def step_activation_bytes(self) -> int:
        """The widest feature map of one denoiser evaluation per video, in bytes: the 3-D
        UNet's first level (block_out_channels[0] x frames x height x width). Guidance adds
        no grad-carrying pass (the unconditional one runs without grad). The trainer's
        estimate for ``algo.micro_batches`` null."""
        height, width = self.resolution
        elements = self.unet.config.block_out_channels[0] * self.frames * height * width
        return elements * next(self.unet.parameters()).element_size()

    @property
    def _replay_key(self) -> str:
        return "prompt_ids" if self.conditioning == "text" else "condition"

    def chain_denoiser(self, replay: dict):
        return self._denoiser(replay[self._replay_key])

    # -------------------------------------------------------------- sampling, media and SFT

    def sample(
        self, inputs, generator: torch.Generator | None = None, deterministic: bool = False, keep_graph: bool = False, noise_group_size: int | None = None
    ) -> Sample:
        """One video per input (a condition id); ``deterministic`` takes the deterministic
        update at every step (the initial noise is still drawn from ``generator``).
        ``keep_graph``: the log-probs keep the autograd graph (``keeps_sampling_graph``).
        ``noise_group_size`` G: every G consecutive inputs start from one initial noise."""
        with torch.set_grad_enabled(keep_graph):
            ids = self._conditions(inputs)
            x_init = self.initial_noise((len(ids), *self.latent_shape), generator, noise_group_size).to(self.device)
            out = self.sample_chain(self._denoiser(ids), x_init, generator, deterministic, keep_graph=keep_graph)
        videos = videos_to_uint8(out.final)
        info = {"videos": videos, "images": videos[:, 0].contiguous()}
        return Sample(output=out.final, logp=out.logp, replay={"chain": out.chain, self._replay_key: ids}, mask=out.mask, entropy=out.entropy, info=info, logp_deferred=out.deferred)

    def media(self, rollout: Rollout) -> dict[str, Tensor]:
        """The sampled videos, to be written at evaluation (an mp4 and a PNG of the frames)."""
        return {"videos": rollout.info["videos"]}

    def sft_loss(self, batch: dict) -> Tensor:
        """The denoising loss (diffusion: ‖target − UNet(x_t, t, c)‖², t uniform over the
        training timesteps; flow matching: ‖(ε − x0) − UNet(x_σ, σ, c)‖², σ ~ U(0, 1)) on
        ``{"videos": uint8 [B, F, H, W, 3], "condition": LongTensor [B] | "prompt": [str]}``
        (neither without conditioning); a ``condition_dropout`` fraction trains on the null
        condition."""
        x0 = uint8_to_videos(batch["videos"]).to(self.device)
        b = x0.shape[0]
        inputs = {"class": batch.get("condition"), "text": batch.get("prompt")}.get(self.conditioning, range(b))
        context = self._context(self._conditions(inputs))
        if self.conditioning != "none" and self.config.condition_dropout > 0:
            drop = torch.rand(b, device=self.device) < self.config.condition_dropout
            context = torch.where(drop.view(-1, 1, 1), self._null_context(b), context)
        noise = torch.randn_like(x0)
        if self.config.is_diffusion:
            t = torch.randint(0, self.config.denoising.num_train_timesteps, (b,), device=self.device)
            alpha_bar = self.alphas_cumprod[t].view(-1, 1, 1, 1, 1)
            prediction = self._unet(alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise, t.float(), context)
            target = diffusion_target(x0, noise, alpha_bar, self.prediction_type)
        else:
            sigma = torch.rand(b, device=self.device)
            s = sigma.view(-1, 1, 1, 1, 1)
            prediction = self._unet((1 - s) * x0 + s * noise, sigma * self.config.flow_time_scale, context)
            target = noise - x0
        return torch.mean((prediction - target) ** 2)
