"""Core types: the policy protocol, rollouts, samplers, rewards, base configs, weight I/O.

Nothing here imports :mod:`mmrl.train`; the training loop builds on these, not the reverse.
"""

from mmrl.core.policy import Policy, PolicyModule, Sample
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import Sampler, group_seed
from mmrl.core.weights import build_policy, latest_checkpoint, load_pretrained, load_state, save_pretrained

__all__ = ["build_policy", "latest_checkpoint", "load_pretrained", "load_state", "save_pretrained", "Policy", "PolicyModule", "Rollout", "Sample", "Sampler", "group_seed"]
