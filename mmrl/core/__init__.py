from mmrl.core.policy import Policy, PolicyModule, Sample, build_policy, load_pretrained, save_pretrained
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import Sampler, group_seed

__all__ = ["build_policy", "load_pretrained", "save_pretrained", "Policy", "PolicyModule", "Rollout", "Sample", "Sampler", "group_seed"]
