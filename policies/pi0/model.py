"""π0 (Black et al. 2024, "π0: A Vision-Language-Action Flow Model for General Robot Control")
and π0.5 (Physical Intelligence 2025, "π0.5: a Vision-Language-Action Model with Open-World
Generalization") loaded from LeRobot policy directories, computed as LeRobot 0.4.4 computes
them (its port of openpi's PyTorch model), and fine-tuned with RL through their denoising chain.

The model (module names give LeRobot's state-dict keys, so mmrl's checkpoints and the
exported ``model.safetensors`` use the same names):

- ``model.paligemma_with_expert.paligemma``: PaliGemma as transformers 4.5x names it — the
  SigLIP tower ``model.vision_tower.vision_model`` (transformers 5 drops the
  ``vision_model`` level; mmrl keeps it), the projector ``model.multi_modal_projector.linear``,
  the Gemma decoder ``model.language_model`` and ``lm_head`` (tied to the word embeddings,
  never used);
- ``model.paligemma_with_expert.gemma_expert``: a Gemma causal LM without word embeddings
  (its ``lm_head`` is never used; kept when the file has it). π0.5's expert norms are
  adaptive (``input_layernorm.dense``, ``post_attention_layernorm.dense``, ``norm.dense``:
  scale, shift and gate from the time embedding) and have no ``weight``;
- ``model.action_in_proj`` / ``action_out_proj``; π0: ``state_proj`` and the action-time MLP
  ``action_time_mlp_in`` / ``_out``; π0.5: the time MLP ``time_mlp_in`` / ``_out``.

The sizes come from ``paligemma_variant`` / ``action_expert_variant`` (openpi's Gemma table)
and LeRobot's fixed PaliGemma config (SigLIP So400m/14 with 4304-wide MLPs, images projected
to 2048, vocabulary 257152), not from any PaliGemma config.json: LeRobot builds them that way.

One chunk: the prefix [camera 1 … camera K | language] (one bidirectional block, images and
words with their pad masks) goes through PaliGemma's decoder once; every layer's keys (after
RoPE) and values are the chunk's conditioning. The suffix — π0: [state | C noisy actions
fused with the time by the action-time MLP], π0.5: [C noisy actions], the time entering
through the expert's adaptive norms — goes through the expert K times, layer i attending
jointly to PaliGemma layer i's prefix keys/values and its own (the prefix never sees the
suffix). Positions count the real tokens; RoPE and the eager attention are transformers'
Gemma ones (4.53 numerics: additive mask −2.3819763e38, float32 softmax).

Time convention (LeRobot's = mmrl's): x_t = t·ε + (1 − t)·x0, velocity ε − x0, Euler steps
from t = 1 to 0 on the grid t_k = 1 + k·dt, dt = −1/K (``EulerGridTransition``). The chain's
latent is the whole normalized chunk [chunk_size, max_action_dim]; the env executes the first
``n_action_steps`` actions of its action dims, un-normalized by the post-processor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.denoising import provisional_logp_why
from mmrl.errors import ConfigError
from mmrl.policies.hf import require_transformers
from mmrl.policies.pi0.config import PI0Config, PI05Config
from mmrl.policies.vla.backbone import observation_spec
from mmrl.policies.vla.lerobot_flow import ACTION_KEY, STATE_KEY, LeRobotFlowPolicy, attention_mask_2d, time_features
from mmrl.policies.vla.lerobot_format import LeRobotPolicyDir, read_lerobot_policy, read_lerobot_weights, resolve_vlm
from mmrl.registry import POLICIES

IMAGE_PREFIX = "observation.images."
MASK_VALUE = -2.3819763e38  # LeRobot's OPENPI_ATTENTION_MASK_VALUE: the additive mask of excluded keys
TOKENIZER = "google/paligemma-3b-pt-224"  # the tokenizer LeRobot's π0 / π0.5 pre-processors name


def _transformers():
    return require_transformers("vla", "π0 / π0.5 policies")


# ------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class GemmaSize:
    """One row of openpi's Gemma table (LeRobot's ``get_gemma_config``)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


# LeRobot's two variants, and mmrl's tiny ones for tests (LeRobot refuses those names).
GEMMA_VARIANTS = {
    "gemma_300m": GemmaSize(1024, 18, 4096, 8, 1, 256),
    "gemma_2b": GemmaSize(2048, 18, 16_384, 8, 1, 256),
    "mmrl_tiny_vlm": GemmaSize(64, 2, 128, 8, 1, 8),
    "mmrl_tiny_expert": GemmaSize(48, 2, 96, 8, 1, 8),
}
# The SigLIP tower under each VLM variant: LeRobot's PaliGemma default (So400m/14, MLP 4304,
# images projected to 2048 = gemma_2b's width); mmrl's tiny one.
VISION = {
    "gemma_2b": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14, projection_dim=2048),
    "mmrl_tiny_vlm": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8, projection_dim=64),
}
VOCAB = {"gemma_2b": 257_152, "mmrl_tiny_vlm": 320}
EXPERT_VARIANTS = ("gemma_300m", "gemma_2b", "mmrl_tiny_expert")


# ------------------------------------------------------------------ the math, as pure functions


def resize_with_pad(images: Tensor, height: int, width: int) -> Tensor:
    """LeRobot's (openpi's) ``resize_with_pad_torch`` of float32 images [B, H, W, C]:
    bilinear resize (align_corners=False) keeping the aspect ratio so that the image fits,
    clamped to [−1, 1], then centred with −1 padding (the extra pixel of an odd margin at
    the bottom / right)."""
    b, h, w, c = images.shape
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    resized = F.interpolate(images.permute(0, 3, 1, 2), size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    top, extra_h = divmod(height - new_h, 2)
    left, extra_w = divmod(width - new_w, 2)
    padded = F.pad(resized, (left, left + extra_w, top, top + extra_h), mode="constant", value=-1.0)
    return padded.permute(0, 2, 3, 1)


def prepare_image(image: Tensor, resolution: tuple[int, int]) -> Tensor:
    """LeRobot's π0 image preparation of float [B, 3, H, W] in [0, 1]: resized with pad to
    ``resolution`` (−1 padding, before the rescaling: padded pixels end at −3) unless it has
    that size, then ×2 − 1."""
    img = image.to(torch.float32).permute(0, 2, 3, 1)
    if tuple(img.shape[1:3]) != tuple(resolution):
        img = resize_with_pad(img, *resolution)
    return (img * 2.0 - 1.0).permute(0, 3, 1, 2)


def rope_cos_sin(positions: Tensor, head_dim: int, base: float = 10_000.0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """transformers' Gemma rotary embedding (default type) at positions [B, L]: inverse
    frequencies 1 / base^(2j/D) in float32, angles as their product with the positions,
    cos and sin [B, L, D] of the angles repeated over both halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=positions.device, dtype=torch.float) / head_dim))
    freqs = (inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1) @ positions[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, L, D] rotated (halves, not interleaved pairs): x·cos + rotate_half(x)·sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def additive_mask(mask: Tensor) -> Tensor:
    """[B, Lq, Lk] bool → LeRobot's additive 4-D mask [B, 1, Lq, Lk]: 0 where attended, −2.38e38 elsewhere."""
    return torch.where(mask[:, None, :, :], 0.0, MASK_VALUE)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """transformers' eager attention of q [B, H, Lq, D] over k, v [B, KV, Lk, D] (key/value
    heads repeated to H), scores q·kᵀ·scaling plus the additive ``mask`` [B, 1, Lq, Lk],
    float32 softmax → [B, Lq, H·D]."""
    b, kv, length, d = k.shape
    groups = q.shape[1] // kv
    if groups > 1:
        k = k[:, :, None, :, :].expand(b, kv, groups, length, d).reshape(b, kv * groups, length, d)
        v = v[:, :, None, :, :].expand(b, kv, groups, length, d).reshape(b, kv * groups, length, d)
    weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    weights = weights + mask[:, :, :, :length]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, v).transpose(1, 2).contiguous()
    return out.reshape(*out.shape[:2], -1)


def rowwise_linear(linear: nn.Module, x: Tensor) -> Tensor:
    """``linear`` of each row of x [B, D] on its own: the same numbers for a row whatever the
    batch (a small matrix product's rounding depends on how many rows it has; mmrl's
    recomputed log-probs must equal the sampled ones exactly)."""
    return torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])]) if x.shape[0] else linear(x)


def gemma_norm(norm: nn.Module, x: Tensor, cond=None) -> tuple[Tensor, Tensor | None]:
    """openpi's Gemma RMSNorm: x / rms(x) (variance in float32), then ×(1 + weight) → (out,
    None); with an adaptive norm (``dense``) and a condition [B, cond] (or the distinct
    conditions [U, cond] and each row's index [B]): ×(1 + scale) + shift and a gate,
    (scale, shift, gate) = dense(cond) → (out, gate)."""
    dtype = x.dtype
    normed = x * torch.rsqrt(torch.mean(torch.square(x.float()), dim=-1, keepdim=True) + norm.eps)
    dense = getattr(norm, "dense", None)
    if cond is None or dense is None:
        return (normed * (1.0 + norm.weight.float())).to(dtype), None
    if isinstance(cond, tuple):  # (distinct conditions [U, cond], the row of each input [B])
        modulation = rowwise_linear(dense, cond[0])[cond[1]]
    else:
        modulation = dense(cond)
    if x.dim() == 3:
        modulation = modulation.unsqueeze(1)
    scale, shift, gate = torch.chunk(modulation, 3, dim=-1)
    return (normed * (1 + scale.to(torch.float32)) + shift.to(torch.float32)).to(dtype), gate.to(dtype)


def gated_residual(x: Tensor, y: Tensor, gate: Tensor | None) -> Tensor:
    """x + y, or x + y·gate (π0.5's adaptive layers)."""
    return x + y if gate is None else x + y * gate


def discretize_state(state: Tensor) -> np.ndarray:
    """π0.5's state tokens: the normalized state (≈ [−1, 1]) in 256 bins — numpy's digitize
    against 256 left edges of linspace(−1, 1, 257), minus 1 (values below −1 give −1)."""
    return np.digitize(state.detach().cpu().numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1


def pi05_prompt(task: str, state_bins) -> str:
    """π0.5's prompt of a task and its discretized state."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, state_bins))};\nAction: "


class AdaRMSNorm(nn.Module):
    """openpi's adaptive Gemma RMSNorm: no weight; ``dense`` maps the condition to scale, shift and gate."""

    def __init__(self, dim: int, cond_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)


# ------------------------------------------------------------------ the architecture


@dataclass
class PI0Arch:
    """What of a π0 / π0.5 config.json shapes and runs the model."""

    pi05: bool
    vlm: GemmaSize
    expert: GemmaSize
    vision: dict
    vocab: int
    image_resolution: tuple[int, int]
    chunk_size: int
    n_action_steps: int
    max_state_dim: int
    max_action_dim: int
    num_inference_steps: int
    tokenizer_max_length: int
    min_period: float
    max_period: float
    empty_cameras: int
    train_expert_only: bool
    freeze_vision_encoder: bool
    dtype: str

    @classmethod
    def of(cls, files: LeRobotPolicyDir) -> "PI0Arch":
        """The architecture of a π0 / π0.5 directory; what mmrl does not implement is refused."""
        where = f"{files.path / 'config.json'}: "
        if files.config.get("n_obs_steps", 1) != 1:
            raise ConfigError(where + "n_obs_steps", files.config["n_obs_steps"], "mmrl feeds the current observation only")
        rtc = files.config.get("rtc_config")
        if isinstance(rtc, dict) and rtc.get("enabled"):
            raise ConfigError(where + "rtc_config.enabled", True, "real-time chunking is not implemented by mmrl; set it false")
        vlm_variant, expert_variant = str(files.field("paligemma_variant")), str(files.field("action_expert_variant"))
        if vlm_variant not in VISION:
            raise ConfigError(where + "paligemma_variant", vlm_variant, f"LeRobot projects images to 2048 wide, so PaliGemma must be gemma_2b (mmrl's tests: {', '.join(v for v in VISION if v != 'gemma_2b')})")
        if expert_variant not in EXPERT_VARIANTS:
            raise ConfigError(where + "action_expert_variant", expert_variant, f"allowed: {', '.join(EXPERT_VARIANTS)}")
        vlm, expert = GEMMA_VARIANTS[vlm_variant], GEMMA_VARIANTS[expert_variant]
        if (vlm.num_heads, vlm.num_kv_heads, vlm.head_dim, vlm.depth) != (expert.num_heads, expert.num_kv_heads, expert.head_dim, expert.depth):
            raise ConfigError(where + "action_expert_variant", expert_variant, f"the expert attends jointly with {vlm_variant}: it needs the same heads, head size and depth")
        resolution = tuple(int(s) for s in files.config.get("image_resolution", (224, 224)))
        if len(resolution) != 2 or resolution[0] != resolution[1]:
            raise ConfigError(where + "image_resolution", list(resolution), "PaliGemma needs square images")
        arch = cls(
            pi05=files.type == "pi05",
            vlm=vlm,
            expert=expert,
            vision=dict(VISION[vlm_variant], image_size=resolution[0]),
            vocab=VOCAB[vlm_variant],
            image_resolution=resolution,
            chunk_size=int(files.field("chunk_size")),
            n_action_steps=int(files.field("n_action_steps")),
            max_state_dim=int(files.field("max_state_dim")),
            max_action_dim=int(files.field("max_action_dim")),
            num_inference_steps=int(files.field("num_inference_steps")),
            tokenizer_max_length=int(files.field("tokenizer_max_length")),
            min_period=float(files.field("min_period")),
            max_period=float(files.field("max_period")),
            empty_cameras=int(files.config.get("empty_cameras", 0)),
            train_expert_only=bool(files.config.get("train_expert_only", False)),
            freeze_vision_encoder=bool(files.config.get("freeze_vision_encoder", False)),
            dtype=str(files.config.get("dtype", "float32")),
        )
        if arch.n_action_steps > arch.chunk_size:
            raise ConfigError(where + "n_action_steps", arch.n_action_steps, f"must be <= chunk_size ({arch.chunk_size})")
        return arch


class _VisionTower(nn.Module):
    """transformers 4.5x's ``SiglipVisionModel`` level: the tower under ``vision_model``
    (transformers 5's SiglipVisionModel holds embeddings / encoder / post_layernorm itself)."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.vision_model = tower


class PaliGemmaWithExpert(nn.Module):
    """LeRobot's ``PaliGemmaWithExpertModel``: attribute names ``paligemma`` and ``gemma_expert``."""

    def __init__(self, arch: PI0Arch):
        super().__init__()
        tf = _transformers()
        vlm, expert = arch.vlm, arch.expert
        vision = tf.SiglipVisionConfig(**arch.vision, vision_use_head=False, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
        text = tf.GemmaConfig(
            hidden_size=vlm.width, intermediate_size=vlm.mlp_dim, num_attention_heads=vlm.num_heads, num_key_value_heads=vlm.num_kv_heads, head_dim=vlm.head_dim,
            num_hidden_layers=vlm.depth, hidden_activation="gelu_pytorch_tanh", vocab_size=arch.vocab, rms_norm_eps=1e-6,
        )
        config = tf.PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), projection_dim=arch.vision["projection_dim"], image_token_index=arch.vocab)
        self.paligemma = tf.PaliGemmaForConditionalGeneration(config)
        self.paligemma.model.vision_tower = _VisionTower(self.paligemma.model.vision_tower)
        expert_config = tf.GemmaConfig(
            hidden_size=expert.width, intermediate_size=expert.mlp_dim, num_attention_heads=expert.num_heads, num_key_value_heads=expert.num_kv_heads, head_dim=expert.head_dim,
            num_hidden_layers=expert.depth, hidden_activation="gelu_pytorch_tanh", vocab_size=arch.vocab, rms_norm_eps=1e-6,
        )
        self.gemma_expert = tf.GemmaForCausalLM(expert_config)
        self.gemma_expert.model.embed_tokens = None
        if arch.pi05:  # adaptive norms conditioned on the time embedding (width of the expert)
            for layer in self.gemma_expert.model.layers:
                layer.input_layernorm = AdaRMSNorm(expert.width, expert.width, 1e-6)
                layer.post_attention_layernorm = AdaRMSNorm(expert.width, expert.width, 1e-6)
            self.gemma_expert.model.norm = AdaRMSNorm(expert.width, expert.width, 1e-6)
        self.head_dim, self.scaling = vlm.head_dim, vlm.head_dim**-0.5

    @property
    def vision_model(self) -> nn.Module:
        return self.paligemma.model.vision_tower.vision_model

    @property
    def language_model(self) -> nn.Module:
        return self.paligemma.model.language_model

    @property
    def expert_model(self) -> nn.Module:
        return self.gemma_expert.model

    def embed_image(self, images: Tensor) -> Tensor:
        """Pixels [B, 3, H, W] in [−1, 1] → image tokens [B, n, width]: SigLIP (SDPA attention,
        as transformers 4.53 runs it) and the linear projector, without PaliGemma's
        1/√width (LeRobot's patched PaliGemma drops it)."""
        tower = self.vision_model
        hidden = tower.embeddings(images.to(tower.embeddings.patch_embedding.weight.dtype))
        layers = tower.encoder.layers
        if len(layers) and layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            hidden = hidden.to(torch.bfloat16)
        for layer in layers:
            attn = layer.self_attn
            b, length, width = hidden.shape
            x = layer.layer_norm1(hidden)
            q, k, v = (proj(x).view(b, length, attn.num_heads, attn.head_dim).transpose(1, 2).contiguous() for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=attn.scale, is_causal=False)
            hidden = hidden + attn.out_proj(out.transpose(1, 2).contiguous().reshape(b, length, width).contiguous())
            hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
        return self.paligemma.model.multi_modal_projector(tower.post_layernorm(hidden))

    def embed_words(self, ids: Tensor) -> Tensor:
        return self.language_model.embed_tokens(ids)

    def _qkv(self, layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, cond) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """A decoder layer's normalized input → q, k (after RoPE), v [B, heads, L, head_dim] and the norm's gate."""
        h, gate = gemma_norm(layer.input_layernorm, hidden, cond)
        attn = layer.self_attn
        shape = (*h.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(h).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    @staticmethod
    def _finish(layer: nn.Module, attended: Tensor, hidden: Tensor, gate: Tensor | None, cond) -> Tensor:
        """Output projection, (gated) residual, normalized MLP, (gated) residual."""
        out = layer.self_attn.o_proj(attended.to(layer.self_attn.o_proj.weight.dtype))
        out = gated_residual(hidden, out, gate)
        h, gate = gemma_norm(layer.post_attention_layernorm, out, cond)
        if layer.mlp.up_proj.weight.dtype == torch.bfloat16:
            h = h.to(torch.bfloat16)
        return gated_residual(out, layer.mlp(h), gate)

    def prefix(self, embeds: Tensor, pad: Tensor, blocks: Tensor) -> dict:
        """PaliGemma's decoder over the prefix embeddings [N, P, width]: every layer's keys
        (after RoPE) and values [N, kv_heads, P, head_dim], and the final normalized states."""
        text = self.language_model
        mask = additive_mask(attention_mask_2d(pad, blocks))
        positions = torch.cumsum(pad, dim=1) - 1
        hidden = embeds
        if text.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            hidden = hidden.to(torch.bfloat16)
        cos, sin = rope_cos_sin(positions, self.head_dim, dtype=hidden.dtype)
        keys, values = [], []
        for layer in text.layers:
            q, k, v, gate = self._qkv(layer, hidden, cos, sin, None)
            keys.append(k)
            values.append(v)
            hidden = self._finish(layer, eager_attention(q, k, v, mask, self.scaling), hidden, gate, None)
        return {"keys": keys, "values": values, "hidden": gemma_norm(text.norm, hidden)[0]}

    def expert(self, tokens: Tensor, blocks: list[int], prefix: dict, pad: Tensor, cond) -> Tensor:
        """The expert over the suffix tokens [B, S, width] (``blocks``: 1 where a causal block
        starts) attending to the prefix's keys/values and real tokens ``pad`` [B, P], its
        norms conditioned on ``cond`` [B, width] (π0.5) → its final normalized states."""
        b, s = tokens.shape[:2]
        own = torch.ones(b, s, dtype=torch.bool, device=tokens.device)
        starts = torch.tensor(blocks, dtype=tokens.dtype, device=tokens.device)[None, :].expand(b, s)
        mask = additive_mask(torch.cat([pad[:, None, :].expand(b, s, pad.shape[1]), attention_mask_2d(own, starts)], dim=2))
        positions = torch.sum(pad, dim=-1)[:, None] + torch.cumsum(own, dim=1) - 1
        cos, sin = rope_cos_sin(positions, self.head_dim, dtype=tokens.dtype)
        hidden = tokens
        for i, layer in enumerate(self.expert_model.layers):
            q, k, v, gate = self._qkv(layer, hidden, cos, sin, cond)
            k_all = torch.cat([prefix["keys"][i].to(k.dtype), k], dim=2)
            v_all = torch.cat([prefix["values"][i].to(v.dtype), v], dim=2)
            hidden = self._finish(layer, eager_attention(q, k_all, v_all, mask, self.scaling), hidden, gate, cond)
        return gemma_norm(self.expert_model.norm, hidden, cond)[0]


class PI0Model(nn.Module):
    """LeRobot's ``PI0Pytorch`` / ``PI05Pytorch``: PaliGemma with its expert and the projections."""

    def __init__(self, arch: PI0Arch):
        super().__init__()
        self.arch = arch
        self.paligemma_with_expert = PaliGemmaWithExpert(arch)
        width = arch.expert.width
        self.action_in_proj = nn.Linear(arch.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, arch.max_action_dim)
        if arch.pi05:
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:
            self.state_proj = nn.Linear(arch.max_state_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)

    def embed_prefix(self, images: list[Tensor], image_masks: list[Tensor], ids: Tensor, id_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[images | words] → embeddings [N, P, width], real tokens [N, P] bool and block
        starts [N, P] (all 0: one bidirectional block)."""
        pw = self.paligemma_with_expert
        embeds, pads = [], []
        n = ids.shape[0]
        for image, image_mask in zip(images, image_masks):
            tokens = pw.embed_image(image)
            embeds.append(tokens)
            pads.append(image_mask[:, None].expand(n, tokens.shape[1]))
        words = pw.embed_words(ids)
        embeds.append(words * math.sqrt(words.shape[-1]))
        pads.append(id_mask)
        embeds, pads = torch.cat(embeds, dim=1), torch.cat(pads, dim=1)
        return embeds, pads, torch.zeros_like(pads)

    def state_token(self, state: Tensor) -> Tensor:
        """π0's state token [N, width] of the normalized, padded states [N, max_state_dim]."""
        return rowwise_linear(self.state_proj, state.to(torch.float32))

    def time_condition(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """π0.5's adaRMS condition: silu(time_mlp_out(silu(time_mlp_in(sincos(t))))) of the
        distinct times [U, width] and each row's index into them [B]."""
        times, inverse = torch.unique(t, return_inverse=True)
        time = time_features(times, self.arch.expert.width, self.arch.min_period, self.arch.max_period).to(t.dtype)
        return F.silu(rowwise_linear(self.time_mlp_out, F.silu(rowwise_linear(self.time_mlp_in, time)))), inverse

    def velocity(self, x: Tensor, t: Tensor, prefix: dict, pad: Tensor, state_token: Tensor | None, with_hidden: bool = False):
        """v(x_t, t) [B, C, max_action_dim] of noisy chunks x [B, C, max_action_dim] at times
        t [B]; π0 reads the state token [B, width] (:meth:`state_token`). ``with_hidden``: also
        the action tokens' states [B, C, width]."""
        actions = self.action_in_proj(x)
        if self.arch.pi05:
            cond = self.time_condition(t)
            tokens, blocks = actions, [1] + [0] * (self.arch.chunk_size - 1)
        else:
            cond = None
            time = time_features(t, actions.shape[-1], self.arch.min_period, self.arch.max_period).to(t.dtype)
            fused = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([actions, time[:, None, :].expand_as(actions)], dim=2))))
            tokens = torch.cat([state_token[:, None, :].to(fused.dtype), fused], dim=1)
            blocks = [1, 1] + [0] * (self.arch.chunk_size - 1)
        out = self.paligemma_with_expert.expert(tokens, blocks, prefix, pad, cond)
        hidden = out[:, -self.arch.chunk_size :].to(torch.float32)
        v = self.action_out_proj(hidden)
        return (v, hidden) if with_hidden else v


# ------------------------------------------------------------------ the policy


# The tiny examples the contract tests build (tests/policies/test_contract.py): ``prepare``
# writes a tiny directory for the Tabletop (state 4, actions 2) and names it.
def _contract(kind: str) -> dict:
    return {
        "train": {
            "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
            "sampler": {"type": "env"},
            "policy": {"type": kind, "denoising": {"num_inference_steps": 2}},
            "rewards": [{"type": "success"}],
        },
        "prepare": f"mmrl.policies.pi0.tiny:contract_{kind}",
        "ratio_atol": 1e-4,
        "ratio_why": provisional_logp_why(
            ("1.9e-6 on an Intel Xeon (AVX512, MKL); " if kind == "pi05" else "") + "up to 7.6e-6 (log-probs up to 44) under MMRL_SHAPE_KERNELS=1 over seeds 0-2"
        ),
    }


class _PaliGemmaFlowPolicy(LeRobotFlowPolicy):
    """A LeRobot π0 / π0.5 checkpoint: its pre-processor, model and post-processor; RL via Flow-SDE chains."""

    kind = "pi0"

    def __init__(self, config: PI0Config, spec: dict):
        super().__init__(config, spec)
        tf = _transformers()
        self.files = files = read_lerobot_policy(config.checkpoint, "policy.checkpoint", (self.kind,))
        where = f"{files.path / 'config.json'}: "
        self.arch = arch = PI0Arch.of(files)
        self.chunk = arch.chunk_size
        self.n_action_steps = config.n_action_steps or arch.n_action_steps
        if self.n_action_steps > arch.chunk_size:
            raise ConfigError("policy.n_action_steps", self.n_action_steps, f"must be <= the checkpoint's chunk_size ({arch.chunk_size})")
        self._denoising = config.denoising.resolved(arch.num_inference_steps)
        self._denoising.validate("policy.denoising")

        # processors: normalizers, tokenizer settings, renames
        self._read_processors(files, arch.tokenizer_max_length)
        self.newline = files.step("preprocessor", "pi0_new_line_processor") is not None
        self.state_prompt = files.step("preprocessor", "pi05_prepare_state_tokenizer_processor_step") is not None
        if arch.pi05 and not self.state_prompt:
            raise ConfigError(f"{files.path / 'policy_preprocessor.json'}: steps", None, "a pi05 pre-processor has the pi05_prepare_state_tokenizer_processor_step (the state in the prompt)")

        # features against the env
        inputs, outputs = files.features("input_features"), files.features("output_features")
        self.image_keys = [key for key, f in inputs.items() if f.type == "VISUAL"]
        self.image_keys += [k for k in (f"{IMAGE_PREFIX}empty_camera_{i}" for i in range(arch.empty_cameras)) if k not in self.image_keys]
        if ACTION_KEY not in outputs:
            raise ConfigError(where + "output_features", sorted(outputs), f"a {self.kind} policy predicts {ACTION_KEY}")
        self.state_dim = inputs[STATE_KEY].shape[0] if STATE_KEY in inputs else arch.max_state_dim
        self.lerobot_action_dim = outputs[ACTION_KEY].shape[0]
        if self.lerobot_action_dim != self.action_dim:
            raise ConfigError(where + "output_features.action.shape", list(outputs[ACTION_KEY].shape), f"the env's actions have {self.action_dim} dims")
        if self.lerobot_action_dim > arch.max_action_dim or self.state_dim > arch.max_state_dim:
            raise ConfigError(where + "max_action_dim/max_state_dim", [arch.max_action_dim, arch.max_state_dim], f"must hold the action ({self.lerobot_action_dim}) and state ({self.state_dim}) dims")
        env_state, image_shape, num_cameras = observation_spec(spec)
        if env_state != self.state_dim:
            raise ConfigError(where + "input_features.observation.state.shape", [self.state_dim], f"the env's state has {env_state} dims")
        self.cameras = list(config.cameras) if config.cameras is not None else self.image_keys[:num_cameras]
        unknown = [c for c in self.cameras if c not in self.image_keys]
        if unknown or len(self.cameras) != num_cameras or num_cameras == 0:
            why = f"unknown image features {unknown}" if unknown else f"the env has {num_cameras} camera(s)"
            raise ConfigError("policy.cameras", config.cameras, f"{why}; name one of the checkpoint's image features {self.image_keys} per env camera (at least one)")

        # the tokenizer: the pre-processor's tokenizer_name (a hub id: vlm_dir or the cache)
        vlm_path = resolve_vlm(str(self.tokenizer_settings.get("tokenizer_name", TOKENIZER)), config.vlm_dir)
        self.tokenizer = tf.AutoTokenizer.from_pretrained(vlm_path, local_files_only=True)
        self.vlm_path = vlm_path
        self.model = PI0Model(arch)
        stored = _fix_lerobot_keys(read_lerobot_weights(files.path), arch)
        if "model.paligemma_with_expert.gemma_expert.lm_head.weight" not in stored:
            self.model.paligemma_with_expert.gemma_expert.lm_head = None  # never used; absent from the file
        self.lerobot_keys = list(stored)  # the names export writes
        self.register_state_dict_post_hook(_keep_file_aliases)
        self.register_load_state_dict_post_hook(_allow_missing_tied_names)
        self._load_lerobot_weights(stored)
        self._add_noise_head()
        if config.vlm_dtype == "bfloat16":
            self._paligemma_to_bfloat16()
        self._set_trainable(config, arch)
        self.lora = config.lora.r > 0
        if self.lora:
            self._add_lora(config)

    # ------------------------------------------------------------------ construction pieces

    def _paligemma_to_bfloat16(self) -> None:
        """PaliGemma in bfloat16 but for what LeRobot keeps float32 (patch and position embeddings, norms)."""
        keep = ("vision_model.embeddings.patch_embedding", "vision_model.embeddings.position_embedding", "input_layernorm", "post_attention_layernorm", "model.norm")
        for name, param in self.model.paligemma_with_expert.paligemma.named_parameters():
            if not any(k in name for k in keep):
                param.data = param.data.to(torch.bfloat16)

    def _set_trainable(self, config: PI0Config, arch: PI0Arch) -> None:
        pw = self.model.paligemma_with_expert
        expert_only = arch.train_expert_only if config.train_expert_only is None else config.train_expert_only
        freeze_vision = arch.freeze_vision_encoder if config.freeze_vision_encoder is None else config.freeze_vision_encoder
        pw.paligemma.lm_head.requires_grad_(False)  # tied to the word embeddings: see below
        pw.language_model.embed_tokens.requires_grad_(not expert_only)
        if pw.gemma_expert.lm_head is not None:
            pw.gemma_expert.lm_head.requires_grad_(False)  # never used
        if freeze_vision:
            pw.paligemma.model.vision_tower.requires_grad_(False)
        if expert_only:
            pw.paligemma.requires_grad_(False)

    def _lora_targets(self) -> dict[str, list[nn.Module]]:
        pw = self.model.paligemma_with_expert
        return {"expert": [pw.expert_model], "vlm": [pw.language_model]}

    @property
    def prefix_width(self) -> int:
        return int(self.arch.vlm.width)

    # ------------------------------------------------------------------ observations → prefix

    def prompts(self, tasks: list[str], state: Tensor | None) -> list[str]:
        """The text the pre-processor tokenizes: π0 the task with a trailing newline; π0.5
        ``Task: …, State: <bins>;\\nAction: `` from the normalized state padded to max_state_dim."""
        if self.state_prompt:
            normalized = F.pad(self.normalizer.normalize(STATE_KEY, state.to(torch.float32)), (0, self.arch.max_state_dim - state.shape[-1]))
            bins = discretize_state(normalized)
            return [pi05_prompt(task, bins[i]) for i, task in enumerate(tasks)]
        if self.newline:
            return [t if t.endswith("\n") else t + "\n" for t in tasks]
        return list(tasks)

    def lerobot_prefix(self, images: dict[str, Tensor], state: Tensor, ids: Tensor, id_mask: Tensor) -> dict:
        """The chunk conditioning from LeRobot's raw inputs: images {feature key: float
        [N, 3, H, W] in [0, 1]}, the raw state [N, D], token ids and mask [N, L]. The
        pre-processor's normalization, the model's image preparation (present cameras in
        the checkpoint's order, then each absent one as a −1 image with its mask off) and
        PaliGemma's pass over the prefix."""
        prepared, masks = [], []
        for key in self.image_keys:
            if key in images:
                image = prepare_image(self.normalizer.normalize(key, images[key]), self.arch.image_resolution)
                prepared.append(image)
                masks.append(torch.ones(image.shape[0], dtype=torch.bool, device=image.device))
        for key in self.image_keys:
            if key not in images:
                prepared.append(torch.ones_like(prepared[0]) * -1)
                masks.append(torch.zeros_like(masks[0]))
        state = F.pad(self.normalizer.normalize(STATE_KEY, state), (0, self.arch.max_state_dim - state.shape[-1]))
        embeds, pad, blocks = self.model.embed_prefix(prepared, masks, ids, id_mask)
        prefix = self.model.paligemma_with_expert.prefix(embeds, pad, blocks)
        token = None if self.arch.pi05 else self.model.state_token(state)
        return {"prefix": prefix, "pad": pad, "state": token, "hidden": prefix["hidden"]}

    def _denoiser(self, cond: dict):
        def denoise(x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
            if rows.shape[0] == cond["pad"].shape[0] and bool((rows == torch.arange(rows.shape[0], device=rows.device)).all()):
                prefix, pad, state = cond["prefix"], cond["pad"], cond["state"]
            else:
                prefix = {"keys": [k[rows] for k in cond["prefix"]["keys"]], "values": [v[rows] for v in cond["prefix"]["values"]]}
                pad, state = cond["pad"][rows], None if cond["state"] is None else cond["state"][rows]
            return self._velocity(lambda with_hidden: self.model.velocity(x, t, prefix, pad, state, with_hidden))

        return denoise


def _fix_lerobot_keys(state: dict[str, Tensor], arch: PI0Arch) -> dict[str, Tensor]:
    """The renames LeRobot's ``from_pretrained`` applies (``_fix_pytorch_state_dict_keys``):
    a ``model.`` prefix where missing; π0: ``time_mlp_*`` → ``action_time_mlp_*``; π0.5:
    ``action_time_mlp_*`` → ``time_mlp_*``, ``state_proj`` and the expert's plain norm
    weights dropped (its norms are adaptive)."""
    fixed = {}
    for key, value in state.items():
        name = key[len("model.") :] if key.startswith("model.") else key
        if arch.pi05:
            if name.startswith("state_proj.") or (name.startswith("paligemma_with_expert.gemma_expert.model.") and name.endswith(("layernorm.weight", "model.norm.weight"))):
                continue
            if name.startswith("action_time_mlp_"):
                name = name.replace("action_time_mlp_", "time_mlp_", 1)
        elif name.startswith("time_mlp_"):
            name = "action_" + name
        fixed["model." + name] = value
    return fixed


def _keep_file_aliases(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """Of the names of a tied tensor (PaliGemma's lm_head / word embeddings), keep those the
    file had (safetensors refuses two names for one tensor; the tie restores the other)."""
    keys = set(getattr(module, "lerobot_keys", ()))
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    for names in groups.values():
        if len(names) > 1:
            kept = [n for n in names if n in keys] or names[:1]
            for name in names:
                if name not in kept:
                    state_dict.pop(prefix + name, None)


def _allow_missing_tied_names(module: nn.Module, incompatible_keys) -> None:
    """A tied tensor loaded under one of its names is not missing under the others."""
    missing = set(incompatible_keys.missing_keys)
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    loaded_aliases = {n for names in groups.values() if len(names) > 1 and any(m not in missing for m in names) for n in names}
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded_aliases]


@POLICIES.register("pi0", config=PI0Config, contract=_contract("pi0"))
class PI0Policy(_PaliGemmaFlowPolicy):
    """A LeRobot π0 checkpoint: its pre-processor, model and post-processor; RL via Flow-SDE chains."""

    kind = "pi0"


@POLICIES.register("pi05", config=PI05Config, contract=_contract("pi05"))
class PI05Policy(_PaliGemmaFlowPolicy):
    """A LeRobot π0.5 checkpoint (state as prompt tokens, adaRMS time conditioning); RL via Flow-SDE chains."""

    kind = "pi05"


def lerobot_actions(directory: str, observation: dict, noise: Tensor, vlm_dir: str | None = None) -> Tensor:
    """LeRobot's pre-processor → ``predict_action_chunk`` (``sample_actions`` with ``noise``) →
    post-processor of the π0 / π0.5 in ``directory``, computed by mmrl: ``observation`` in
    LeRobot's raw keys (``observation.images.<name>`` float32 [B, 3, H, W] in [0, 1],
    ``observation.state`` float32 [B, D], ``task`` list of B strings), ``noise`` float32
    [B, chunk_size, max_action_dim] → the un-normalized chunk [B, chunk_size, action_dim]."""
    files = read_lerobot_policy(directory, "directory", ("pi0", "pi05"))
    rename = dict((files.step("preprocessor", "rename_observations_processor") or {}).get("config", {}).get("rename_map", {}))
    keys = [rename.get(k, k) for k in observation]
    inputs, outputs = files.features("input_features"), files.features("output_features")
    cameras = [key for key, f in inputs.items() if f.type == "VISUAL" and key in keys]
    raw_key = {rename.get(k, k): k for k in observation}
    spec: dict = {"action_dim": outputs[ACTION_KEY].shape[0], "state_dim": inputs[STATE_KEY].shape[0] if STATE_KEY in inputs else int(files.config.get("max_state_dim", 32))}
    h, w = observation[raw_key[cameras[0]]].shape[-2:]
    spec["image_shape"] = [len(cameras), int(h), int(w), 3]
    policy_class, config_class = (PI05Policy, PI05Config) if files.type == "pi05" else (PI0Policy, PI0Config)
    policy = policy_class(config_class(checkpoint=str(directory), vlm_dir=vlm_dir, cameras=cameras), spec).eval()
    return policy.lerobot_chunk(observation, noise)
