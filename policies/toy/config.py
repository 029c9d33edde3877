"""Configs of the toy policies: a token sequence model and a small Gaussian denoising chain."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.denoising.options import DenoisingOptions
from mmrl.errors import ConfigError
from mmrl.core.component_config import PolicyConfig


@dataclass
class CategoricalSequenceConfig(PolicyConfig):
    """A tiny autoregressive token model: the stand-in for an LLM."""

    vocab_size: int = option(8, "number of token ids", ge=2)
    seq_len: int = option(6, "tokens generated per sample (the decisions)", ge=1)
    hidden: int = option(32, "width of the embeddings and the GRU state", ge=1)
    eos_token: int | None = option(None, "token id that ends a sample (null = always generate seq_len tokens)", ge=0)
    dtype: str = option("float32", "parameter precision; float64 checks the algorithm where float32 summation order would blur equality", choices=("float32", "float64"))

    def validate(self, path: str) -> None:
        if self.eos_token is not None and self.eos_token >= self.vocab_size:
            p = f"{path}." if path else ""
            raise ConfigError(p + "eos_token", self.eos_token, f"must be a token id in [0, vocab_size={self.vocab_size}) or null")


@dataclass
class GaussianChainConfig(PolicyConfig):
    """A tiny conditional denoising chain on mmrl.denoising: the stand-in for a diffusion/flow generator."""

    dim: int = option(1, "dimensions of the generated sample x_0", ge=1)
    hidden: int = option(32, "width of the denoiser MLP (even: sinusoidal time features)", ge=2)
    denoising: DenoisingOptions = option(
        factory=lambda: DenoisingOptions(transition="flow_sde", num_inference_steps=8, noise_level=0.7),
        doc="the denoising chain: transition, steps, which steps are the decisions, log-prob options",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.hidden % 2:
            raise ConfigError(p + "hidden", self.hidden, "must be even (sinusoidal time features)")
        self.denoising.validate(p + "denoising")
