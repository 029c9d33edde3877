"""A pretrained transformers vision-language model as the backbone of a VLA.

``policy.backbone.vlm_path`` names a local ``save_pretrained`` directory of an
image-text-to-text model with its tokenizer and image processor: an OpenVLA-style LLaVA
model, an Idefics3/SmolVLM (SmolVLA's backbone), a PaliGemma (π0's), a Qwen2-VL or
Qwen2.5-VL. The VLA then reads the same prefix as with mmrl's miniature backbone, in the
model's own token layout:

    prefix = [ image block(camera 1) … image block(camera K) | state | instruction ]

- an image block is what the family's processor puts for one image: LLaVA n × ``<image>``;
  Idefics3/SmolVLM ``<fake_token_around_image><global-img>`` n × ``<image>``
  ``<fake_token_around_image>`` (image splitting off: a camera frame is one tile);
  PaliGemma n × ``<image>``; Qwen2-VL ``<|vision_start|>`` n × ``<|image_pad|>``
  ``<|vision_end|>``. The n image-token slots hold the model's own image features
  (``get_image_features``: vision tower + projector/connector), the other slots their
  token embeddings;
- state: one slot holding a learned linear projection of the proprioceptive state (the
  models have no such input; π0 and SmolVLA add one the same way);
- instruction: the model's tokenizer's ids of the instruction (PaliGemma: after ``<bos>``,
  as its prompts are), right-padded to ``max_instruction_tokens``.

The decoder is the model's language model, fed ``inputs_embeds``. Positions count the
attended tokens (padding inside the instruction takes none), so a prefix decodes the same
with or without padding. Qwen2-VL's multimodal rotary positions are computed here from the
image grids — an image token at merged-grid cell (h, w) of an image whose block starts at
position s gets (s, s + h, s + w), and the text after an image continues from
s + max(grid_h, grid_w) — the rule of the model's ``get_rope_index``, which the tests check
against it. PaliGemma's language model attends bidirectionally (π0 keeps that inside the
prefix); here every family's decoder is causal, PaliGemma's included, since the token VLA
decodes its action tokens one at a time and a position must not see the tokens after it.

Options: ``vlm_layers`` keeps only the first N decoder layers (SmolVLA uses the first half of
its VLM); ``freeze_vision_tower``; ``lora`` adds peft LoRA adapters to the language model
(then its base weights are frozen and the adapter-free model is the KL reference);
``vlm_dtype: bfloat16`` holds the VLM's weights in bf16 (what mmrl adds stays float32; the
hidden states are handed back in float32).

Images are turned into pixel values by the model's own image processor (its Pillow
variant) on every call, sampling and ``log_prob`` alike, so the replay keeps the raw uint8
frames and a recomputed chunk sees exactly the pixels it was sampled from.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.errors import ConfigError, MissingExtraError
from mmrl.hub import pretrained_dir
from mmrl.policies.hf import require_transformers, save_tied_weights_once, without_dropout
from mmrl.policies.lora import adapters_disabled
from mmrl.policies.vla.backbone import VLABackbone, VLABackboneConfig, observation_spec
from mmrl.policies.vla.static_decode import static_decoder
from mmrl.policies.vla.tokenizer import InstructionTokenizer

# model_type → family rule: which special tokens wrap an image's block
SUPPORTED = ("llava", "idefics3", "smolvlm", "paligemma", "qwen2_vl", "qwen2_5_vl")
_MROPE = ("qwen2_vl", "qwen2_5_vl")
_IMAGE = -1  # an image-feature slot in a block layout
_FIELD = "policy.backbone.vlm_path"


def _transformers():
    return require_transformers("vla", "a pretrained VLA backbone")


def _first_attribute(module: nn.Module, names: tuple[str, ...]) -> nn.Module:
    for name in names:
        if getattr(module, name, None) is not None:
            return getattr(module, name)
    raise AttributeError(f"{type(module).__name__} has none of {names}")


class VLMTokenizer:
    """The VLM's tokenizer with the miniature's ``encode(texts, max_words)`` interface."""

    def __init__(self, tokenizer):
        self.hf = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, texts: list[str], max_words: int) -> tuple[Tensor, Tensor]:
        """Ids [N, max_words] (right-padded, truncated) and mask [N, max_words] (1 = token)."""
        rows = [self.hf(t, add_special_tokens=False)["input_ids"][:max_words] for t in texts]
        # padded on the host and made tensors at once: two operators for the batch, not two per row
        ids = torch.tensor([row + [self.pad_id] * (max_words - len(row)) for row in rows], dtype=torch.long).view(len(rows), max_words)
        mask = torch.tensor([[1.0] * len(row) + [0.0] * (max_words - len(row)) for row in rows], dtype=torch.float32).view(len(rows), max_words)
        return ids, mask


class PretrainedVLMBackbone(nn.Module):
    """Prefix embeddings (cameras, state, instruction) + the language model of a pretrained VLM."""

    pretrained = True

    def __init__(self, cfg, spec: dict):
        super().__init__()
        tf = _transformers()
        self.cfg = cfg
        self.path = path = pretrained_dir(cfg.vlm_path, _FIELD)
        if not (path / "config.json").is_file():
            raise ConfigError(_FIELD, cfg.vlm_path, "expected a save_pretrained directory of a transformers vision-language model (config.json, weights, tokenizer, image processor)")
        model_config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        self.family = model_config.model_type
        if self.family not in SUPPORTED:
            raise ConfigError(_FIELD, cfg.vlm_path, f"holds a {self.family!r} model; supported: {', '.join(SUPPORTED)}")
        without_dropout(model_config)
        text_config = getattr(model_config, "text_config", None)
        if getattr(text_config, "use_bidirectional_attention", False):
            # PaliGemma's language model attends both ways (its prefix-LM); the VLA's action
            # tokens are decoded one at a time, so every position must see only its past
            text_config.use_bidirectional_attention = False
        dtype = getattr(torch, cfg.vlm_dtype)
        # local_files_only: the directory is resolved (mmrl.hub); transformers must not look further
        model = tf.AutoModelForImageTextToText.from_pretrained(path, config=model_config, dtype=dtype, attn_implementation=cfg.attn_implementation, local_files_only=True)
        self.vlm = model
        self.tokenizer = VLMTokenizer(tf.AutoTokenizer.from_pretrained(path, local_files_only=True))
        # a head tied to the input embeddings is one tensor under two names: saved once, restored by the tie
        save_tied_weights_once(self)
        # aliases into self.vlm, kept out of the module tree (a second name would save every weight twice)
        object.__setattr__(self, "language_model", _first_attribute(model.model, ("language_model", "text_model")))
        object.__setattr__(self, "vision_tower", _first_attribute(model.model, ("vision_tower", "vision_model", "visual")))
        text_config = self.language_model.config
        if cfg.vlm_layers is not None:
            total = len(self.language_model.layers)
            if not 1 <= cfg.vlm_layers <= total:
                raise ConfigError("policy.backbone.vlm_layers", cfg.vlm_layers, f"between 1 and the model's {total} decoder layers")
            self.language_model.layers = self.language_model.layers[: cfg.vlm_layers]
            text_config.num_hidden_layers = cfg.vlm_layers
            if getattr(text_config, "layer_types", None):
                text_config.layer_types = text_config.layer_types[: cfg.vlm_layers]
        self.hidden_size = int(text_config.hidden_size)
        self.state_dim, image_shape, self.num_cameras = observation_spec(spec)
        self._cache_argument = "cache" if "cache" in inspect.signature(self.language_model.forward).parameters else "past_key_values"

        if cfg.freeze_vision_tower:
            self.vision_tower.requires_grad_(False)
        self.lora = cfg.lora.r > 0
        if self.lora:
            self._add_lora(cfg.lora)

        # the fixed part of the prefix: image blocks, the state slot, the family's text start
        layout: list[int] = []
        self.image_grid = None
        if image_shape is not None:
            self.image_shape = image_shape
            self.image_processor = tf.AutoImageProcessor.from_pretrained(path, local_files_only=True)
            blank = torch.zeros(1, *image_shape[-3:], dtype=torch.uint8)
            with torch.no_grad():
                features, grid = self._image_features(blank)
            self.image_tokens = features.shape[1]
            self.image_grid = grid
            for _ in range(self.num_cameras):
                layout += self._image_block(self.image_tokens)
        self.state_slot = None
        if self.state_dim > 0:
            self.state_slot = len(layout)
            layout.append(self.tokenizer.pad_id)
            self.state_proj = nn.Linear(self.state_dim, self.hidden_size)
        if self.family == "paligemma":
            layout.append(self._token_id("<bos>" if self.tokenizer.hf.bos_token is None else self.tokenizer.hf.bos_token))
        layout_t = torch.tensor(layout, dtype=torch.long)
        self.register_buffer("fixed_ids", torch.where(layout_t == _IMAGE, 0, layout_t), persistent=False)
        self.register_buffer("image_slots", (layout_t == _IMAGE).nonzero().flatten(), persistent=False)
        self.fixed_length = len(layout)
        if self.family in _MROPE:
            positions, end = self._vision_positions(layout)
            self.register_buffer("fixed_positions", positions, persistent=False)  # [3, fixed_length]
            self.text_shift = end - self.fixed_length
        else:
            self.text_shift = 0

    # ------------------------------------------------------------------ construction pieces

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.hf.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.hf.unk_token_id:
            raise ConfigError(_FIELD, self.cfg.vlm_path, f"its tokenizer has no {token!r} token, which a {self.family} model's image blocks need")
        return int(token_id)

    def _image_token_id(self) -> int:
        config = self.vlm.config
        token_id = getattr(config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(config, "image_token_index", None)
        if token_id is None:
            raise ConfigError(_FIELD, self.cfg.vlm_path, f"its {self.family} config names no image token id")
        return int(token_id)

    def _image_block(self, n: int) -> list[int]:
        """Token ids of one image's block, ``_IMAGE`` at the n image-feature slots."""
        if self.family in ("idefics3", "smolvlm"):
            around, whole = self._token_id("<fake_token_around_image>"), self._token_id("<global-img>")
            return [around, whole, *[_IMAGE] * n, around]
        if self.family in _MROPE:
            config = self.vlm.config
            return [int(config.vision_start_token_id), *[_IMAGE] * n, int(config.vision_end_token_id)]
        return [_IMAGE] * n

    def _vision_positions(self, layout: list[int]) -> tuple[Tensor, int]:
        """Qwen2-VL's (time, height, width) positions of the fixed prefix and the position
        the text after it starts from."""
        gh, gw = self.image_grid
        positions, current, i = [], 0, 0
        while i < len(layout):
            if layout[i] != _IMAGE:
                positions.append([current] * 3)
                current, i = current + 1, i + 1
                continue
            for h in range(gh):
                for w in range(gw):
                    positions.append([current, current + h, current + w])
            current, i = current + max(gh, gw), i + gh * gw
        return torch.tensor(positions, dtype=torch.long).T.contiguous(), current

    def _add_lora(self, lora) -> None:
        try:
            import peft
        except ImportError:
            raise MissingExtraError("peft", "text", "LoRA adapters (policy.backbone.lora.r > 0)") from None
        adapter = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none")
        self.language_model.requires_grad_(False)
        try:
            peft.inject_adapter_in_model(adapter, self.language_model)
        except ValueError as e:  # peft's message lists the modules it could not find
            raise ConfigError("policy.backbone.lora.target_modules", lora.target_modules, f"must name linear layers of the language model: {e}") from None
        for name, param in self.language_model.named_parameters():
            if "lora_" in name:
                param.requires_grad_(True)

    def adapters_disabled(self):
        """A context in which the language model runs without its LoRA adapters (the KL reference)."""
        return adapters_disabled(self.language_model)

    # ------------------------------------------------------------------ images

    def _pixel_inputs(self, images: Tensor) -> dict[str, Tensor]:
        """uint8 [M, H, W, 3] → the image processor's tensors for M single-image samples."""
        frames = list(images.cpu().numpy().astype(np.uint8))
        if self.family in ("idefics3", "smolvlm"):
            out = self.image_processor(images=[[f] for f in frames], do_image_splitting=False, return_tensors="pt")
        else:
            out = self.image_processor(images=frames, return_tensors="pt")
        return {k: v for k, v in out.items() if isinstance(v, Tensor)}

    def _image_features(self, images: Tensor) -> tuple[Tensor, tuple[int, int] | None]:
        """uint8 [M, H, W, 3] → the model's image features [M, n, hidden] (and, for
        Qwen2-VL, the merged patch grid (h, w) of one image)."""
        inputs = self._pixel_inputs(images)
        device = next(self.vision_tower.parameters()).device
        dtype = next(self.vision_tower.parameters()).dtype
        inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}
        if self.family in ("idefics3", "smolvlm"):
            # the M single-image samples [M, 1, ...] as one sample of M images [1, M, ...]: the
            # vision model runs on the same [M, 3, H, W] pixels, and the model hands back one
            # feature tensor rather than a view per sample
            inputs = {k: v.reshape(1, -1, *v.shape[2:]) if k in ("pixel_values", "pixel_attention_mask") else v for k, v in inputs.items()}
        out = self.vlm.model.get_image_features(**inputs)
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(features, (list, tuple)):
            flat = [f if f.dim() == 2 else f.reshape(-1, f.shape[-1]) for f in features]  # no view per image where it is flat already
            features = flat[0] if len(flat) == 1 else torch.cat(flat)
        features = features.reshape(images.shape[0], -1, features.shape[-1])
        grid = None
        if "image_grid_thw" in inputs:
            merge = self.vlm.config.vision_config.spatial_merge_size
            _, h, w = inputs["image_grid_thw"][0].tolist()
            grid = (h // merge, w // merge)
        return features, grid

    # ------------------------------------------------------------------ the VLA interface

    def least_used_token_ids(self, count: int) -> Tensor:
        """The ``count`` highest ids of the tokenizer's base vocabulary that are not special
        tokens, ascending. A BPE vocabulary lists its merges in the order they were learned,
        most frequent first, so its last ids are its least-used tokens: OpenVLA overwrites
        the last 256 of Llama 2's vocabulary with its action bins. Taking existing ids rather
        than adding tokens keeps the VLM's embedding table and output head as they are (no
        resizing, no new rows outside LoRA's reach, checkpoints that load into the
        unmodified architecture)."""
        tokenizer = self.tokenizer.hf
        special = set(tokenizer.all_special_ids)
        ids = [i for i in range(tokenizer.vocab_size - 1, -1, -1) if i not in special][:count]
        if len(ids) < count:
            raise ConfigError("policy.action_bins", count, f"at most {len(ids)}: the bins take ids of the VLM's base vocabulary, which has {len(ids)} non-special tokens")
        return torch.tensor(sorted(ids), dtype=torch.long, device=self.fixed_ids.device)

    def text_start_id(self) -> Tensor:
        """An id whose embedding starts the action tokens (the tokenizer's EOS, else its
        padding): the learned start vector of the token VLA is initialized from it."""
        tokenizer = self.tokenizer.hf
        token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.tokenizer.pad_id
        return torch.tensor(int(token_id), device=self.fixed_ids.device)

    def freeze_output_head(self) -> None:
        """Fix the language-model head's weights when the policy never reads them (an action
        expert): a trainable parameter outside the graph would stall distributed training.
        A head tied to the input embeddings stays trainable (the embeddings are read)."""
        head = self.vlm.get_output_embeddings()
        if head is not None and head.weight is not self.language_model.get_input_embeddings().weight:
            head.requires_grad_(False)

    def resize_instruction_vocab(self, vocab_size: int) -> None:
        """The VLM's own tokenizer sizes its embeddings; nothing to resize."""

    def token_embeddings(self, ids: Tensor) -> Tensor:
        """The language model's input embeddings of token ``ids`` (float32)."""
        return self.language_model.get_input_embeddings()(ids).float()

    def output_rows(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """The language-model head's weight rows (and bias) of token ``ids``."""
        head = self.vlm.get_output_embeddings()
        return head.weight[ids], (head.bias[ids] if getattr(head, "bias", None) is not None else None)

    def prefix(self, image: Tensor | None, state: Tensor | None, instruction_ids: Tensor, instruction_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Prefix embeddings [N, P, hidden] (float32) and mask [N, P] (1 = attend)."""
        device = self.fixed_ids.device
        ids = instruction_ids.to(device)
        n = ids.shape[0]
        fixed = self.token_embeddings(self.fixed_ids).expand(n, -1, -1).clone()
        if self.num_cameras:
            if image is None:
                raise ValueError("this backbone was built for image observations; got none")
            if image.dim() == 4:
                image = image.unsqueeze(1)
            if image.shape[1] != self.num_cameras or tuple(image.shape[2:]) != tuple(self.image_shape[-3:]):
                raise ValueError(f"expected images [N, {self.num_cameras}, {', '.join(map(str, self.image_shape[-3:]))}], got {list(image.shape)}")
            features, _ = self._image_features(image.reshape(-1, *image.shape[2:]))
            fixed[:, self.image_slots] = features.float().reshape(n, -1, self.hidden_size)
        if self.state_slot is not None:
            if state is None:
                raise ValueError(f"this backbone was built for a state of {self.state_dim} dims; got none")
            fixed[:, self.state_slot] = self.state_proj(state.to(device, torch.float32).reshape(n, self.state_dim))
        embeds = torch.cat([fixed, self.token_embeddings(ids)], dim=1)
        mask = torch.cat([torch.ones(n, self.fixed_length, device=device), instruction_mask.to(device, torch.float32)], dim=1)
        return embeds, mask

    def positions(self, mask: Tensor, length: int) -> Tensor:
        """Position ids of the last ``length`` tokens of sequences with attention ``mask``
        [N, S]: [N, length], or [3, N, length] for multimodal rotary positions."""
        text = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.family not in _MROPE:
            return text[:, -length:]
        positions = (text + self.text_shift).unsqueeze(0).repeat(3, 1, 1)
        positions[:, :, : self.fixed_length] = self.fixed_positions[:, None, :]
        return positions[:, :, -length:]

    def new_cache(self):
        """An empty key/value cache for incremental decoding with ``forward(..., cache=)``."""
        return _transformers().DynamicCache(config=self.language_model.config)

    def static_decoder(self, cache, mask: Tensor, steps: int):
        """The next ``steps`` single-token steps after a pass that filled ``cache`` over tokens
        with attention ``mask`` [N, P] (:func:`~mmrl.policies.vla.static_decode.static_decoder`;
        None for a language model it does not serve, multimodal rotary positions included)."""
        if self.family in _MROPE:
            return None
        full = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
        return static_decoder(self.language_model, cache, mask, self.positions(full, steps))

    def forward(self, embeds: Tensor, mask: Tensor, cache=None) -> Tensor:
        """The language model over ``embeds`` [N, S, hidden] → last hidden states [N, S,
        hidden] in float32; ``mask`` [N, S] (or [N, S_past + S] with a ``cache``)."""
        dtype = self.language_model.get_input_embeddings().weight.dtype
        out = self.language_model(
            inputs_embeds=embeds.to(dtype),
            attention_mask=mask.to(embeds.device, torch.long),
            position_ids=self.positions(mask.to(embeds.device), embeds.shape[1]),
            use_cache=cache is not None,
            **{self._cache_argument: cache},
        )
        return out.last_hidden_state.float()


def build_backbone(cfg: VLABackboneConfig, spec: dict, instructions: list[str]):
    """(tokenizer, backbone): the miniature with a word-level tokenizer over the env's
    ``instructions``, or, with ``cfg.vlm_path``, the pretrained VLM and its own tokenizer."""
    cfg.validate("policy.backbone")
    if cfg.vlm_path is not None:
        backbone = PretrainedVLMBackbone(cfg, spec)
        return backbone.tokenizer, backbone
    tokenizer = InstructionTokenizer.build(instructions)
    return tokenizer, VLABackbone(cfg, spec, tokenizer.vocab_size)


class AdapterFreeReference(nn.Module):
    """The KL reference of a VLA with LoRA adapters on its VLM: the policy itself with its
    adapters disabled. It shares the policy's weights without registering them, so the
    trainer freezing it or setting it to eval mode leaves the policy alone. What mmrl adds
    around the VLM (state projection, action start/slots, an action expert) is not adapted:
    the reference reads its current weights."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    @torch.no_grad()
    def log_prob(self, replay: dict) -> Tensor:
        with self.policy.backbone.adapters_disabled():
            return self.policy.log_prob(replay)

    @torch.no_grad()
    def chain_denoiser(self, replay: dict):
        """The reference's denoiser (the prefix is encoded here, adapters off; the
        expert's steps then need no VLM pass)."""
        with self.policy.backbone.adapters_disabled():
            return self.policy.chain_denoiser(replay)

    def forward(self, replay: dict) -> Tensor:
        return self.log_prob(replay)


# what a VLA on a pretrained VLM can be exported as (:func:`export_vlm`)
VLM_LAYOUTS = {"transformers": "the VLM with its trained weights, tokenizer and image processor (save_pretrained); the action head stays in the checkpoint"}


def vlm_export_formats(policy: nn.Module) -> dict[str, str]:
    """``transformers`` for a VLA on a pretrained VLM without LoRA adapters (:func:`export_vlm`)."""
    backbone = getattr(policy, "backbone", None)
    if backbone is not None and getattr(backbone, "pretrained", False) and not backbone.lora:
        return dict(VLM_LAYOUTS)
    return {}


def export_vlm(policy: nn.Module, out) -> Path:
    """Write the VLM a VLA sits on, with the weights it has now (after SFT or RL), as a
    transformers ``save_pretrained`` directory with its tokenizer and image processor: a
    checkpoint another VLA (or any transformers code) loads as it loads a downloaded one.
    The token VLA's action bins live in the VLM's own embedding and output rows, so they
    travel with it; what mmrl adds around the VLM (state projection, action start and slots,
    an action expert) stays in the policy's own checkpoint."""
    backbone = getattr(policy, "backbone", None)
    if backbone is None or not getattr(backbone, "pretrained", False):
        raise ConfigError("policy.backbone.vlm_path", None, "the policy sits on mmrl's miniature backbone, not a transformers VLM: there is no VLM to export")
    if backbone.lora:
        raise ConfigError("policy.backbone.lora.r", backbone.cfg.lora.r, "a VLM with LoRA adapters injected cannot be saved as a plain transformers model: export one trained without adapters")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    backbone.vlm.save_pretrained(out)
    backbone.tokenizer.hf.save_pretrained(out)
    image_processor = getattr(backbone, "image_processor", None)
    if image_processor is None:  # built for a state-only env: the source directory's processor
        image_processor = _transformers().AutoImageProcessor.from_pretrained(backbone.path, local_files_only=True)
    image_processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mmrl.policies.vla.pretrained export RUN_OR_WEIGHTS --out DIR``."""
    import argparse
    import sys

    from mmrl.core.weights import load_pretrained, resolve_weights_dir

    parser = argparse.ArgumentParser(prog="python -m mmrl.policies.vla.pretrained", description="export the transformers VLM of a VLA policy (a run, a checkpoint or a weights directory)")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("source", help="a run directory (its latest checkpoint), a checkpoint or a save_pretrained directory of a token_vla / flow_vla on a VLM")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        print(export_vlm(load_pretrained(resolve_weights_dir(args.source)), args.out))
    except (ConfigError, MissingExtraError) as e:
        print(f"mmrl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
