"""What the ``diffusers`` families (``image_diffusion``, ``video_diffusion``, ``wan_video``)
share: what a denoiser predicts and how it converts, pixels to uint8 and back, the tiny text
encoder, LoRA on a denoiser, the prompt cache and the hooks that keep frozen parts out of a
checkpoint. A family imports these from here, never from another family."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mmrl.config import option
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.policies.hf import require_transformers
from mmrl.policies.lora import LoraOptions
from mmrl.policies.tiny_tokenizers import byte_tokenizer, word_tokenizer

def class_name(directory, config_file: str = "config.json") -> str | None:
    """The class a diffusers or transformers sub-directory's config names (``_class_name``,
    else the first of ``architectures``); None when it has no such config."""
    import json
    from pathlib import Path

    path = Path(directory) / config_file
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data.get("_class_name") or (data.get("architectures") or [None])[0]


def require_diffusers(what: str):
    """The ``diffusers`` module, or a :class:`MissingExtraError` saying that ``what`` needs it
    and that the ``image`` extra brings it."""
    try:
        import diffusers
    except ImportError:
        raise MissingExtraError("diffusers", "image", what) from None
    return diffusers


# What each family of transitions takes from the denoiser: an ε-prediction diffusion step
# converts epsilon / v_prediction / sample outputs to ε; a flow step takes the velocity.
DIFFUSION_PREDICTIONS = ("epsilon", "v_prediction", "sample")
FLOW_PREDICTIONS = ("velocity",)


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


def videos_to_uint8(x: Tensor) -> Tensor:
    """Videos [N, 3, F, H, W] in [-1, 1] → uint8 [N, F, H, W, 3] (each frame as :func:`pixels_to_uint8`)."""
    n, _, f, h, w = x.shape
    return pixels_to_uint8(x.transpose(1, 2).flatten(0, 1)).view(n, f, h, w, 3)


# ------------------------------------------------------------------ parts


def tiny_text_encoder(
    width: int, layers: int, heads: int, max_tokens: int, with_projection: bool = False, user: str = "image_diffusion", vocabulary: list[str] | None = None
):
    """A small random CLIP text encoder over mmrl's byte-level tokenizer, or over a word-level
    one when ``vocabulary`` lists the words (right padding, at most ``max_tokens``), and the
    tokenizer: the text conditioning of the tiny image and video denoisers."""
    tf = require_transformers("text", f"text prompts of the {user} policy (a CLIP text encoder)")
    tokenizer = word_tokenizer(vocabulary) if vocabulary else byte_tokenizer()
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = max_tokens
    text_config = tf.CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_tokens,
        projection_dim=width,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.pad_token_id,
    )
    model = tf.CLIPTextModelWithProjection(text_config) if with_projection else tf.CLIPTextModel(text_config)
    return model, tokenizer


@dataclass
class ImageLoraOptions(LoraOptions):
    """The ``lora:`` section of a diffusers denoiser: :class:`~mmrl.policies.lora.LoraOptions`
    with diffusers' attention projections as the default targets."""

    r: int = option(0, "rank of the adapters; 0 = no adapters (every weight of the denoiser trains)", ge=0)
    target_modules: list[str] = option(
        factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        doc="names (or name suffixes) of the denoiser's layers that get adapters: diffusers' attention projections by default; linear and conv layers are allowed",
    )


def with_lora(denoiser: nn.Module, lora) -> None:
    """Inject ``peft`` LoRA layers into the denoiser in place (any diffusers model, with or
    without diffusers' own adapter mixin) and leave only them trainable."""
    try:
        import peft
    except ImportError:
        raise MissingExtraError("peft", "text", "LoRA adapters on the image denoiser (policy.lora.r > 0)") from None
    adapter = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none")
    try:
        peft.inject_adapter_in_model(adapter, denoiser)
    except ValueError as e:  # peft's message lists the modules it could not find
        raise ConfigError("policy.lora.target_modules", lora.target_modules, f"must name linear or conv layers of the denoiser: {e}") from None
    for name, param in denoiser.named_parameters():
        param.requires_grad_("lora_" in name)


class PromptCache:
    """An LRU cache of text conditionings (the embeddings of one prompt: a tensor, or a tuple
    for SD3 / SDXL), keyed by the bytes of the prompt's token ids of every tokenizer, held in
    CPU memory. A plain attribute of the policy: not a parameter or buffer, so it never
    reaches ``state_dict`` or a checkpoint; a deep copy of the policy (the trainer's frozen
    reference) shares it, as the frozen text encoders it caches are the same."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[bytes, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __deepcopy__(self, memo):
        return self

    def get(self, key: bytes):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def _drop_unsaved(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in module._unsaved:
        state_dict.pop(prefix + name, None)


def _allow_missing_unsaved(module: nn.Module, incompatible_keys) -> None:
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in module._unsaved]


def leave_frozen_weights_unsaved(module: nn.Module, save_frozen_weights: bool) -> None:
    """Unless ``save_frozen_weights``, hook ``module``'s ``state_dict`` to leave out the
    parameters that do not train (the frozen parts read from ``model_path`` again) and its
    ``load_state_dict`` to accept their absence. Call it once the trainable parameters are set."""
    module._unsaved = set() if save_frozen_weights else {n for n, p in module.named_parameters() if not p.requires_grad}
    if module._unsaved:
        module.register_state_dict_post_hook(_drop_unsaved)
        module.register_load_state_dict_post_hook(_allow_missing_unsaved)
