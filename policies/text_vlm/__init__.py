"""Vision-language policies: ``text_vlm``, text_lm over a transformers image-text-to-text model
and its processor (docs/text.md, "Vision-language models")."""

from mmrl.policies.text_vlm.config import TextVLMConfig, TinyVisionConfig
from mmrl.policies.text_vlm.model import TextVLMPolicy  # registers text_vlm

__all__ = ["TextVLMConfig", "TextVLMPolicy", "TinyVisionConfig"]
