"""SmolVLA (Shukor et al. 2025, "SmolVLA: A Vision-Language-Action Model for Affordable and
Efficient Robotics") loaded from a LeRobot policy directory, computed as LeRobot 0.4 computes
it, and fine-tuned with RL through its denoising chain.

The model (module names give LeRobot's state-dict keys, so mmrl's checkpoints and the
exported ``model.safetensors`` use the same names):

- ``model.vlm_with_expert.vlm``: SmolVLM (vision encoder, pixel-shuffle connector, Llama
  decoder cut to its first ``num_vlm_layers`` layers);
- ``model.vlm_with_expert.lm_expert``: the action expert, a Llama decoder of width
  hidden·``expert_width_multiplier`` with the VLM's heads and head size; in its
  cross-attention layers the key/value projections read the VLM's keys/values;
- ``model.state_proj`` (state → one prefix token), ``model.action_in_proj`` /
  ``action_out_proj`` and the action-time MLP (``action_time_mlp_in`` / ``_out``, SiLU).

One chunk: the prefix [camera 1 … camera K | language | state] goes through the VLM once
(its per-layer keys/values are the chunk's conditioning); then K Euler steps of the flow
x ← x − v/K from t = 1 to 0, each one pass of the expert over the chunk's C noisy actions.
The expert's layer i attends to the VLM layer i's prefix keys/values: every
``self_attn_every_n_layers``-th layer jointly with its own (self-attention, positions after
the prefix), the others only to the prefix (cross-attention, positions from 0). Within the
chunk attention is causal. Positions are the count of attended tokens; RoPE is LeRobot's own
(base 10000), attention is eager with a float32 softmax.

Time convention (LeRobot's = mmrl's): x_t = t·ε + (1 − t)·x0, velocity ε − x0. The chain's
latent is the whole normalized chunk [chunk_size, max_action_dim] (padded dims included:
their likelihood is part of what the expert denoises); the env executes the first
``n_action_steps`` actions of its action dims, un-normalized by the post-processor's
statistics. The deterministic chain uses LeRobot's grid t_k = 1 + k·dt, dt = −1/K, and its
update x + dt·v, so ``lerobot_actions`` gives what LeRobot's ``predict_action_chunk`` gives
for the same noise. RL: Flow-SDE (or CPS) steps on that grid, one decision per chunk by default.
"""

from __future__ import annotations

import copy
import logging
import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.denoising import provisional_logp_why
from mmrl.errors import ConfigError
from mmrl.policies.hf import require_transformers, save_tied_weights_once
from mmrl.policies.smolvla.config import SmolVLAConfig
from mmrl.policies.vla.backbone import observation_spec
from mmrl.policies.vla.lerobot_flow import ACTION_KEY, STATE_KEY, LeRobotFlowPolicy, attention_mask_2d, time_features
from mmrl.policies.vla.lerobot_format import LeRobotPolicyDir, read_lerobot_policy, read_lerobot_weights, resolve_vlm
from mmrl.registry import POLICIES

logger = logging.getLogger(__name__)
_warned_empty_cameras: set[tuple[str, tuple[str, ...]]] = set()

ATTENTION_MODES = ("cross_attn", "self_attn")


def _transformers():
    return require_transformers("vla", "SmolVLA policies")


# ------------------------------------------------------------------ the math, as pure functions


def resize_with_pad(images: Tensor, width: int, height: int, pad_value: float = 0.0) -> Tensor:
    """[B, C, h, w] → [B, C, height, width]: bilinear resize (align_corners=False) keeping the
    aspect ratio so that the image fits, then padding on the left and top."""
    h, w = images.shape[-2:]
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    resized = F.interpolate(images, size=(new_h, new_w), mode="bilinear", align_corners=False)
    return F.pad(resized, (max(0, int(width - new_w)), 0, max(0, int(height - new_h)), 0), value=pad_value)


def rotary(x: Tensor, positions: Tensor, base: float = 10_000) -> Tensor:
    """RoPE of x [B, L, H, D] at positions [B, L] with halves (not interleaved pairs)
    rotated, in float32: angle_j = position / base^(2j/D)."""
    half = x.shape[-1] // 2
    dtype = x.dtype
    x = x.to(torch.float32)
    timescale = base ** ((2.0 / x.shape[-1]) * torch.arange(half, dtype=torch.float32, device=x.device))
    angles = (positions[..., None].to(torch.float32) / timescale[None, None, :])[..., None, :]
    sin, cos = torch.sin(angles), torch.cos(angles)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(dtype)


def grouped_attention(mask: Tensor, q: Tensor, k: Tensor, v: Tensor, heads: int, kv_heads: int, head_dim: int) -> Tensor:
    """Eager attention [B, Lq, heads·head_dim] of q [B, Lq, heads, d] over k, v [B, Lk,
    kv_heads, d] (each key/value head shared by heads / kv_heads query heads), scores in
    float32 with masked entries at the float32 minimum, ``mask`` [B, Lq, Lk] bool."""
    b, length = k.shape[:2]
    groups = heads // kv_heads
    k = k[:, :, :, None, :].expand(b, length, kv_heads, groups, head_dim).reshape(b, length, heads, head_dim)
    v = v[:, :, :, None, :].expand(b, length, kv_heads, groups, head_dim).reshape(b, length, heads, head_dim)
    q, k = q.to(torch.float32).transpose(1, 2), k.to(torch.float32).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) * head_dim**-0.5
    scores = torch.where(mask[:, None, :, :], scores, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))
    return out.permute(0, 2, 1, 3).reshape(b, -1, heads * head_dim)


def expert_intermediate_size(width: int, multiplier: int = 4, multiple_of: int = 256) -> int:
    """The expert MLP's width for an expert of width ``width``: 4·⌊2·width/3⌋ rounded up to a multiple of 256."""
    size = int(multiplier * int(2 * width / 3))
    return multiple_of * ((size + multiple_of - 1) // multiple_of)


def patch_position_ids(rows: int, cols: int, per_side: int, dtype: torch.dtype, device) -> Tensor:
    """The position-embedding index [rows·cols] of each patch of a full (unmasked) image, as
    the SigLIP tower of SmolVLM numbered them in the transformers releases LeRobot 0.4.x runs
    on (4.5x), which SmolVLA was trained with: patch i of n along an axis goes to the bucket of
    i / n · (1 − 1e−6) (computed in the pixels' dtype) among the edges 1/N, 2/N, … (N =
    ``per_side``), so with n = N the positions are 0, 0, 1, …, N − 2. transformers 5 buckets
    i / n and gets 0, 1, …, N − 1: the same weights then see other position embeddings and the
    actions move (by 0.1 on the tiny parity checkpoint, docs/parity.md)."""
    edges = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)
    row = torch.bucketize(torch.arange(rows, device=device, dtype=dtype) / rows * (1 - 1e-6), edges, right=True)
    col = torch.bucketize(torch.arange(cols, device=device, dtype=dtype) / cols * (1 - 1e-6), edges, right=True)
    return (row[:, None] * per_side + col[None, :]).flatten()


def _embed_patches_as_trained(self, pixel_values: Tensor, patch_attention_mask: Tensor | None = None) -> Tensor:
    """``SmolVLMVisionEmbeddings.forward`` with :func:`patch_position_ids` (bound to the
    vision tower's embeddings module; its parameters and their names are unchanged). SmolVLA
    passes whole images (no patch mask)."""
    rows, cols = pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size
    patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
    ids = patch_position_ids(rows, cols, self.num_patches_per_side, pixel_values.dtype, pixel_values.device)
    return patches + self.position_embedding(ids)[None]


def _qkv(layer: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer's normalized input projected to q, k, v [B, L, heads, head_dim]."""
    attn = layer.self_attn
    h = layer.input_layernorm(hidden).to(attn.q_proj.weight.dtype)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    return attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)


def _finish_layer(layer: nn.Module, attended: Tensor, hidden: Tensor) -> Tensor:
    """The rest of a pre-norm decoder layer after attention: output projection, residual,
    normalized MLP, residual."""
    out = layer.self_attn.o_proj(attended.to(layer.self_attn.o_proj.weight.dtype)) + hidden
    return layer.mlp(layer.post_attention_layernorm(out)) + out


# ------------------------------------------------------------------ the architecture


@dataclass
class SmolVLAArch:
    """What of a SmolVLA config.json shapes and runs the model."""

    chunk_size: int
    n_action_steps: int
    max_state_dim: int
    max_action_dim: int
    resize_imgs_with_padding: tuple[int, int] | None
    empty_cameras: int
    tokenizer_max_length: int
    num_steps: int
    num_vlm_layers: int
    num_expert_layers: int
    self_attn_every_n_layers: int
    expert_width_multiplier: float
    attention_mode: str
    add_image_special_tokens: bool
    prefix_length: int
    min_period: float
    max_period: float
    train_expert_only: bool
    freeze_vision_encoder: bool
    train_state_proj: bool

    @classmethod
    def of(cls, files: LeRobotPolicyDir) -> "SmolVLAArch":
        """The architecture of a SmolVLA directory; what mmrl does not implement is refused."""
        where = f"{files.path / 'config.json'}: "
        refuse = {
            "adapt_to_pi_aloha": (False, "mmrl does not convert ALOHA joints/grippers; only checkpoints with adapt_to_pi_aloha false load"),
            "use_delta_joint_actions_aloha": (False, "not implemented by LeRobot either"),
            "use_cache": (True, "mmrl always caches the prefix (LeRobot's sampling needs it too)"),
            "n_obs_steps": (1, "mmrl feeds the current observation only"),
        }
        for name, (wanted, why) in refuse.items():
            if files.config.get(name, wanted) != wanted:
                raise ConfigError(where + name, files.config[name], why)
        rtc = files.config.get("rtc_config")
        if isinstance(rtc, dict) and rtc.get("enabled"):
            raise ConfigError(where + "rtc_config.enabled", True, "real-time chunking is not implemented by mmrl; set it false")
        mode = files.field("attention_mode")
        if mode not in ATTENTION_MODES:
            raise ConfigError(where + "attention_mode", mode, f"allowed: {', '.join(ATTENTION_MODES)}")
        resize = files.field("resize_imgs_with_padding")
        arch = cls(
            chunk_size=int(files.field("chunk_size")),
            n_action_steps=int(files.field("n_action_steps")),
            max_state_dim=int(files.field("max_state_dim")),
            max_action_dim=int(files.field("max_action_dim")),
            resize_imgs_with_padding=None if resize is None else (int(resize[0]), int(resize[1])),
            empty_cameras=int(files.config.get("empty_cameras", 0)),
            tokenizer_max_length=int(files.field("tokenizer_max_length")),
            num_steps=int(files.field("num_steps")),
            num_vlm_layers=int(files.field("num_vlm_layers")),
            num_expert_layers=int(files.field("num_expert_layers")),
            self_attn_every_n_layers=int(files.field("self_attn_every_n_layers")),
            expert_width_multiplier=float(files.field("expert_width_multiplier")),
            attention_mode=mode,
            add_image_special_tokens=bool(files.config.get("add_image_special_tokens", False)),
            prefix_length=int(files.config.get("prefix_length", -1)),
            min_period=float(files.field("min_period")),
            max_period=float(files.field("max_period")),
            train_expert_only=bool(files.config.get("train_expert_only", True)),
            freeze_vision_encoder=bool(files.config.get("freeze_vision_encoder", True)),
            train_state_proj=bool(files.config.get("train_state_proj", True)),
        )
        if arch.n_action_steps > arch.chunk_size:
            raise ConfigError(where + "n_action_steps", arch.n_action_steps, f"must be <= chunk_size ({arch.chunk_size})")
        return arch

    def is_self_attention(self, layer: int) -> bool:
        """Whether the expert's layer ``layer`` attends jointly to the prefix and the chunk."""
        return "cross" not in self.attention_mode or (self.self_attn_every_n_layers > 0 and layer % self.self_attn_every_n_layers == 0)


class VLMWithExpert(nn.Module):
    """The VLM and the action expert side by side (LeRobot's ``SmolVLMWithExpertModel``:
    attribute names ``vlm`` and ``lm_expert``)."""

    def __init__(self, vlm_config, arch: SmolVLAArch, where: str):
        super().__init__()
        tf = _transformers()
        self.vlm = tf.SmolVLMForConditionalGeneration(vlm_config)
        embeddings = self.vlm.model.vision_model.embeddings  # the patch positions SmolVLA was trained with
        embeddings.forward = types.MethodType(_embed_patches_as_trained, embeddings)
        text = self.vlm.model.text_model
        total = len(text.layers)
        if arch.num_vlm_layers > total:
            raise ConfigError(where + "num_vlm_layers", arch.num_vlm_layers, f"the VLM has {total} decoder layers")
        if arch.num_vlm_layers > 0:
            text.layers = text.layers[: arch.num_vlm_layers]
        self.num_vlm_layers = len(text.layers)
        text_config = vlm_config.text_config
        expert_config = copy.deepcopy(text_config)
        expert_config.hidden_size = int(text_config.hidden_size * arch.expert_width_multiplier)
        expert_config.intermediate_size = expert_intermediate_size(expert_config.hidden_size)
        expert_config.num_hidden_layers = self.num_vlm_layers
        if arch.num_expert_layers > 0:
            if self.num_vlm_layers % arch.num_expert_layers:
                raise ConfigError(where + "num_expert_layers", arch.num_expert_layers, f"must divide the VLM's {self.num_vlm_layers} layers")
            expert_config.num_hidden_layers = arch.num_expert_layers
        if expert_config.hidden_size % 2:
            raise ConfigError(where + "expert_width_multiplier", arch.expert_width_multiplier, f"gives an odd expert width {expert_config.hidden_size} (sinusoidal time features need it even)")
        self.lm_expert = tf.AutoModel.from_config(expert_config)
        self.lm_expert.embed_tokens = None  # the expert reads action tokens, never words
        self.head_dim = int(text_config.head_dim)
        self.heads, self.kv_heads = int(text_config.num_attention_heads), int(text_config.num_key_value_heads)
        self.arch = arch
        kv_width = self.kv_heads * self.head_dim
        for index, layer in enumerate(self.lm_expert.layers):
            if not arch.is_self_attention(index):  # cross-attention: k/v project the VLM's keys/values
                bias = bool(getattr(expert_config, "attention_bias", False))
                layer.self_attn.k_proj = nn.Linear(kv_width, kv_width, bias=bias)
                layer.self_attn.v_proj = nn.Linear(kv_width, kv_width, bias=bias)
        self.expert_hidden_size = int(expert_config.hidden_size)
        # VLM layer i ↔ expert layer i / stride (None: that VLM layer has no expert layer)
        stride = self.num_vlm_layers // len(self.lm_expert.layers)
        self.expert_index = [None if (i > 0 and i % stride) else i // stride for i in range(self.num_vlm_layers)]
        for i, j in enumerate(self.expert_index):
            if j is None and arch.is_self_attention(i):
                raise ConfigError(where + "self_attn_every_n_layers", arch.self_attn_every_n_layers, f"VLM layer {i} is a self-attention layer without an expert layer (num_expert_layers {arch.num_expert_layers})")

    @property
    def vision_model(self) -> nn.Module:
        return self.vlm.model.vision_model

    @property
    def text_model(self) -> nn.Module:
        return self.vlm.model.text_model

    def embed_image(self, images: Tensor) -> Tensor:
        """Pixels [B, 3, H, W] in [−1, 1] → image tokens [B, n, hidden] (vision encoder + connector)."""
        states = self.vision_model(pixel_values=images.to(self.vision_model.dtype), patch_attention_mask=None).last_hidden_state
        return self.vlm.model.connector(states)

    def embed_words(self, ids: Tensor) -> Tensor:
        return self.text_model.get_input_embeddings()(ids)

    def prefix(self, embeds: Tensor, pad: Tensor, blocks: Tensor) -> dict:
        """Run the VLM over the prefix embeddings [N, P, hidden]: every layer's keys (after
        RoPE) and values, and the final normalized states."""
        mask = attention_mask_2d(pad, blocks)
        positions = torch.cumsum(pad, dim=1) - 1
        hidden = embeds.to(self.text_model.embed_tokens.weight.dtype)
        keys, values = [], []
        for layer in self.text_model.layers:
            q, k, v = _qkv(layer, hidden)
            q, k = rotary(q, positions), rotary(k, positions)
            keys.append(k)
            values.append(v)
            hidden = _finish_layer(layer, grouped_attention(mask, q, k, v, self.heads, self.kv_heads, self.head_dim), hidden)
        return {"keys": keys, "values": values, "hidden": self.text_model.norm(hidden)}

    def expert_memory(self, prefix: dict) -> list[tuple[Tensor, Tensor] | None]:
        """Per VLM layer, what the expert layer beside it attends to in the prefix: the VLM's
        keys/values (self-attention layers) or their projections by the expert's k/v
        (cross-attention layers); None where there is no expert layer."""
        memory = []
        for i, j in enumerate(self.expert_index):
            if j is None:
                memory.append(None)
                continue
            attn = self.lm_expert.layers[j].self_attn
            k, v = prefix["keys"][i], prefix["values"][i]
            dtype = attn.k_proj.weight.dtype
            if self.arch.is_self_attention(i):
                memory.append((k.to(dtype), v.to(dtype)))
                continue
            n, p = k.shape[:2]
            memory.append((attn.k_proj(k.to(dtype).view(n, p, -1)).view(n, p, -1, self.head_dim), attn.v_proj(v.to(dtype).view(n, p, -1)).view(n, p, -1, self.head_dim)))
        return memory

    def expert(self, tokens: Tensor, memory: list, pad: Tensor) -> Tensor:
        """The expert over the chunk's tokens [B, S, width] given ``expert_memory`` and the
        prefix's real tokens ``pad`` [B, P] → its final normalized states."""
        b, s = tokens.shape[:2]
        p = pad.shape[1]
        own = torch.ones(b, s, dtype=torch.bool, device=tokens.device)
        mask = torch.cat([pad[:, None, :].expand(b, s, p), attention_mask_2d(own, torch.ones(b, s, dtype=tokens.dtype, device=tokens.device))], dim=2)
        positions = torch.sum(pad, dim=-1)[:, None] + torch.cumsum(own, dim=1) - 1
        hidden = tokens
        for i, j in enumerate(self.expert_index):
            if j is None:
                continue
            layer = self.lm_expert.layers[j]
            k_prefix, v_prefix = memory[i]
            if self.arch.is_self_attention(i):
                q, k, v = _qkv(layer, hidden)
                q, k = rotary(q, positions), rotary(k, positions)
                attended = grouped_attention(mask, q, torch.cat([k_prefix, k], dim=1), torch.cat([v_prefix, v], dim=1), self.heads, self.kv_heads, self.head_dim)
            else:
                attn = layer.self_attn
                h = layer.input_layernorm(hidden).to(attn.q_proj.weight.dtype)
                q = attn.q_proj(h).view(*h.shape[:-1], -1, attn.head_dim)
                q = rotary(q, positions - torch.min(positions, dim=1, keepdim=True).values)
                attended = grouped_attention(mask[:, -s:, :p], q, k_prefix, v_prefix, self.heads, self.kv_heads, self.head_dim)
            hidden = _finish_layer(layer, attended, hidden)
        return self.lm_expert.norm(hidden)


class SmolVLAModel(nn.Module):
    """LeRobot's ``VLAFlowMatching``: the VLM with its expert and the state/action/time projections."""

    def __init__(self, vlm_config, arch: SmolVLAArch, where: str):
        super().__init__()
        self.arch = arch
        self.vlm_with_expert = VLMWithExpert(vlm_config, arch, where)
        hidden, width = int(vlm_config.text_config.hidden_size), self.vlm_with_expert.expert_hidden_size
        self.state_proj = nn.Linear(arch.max_state_dim, hidden)
        self.action_in_proj = nn.Linear(arch.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, arch.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)

    def embed_prefix(self, images: list[Tensor], image_masks: list[Tensor], ids: Tensor, id_mask: Tensor, state: Tensor, special_ids: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """[images | words | state] → embeddings [N, P, hidden], real tokens [N, P] bool and
        block starts [N, P] (images and words one bidirectional block, the state a new one)."""
        vlm = self.vlm_with_expert
        embeds, pads, blocks = [], [], []
        n = state.shape[0]

        def special(ids_: Tensor):
            tokens = vlm.embed_words(ids_.to(state.device)).unsqueeze(0).expand(n, -1, -1)
            embeds.append(tokens)
            pads.append(torch.ones(n, tokens.shape[1], dtype=torch.bool, device=state.device))
            blocks.extend([0] * tokens.shape[1])

        for image, image_mask in zip(images, image_masks):
            if special_ids is not None:
                special(special_ids[0])
            tokens = vlm.embed_image(image)
            tokens = tokens * torch.tensor(tokens.shape[-1] ** 0.5, dtype=tokens.dtype, device=tokens.device)
            embeds.append(tokens)
            pads.append(image_mask[:, None].expand(n, tokens.shape[1]))
            blocks.extend([0] * tokens.shape[1])
            if special_ids is not None:
                special(special_ids[1])
        words = vlm.embed_words(ids)
        embeds.append(words * math.sqrt(words.shape[-1]))
        pads.append(id_mask)
        blocks.extend([0] * words.shape[1])
        embeds.append(self.state_proj(state)[:, None, :])
        pads.append(torch.ones(n, 1, dtype=torch.bool, device=state.device))
        blocks.append(1)
        embeds, pads = torch.cat(embeds, dim=1), torch.cat(pads, dim=1)
        blocks = torch.tensor(blocks, dtype=torch.bool, device=state.device)[None, :]
        if pads.shape[1] < self.arch.prefix_length:
            extra = self.arch.prefix_length - pads.shape[1]
            embeds = F.pad(embeds, (0, 0, 0, extra))
            pads = F.pad(pads, (0, extra))
            blocks = F.pad(blocks, (0, extra))
        return embeds, pads, blocks.expand(n, -1)

    def velocity(self, x: Tensor, t: Tensor, memory: list, pad: Tensor, with_hidden: bool = False):
        """v(x_t, t) [B, C, max_action_dim] of noisy chunks x [B, C, max_action_dim] at times t
        [B] (and the action tokens' states [B, C, width], ``with_hidden``)."""
        actions = self.action_in_proj(x)
        time = time_features(t, actions.shape[-1], self.arch.min_period, self.arch.max_period).to(actions.dtype)
        tokens = self.action_time_mlp_in(torch.cat([actions, time[:, None, :].expand_as(actions)], dim=2))
        tokens = self.action_time_mlp_out(F.silu(tokens))
        out = self.vlm_with_expert.expert(tokens, memory, pad)
        hidden = out[:, -self.arch.chunk_size :].to(torch.float32)
        v = self.action_out_proj(hidden)
        return (v, hidden) if with_hidden else v


# ------------------------------------------------------------------ the policy


# The tiny example the contract tests build (tests/policies/test_contract.py): ``prepare``
# writes a tiny SmolVLA directory for the Tabletop (state 4, actions 2) and names it.
CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "max_episode_steps": 4, "kwargs": {"task": "spatial", "image_size": 16}},
        "sampler": {"type": "env"},
        "policy": {"type": "smolvla", "denoising": {"num_inference_steps": 2}},
        "rewards": [{"type": "success"}],
    },
    "prepare": "mmrl.policies.smolvla.tiny:contract_checkpoint",
    "ratio_atol": 1e-4,
    "ratio_why": provisional_logp_why("up to 3.8e-6 (log-probs up to 44) under MMRL_SHAPE_KERNELS=1 over seeds 0-2"),
}


@POLICIES.register("smolvla", config=SmolVLAConfig, contract=CONTRACT)
class SmolVLAPolicy(LeRobotFlowPolicy):
    """A LeRobot SmolVLA checkpoint: its pre-processor, model and post-processor; RL via Flow-SDE chains."""

    def __init__(self, config: SmolVLAConfig, spec: dict):
        super().__init__(config, spec)
        tf = _transformers()
        self.files = files = read_lerobot_policy(config.checkpoint, "policy.checkpoint", ("smolvla",))
        where = f"{files.path / 'config.json'}: "
        self.arch = arch = SmolVLAArch.of(files)
        self.chunk = arch.chunk_size
        self.n_action_steps = config.n_action_steps or arch.n_action_steps
        if self.n_action_steps > arch.chunk_size:
            raise ConfigError("policy.n_action_steps", self.n_action_steps, f"must be <= the checkpoint's chunk_size ({arch.chunk_size})")
        self._denoising = config.denoising.resolved(arch.num_steps)
        self._denoising.validate("policy.denoising")

        # processors: normalizers, tokenizer settings, renames
        self._read_processors(files, arch.tokenizer_max_length)
        self.newline = files.step("preprocessor", "smolvla_new_line_processor") is not None

        # features against the env
        inputs, outputs = files.features("input_features"), files.features("output_features")
        self.image_keys = [key for key, f in inputs.items() if f.type == "VISUAL"]
        if STATE_KEY not in inputs or ACTION_KEY not in outputs:
            raise ConfigError(where + "input_features/output_features", sorted(inputs) + sorted(outputs), f"a SmolVLA policy reads {STATE_KEY} and predicts {ACTION_KEY}")
        self.state_dim, self.lerobot_action_dim = inputs[STATE_KEY].shape[0], outputs[ACTION_KEY].shape[0]
        if self.lerobot_action_dim != self.action_dim:
            raise ConfigError(where + "output_features.action.shape", list(outputs[ACTION_KEY].shape), f"the env's actions have {self.action_dim} dims")
        if self.lerobot_action_dim > arch.max_action_dim or self.state_dim > arch.max_state_dim:
            raise ConfigError(where + "max_action_dim/max_state_dim", [arch.max_action_dim, arch.max_state_dim], f"must hold the action ({self.lerobot_action_dim}) and state ({self.state_dim}) dims")
        env_state, image_shape, num_cameras = observation_spec(spec)
        if env_state != self.state_dim:
            raise ConfigError(where + "input_features.observation.state.shape", list(inputs[STATE_KEY].shape), f"the env's state has {env_state} dims")
        self.cameras = list(config.cameras) if config.cameras is not None else self.image_keys[:num_cameras]
        unknown = [c for c in self.cameras if c not in self.image_keys]
        if unknown or len(self.cameras) != num_cameras:
            why = f"unknown image features {unknown}" if unknown else f"the env has {num_cameras} camera(s)"
            raise ConfigError("policy.cameras", config.cameras, f"{why}; name one of the checkpoint's image features {self.image_keys} per env camera")
        absent = [key for key in self.image_keys if key not in self.cameras]
        if absent and not arch.empty_cameras:
            raise ConfigError(
                where + "input_features", absent, f"image features the env does not provide (it gives {self.cameras}); the checkpoint allows no empty camera (empty_cameras 0): map env cameras with policy.cameras"
            )
        if absent:
            _warn_empty_cameras(str(config.checkpoint), self.cameras, absent, arch.empty_cameras)

        # the VLM: config and tokenizer from its directory, weights from model.safetensors
        vlm_path = resolve_vlm(str(files.field("vlm_model_name")), config.vlm_dir)
        vlm_config = tf.AutoConfig.from_pretrained(vlm_path, local_files_only=True)
        if vlm_config.model_type != "smolvlm":
            raise ConfigError("policy.vlm_dir", str(vlm_path), f"holds a {vlm_config.model_type!r} model; SmolVLA sits on smolvlm")
        self.tokenizer = tf.AutoTokenizer.from_pretrained(vlm_path, local_files_only=True)
        self.vlm_path = vlm_path
        self.special_ids = None
        if arch.add_image_special_tokens:
            ids = self.tokenizer.convert_tokens_to_ids
            self.special_ids = (torch.tensor([ids("<fake_token_around_image>"), ids("<global-img>")]), torch.tensor([ids("<fake_token_around_image>")]))
        self.model = SmolVLAModel(vlm_config, arch, where)
        # a head tied to the word embeddings is one tensor under two names: mmrl's checkpoints
        # keep one, LeRobot's file the other (safetensors' choice); both load
        save_tied_weights_once(self)
        stored = read_lerobot_weights(files.path)
        self._load_lerobot_weights(stored)
        self._add_noise_head()
        self.lerobot_keys = list(stored)  # the names export writes
        if config.vlm_dtype == "bfloat16":
            self.model.vlm_with_expert.vlm.to(torch.bfloat16)
        self._set_trainable(config, arch)
        self.lora = config.lora.r > 0
        if self.lora:
            self._add_lora(config)

    # ------------------------------------------------------------------ construction pieces

    def _set_trainable(self, config: SmolVLAConfig, arch: SmolVLAArch) -> None:
        vlm = self.model.vlm_with_expert
        expert_only = arch.train_expert_only if config.train_expert_only is None else config.train_expert_only
        freeze_vision = arch.freeze_vision_encoder if config.freeze_vision_encoder is None else config.freeze_vision_encoder
        state_proj = arch.train_state_proj if config.train_state_proj is None else config.train_state_proj
        vlm.vlm.lm_head.requires_grad_(False)  # never used: the VLA reads states, not words
        if freeze_vision:
            vlm.vision_model.requires_grad_(False)
        if expert_only:
            vlm.vlm.requires_grad_(False)
        self.model.state_proj.requires_grad_(state_proj)

    def _lora_targets(self) -> dict[str, list[nn.Module]]:
        return {"expert": [self.model.vlm_with_expert.lm_expert], "vlm": [self.model.vlm_with_expert.text_model]}

    @property
    def prefix_width(self) -> int:
        return int(self.model.state_proj.out_features)

    # ------------------------------------------------------------------ observations → prefix

    def prompts(self, tasks: list[str], state: Tensor | None) -> list[str]:
        """The task strings with the trailing newline of LeRobot's SmolVLA pre-processor (the state is not in the prompt)."""
        return [t if t.endswith("\n") else t + "\n" for t in tasks] if self.newline else list(tasks)

    def lerobot_prefix(self, images: dict[str, Tensor], state: Tensor, ids: Tensor, id_mask: Tensor) -> dict:
        """The chunk conditioning from LeRobot's raw inputs: images {feature key: float
        [N, 3, H, W] in [0, 1]}, the raw state [N, D], token ids and mask [N, L]. The
        pre-processor's normalization, then the model's image preparation (resize with pad,
        ×2 − 1; absent cameras as −1 images with their mask off, up to ``empty_cameras``)
        and the VLM pass over the prefix."""
        arch = self.arch
        prepared, masks = [], []
        for key in self.image_keys:
            if key not in images:
                continue
            image = self.normalizer.normalize(key, images[key])
            if arch.resize_imgs_with_padding is not None:
                image = resize_with_pad(image, *arch.resize_imgs_with_padding, pad_value=0)
            prepared.append(image * 2.0 - 1.0)
            masks.append(torch.ones(image.shape[0], dtype=torch.bool, device=image.device))
        absent = len(self.image_keys) - len(prepared)
        for _ in range(min(absent, arch.empty_cameras)):
            prepared.append(torch.ones_like(prepared[-1]) * -1)
            masks.append(torch.zeros_like(masks[-1]))
        state = self.normalizer.normalize(STATE_KEY, state)
        state = F.pad(state, (0, arch.max_state_dim - state.shape[-1]))
        embeds, pad, blocks = self.model.embed_prefix(prepared, masks, ids, id_mask, state, self.special_ids)
        prefix = self.model.vlm_with_expert.prefix(embeds, pad, blocks)
        return {"memory": self.model.vlm_with_expert.expert_memory(prefix), "pad": pad, "hidden": prefix["hidden"]}

    def _denoiser(self, cond: dict):
        def denoise(x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
            if rows.shape[0] == cond["pad"].shape[0] and bool((rows == torch.arange(rows.shape[0], device=rows.device)).all()):
                memory, pad = cond["memory"], cond["pad"]
            else:
                memory = [None if m is None else (m[0][rows], m[1][rows]) for m in cond["memory"]]
                pad = cond["pad"][rows]
            return self._velocity(lambda with_hidden: self.model.velocity(x, t, memory, pad, with_hidden))

        return denoise


def _warn_empty_cameras(checkpoint: str, given: list[str], absent: list[str], empty_cameras: int) -> None:
    """Once per process and checkpoint: the image features the env does not give, which run
    as LeRobot's ``prepare_images`` runs them (:meth:`SmolVLAPolicy.lerobot_prefix`): the
    first ``empty_cameras`` as empty images (−1, masked out), any further ones left out."""
    key = (checkpoint, tuple(given))
    if key in _warned_empty_cameras:
        return
    _warned_empty_cameras.add(key)
    filled, left_out = absent[:empty_cameras], absent[empty_cameras:]
    extra = f"; {left_out} are left out (beyond the checkpoint's empty_cameras {empty_cameras})" if left_out else ""
    logger.warning("SmolVLA %s: the env gives %s; %s filled with an empty image (-1, masked out) as LeRobot does%s", checkpoint, given, filled, extra)


def lerobot_actions(directory: str, observation: dict, noise: Tensor, vlm_dir: str | None = None) -> Tensor:
    """LeRobot's pre-processor → ``predict_action_chunk(batch, noise=noise)`` →
    post-processor of the SmolVLA in ``directory``, computed by mmrl: ``observation`` in
    LeRobot's raw keys (``observation.images.<name>`` float32 [B, 3, H, W] in [0, 1],
    ``observation.state`` float32 [B, D], ``task`` list of B strings), ``noise`` float32
    [B, chunk_size, max_action_dim] → the un-normalized chunk [B, chunk_size, action_dim]."""
    files = read_lerobot_policy(directory, "directory", ("smolvla",))
    rename = dict((files.step("preprocessor", "rename_observations_processor") or {}).get("config", {}).get("rename_map", {}))
    keys = [rename.get(k, k) for k in observation]
    inputs, outputs = files.features("input_features"), files.features("output_features")
    cameras = [key for key, f in inputs.items() if f.type == "VISUAL" and key in keys]
    raw_key = {rename.get(k, k): k for k in observation}
    spec: dict = {"action_dim": outputs[ACTION_KEY].shape[0], "state_dim": inputs[STATE_KEY].shape[0] if STATE_KEY in inputs else 0}
    if cameras:
        h, w = observation[raw_key[cameras[0]]].shape[-2:]
        spec["image_shape"] = [len(cameras), int(h), int(w), 3]
    policy = SmolVLAPolicy(SmolVLAConfig(checkpoint=str(directory), vlm_dir=vlm_dir, cameras=cameras), spec).eval()
    return policy.lerobot_chunk(observation, noise)
