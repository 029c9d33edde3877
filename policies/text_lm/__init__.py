"""Text policies: ``text_lm``, any transformers causal LM and its tokenizer (docs/text.md)."""

from mmrl.policies.text_lm.config import GenerationOptions, LoraOptions, TextLMConfig, TinyLMConfig
from mmrl.policies.text_lm.generation import BuiltinBackend, Generation, GenerationBackend, SamplingOptions
from mmrl.policies.text_lm.model import TextLMPolicy  # registers text_lm

__all__ = [
    "BuiltinBackend",
    "Generation",
    "GenerationBackend",
    "GenerationOptions",
    "LoraOptions",
    "SamplingOptions",
    "TextLMConfig",
    "TextLMPolicy",
    "TinyLMConfig",
]
