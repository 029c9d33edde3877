"""The shared vision-language backbone of mmrl's VLA policies.

A VLA reads a *prefix* of tokens and runs a causal transformer decoder over it (and over
whatever the policy appends: action tokens for the token VLA, action-expert queries for the
flow VLA):

    prefix = [ patches(camera 1) … patches(camera K) | state | [BOS] w_1 … w_L ]

- image: uint8 [N, (K,) H, W, 3] → float in [-2, 2] (plus two coordinate planes with
  ``coord_channels``) → a small CNN of stride-2 3×3 convs (``vision_channels``), each followed
  by GroupNorm (``vision_norm``), optionally FiLM-conditioned on the instruction (``film``),
  and GELU → a feature map whose cells are patch tokens (optionally average-pooled to a
  ``patch_grid`` × ``patch_grid`` grid), each layer-normed (``patch_norm``) and projected to
  ``hidden_size`` plus a learned
  position embedding (per grid cell) and a learned camera embedding (per camera); with
  ``keypoints`` K > 0 also K keypoint tokens per camera, the softmax-expected (x, y) of K
  learned feature maps (spatial softmax), projected to ``hidden_size``;
- state: one token, a linear projection of the proprioceptive state (if the env has one);
- instruction: word embeddings of the tokenized instruction (padding masked out).

This is the OpenVLA recipe in miniature (vision encoder → projector → language-model
decoder; Kim et al. 2024, "OpenVLA: An Open-Source Vision-Language-Action Model"), with a CNN
in place of the pretrained ViTs so that tiny models train from scratch on a CPU.

The normalizations matter at this size: a tabletop image is mostly uniform background with
a few small objects, and with raw [0, 1] inputs and no normalization the patch tokens of
different images differed by ~1% of their norm — trained from demonstrations, the policy
learned to ignore the image altogether (its loss did not change when the images of a batch
were shuffled). Standardized inputs, GroupNorm and a LayerNorm per patch make the image's
content a first-order part of every patch token.

The decoder is a ``transformers`` decoder-only model built from its config with random
weights (``arch`` picks the family); it is fed ``inputs_embeds`` and a padding mask, and
its own token embedding table is removed (nothing here has token ids for it). Its rotary
position embeddings give every prefix slot its position. Pretrained weights of a whole
policy come from mmrl's ``save_pretrained``/``load_pretrained`` directories.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.policies.hf import DECODER_ARCHS, require_transformers
from mmrl.policies.lora import LoraOptions
from mmrl.policies.vla.static_decode import static_decoder



@dataclass
class VLABackboneConfig:
    """The ``backbone:`` section of every VLA policy config."""

    hidden_size: int = option(64, "width of the transformer decoder (every token is projected to it)", ge=1)
    num_layers: int = option(2, "decoder layers", ge=1)
    num_heads: int = option(4, "attention heads (hidden_size / num_heads must be an even integer)", ge=1)
    intermediate_size: int = option(128, "width of the decoder's MLP", ge=1)
    vision_channels: list[int] = option(factory=lambda: [16, 32], doc="output channels of the image CNN's stride-2 3x3 convs (each halves H and W)")
    vision_norm: str = option("group", "normalization after each conv: GroupNorm (features of small objects stand out against a uniform background) or none", choices=("group", "none"))
    patch_norm: bool = option(True, "LayerNorm on every cell's CNN features before the projection to a patch token")
    coord_channels: bool = option(False, "append x/y coordinate planes in [-1, 1] to the image before the CNN (CoordConv, Liu et al. 2018): pooled patches can then tell where in their cell an object lies")
    film: bool = option(False, "condition every CNN layer on the instruction with FiLM (per-channel scale and shift from the mean word embedding; RT-1, Brohan et al. 2022), so the vision features can single out what the instruction names")
    keypoints: int = option(0, "also give K keypoint tokens per camera: the expected (x, y) of K learned feature maps under a spatial softmax (Levine et al. 2016), precise object positions that pooled patches blur; 0 = none", ge=0)
    patch_grid: int | None = option(8, "average-pool the CNN feature map to at most this many cells per side (fewer patch tokens, a faster decoder); null keeps every cell", ge=1)
    max_instruction_tokens: int = option(16, "instruction tokens kept ([BOS] included); longer instructions are truncated", ge=1)
    arch: str = option("llama", "transformers decoder family, built from a config with random weights", choices=DECODER_ARCHS)
    attn_implementation: str = option("sdpa", "transformers attention kernel", choices=("sdpa", "eager"))
    vlm_path: str | None = option(
        None,
        "directory or hub id (org/name[@revision]) of a transformers vision-language model with its tokenizer and image processor, save_pretrained layout (LLaVA, Idefics3/SmolVLM, PaliGemma, Qwen2-VL/Qwen2.5-VL): the VLA sits on it instead of the miniature above, whose size fields are then unused; null = the miniature",
    )
    vlm_layers: int | None = option(None, "with vlm_path: keep only the first N decoder layers of the VLM (SmolVLA uses the first half); null = all", ge=1)
    vlm_dtype: str = option("float32", "with vlm_path: dtype of the VLM's weights (what mmrl adds stays float32)", choices=("float32", "bfloat16"))
    freeze_vision_tower: bool = option(False, "with vlm_path: keep the VLM's vision encoder fixed")
    lora: LoraOptions = option(factory=LoraOptions, doc="with vlm_path: LoRA adapters on the VLM's language model (r > 0; its base weights are then frozen and the adapter-free model is the KL reference)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.vlm_path is None:
            for name in ("vlm_layers", "freeze_vision_tower"):
                if getattr(self, name):
                    raise ConfigError(p + name, getattr(self, name), "applies to a pretrained VLM: set vlm_path too")
            if self.lora.r or self.vlm_dtype != "float32":
                name, value = ("lora.r", self.lora.r) if self.lora.r else ("vlm_dtype", self.vlm_dtype)
                raise ConfigError(p + name, value, "applies to a pretrained VLM: set vlm_path too")
        self.lora.validate(p + "lora")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                p + "num_heads", self.num_heads, f"must divide hidden_size ({self.hidden_size}) into heads of even width (rotary embeddings)"
            )
        if not self.vision_channels or any(c < 1 for c in self.vision_channels):
            raise ConfigError(p + "vision_channels", self.vision_channels, "expected a non-empty list of positive channel counts")


def _transformers():
    return require_transformers("vla", "the VLA backbone")


def observation_spec(spec: dict) -> tuple[int, tuple[int, ...] | None, int]:
    """(state dim, image shape, cameras) of the env's spec: the image shape [H, W, 3] (one
    camera) or [K, H, W, 3] (K cameras), None (and 0 cameras) without images."""
    state_dim = int(spec.get("state_dim", spec.get("obs_dim", 0)) or 0)
    image_shape = spec.get("image_shape")
    if image_shape is None:
        return state_dim, None, 0
    image_shape = tuple(int(s) for s in image_shape)
    if len(image_shape) not in (3, 4) or image_shape[-1] != 3:
        raise ConfigError("env", list(image_shape), "expected RGB images of shape [H, W, 3] or [K, H, W, 3] (K cameras)")
    return state_dim, image_shape, 1 if len(image_shape) == 3 else image_shape[0]


def _conv_out(size: int) -> int:
    """Output size of a 3×3, stride-2, padding-1 convolution."""
    return (size - 1) // 2 + 1


class VLABackbone(nn.Module):
    """Prefix embeddings (cameras, state, instruction) + a causal ``transformers`` decoder."""

    pretrained = False

    def __init__(self, cfg: VLABackboneConfig, spec: dict, vocab_size: int):
        super().__init__()
        cfg.validate("policy.backbone")
        self.cfg = cfg
        self.hidden_size = hd = cfg.hidden_size
        self.state_dim, image_shape, self.num_cameras = observation_spec(spec)
        self.num_keypoints = 0
        self.film = None
        if image_shape is not None:
            self.image_shape = image_shape
            h, w = image_shape[-3:-1]
            layers: list[nn.Module] = []
            channels = 5 if cfg.coord_channels else 3
            self.coord_channels = cfg.coord_channels
            self.film = nn.ModuleList() if cfg.film else None
            for c in cfg.vision_channels:
                norm = nn.GroupNorm(min(8, c), c) if cfg.vision_norm == "group" else nn.Identity()
                layers.append(nn.ModuleDict({"conv": nn.Conv2d(channels, c, kernel_size=3, stride=2, padding=1), "norm": norm, "act": nn.GELU()}))
                if cfg.film:
                    film = nn.Linear(hd, 2 * c)
                    nn.init.zeros_(film.weight)
                    nn.init.zeros_(film.bias)
                    self.film.append(film)  # starts as the identity: scale 1, shift 0
                channels = c
                h, w = _conv_out(h), _conv_out(w)
            if cfg.patch_grid is not None:
                h, w = min(h, cfg.patch_grid), min(w, cfg.patch_grid)
            self.grid = (h, w)
            self.vision = nn.ModuleList(layers)
            self.patch_norm = nn.LayerNorm(channels) if cfg.patch_norm else nn.Identity()
            self.num_keypoints = cfg.keypoints
            if cfg.keypoints:
                fh, fw = image_shape[-3], image_shape[-2]
                for _ in cfg.vision_channels:
                    fh, fw = _conv_out(fh), _conv_out(fw)
                self.keypoint_maps = nn.Conv2d(channels, cfg.keypoints, kernel_size=1)
                ys, xs = torch.meshgrid(torch.linspace(-1, 1, fh), torch.linspace(-1, 1, fw), indexing="ij")
                self.register_buffer("keypoint_grid", torch.stack([xs.flatten(), ys.flatten()], dim=1), persistent=False)
                self.keypoint_proj = nn.Linear(2, hd)
                self.keypoint_embedding = nn.Parameter(torch.randn(cfg.keypoints, hd) * 0.02)
            self.patch_proj = nn.Linear(channels, hd)
            self.patch_position = nn.Parameter(torch.randn(h * w, hd) * 0.02)
            self.camera_embedding = nn.Parameter(torch.randn(self.num_cameras, hd) * 0.02)
        if self.state_dim > 0:
            self.state_proj = nn.Linear(self.state_dim, hd)
        self.instruction_embedding = nn.Embedding(vocab_size, hd)
        nn.init.normal_(self.instruction_embedding.weight, std=0.02)

        tf = _transformers()
        decoder_config = tf.AutoConfig.for_model(
            cfg.arch,
            hidden_size=hd,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_heads,
            head_dim=hd // cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            vocab_size=1,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            tie_word_embeddings=False,
        )
        self.decoder = tf.AutoModel.from_config(decoder_config, attn_implementation=cfg.attn_implementation)
        self.decoder.set_input_embeddings(None)  # fed inputs_embeds only; an unused table would stall DDP
        # transformers 5.24 renamed the decoders' `past_key_values` argument to `cache` (the old
        # name warns, and goes in 5.40); earlier versions know only `past_key_values`.
        self._cache_argument = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"

    @property
    def num_patch_tokens(self) -> int:
        """Prefix tokens the images give (all cameras)."""
        return self.num_cameras * (self.grid[0] * self.grid[1] + self.num_keypoints) if self.num_cameras else 0

    def prefix_length(self, instruction_length: int | None = None) -> int:
        length = self.cfg.max_instruction_tokens if instruction_length is None else instruction_length
        return self.num_patch_tokens + (1 if self.state_dim > 0 else 0) + length

    def resize_instruction_vocab(self, vocab_size: int) -> None:
        """A fresh embedding table of ``vocab_size`` words (before loading weights saved
        with a tokenizer of that size)."""
        old = self.instruction_embedding.weight
        if old.shape[0] != vocab_size:
            self.instruction_embedding = nn.Embedding(vocab_size, self.hidden_size, device=old.device, dtype=old.dtype)
            nn.init.normal_(self.instruction_embedding.weight, std=0.02)

    def encode_images(self, image: Tensor, condition: Tensor | None = None) -> Tensor:
        """uint8 [N, H, W, 3] or [N, K, H, W, 3] → patch tokens [N, K*h*w (+K*keypoints), hidden].
        ``condition`` [N, hidden] (the mean instruction embedding) drives FiLM when enabled."""
        if image.dim() == 4:
            image = image.unsqueeze(1)
        n, k = image.shape[:2]
        if k != self.num_cameras or tuple(image.shape[2:]) != tuple(self.image_shape[-3:]):
            raise ValueError(f"expected images [N, {self.num_cameras}, {', '.join(map(str, self.image_shape[-3:]))}], got {list(image.shape)}")
        x = image.to(self.patch_position.device).reshape(n * k, *image.shape[2:]).permute(0, 3, 1, 2).float() * (4.0 / 255.0) - 2.0
        if self.coord_channels:
            ys = torch.linspace(-1.0, 1.0, x.shape[-2], device=x.device)
            xs = torch.linspace(-1.0, 1.0, x.shape[-1], device=x.device)
            grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))  # [2, H, W]
            x = torch.cat([x, grid.expand(x.shape[0], -1, -1, -1)], dim=1)
        cond = None
        if self.film is not None:
            if condition is None:
                raise ValueError("this backbone conditions its CNN on the instruction (film: true); pass condition")
            cond = condition.repeat_interleave(k, dim=0)  # [N*K, hidden]
        features = x
        for i, block in enumerate(self.vision):
            features = block["norm"](block["conv"](features))
            if cond is not None:
                scale, shift = self.film[i](cond).chunk(2, dim=-1)
                features = features * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
            features = block["act"](features)
        keypoint_tokens = None
        if self.num_keypoints:
            attention = torch.softmax(self.keypoint_maps(features).flatten(2), dim=-1)  # [N*K, P, h*w]
            keypoint_tokens = self.keypoint_proj(attention @ self.keypoint_grid) + self.keypoint_embedding  # [N*K, P, hd]
        if tuple(features.shape[-2:]) != self.grid:
            features = nn.functional.adaptive_avg_pool2d(features, self.grid)
        tokens = self.patch_proj(self.patch_norm(features.flatten(2).transpose(1, 2))) + self.patch_position  # [N*K, h*w, hd]
        if keypoint_tokens is not None:
            tokens = torch.cat([tokens, keypoint_tokens], dim=1)
        tokens = tokens.view(n, k, -1, self.hidden_size) + self.camera_embedding[:, None, :]
        return tokens.reshape(n, -1, self.hidden_size)

    def prefix(self, image: Tensor | None, state: Tensor | None, instruction_ids: Tensor, instruction_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Prefix embeddings [N, P, hidden] and mask [N, P] (1 = attend), P = K*h*w
        (+1 with a state) + L. ``image``/``state`` may be None when the env has none."""
        device = self.instruction_embedding.weight.device
        ids = instruction_ids.to(device)
        n = ids.shape[0]
        parts = []
        if self.num_cameras:
            if image is None:
                raise ValueError("this backbone was built for image observations; got none")
            condition = None
            if self.film is not None:
                weights = instruction_mask.to(device, torch.float32).unsqueeze(-1)
                condition = (self.instruction_embedding(ids) * weights).sum(1) / weights.sum(1).clamp(min=1.0)
            parts.append(self.encode_images(image, condition))
        if self.state_dim > 0:
            if state is None:
                raise ValueError(f"this backbone was built for a state of {self.state_dim} dims; got none")
            parts.append(self.state_proj(state.to(device, torch.float32).reshape(n, self.state_dim)).unsqueeze(1))
        words = self.instruction_embedding(ids)
        always = sum(p.shape[1] for p in parts)
        embeds = torch.cat([*parts, words], dim=1)
        mask = torch.cat([torch.ones(n, always, device=device), instruction_mask.to(device, torch.float32)], dim=1)
        return embeds, mask

    def new_cache(self):
        """An empty key/value cache for incremental decoding with ``forward(..., cache=)``."""
        return _transformers().DynamicCache(config=self.decoder.config)

    def static_decoder(self, cache, mask: Tensor, steps: int):
        """The next ``steps`` single-token steps after a pass that filled ``cache`` over tokens
        with attention ``mask`` [N, P] (:func:`~mmrl.policies.vla.static_decode.static_decoder`;
        None for a decoder it does not serve). Positions continue from P, as the decoder's own."""
        n, p = mask.shape
        positions = torch.arange(p, p + steps, device=mask.device).expand(n, steps)
        return static_decoder(self.decoder, cache, mask, positions)

    def forward(self, embeds: Tensor, mask: Tensor, cache=None) -> Tensor:
        """Causal decoder over ``embeds`` [N, S, hidden] → last hidden states [N, S, hidden].

        ``mask`` [N, S] marks the tokens to attend to (without a cache), or [N, S_past + S]
        with a ``cache`` from :meth:`new_cache` that holds the S_past earlier tokens (the
        cache is extended in place, so decoding one token at a time equals one full pass)."""
        out = self.decoder(
            inputs_embeds=embeds,
            attention_mask=mask.to(embeds.device, torch.long),
            use_cache=cache is not None,
            **{self._cache_argument: cache},
        )
        return out.last_hidden_state


def pooled_prefix_state(hidden: Tensor, mask: Tensor) -> Tensor:
    """The mean of a prefix's hidden states [N, P, hidden] over its attended tokens (``mask``
    [N, P]) → [N, hidden]: what a VLA's value head reads (RLinf adds a value head on the VLM's
    state the same way), one value per observation."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def encode_observations(backbone: VLABackbone, tokenizer, inputs, device, max_words: int) -> dict[str, Tensor]:
    """A VLA policy's tensors for a batch of observations (what replay stores, without the
    decision dim): uint8 image, float state, instruction token ids and mask. ``inputs`` is
    a dict with the keys the env has (instruction strings, or the "instruction_ids" and
    "instruction_mask" of a replay), or a state tensor for a flat-observation env."""
    if isinstance(inputs, Tensor):  # a flat-observation env: the observation is the state
        inputs = {"state": inputs}
    obs: dict[str, Tensor] = {}
    n = None
    if backbone.num_cameras:
        obs["image"] = inputs["image"].to(device)
        n = obs["image"].shape[0]
    if backbone.state_dim > 0:
        obs["state"] = inputs["state"].to(device, torch.float32)
        n = obs["state"].shape[0]
    if "instruction_ids" in inputs:  # already encoded (a replay's observations)
        obs["instruction_ids"] = inputs["instruction_ids"].to(device)
        obs["instruction_mask"] = inputs["instruction_mask"].to(device)
        return obs
    texts = inputs.get("instruction")
    if texts is None:
        if n is None:
            raise ValueError("a VLA needs an image, a state or an instruction in its inputs")
        texts = [""] * n
    ids, mask = tokenizer.encode(list(texts), max_words)
    obs["instruction_ids"], obs["instruction_mask"] = ids.to(device), mask.to(device)
    return obs
