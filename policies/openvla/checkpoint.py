"""Reading and writing OpenVLA checkpoints in their released Hugging Face layout.

A directory holds ``config.json`` (an ``OpenVLAConfig``: the Prismatic fields, the Llama
``text_config``, ``norm_stats``, ``n_action_bins``), the weights as ``model.safetensors`` or
shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, the
tokenizer files, ``preprocessor_config.json`` (the ``PrismaticImageProcessor``) and
``dataset_statistics.json``. Nothing here imports the checkpoint's own Python files
(``auto_map``): the formats are read as data.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmrl.errors import ConfigError
from mmrl.hub import pretrained_dir

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
STATISTICS = "dataset_statistics.json"
PREPROCESSOR = "preprocessor_config.json"

# configuration_prismatic.VISION_BACKBONE_TO_TIMM_ID: the featurizers of each vision backbone id
VISION_BACKBONES = {
    "clip-vit-l": ["vit_large_patch14_clip_224.openai"],
    "clip-vit-l-336px": ["vit_large_patch14_clip_336.openai"],
    "dinov2-vit-l": ["vit_large_patch14_reg4_dinov2.lvd142m"],
    "in1k-vit-l": ["vit_large_patch16_224.augreg_in21k_ft_in1k"],
    "siglip-vit-so400m": ["vit_so400m_patch14_siglip_224"],
    "siglip-vit-so400m-384px": ["vit_so400m_patch14_siglip_384"],
    "dinoclip-vit-l-336px": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_large_patch14_clip_336.openai"],
    "dinosiglip-vit-so-224px": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "dinosiglip-vit-so-384px": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_384"],
}

# The released config.json stores text_config as a diff against transformers 4.40's
# LlamaConfig defaults (Llama-2-7B); they are pinned here so that a later transformers
# changing a default cannot change what a checkpoint means.
LLAMA2_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "attention_dropout": 0.0, "mlp_bias": False,
}


@dataclass
class OpenVLACheckpoint:
    """What mmrl reads from an OpenVLA directory before building the model."""

    path: Path
    config: dict
    weight_files: dict[str, str]  # tensor name -> file name
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    file_metadata: dict[str, dict | None] = field(default_factory=dict)
    norm_stats: dict = field(default_factory=dict)
    statistics_file: bool = False  # the statistics came from dataset_statistics.json

    @property
    def timm_ids(self) -> list[str]:
        return VISION_BACKBONES[self.config["vision_backbone_id"]]

    @property
    def fused(self) -> bool:
        fused = self.config.get("use_fused_vision_backbone")
        if fused is None:  # the reference's rule when the field is absent
            fused = self.config["vision_backbone_id"].startswith(("dinoclip", "dinosiglip"))
        return bool(fused)

    def text_config(self) -> dict:
        text = dict(self.config.get("text_config") or {})
        model_type = text.pop("model_type", "llama")
        if model_type != "llama":
            raise ConfigError("policy.checkpoint", str(self.path), f"its language model is a {model_type!r}; supported: llama (OpenVLA's Llama-2)")
        for key in ("torch_dtype", "dtype", "architectures", "_name_or_path", "transformers_version"):
            text.pop(key, None)
        return {**LLAMA2_DEFAULTS, **text}

    def read_tensors(self, names=None) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (all, or ``names``), in their stored dtypes."""
        from safetensors import safe_open

        wanted = set(self.weight_files if names is None else names)
        out = {}
        for file in dict.fromkeys(self.weight_files.values()):
            with safe_open(str(self.path / file), framework="pt") as f:
                for name in f.keys():
                    if name in wanted:
                        out[name] = f.get_tensor(name)
        return out


def read_checkpoint(path) -> OpenVLACheckpoint:
    """Read an OpenVLA directory's config, statistics and weight layout (shapes, dtypes)."""
    from safetensors import safe_open

    # a hub id fetches OpenVLA-OFT's head files too (loaded with torch.load(weights_only=True))
    root = pretrained_dir(path, "policy.checkpoint", files=["*checkpoint.pt"])
    config_file = root / "config.json"
    expected = "expected an OpenVLA checkpoint directory in the released Hugging Face layout (config.json of model_type 'openvla', model.safetensors or its shards)"
    if not config_file.is_file():
        raise ConfigError("policy.checkpoint", str(path), expected)
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "openvla" or config.get("vision_backbone_id") not in VISION_BACKBONES:
        raise ConfigError("policy.checkpoint", str(path), f"config.json has model_type {config.get('model_type')!r}, vision_backbone_id {config.get('vision_backbone_id')!r}; {expected}")
    if (root / INDEX).is_file():
        weight_files = dict(json.loads((root / INDEX).read_text())["weight_map"])
    elif (root / SINGLE).is_file():
        weight_files = {}
    else:
        raise ConfigError("policy.checkpoint", str(path), f"no {SINGLE} or {INDEX}; {expected} (convert .bin weights to safetensors first)")
    shapes, dtypes, metadata = {}, {}, {}
    for file in dict.fromkeys(weight_files.values()) if weight_files else [SINGLE]:
        with safe_open(str(root / file), framework="pt") as f:
            metadata[file] = f.metadata()
            for name in f.keys():
                piece = f.get_slice(name)
                shapes[name] = tuple(piece.get_shape())
                dtypes[name] = _DTYPES[piece.get_dtype()]
                weight_files.setdefault(name, file)
    norm_stats = dict(config.get("norm_stats") or {})
    statistics_file = (root / STATISTICS).is_file()
    if statistics_file:
        # a fine-tuned checkpoint's statistics (OpenVLA's finetune.py writes this file; its
        # eval code loads it as the model's norm_stats)
        norm_stats.update(json.loads((root / STATISTICS).read_text()))
    if not norm_stats:
        raise ConfigError("policy.checkpoint", str(path), f"no action statistics: neither {STATISTICS} nor norm_stats in config.json (the un-normalization of actions needs them)")
    return OpenVLACheckpoint(root, config, weight_files, shapes, dtypes, metadata, norm_stats, statistics_file)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool, "U8": torch.uint8}


def action_statistics(norm_stats: dict, unnorm_key: str | None) -> tuple[str, dict]:
    """(key, the ``action`` statistics) of the dataset ``unnorm_key`` names (the only one when
    it is null)."""
    keys = sorted(norm_stats)
    if unnorm_key is None:
        if len(keys) != 1:
            raise ConfigError("policy.unnorm_key", None, f"the checkpoint holds statistics of {len(keys)} datasets; name one of: {', '.join(keys)}")
        unnorm_key = keys[0]
    if unnorm_key not in norm_stats:
        raise ConfigError("policy.unnorm_key", unnorm_key, f"not in the checkpoint's statistics; they hold: {', '.join(keys)}")
    stats = norm_stats[unnorm_key].get("action") if isinstance(norm_stats[unnorm_key], dict) else None
    if not stats or "q01" not in stats or "q99" not in stats:
        raise ConfigError("policy.unnorm_key", unnorm_key, "its statistics have no action q01/q99 (needed to un-normalize the actions)")
    return unnorm_key, stats


def write_checkpoint(source: OpenVLACheckpoint, tensors: dict[str, torch.Tensor], out) -> Path:
    """Write ``tensors`` (named as in the source) in the source's layout: the same files
    (shards and index), each tensor in the dtype the source stored it in, the same
    safetensors metadata; every other file of the source (config, tokenizer, processor,
    statistics, the checkpoint's own code) copied as it is."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    missing = sorted(set(source.weight_files) - set(tensors))
    extra = sorted(set(tensors) - set(source.weight_files))
    if missing or extra:
        raise ValueError(f"the weights do not match the checkpoint's layout: missing {missing[:5]}, unexpected {extra[:5]}")
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, file in source.weight_files.items():
        by_file.setdefault(file, {})[name] = tensors[name].detach().to("cpu", source.dtypes[name]).contiguous()
    for file, part in by_file.items():
        save_file(part, str(out / file), metadata=source.file_metadata.get(file))
    weights = set(source.weight_files.values())
    for item in source.path.iterdir():
        if item.name in weights:
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    return out
