"""A tiny random OpenVLA checkpoint in the released Hugging Face layout.

Everything a real ``openvla/openvla-7b`` directory holds, at a size a CPU test runs in a
second: ``config.json`` (model_type ``openvla``, a DINOv2 + SigLIP fused backbone, a Llama
``text_config`` given as a diff against Llama-2's defaults, ``norm_stats``), the weights in
bf16 (one ``model.safetensors``, or shards with their index), a Llama-style tokenizer (``<s>``
prepended, SentencePiece's ``▁`` word boundary, ``<PAD>`` added after the base vocabulary,
the embedding padded to a multiple of 64), ``preprocessor_config.json`` and
``dataset_statistics.json`` with two datasets. The tokenizer is character-level: every
printable ASCII character and ``▁`` is a token, the rest of the base vocabulary is filler
whose top 256 ids are the action tokens, as in Llama-2's vocabulary.

    python -m mmrl.policies.openvla.tiny --out checkpoints/tiny_openvla
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch

from mmrl.policies.openvla.checkpoint import INDEX, SINGLE, STATISTICS, VISION_BACKBONES
from mmrl.policies.vla.prismatic_vision import TIMM_VITS, PrismaticProjector, PrismaticViT, ViTSize

BASE_VOCAB = 512
PAD_TO_MULTIPLE = 64
VISION_BACKBONE = "dinosiglip-vit-so-224px"
STATISTICS_DATA = {
    "tabletop": {
        "action": {"mean": [0.0, 0.05], "std": [0.5, 0.4], "max": [1.0, 1.0], "min": [-1.0, -1.0], "q01": [-0.8, -0.9], "q99": [0.9, 0.7], "mask": [True, True]},
        "proprio": {"mean": [0.0] * 4, "std": [1.0] * 4, "max": [1.0] * 4, "min": [-1.0] * 4, "q01": [-1.0] * 4, "q99": [1.0] * 4},
        "num_transitions": 1000, "num_trajectories": 50,
    },
    "bridge_orig": {
        "action": {
            "mean": [0.0] * 7, "std": [0.01] * 7, "max": [0.4] * 6 + [1.0], "min": [-0.4] * 6 + [0.0],
            "q01": [-0.03, -0.04, -0.03, -0.08, -0.09, -0.13, 0.0], "q99": [0.03, 0.04, 0.04, 0.08, 0.08, 0.13, 1.0],
            "mask": [True, True, True, True, True, True, False],
        },
        "proprio": {"mean": [0.0] * 7, "std": [1.0] * 7, "max": [1.0] * 7, "min": [-1.0] * 7, "q01": [-1.0] * 7, "q99": [1.0] * 7},
        "num_transitions": 2000, "num_trajectories": 60,
    },
}


def tiny_tokenizer():
    """A Llama-like fast tokenizer over characters (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = ["<unk>", "<s>", "</s>", "▁", *[c for c in string.printable if c not in " \t\r\x0b\x0c"]]
    symbols += [f"<x{i:03d}>" for i in range(BASE_VOCAB - len(symbols))]
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<PAD>", padding_side="right")


def randomize(module: torch.nn.Module, generator: torch.Generator, scale: float) -> None:
    """Overwrite ``module``'s weights from ``generator``: layer scales in [0.5, 1], norm weights
    near 1, the rest normal with standard deviation ``scale``."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("scale_factor"):
                p.copy_(0.5 + 0.5 * torch.rand(p.shape, generator=generator))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=generator))


def write_tiny_openvla(out, seed: int = 0, image_size: int = 28, patch_size: int = 7, vision_dim: int = 32, vision_depth: int = 3,
                       hidden_size: int = 32, num_layers: int = 2, num_heads: int = 2, shards: int = 1,
                       resize_strategy: str = "resize-naive", statistics: dict | None = None) -> Path:
    """Write a tiny random OpenVLA checkpoint into ``out`` (see the module docstring); with
    ``shards`` > 1 its weights are split into that many files with an index. ``statistics``
    ({dataset name: {"action": ..., "proprio": ..., ...}}, as :data:`STATISTICS_DATA`) replaces
    the two default datasets in ``norm_stats`` and ``dataset_statistics.json`` (e.g. a 7-dim
    ``libero_spatial`` for a LIBERO-shaped checkpoint)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    statistics = STATISTICS_DATA if statistics is None else statistics
    g = torch.Generator().manual_seed(seed)
    grid = image_size // patch_size
    dino_id, siglip_id = VISION_BACKBONES[VISION_BACKBONE]
    dino = PrismaticViT(TIMM_VITS[dino_id], ViTSize(vision_dim, vision_depth, 2 * vision_dim, patch_size, grid), layer_scale=True)
    siglip = PrismaticViT(TIMM_VITS[siglip_id], ViTSize(vision_dim, vision_depth, 3 * vision_dim // 2, patch_size, grid, 3 * vision_dim // 2), layer_scale=False)
    projector = PrismaticProjector(True, 2 * vision_dim, hidden_size)
    for module in (dino, siglip, projector):
        randomize(module, g, 0.1)
    text_config = {
        "model_type": "llama", "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads, "max_position_embeddings": 512,
        "pad_token_id": BASE_VOCAB, "vocab_size": BASE_VOCAB + PAD_TO_MULTIPLE, "torch_dtype": "bfloat16",
    }
    torch.manual_seed(seed)
    language_model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in text_config.items() if k not in ("model_type", "torch_dtype")}, initializer_range=0.3))
    tensors = {}
    for prefix, module in (("vision_backbone.featurizer.", dino), ("vision_backbone.fused_featurizer.", siglip), ("projector.", projector), ("language_model.", language_model)):
        tensors.update({prefix + k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()})

    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
    else:
        weight_map, per = {}, -(-len(names) // shards)
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
            save_file(part, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

    config = {
        "arch_specifier": "no-align+fused-gelu-mlp",
        "architectures": ["OpenVLAForActionPrediction"],
        "auto_map": {"AutoConfig": "configuration_prismatic.OpenVLAConfig", "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction"},
        "hf_llm_id": "meta-llama/Llama-2-7b-hf",
        "image_resize_strategy": resize_strategy,
        "image_sizes": [image_size, image_size],
        "llm_backbone_id": "llama2-7b-pure",
        "llm_max_length": 2048,
        "model_type": "openvla",
        "n_action_bins": 256,
        "norm_stats": statistics,
        "output_projector_states": False,
        "pad_to_multiple_of": PAD_TO_MULTIPLE,
        "pad_token_id": BASE_VOCAB,
        "text_config": text_config,
        "timm_model_ids": [dino_id, siglip_id],
        "timm_override_act_layers": [None, None],
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_fused_vision_backbone": True,
        "vision_backbone_id": VISION_BACKBONE,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / STATISTICS).write_text(json.dumps(statistics, indent=2) + "\n")
    means, stds = [[0.485, 0.456, 0.406], [0.5, 0.5, 0.5]], [[0.229, 0.224, 0.225], [0.5, 0.5, 0.5]]
    # the saved tvf_* fields hold the DINOv2 statistics rounded to bf16, as the released files do
    rounded = [[float(torch.tensor(v).to(torch.bfloat16)) for v in row] for row in means], [[float(torch.tensor(v).to(torch.bfloat16)) for v in row] for row in stds]
    processor = {
        "auto_map": {"AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor", "AutoProcessor": "processing_prismatic.PrismaticProcessor"},
        "image_processor_type": "PrismaticImageProcessor",
        "image_resize_strategy": resize_strategy,
        "input_sizes": [[3, image_size, image_size]] * 2,
        "interpolations": ["bicubic", "bicubic"],
        "means": means,
        "stds": stds,
        "processor_class": "PrismaticProcessor",
        "tvf_crop_params": [{"output_size": [image_size, image_size]}] * 2,
        "tvf_do_letterbox": resize_strategy == "letterbox",
        "tvf_letterbox_fill": [int(x * 255) for x in means[1]] if resize_strategy == "letterbox" else None,
        "tvf_normalize_params": [{"inplace": False, "mean": m, "std": s} for m, s in zip(*rounded)],
        "tvf_resize_params": [{"antialias": True, "interpolation": 3, "max_size": None, "size": [image_size, image_size] if resize_strategy == "resize-naive" else image_size}] * 2,
        "use_fused_vision_backbone": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    tiny_tokenizer().save_pretrained(out)
    return out


def contract_checkpoint(directory) -> dict:
    """The contract's tiny OpenVLA (tests/policies/test_contract.py, ``prepare``): written under
    ``directory``; returns the policy overrides that name it."""
    out = write_tiny_openvla(Path(directory) / "openvla")
    return {"policy": {"checkpoint": str(out)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.policies.openvla.tiny", description="write a tiny random OpenVLA checkpoint (released Hugging Face layout)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args(argv)
    print(write_tiny_openvla(args.out, seed=args.seed, shards=args.shards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
