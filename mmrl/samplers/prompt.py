"""``prompt`` sampler: groups of G samples that share a condition (a prompt id).

The conditions are integers in [0, num_prompts); the policy maps them to whatever it
conditions on. Group g of step s gets prompt ``group_seed(seed, s, g) % num_prompts`` and a
generator seeded with ``group_seed(seed, s, g)``, so a rollout depends only on
(run seed, step, global group indices): one process collecting groups 0…7 gives exactly
what two processes collecting 0…3 and 4…7 give together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.config import option
from mmrl.core.policy import Policy, Sample
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import Sampler, group_seed
from mmrl.registry import SAMPLERS
from mmrl.core.config import SamplerConfig


@dataclass
class PromptSamplerConfig(SamplerConfig):
    """Prompt-conditioned generation: every group shares one prompt id."""

    num_prompts: int = option(4, "number of distinct prompt ids (conditions), drawn from [0, num_prompts)", ge=1)


def _device(policy: Policy) -> torch.device:
    param = next(iter(policy.parameters()), None) if isinstance(policy, nn.Module) else None
    return param.device if param is not None else torch.device("cpu")


def _rollout(sample: Sample, prompt: Tensor, group_id: Tensor) -> Rollout:
    logp = sample.logp
    mask = sample.mask.float() if sample.mask is not None else torch.ones_like(logp)
    return Rollout(
        group_id=group_id.to(logp.device),
        old_logp=logp,
        mask=mask,
        replay=sample.replay,
        entropy=sample.entropy,
        info={**sample.info, "prompt": prompt},
    )


@SAMPLERS.register("prompt", config=PromptSamplerConfig)
class PromptSampler(Sampler):
    """Groups of G samples per prompt id (conditions for text, denoising or toy policies)."""

    def __init__(self, sampler_cfg: PromptSamplerConfig, train_cfg):
        self.config = sampler_cfg
        self.train_cfg = train_cfg

    def policy_spec(self) -> dict:
        return {"num_prompts": self.config.num_prompts}

    @torch.no_grad()
    def collect(self, policy: Policy, num_groups: int, group_size: int, step: int, group_offset: int = 0) -> Rollout:
        device = _device(policy)
        rollouts = []
        for group in range(group_offset, group_offset + num_groups):
            seed = group_seed(self.train_cfg.seed, step, group)
            prompt = torch.full((group_size,), seed % self.config.num_prompts, dtype=torch.long, device=device)
            sample = policy.sample(prompt, torch.Generator().manual_seed(seed))
            rollouts.append(_rollout(sample, prompt, torch.full((group_size,), group, dtype=torch.long)))
        return Rollout.cat(rollouts)

    @torch.no_grad()
    def evaluate(self, policy: Policy, episodes: int, seed: int, rewards=None) -> dict[str, Any]:
        """``episodes`` deterministic samples (greedy / mean), prompts taken round-robin.

        ``reward_mean`` is the mean over samples of Σ_k weight_k · reward_k with the run's
        reward components; ``success_rate`` is reported when the policy's info has ``success``.
        """
        prompt = torch.arange(episodes, device=_device(policy)) % self.config.num_prompts
        sample = policy.sample(prompt, torch.Generator().manual_seed(seed), deterministic=True)
        rollout = _rollout(sample, prompt, torch.arange(episodes))
        reward = rewards.combine(rewards.score(rollout, policy=policy), rollout.group_id)
        metrics = {"reward_mean": reward.mean().item(), "episodes": episodes}
        if "success" in sample.info:
            metrics["success_rate"] = torch.as_tensor(sample.info["success"]).float().mean().item()
        return metrics
