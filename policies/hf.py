"""Hugging Face ``transformers`` pieces that several policy families share: the optional
import, the decoder families a tiny model is built as, dropout off, and checkpoints of
models with tied weights. A family imports these from here, never from another family."""

from __future__ import annotations

from torch import nn

from mmrl.errors import MissingExtraError

DECODER_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma")  # transformers decoder families a tiny: section builds


def require_transformers(extra: str, what: str):
    """The ``transformers`` module, or a :class:`MissingExtraError` saying that ``what`` needs
    it and that the ``extra`` brings it."""
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", extra, what) from None
    return transformers


def without_dropout(model_config) -> None:
    """Zero every dropout probability (``*dropout*``, ``*pdrop``) of a transformers config and
    of its sub-configs (a vision-language model's vision tower and decoder)."""
    from transformers import PretrainedConfig

    for name, value in list(vars(model_config).items()):
        if isinstance(value, PretrainedConfig):
            without_dropout(value)
        elif ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            setattr(model_config, name, 0.0)


def tied_aliases(module: nn.Module) -> list[str]:
    """Names of parameters that are another parameter under a second name (a tied output head)."""
    seen, aliases = set(), []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.append(name)
        seen.add(id(param))
    return aliases


def _drop_tied_aliases(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    # safetensors refuses two names for one tensor; the tie restores the second on load
    for name in tied_aliases(module):
        state_dict.pop(prefix + name, None)


def _allow_missing_tied_aliases(module: nn.Module, incompatible_keys) -> None:
    aliases = tied_aliases(module)
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not any(k == a or k.endswith("." + a) for a in aliases)]


def save_tied_weights_once(module: nn.Module) -> None:
    """Hook ``module``'s ``state_dict`` to leave out the second name of each tied parameter, and
    its ``load_state_dict`` to accept that name's absence (the tie fills it)."""
    module.register_state_dict_post_hook(_drop_tied_aliases)
    module.register_load_state_dict_post_hook(_allow_missing_tied_aliases)
