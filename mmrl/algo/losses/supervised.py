"""Supervised loss modules: ``sft`` (the policy's own supervised loss on a data source's
batch) and ``self_imitation`` (Oh et al., 2018: imitate the decisions whose advantage was
positive, ``mmrl/train/self_imitation.py`` keeps the memory they are drawn from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mmrl import registry
from mmrl.algo.losses import Loss, LossConfig, LossOutput, Targets
from mmrl.config import option
from mmrl.core.policy import overrides
from mmrl.errors import ConfigError


@dataclass
class SFTLossConfig(LossConfig):
    type: str = option("sft", "the loss module (mmrl list losses)")


@registry.LOSSES.register("sft", SFTLossConfig)
class SFT(Loss):
    """The policy's own supervised loss (flow matching, token cross-entropy) on a batch."""

    def __init__(self, algo, options: LossConfig, policy, **_):
        pass

    def __call__(self, model, batch, targets: Targets | None, norm: dict, at_sampling_weights: bool = False) -> LossOutput:
        """``batch`` is a data source's batch (what ``policy.sft_loss`` reads); the policy's
        loss is already a mean over it."""
        loss = model(batch, mode="sft")
        return LossOutput(loss, {"loss/sft": loss.detach()})


@dataclass
class SelfImitationLossConfig(LossConfig):
    type: str = option("self_imitation", "the loss module (mmrl list losses)")
    loss: Literal["logp", "sft"] = option("logp", "-A+ logpi of the decisions, or the policy's supervised loss on their executed actions weighted by A+")


@registry.LOSSES.register("self_imitation", SelfImitationLossConfig)
class SelfImitation(Loss):
    """Imitate the decisions with a positive advantage (by log-prob or supervised loss).

    ``-sum(A+ m logpi) / count``, or ``sum(A+ l) / sum(A+)`` with ``l`` the policy's
    supervised loss of each decision's executed chunk (``policy.imitation_batch``)."""

    zero_at_zero_advantage = True

    def __init__(self, algo, options: LossConfig, policy, field: str = "algo.loss.loss", **_):
        self.kind, self.policy = options.loss, policy
        self.count_floor = 1e-8 if self.kind == "sft" else 1.0  # the normalizer's floor: an advantage mass, or a count
        if self.kind == "sft" and not overrides(policy, "imitation_batch"):
            raise ConfigError(field, "sft", f"policy {type(policy).__name__} cannot turn its replay into a supervised batch; use logp")

    def counts(self, batch, targets: Targets) -> torch.Tensor:
        """This process's part of the loss's normalizer (summed over processes and floored at
        ``count_floor`` by the caller): the valid decisions (``logp``) or the advantage mass
        (``sft``)."""
        adv = targets.adv.clamp_min(0)
        return (adv * batch.mask).sum() if self.kind == "sft" else batch.mask.sum()

    def __call__(self, model, batch, targets: Targets, norm: dict, at_sampling_weights: bool = False) -> LossOutput:
        """``norm["count"]``: the normalizer over the whole batch and all processes, divided
        by the number of processes (:meth:`counts`)."""
        adv, count = targets.adv.clamp_min(0), norm["count"]
        if self.kind == "logp":
            loss = -(adv * batch.mask * model(batch.replay)).sum() / count
        else:
            loss = self.weighted_sft(model, batch.replay, adv * batch.mask, count)
        return LossOutput(loss, {"loss/self_imitation": loss.detach()})

    def weighted_sft(self, model, replay: dict, weight: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """``sum(w l) / count`` over the decisions with weight w > 0."""
        flat = self.policy.imitation_batch(replay)
        w = weight.reshape(-1)
        rows = (w > 0).nonzero().squeeze(1)
        if rows.numel() == 0:  # nothing to imitate here: a zero-weighted forward keeps the processes in step
            sub = {k: ([v[0]] if isinstance(v, list) else v[:1]) for k, v in flat.items()}
            sub["action_mask"] = torch.ones_like(sub["action_mask"], dtype=torch.float32) if "action_mask" in sub else torch.ones(1, sub["actions"].shape[1])
            return 0.0 * model(sub, mode="sft")
        sub = {k: ([v[i] for i in rows.tolist()] if isinstance(v, list) else v[rows.to(v.device)]) for k, v in flat.items()}
        kept = w[rows]
        # sft_loss is the mean over its action_mask; weights scaled to a mean of 1 make it the
        # weighted mean sum(w l) / sum(w) (a mask summing below 1 would be clamped), then
        # rescale to ``count``
        sub["action_mask"] = (kept / kept.mean())[:, None].expand(-1, sub["actions"].shape[1])
        return model(sub, mode="sft") * (kept.sum() / count)
