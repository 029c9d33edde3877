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
Models whose rotary positions depend on the image layout (Qwen2-VL's multimodal RoPE) are not
supported: positions here count each row's tokens, as text_lm's do.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mmrl.data.prompts import ImagePrompt
from mmrl.errors import ConfigError
from mmrl.policies.text_lm.model import TextLMPolicy, _transformers, resolve_model_path, tiny_decoder_config
from mmrl.policies.text_lm.tokenizer import TURN_END, TURN_START, byte_tokenizer
from mmrl.policies.text_vlm.config import TextVLMConfig
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
_TOKEN_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def _without_dropout(model_config) -> None:
    """Zero every dropout probability of a transformers config and of its sub-configs (the
    vision tower's, the decoder's)."""
    base = _transformers().PretrainedConfig
    for name, value in list(vars(model_config).items()):
        if isinstance(value, base):
            _without_dropout(value)
        elif ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            setattr(model_config, name, 0.0)


def _tiny_model(config: TextVLMConfig, dtype: torch.dtype):
    """(processor, random tiny LLaVA): CLIP vision tower + projector + the ``tiny`` decoder."""
    tf = _transformers()
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
        _without_dropout(model_config)
    model = tf.LlavaForConditionalGeneration._from_config(model_config, attn_implementation=config.attn_implementation, dtype=dtype)
    return processor, model


def _pretrained_model(config: TextVLMConfig, dtype: torch.dtype):
    """(processor, model) from the ``save_pretrained`` directory ``model_path``."""
    tf = _transformers()
    path = resolve_model_path(config.model_path)
    if not path.is_dir():
        raise ConfigError("policy.model_path", config.model_path, "expected a local directory holding a transformers vision-language model and its processor (save_pretrained)")
    # local_files_only: a directory name that looks like a hub id must never start a download
    model_config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    if config.disable_dropout:
        _without_dropout(model_config)
    model = tf.AutoModelForImageTextToText.from_pretrained(path, config=model_config, dtype=dtype, attn_implementation=config.attn_implementation, local_files_only=True)
    if hasattr(getattr(model, "model", model), "get_rope_index"):  # Qwen2-VL and its kin compute 3-D positions from the image layout
        raise ConfigError("policy.model_path", config.model_path, f"holds a {model_config.model_type} model, whose rotary positions follow the image layout (multimodal RoPE); text_vlm takes models with 1-D positions (the LLaVA family)")
    processor = tf.AutoProcessor.from_pretrained(path, local_files_only=True)
    if getattr(processor, "image_token", None) is None or not hasattr(processor, "tokenizer"):
        raise ConfigError("policy.model_path", config.model_path, f"its processor ({type(processor).__name__}) has no image token and tokenizer; expected a vision-language processor")
    return processor, model


@POLICIES.register("text_vlm", config=TextVLMConfig)
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
        """The model's image encoder (with its adapters, under LoRA)."""
        return self.language_model.model.vision_tower

    # ------------------------------------------------------------------ prompts -> model inputs

    def _prompt_text(self, text: str, num_images: int) -> str:
        """The prompt as the processor takes it: one image placeholder per image before the
        text, inside the user turn with ``chat_template``."""
        generation = self.config.generation
        if not generation.chat_template:
            return self.processor.image_token * num_images + text
        system = [{"role": "system", "content": [{"type": "text", "text": generation.system_prompt}]}] if generation.system_prompt is not None else []
        user = {"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}
        return self.processor.apply_chat_template([*system, user], tokenize=False, add_generation_prompt=True)

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
        for name, value in encoded.items():
            if name in _TOKEN_OUTPUTS:
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
            encoded = self.processor(text=[self.processor.image_token], images=[blank], return_tensors="pt")
            self._image_output_shapes = {name: (tuple(v.shape[1:]), v.dtype) for name, v in encoded.items() if name not in _TOKEN_OUTPUTS}
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
        logits = super().forward_logits(ids, mask, cache=cache, logits_to_keep=logits_to_keep, **model_inputs)
        # the image placeholder gets probability 0 in every pass, sampling and log_prob alike
        return logits.index_fill(-1, self._placeholder_ids.to(logits.device), float("-inf"))
