"""``text_vlm``: a vision-language policy, ``text_lm`` over a transformers image-text-to-text
model (LLaVA family) and its processor.

Everything of ``text_lm`` carries over — one decision is one completion token; the decoding
loop, the generation backends, the sampling distribution (temperature, top-p) and its
log-probs, stop strings, LoRA with the adapter-disabled reference, ``sft_loss`` — because
this policy only changes how prompts become model inputs. A prompt is a string or an
:class:`~mmrl.data.prompts.ImagePrompt` (a text and its images, a video's frames being
several images). The processor puts the model's image placeholder before the text (one per
image, inside the user turn with ``generation.chat_template``), expands each placeholder to
the image's tokens and turns the images into pixel values. The replay holds, beside
``text_lm``'s token ids and masks,

    pixel_values [B, K, ...]   each row's images as the processor made them (K = most images of a row; zero padding)
    image_count [B]            how many of a row's K are images

and every pass over a prompt (the decoding loop's first step, ``log_prob``) hands the model
the valid images in row order, where the model's image tokens take their features. So
``log_prob(replay)`` repeats the sampling pass exactly: the ratio is 1 before an update.

Weights: ``model_path`` loads a local ``save_pretrained`` directory of the model and its
processor; otherwise a tiny LLaVA is built from a ``transformers`` config with random weights:
a CLIP vision tower (``vision``), LLaVA's projector and the decoder of ``tiny``, with
text_lm's byte-level tokenizer plus an ``<image>`` token and a CLIP image processor.
Positions count each row's tokens, as text_lm's do, except for models whose rotary positions
follow the image layout (Qwen2-VL and Qwen2.5-VL's multimodal RoPE): there a whole sequence
gets the model's own ``get_rope_index`` positions, and a token decoded after the cached prompt
continues its row's text positions by the offset the prompt's images left (kept with the
cache). Their processor wants a video processor, which needs torchvision; without it the
image processor and tokenizer are put together without one.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mmrl.data.prompts import ImagePrompt
from mmrl.errors import ConfigError
from mmrl.policies.hf import require_transformers, without_dropout
from mmrl.policies.text_lm.model import TextLMPolicy, resolve_model_path, tiny_decoder_config
from mmrl.policies.text_vlm.config import TextVLMConfig
from mmrl.policies.tiny_tokenizers import TURN_END, TURN_START, byte_tokenizer
from mmrl.registry import POLICIES

IMAGE_TOKEN = "<image>"

# ChatML whose user turns may be lists of parts: {"type": "image"} becomes the image token
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    f"{TURN_START}{{{{ message['role'] }}}}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    f"{{% if part['type'] == 'image' %}}{IMAGE_TOKEN}{{% else %}}{{{{ part['text'] }}}}{{% endif %}}"
    "{% endfor %}{% endif %}"
    f"{TURN_END}\n"
    "{% endfor %}"
    f"{{% if add_generation_prompt %}}{TURN_START}assistant\n{{% endif %}}"
)

# outputs of a processor that are token-level, not per image
TOKEN_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def per_image(encoded, num_images: int) -> dict:
    """The processor's outputs with one entry per image: Qwen2-VL's processor gives the
    patches of all images as one [Σ patches, D] tensor beside ``image_grid_thw`` [images, 3];
    they are split per image (t·h·w patches each) and zero-padded to the longest."""
    encoded = dict(encoded)
    if "image_grid_thw" in encoded and "pixel_values" in encoded:
        sizes = encoded["image_grid_thw"].prod(-1).tolist()
        pieces = encoded["pixel_values"].split(sizes)
        padded = encoded["pixel_values"].new_zeros((num_images, max(sizes), encoded["pixel_values"].shape[-1]))
        for i, piece in enumerate(pieces):
            padded[i, : piece.shape[0]] = piece
        encoded["pixel_values"] = padded
    return encoded


def _tiny_model(config: TextVLMConfig, dtype: torch.dtype):
    """(processor, random tiny LLaVA): CLIP vision tower + projector + the ``tiny`` decoder."""
    tf = require_transformers("text", "the text policy")
    vision = config.vision
    tokenizer = byte_tokenizer((IMAGE_TOKEN,))
    # transformers 5 names the Pillow (no torchvision) variant apart
    image_processor_class = getattr(tf, "CLIPImageProcessorPil", None) or tf.CLIPImageProcessor
    image_processor = image_processor_class(size={"shortest_edge": vision.image_size}, crop_size={"height": vision.image_size, "width": vision.image_size})
    processor = tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vision.patch_size,
        vision_feature_select_strategy="default",  # the CLS token is dropped: one token per patch
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    vision_config = tf.CLIPVisionConfig(
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        num_hidden_layers=vision.num_layers,
        num_attention_heads=vision.num_heads,
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        projection_dim=vision.hidden_size,
    )
    model_config = tf.LlavaConfig(
        vision_config=vision_config,
        text_config=tiny_decoder_config(config.tiny, tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=vision.image_tokens,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=config.tiny.tie_word_embeddings,
    )
    if config.disable_dropout:
        without_dropout(model_config)
    model = tf.LlavaForConditionalGeneration._from_config(model_config, attn_implementation=config.attn_implementation, dtype=dtype)
    return processor, model


def _pretrained_model(config: TextVLMConfig, dtype: torch.dtype):
    """(processor, model) from the ``save_pretrained`` directory ``model_path``."""
    tf = require_transformers("text", "the text policy")
    path = resolve_model_path(config.model_path)
    if not path.is_dir():
        raise ConfigError("policy.model_path", config.model_path, "expected a directory holding a transformers vision-language model and its processor (save_pretrained)")
    # local_files_only: the directory is resolved (mmrl.hub); transformers must not look further
    model_config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    if config.disable_dropout:
        without_dropout(model_config)
    model = tf.AutoModelForImageTextToText.from_pretrained(path, config=model_config, dtype=dtype, attn_implementation=config.attn_implementation, local_files_only=True)
    try:
        processor = tf.AutoProcessor.from_pretrained(path, local_files_only=True)
    except (AttributeError, ImportError, OSError, TypeError, ValueError):
        if model_config.model_type not in _QWEN_PROCESSORS:
            raise
        processor = _image_only_processor(tf, model_config.model_type, path)
    if getattr(processor, "image_token", None) is None or not hasattr(processor, "tokenizer"):
        raise ConfigError("policy.model_path", config.model_path, f"its processor ({type(processor).__name__}) has no image token and tokenizer; expected a vision-language processor")
    return processor, model


# Qwen2-VL's processor also wants a video processor, which needs torchvision; images alone do not
_QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


def _image_only_processor(tf, model_type: str, path):
    """The family's processor over its tokenizer and image processor, without the video
    processor (Qwen2-VL's needs torchvision, which mmrl does not install)."""
    base = getattr(tf, _QWEN_PROCESSORS[model_type])

    class ImageOnly(base):
        def check_argument_for_proper_class(self, attribute_name, arg):
            if arg is None:  # no video processor
                return None
            return super().check_argument_for_proper_class(attribute_name, arg)

    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return ImageOnly(image_processor=tf.AutoImageProcessor.from_pretrained(path, local_files_only=True), tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template)


class _MultimodalRopeCache:
    """A key/value cache that also keeps each row's multimodal-position offset: how far the
    (time, height, width) positions of its prompt's last token run ahead of its count of
    tokens. A decoded token's three positions are its count plus that offset."""

    def __init__(self, cache):
        self.cache, self.rope_deltas = cache, None

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def reorder_cache(self, rows: Tensor) -> None:
        self.cache.reorder_cache(rows)
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas[rows.to(self.rope_deltas.device)]


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {  # paths are relative to the repository root, as in configs/
        "sampler": {"type": "prompt", "data": {"train": "examples/shapes_qa/held_out.jsonl"}},
        "policy": {"type": "text_vlm", "tiny": {"hidden_size": 16, "num_heads": 2, "intermediate_size": 32}, "generation": {"max_new_tokens": 4}},
        "rewards": [{"type": "exact_match"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": (
        "the old log-probs are deferred (the trainer's ratio is exactly 1); the provisional numbers are the key/value-cache decoding "
        "loop's, which sums each token's float32 logits in another order than log_prob's one teacher-forced pass: docs/text.md "
        "bounds the difference by 1e-4 per token (a decision). Measured: 0 to 9.5e-7 over seeds 0-4 under ATEN_CPU_CAPABILITY "
        "default, avx2 and avx512"
    ),
}


@POLICIES.register("text_vlm", config=TextVLMConfig, contract=CONTRACT)
class TextVLMPolicy(TextLMPolicy):
    """Completions of text prompts with images by a transformers vision-language model; samples,
    log-probs, LoRA and backends as ``text_lm`` (module docstring)."""

    config: TextVLMConfig

    def __init__(self, config: TextVLMConfig, spec: dict):
        super().__init__(config, spec)
        # placeholders stand for images in prompts; a completion must never produce one
        placeholders = {self.tokenizer.convert_tokens_to_ids(self.processor.image_token), getattr(self.language_model.config, "image_token_id", None)}
        self._image_output_shapes = None
        self._placeholder_ids = torch.tensor(sorted(i for i in placeholders if i is not None), dtype=torch.long)
        if config.freeze_vision_tower:
            for param in self.vision_tower.parameters():
                param.requires_grad_(False)

    def _build_model(self, config: TextVLMConfig):
        dtype = getattr(torch, config.dtype)
        self.processor, model = _tiny_model(config, dtype) if config.model_path is None else _pretrained_model(config, dtype)
        self.processor.tokenizer.padding_side = "left"
        return self.processor.tokenizer, model

    def _has_chat_template(self) -> bool:
        return bool(self.processor.chat_template)

    @property
    def vision_tower(self) -> torch.nn.Module:
        """The model's image encoder (with its adapters, under LoRA): LLaVA's ``vision_tower``,
        Qwen2-VL's ``visual``, Idefics3's ``vision_model``."""
        base = self.language_model.model
        return next(getattr(base, name) for name in ("vision_tower", "visual", "vision_model") if getattr(base, name, None) is not None)

    # ------------------------------------------------------------------ prompts -> model inputs

    def _rope_positions(self, ids: Tensor, mask: Tensor, cache, image_grid_thw: Tensor | None) -> Tensor:
        """Qwen2-VL's (time, height, width) positions [3, N, S] of ``ids``: the model's own
        ``get_rope_index`` over a whole sequence (its image tokens at their grid cells, the
        text after an image continuing from the image's largest position); a token decoded
        after a cached prompt continues its row's text positions by the prompt's offset."""
        counts = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0:
            image_id = int(self.language_model.config.image_token_id)
            token_type = (ids == image_id).int()
            positions, deltas = self.language_model.model.get_rope_index(ids, token_type, image_grid_thw=image_grid_thw, attention_mask=mask[:, -ids.shape[1] :].long())
            if isinstance(cache, _MultimodalRopeCache):
                cache.rope_deltas = deltas.view(-1).to(ids.device)
            return positions
        deltas = cache.rope_deltas if isinstance(cache, _MultimodalRopeCache) and cache.rope_deltas is not None else torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
        return (counts + deltas[:, None]).unsqueeze(0).expand(3, -1, -1)

    def _prompt_text(self, text: str, num_images: int) -> str:
        """The prompt as the processor takes it: one image placeholder per image before the
        text, inside the user turn with ``chat_template``."""
        generation = self.config.generation
        if not generation.chat_template:
            return self._image_placeholder() * num_images + text
        system = [{"role": "system", "content": [{"type": "text", "text": generation.system_prompt}]}] if generation.system_prompt is not None else []
        user = {"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}
        return self.processor.apply_chat_template([*system, user], tokenize=False, add_generation_prompt=True)

    def _image_placeholder(self) -> str:
        """What stands for one image in a prompt without a chat template: the processor's
        image token, between the vision start and end tokens for models that have them."""
        config = self.language_model.config
        start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
        if start is None or end is None:
            return self.processor.image_token
        return self.tokenizer.convert_ids_to_tokens(int(start)) + self.processor.image_token + self.tokenizer.convert_ids_to_tokens(int(end))

    @property
    def _multimodal_rope(self) -> bool:
        return hasattr(self.language_model.model, "get_rope_index")

    def new_cache(self):
        cache = super().new_cache()
        return _MultimodalRopeCache(cache) if self._multimodal_rope else cache

    def _encode_inputs(self, inputs) -> tuple[list[list[int]], dict[str, Tensor]]:
        """Token ids of each prompt (image placeholders expanded) and the image tensors, one
        row per prompt: ``pixel_values`` [B, K, ...] (zero rows past a prompt's images) and
        ``image_count`` [B]; K = 0 when no prompt of the batch has images."""
        if isinstance(inputs, (str, ImagePrompt)) or not isinstance(inputs, (list, tuple)) or not all(isinstance(p, (str, ImagePrompt)) for p in inputs):
            raise ConfigError("policy.type", self.config.type, f"takes a list of prompts, each a string or an ImagePrompt (sampler.type: prompt with text prompts and an image_field), got {type(inputs).__name__}")
        prompts = [p if isinstance(p, ImagePrompt) else ImagePrompt(p, ()) for p in inputs]
        images = [image for p in prompts for image in p.images]
        encoded = self.processor(
            text=[self._prompt_text(p.text, len(p.images)) for p in prompts],
            images=images or None,
            padding=True,
            return_tensors="pt",
            add_special_tokens=not self.config.generation.chat_template,  # a chat template supplies its own
        )
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        for i, seq in enumerate(prompt_ids):
            if not seq:
                raise ValueError(f"prompt {i} ({prompts[i].text!r}) encodes to no tokens: a completion needs at least one token to follow")
        if not images:  # tensors of width 0, so that the replay has the keys of a call with images
            empty = {name: torch.zeros((len(prompts), 0, *shape), dtype=dtype) for name, (shape, dtype) in self._image_outputs().items()}
            return prompt_ids, {"image_count": torch.zeros(len(prompts), dtype=torch.long), **empty}
        counts = torch.tensor([len(p.images) for p in prompts], dtype=torch.long)
        starts = (counts.cumsum(0) - counts).tolist()
        width = int(counts.max())
        model_inputs = {"image_count": counts}
        encoded = per_image(encoded, len(images))
        for name, value in encoded.items():
            if name in TOKEN_OUTPUTS:
                continue
            if not isinstance(value, Tensor) or value.shape[0] != len(images):
                raise ValueError(f"the processor's output {name!r} is not one entry per image ({len(images)} images); text_vlm takes processors that make per-image tensors (LLaVA family)")
            rows = value.new_zeros((len(prompts), width, *value.shape[1:]))
            for row, (start, count) in enumerate(zip(starts, counts.tolist())):
                rows[row, :count] = value[start : start + count]
            model_inputs[name] = rows
        return prompt_ids, model_inputs

    def _image_outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of one image's entry in each per-image output of the processor
        (found once, on a blank image)."""
        if self._image_output_shapes is None:
            blank = np.zeros((64, 64, 3), dtype=np.uint8)
            encoded = per_image(self.processor(text=[self._image_placeholder()], images=[blank], return_tensors="pt"), 1)
            self._image_output_shapes = {name: (tuple(v.shape[1:]), v.dtype) for name, v in encoded.items() if name not in TOKEN_OUTPUTS}
        return self._image_output_shapes

    def forward_logits(self, ids: Tensor, mask: Tensor, cache=None, logits_to_keep: int = 0, image_count: Tensor | None = None, **image_inputs) -> Tensor:
        """``text_lm``'s :meth:`forward_logits`; ``image_count`` [N] and the per-row image
        tensors [N, K, ...] (a replay's) are handed to the model as its valid images in row
        order, the order of the image tokens in ``ids``. The image placeholder's logit is −inf:
        sampled in a completion, it would be taken for an image slot."""
        model_inputs = {}
        if image_count is not None and int(image_count.sum()) > 0:
            width = next(iter(image_inputs.values())).shape[1]
            valid = torch.arange(width, device=image_count.device)[None, :] < image_count[:, None]
            dtype = next(self.vision_tower.parameters()).dtype
            for name, value in image_inputs.items():
                value = value[valid.to(value.device)]
                model_inputs[name] = value.to(dtype) if value.is_floating_point() else value
            if "image_grid_thw" in model_inputs:  # back to Qwen2-VL's [Σ patches, D]
                sizes = model_inputs["image_grid_thw"].prod(-1).tolist()
                model_inputs["pixel_values"] = torch.cat([v[:size] for v, size in zip(model_inputs["pixel_values"], sizes)])
        position_ids = None
        if self._multimodal_rope:
            position_ids = self._rope_positions(ids, mask, cache, model_inputs.get("image_grid_thw"))
            if isinstance(cache, _MultimodalRopeCache):
                cache = cache.cache
        logits = super().forward_logits(ids, mask, cache=cache, logits_to_keep=logits_to_keep, position_ids=position_ids, **model_inputs)
        # the image placeholder gets probability 0 in every pass, sampling and log_prob alike
        return logits.index_fill(-1, self._placeholder_ids.to(logits.device), float("-inf"))
