"""Configs of the toy policies: a token sequence model and a 1-D Gaussian denoising chain."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.train.config import PolicyConfig


@dataclass
class CategoricalSequenceConfig(PolicyConfig):
    """A tiny autoregressive token model: the stand-in for an LLM."""

    vocab_size: int = option(8, "number of token ids", ge=2)
    seq_len: int = option(6, "tokens generated per sample (the decisions)", ge=1)
    hidden: int = option(32, "width of the embeddings and the GRU state", ge=1)
    eos_token: int | None = option(None, "token id that ends a sample (null = always generate seq_len tokens)", ge=0)

    def validate(self, path: str) -> None:
        if self.eos_token is not None and self.eos_token >= self.vocab_size:
            p = f"{path}." if path else ""
            raise ConfigError(p + "eos_token", self.eos_token, f"must be a token id in [0, vocab_size={self.vocab_size}) or null")


@dataclass
class GaussianChainConfig(PolicyConfig):
    """A tiny conditional denoising chain: the stand-in for a diffusion/flow generator."""

    dim: int = option(1, "dimensions of the generated sample x_0", ge=1)
    num_steps: int = option(8, "denoising transitions x_T -> ... -> x_0 (the decisions)", ge=1)
    hidden: int = option(32, "width of the denoiser MLP", ge=1)
    sigma_max: float = option(0.5, "std of the first (noisiest) transition", gt=0)
    sigma_min: float = option(0.05, "std of the last transition; stds are geometric in between", gt=0)

    def validate(self, path: str) -> None:
        if self.sigma_min > self.sigma_max:
            p = f"{path}." if path else ""
            raise ConfigError(p + "sigma_min", self.sigma_min, f"must be <= sigma_max ({self.sigma_max})")
