"""Gaussian MLP policy: actions (or action chunks) ~ N(MLP(obs), diag(std^2))."""

from mmrl.policies.gaussian_mlp.config import GaussianMLPConfig
from mmrl.policies.gaussian_mlp.model import GaussianMLPPolicy

__all__ = ["GaussianMLPConfig", "GaussianMLPPolicy"]
