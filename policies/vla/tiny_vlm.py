"""Tiny vision-language models of the transformers families a VLA can sit on, with random
weights, written as a ``save_pretrained`` directory (model + tokenizer + image processor).

They stand in for real checkpoints where none can be downloaded: the tests load one of each
family through ``policy.backbone.vlm_path`` exactly as a user's OpenVLA/π0/SmolVLA/Qwen2-VL
directory would be loaded, and the pretrained-backbone demo starts from one that mmrl then
pretrains on tabletop demonstrations.

Each family keeps its real structure at a tiny size: LLaVA (CLIP vision tower + MLP projector
+ Llama), Idefics3 and SmolVLM (SigLIP-style vision + pixel-shuffle connector + Llama),
PaliGemma (SigLIP + linear projector + Gemma), Qwen2-VL and Qwen2.5-VL (their ViT with 2×2
patch merging + a Qwen2 decoder with multimodal rotary positions). The tokenizer is mmrl's
byte-level one plus the family's special tokens; the image processors are the Pillow
variants (no torchvision needed).

    python -m mmrl.policies.vla.tiny_vlm --family paligemma --out checkpoints/tiny_paligemma
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mmrl.errors import ConfigError
from mmrl.policies.hf import require_transformers
from mmrl.policies.tiny_tokenizers import byte_tokenizer

FAMILY_TOKENS = {
    "llava": ("<image>",),
    "idefics3": ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"),
    "smolvlm": ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"),
    "paligemma": ("<image>", "<bos>"),
    "qwen2_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen2_5_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
}
FAMILIES = tuple(FAMILY_TOKENS)


@dataclass
class TinyVLMSize:
    """Sizes of a tiny VLM: the image it is built for, the vision tower and the decoder."""

    image_size: int = 32
    patch_size: int = 8
    vision_hidden_size: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128


def _transformers():
    return require_transformers("vla", "tiny vision-language models")


def build_tiny_vlm(family: str, size: TinyVLMSize | None = None, seed: int = 0):
    """(model, tokenizer, image processor) of a tiny random ``family`` VLM."""
    if family not in FAMILY_TOKENS:
        raise ConfigError("family", family, f"allowed: {', '.join(FAMILIES)}")
    tf = _transformers()
    s = size or TinyVLMSize()
    tokenizer = byte_tokenizer(FAMILY_TOKENS[family])
    ids = tokenizer.convert_tokens_to_ids
    vocab = len(tokenizer)
    head_dim = s.hidden_size // s.num_heads
    vision = dict(
        hidden_size=s.vision_hidden_size,
        intermediate_size=2 * s.vision_hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        image_size=s.image_size,
        patch_size=s.patch_size,
    )
    decoder = dict(
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_heads,
        head_dim=head_dim,
        intermediate_size=s.intermediate_size,
        vocab_size=vocab,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    patches = (s.image_size // s.patch_size) ** 2
    torch.manual_seed(seed)
    if family == "llava":
        image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": s.image_size}, crop_size={"height": s.image_size, "width": s.image_size})
        config = tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(projection_dim=s.hidden_size, **vision),
            text_config=tf.LlamaConfig(**decoder),
            image_token_id=ids("<image>"),
            image_seq_length=patches,
            vision_feature_select_strategy="default",
            vision_feature_layer=-1,
        )
        model = tf.LlavaForConditionalGeneration(config)
    elif family in ("idefics3", "smolvlm"):
        pil = tf.Idefics3ImageProcessorPil if family == "idefics3" else tf.SmolVLMImageProcessorPil
        image_processor = pil(do_image_splitting=False, size={"longest_edge": s.image_size}, max_image_size={"longest_edge": s.image_size})
        config_class = tf.Idefics3Config if family == "idefics3" else tf.SmolVLMConfig
        vision_class = tf.Idefics3VisionConfig if family == "idefics3" else tf.SmolVLMVisionConfig
        config = config_class(
            vision_config=vision_class(**vision).to_dict(), text_config=tf.LlamaConfig(**decoder).to_dict(), image_token_id=ids("<image>"), scale_factor=2
        )
        model = (tf.Idefics3ForConditionalGeneration if family == "idefics3" else tf.SmolVLMForConditionalGeneration)(config)
    elif family == "paligemma":
        image_processor = tf.SiglipImageProcessorPil(size={"height": s.image_size, "width": s.image_size})
        config = tf.PaliGemmaConfig(
            vision_config=tf.SiglipVisionConfig(projection_dim=s.hidden_size, **vision).to_dict(),
            text_config=tf.GemmaConfig(**decoder).to_dict(),
            image_token_id=ids("<image>"),
            projection_dim=s.hidden_size,
        )
        model = tf.PaliGemmaForConditionalGeneration(config)
    else:  # qwen2_vl, qwen2_5_vl
        pixels = s.image_size * s.image_size
        image_processor = tf.Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=s.patch_size, merge_size=2, temporal_patch_size=2)
        # mrope_section splits head_dim / 2 rotary frequencies over (time, height, width)
        half = head_dim // 2
        section = [half - 2 * (half // 3), half // 3, half // 3]
        text = dict(decoder, rope_scaling={"rope_type": "default", "mrope_section": section})
        tokens = dict(
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
        if family == "qwen2_vl":
            vision_config = dict(
                depth=s.num_layers, embed_dim=s.vision_hidden_size, hidden_size=s.hidden_size, num_heads=s.num_heads, mlp_ratio=2, patch_size=s.patch_size, spatial_merge_size=2
            )
            model = tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(vision_config=vision_config, text_config=text, **tokens))
        else:
            vision_config = dict(
                depth=s.num_layers,
                hidden_size=s.vision_hidden_size,
                out_hidden_size=s.hidden_size,
                intermediate_size=2 * s.vision_hidden_size,
                num_heads=s.num_heads,
                patch_size=s.patch_size,
                spatial_merge_size=2,
                window_size=4 * s.patch_size,
                fullatt_block_indexes=[s.num_layers - 1],
            )
            model = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(vision_config=vision_config, text_config=text, **tokens))
    return model.eval(), tokenizer, image_processor


def save_tiny_vlm(family: str, out: str | os.PathLike, size: TinyVLMSize | None = None, seed: int = 0) -> Path:
    """Build a tiny ``family`` VLM and write it, its tokenizer and its image processor into
    ``out`` with their ``save_pretrained``."""
    model, tokenizer, image_processor = build_tiny_vlm(family, size, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.policies.vla.tiny_vlm", description="write a tiny random VLM of a transformers family (save_pretrained directory)")
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    for name, value in vars(TinyVLMSize()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    args = parser.parse_args(argv)
    size = TinyVLMSize(**{name: getattr(args, name) for name in vars(TinyVLMSize())})
    print(save_tiny_vlm(args.family, args.out, size, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
