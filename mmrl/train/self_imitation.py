"""Self-imitation memory: the positive-advantage samples of past training steps.

Self-imitation learning (Oh et al., 2018, "Self-Imitation Learning") adds to the policy
gradient a term that imitates the agent's own past actions where they turned out better
than expected, ``-max(R - V, 0) * log pi(a|s)``. With group-relative advantages the group
mean is the baseline, so the term becomes ``-A+ * log pi`` over the decisions of past
samples whose advantage was positive (in a binary-success task: the successful episodes of
groups that also failed). Replayed experience of this kind is also the idea of ExGRPO
(Zhan et al., 2025) for LLM reasoning.

Why it helps where one batch is mostly noise: a policy-gradient step uses each sample
once, so the noise of every batch stays in the weights as a random walk; the imitation
term is a regression onto a growing set of good samples, whose fit averages their noise
out instead of accumulating it (``benchmarks/RESULTS.md``, tabletop section).

The memory keeps up to ``size`` samples (first in, first out) with their per-decision
advantages ``[N, T]`` (sequence advantages are broadcast over the sample's decisions) and
their training masks; only what the policy's ``log_prob`` needs (``replay``) and the mask
are kept. It is saved in checkpoints (unless ``algo.self_imitation.in_checkpoint`` is
false), so ``--resume`` continues with the same memory.

Two losses over a batch drawn from the memory (``algo.self_imitation.loss``):

- ``logp``: ``-sum(A+ m logpi) / count`` through the policy's ``log_prob``;
- ``sft``: the policy's own supervised loss (flow matching, token cross-entropy) on the
  executed action chunks of the decisions with A+ > 0, weighted by A+
  (``sum(A+ l) / count``), through ``policy.imitation_batch`` and ``policy.sft_loss``.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.core.rollout import Rollout


class SelfImitationMemory:
    def __init__(self, size: int):
        self.size = size
        self.data: Rollout | None = None
        self.adv: torch.Tensor | None = None  # [N, T], >= 0
        self.added = 0  # samples ever added (for the metrics)

    def __len__(self) -> int:
        return 0 if self.data is None else self.data.batch_size

    def add(self, rollout: Rollout, adv: torch.Tensor) -> int:
        """Keep the samples of ``rollout`` (its ``mask`` = the training mask) whose
        advantage is positive on some valid decision; returns how many were added."""
        rollout = rollout.to("cpu")
        adv = adv.detach().cpu().float()
        adv = adv[:, None].expand_as(rollout.mask) if adv.dim() == 1 else adv
        positive = adv.clamp_min(0) * rollout.mask
        rows = (positive > 0).any(1)
        n = int(rows.sum())
        if n == 0:
            return 0
        kept = rollout[rows]
        kept = Rollout(group_id=kept.group_id, old_logp=kept.old_logp, mask=kept.mask, replay=kept.replay)
        new_adv = positive[rows]
        if self.data is None:
            self.data, self.adv = kept, new_adv
        else:
            self.data = Rollout.cat([self.data, kept])
            width = self.data.mask.shape[1]
            old = torch.nn.functional.pad(self.adv, (0, width - self.adv.shape[1]))
            self.adv = torch.cat([old, torch.nn.functional.pad(new_adv, (0, width - new_adv.shape[1]))])
        if len(self) > self.size:
            drop = len(self) - self.size
            self.data = self.data[drop:]
            self.adv = self.adv[drop:]
        self.added += n
        return n

    def sample(self, n: int, generator: torch.Generator) -> tuple[Rollout, torch.Tensor]:
        """``n`` samples drawn uniformly (with replacement) and their advantages."""
        idx = torch.randint(len(self), (n,), generator=generator)
        return self.data[idx], self.adv[idx]

    def state_dict(self) -> dict[str, Any]:
        if self.data is None:
            return {"added": self.added}
        d = self.data
        return {"added": self.added, "group_id": d.group_id, "old_logp": d.old_logp, "mask": d.mask, "replay": d.replay, "adv": self.adv}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.added = int(state.get("added", 0))
        if "mask" not in state:
            self.data, self.adv = None, None
            return
        self.data = Rollout(group_id=state["group_id"], old_logp=state["old_logp"], mask=state["mask"], replay=state["replay"])
        self.adv = state["adv"]


def logp_loss(model, replay: dict, mask: torch.Tensor, adv: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``-sum(A+ m logpi) / count``; ``model`` is the (possibly distributed) policy whose
    forward is ``log_prob``."""
    return -(adv * mask * model(replay)).sum() / count


def sft_loss(model, policy, replay: dict, weight: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``sum(w l) / count`` over the decisions with weight w > 0, l the policy's supervised
    loss of one decision's executed chunk (``policy.imitation_batch``, ``sft_loss``)."""
    flat = policy.imitation_batch(replay)
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
