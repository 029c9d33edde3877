"""Toy policies: ``categorical_sequence`` (tokens) and ``gaussian_chain`` (denoising steps)."""

from mmrl.policies.toy.config import CategoricalSequenceConfig, GaussianChainConfig
from mmrl.policies.toy.model import CategoricalSequencePolicy, GaussianChainPolicy  # registers both

__all__ = ["CategoricalSequenceConfig", "CategoricalSequencePolicy", "GaussianChainConfig", "GaussianChainPolicy"]
