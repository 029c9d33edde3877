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
out instead of accumulating it (``benchmarks/results/robots_tabletop.md``, "Why these updates do
not move success").

The memory keeps up to ``size`` samples (first in, first out) with their per-decision
advantages ``[N, T]`` (sequence advantages are broadcast over the sample's decisions) and
their training masks; only what the policy's ``log_prob`` needs (``replay``) and the mask
are kept. It is saved in checkpoints (unless ``algo.self_imitation.in_checkpoint`` is
false), so ``--resume`` continues with the same memory.

Two losses over a batch drawn from the memory (``algo.self_imitation.loss``; the
``self_imitation`` loss module, ``mmrl/algo/losses/supervised.py``):

- ``logp``: ``-sum(A+ m logpi) / count`` through the policy's ``log_prob``;
- ``sft``: the policy's own supervised loss (flow matching, token cross-entropy) on the
  executed action chunks of the decisions with A+ > 0, weighted by A+
  (``sum(A+ l) / count``), through ``policy.imitation_batch`` and ``policy.sft_loss``.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.algo.losses import Targets
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.core.sampler import group_seed
from mmrl.train import speedups
from mmrl.train.optimization import optimizer_step


_STEP = 1 << 32  # key = step * _STEP + position of the sample among the step's additions
_STREAM = 1 << 41  # the group index reserved for the seed of a step's draws (the learner's update order: 1 << 40)


class SelfImitationMemory:
    """One memory over all processes. Each process stores the samples it collected, but
    every entry has a global key (the step it was added at, then its position in group order
    among that step's additions), every process knows all keys, and eviction (oldest keys
    first) and draws (uniform over all keys, from a generator shared by the processes) are
    decided on the keys. So N processes keep and replay exactly what one process would; a
    draw's samples are then used by whichever process holds them."""

    def __init__(self, size: int, collectives):
        self.size = size
        self.dist = collectives
        self.data: Rollout | None = None  # this process's entries
        self.adv: torch.Tensor | None = None  # [N, T], >= 0
        self.keys = torch.zeros(0, dtype=torch.long)  # keys of this process's entries, increasing
        self.all_keys = torch.zeros(0, dtype=torch.long)  # every process's keys, increasing
        self.added = 0  # samples ever added, over all processes

    def __len__(self) -> int:
        """Entries over all processes."""
        return len(self.all_keys)

    def add(self, rollout: Rollout, adv: torch.Tensor, step: int) -> int:
        """Keep the samples of ``rollout`` (its ``mask`` = the training mask) whose advantage
        is positive on some valid decision; returns how many were added over all processes."""
        rollout = rollout.to("cpu")
        adv = adv.detach().cpu().float()
        adv = adv[:, None].expand_as(rollout.mask) if adv.dim() == 1 else adv
        positive = adv.clamp_min(0) * rollout.mask
        rows = (positive > 0).any(1)
        sizes = self.dist.sizes(int(rows.sum()))
        total = sum(sizes)
        if total == 0:
            return 0
        # position of each added sample in group order over all processes
        order = torch.sort(self.dist.gather_rows(rollout.group_id[rows], sizes), stable=True).indices
        position = torch.empty_like(order)
        position[order] = torch.arange(total)
        start = self.dist.offset(sizes)
        new_keys = step * _STEP + position[start : start + sizes[self.dist.rank]]
        self.all_keys = torch.cat([self.all_keys, step * _STEP + torch.arange(total)])
        if rows.any():
            mine = torch.argsort(new_keys)
            kept = rollout[rows][mine]
            self._append(Rollout(group_id=kept.group_id, old=OldLogProbs(kept.old_logp), mask=kept.mask, replay=kept.replay), positive[rows][mine], new_keys[mine])
        if len(self.all_keys) > self.size:
            self._drop_before(self.all_keys[-self.size])
        self.added += total
        return total

    def _append(self, data: Rollout, adv: torch.Tensor, keys: torch.Tensor) -> None:
        if self.data is None:
            self.data, self.adv, self.keys = data, adv, keys
            return
        self.data = Rollout.cat([self.data, data])
        width = self.data.mask.shape[1]
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        self.adv = torch.cat([pad(self.adv), pad(adv)])
        self.keys = torch.cat([self.keys, keys])

    def _drop_before(self, key: torch.Tensor) -> None:
        self.all_keys = self.all_keys[self.all_keys >= key]
        if self.data is not None:
            keep = self.keys >= key
            self.data, self.adv, self.keys = self.data[keep], self.adv[keep], self.keys[keep]

    def sample(self, n: int, generator: torch.Generator) -> tuple[Rollout, torch.Tensor]:
        """This process's part of ``n`` entries drawn uniformly (with replacement) from the
        memory of all processes, and their advantages. ``generator`` must be the same on
        every process."""
        drawn = self.all_keys[torch.randint(len(self.all_keys), (n,), generator=generator)]
        if self.data is None:
            return None, None
        where = torch.searchsorted(self.keys, drawn).clamp(max=max(len(self.keys) - 1, 0))
        local = where[self.keys[where] == drawn] if len(self.keys) else where[:0]
        return self.data[local], self.adv[local]

    def state_dict(self) -> dict[str, Any]:
        """The entries of every process (gathered), so that a resumed run of any number of
        processes can share them out again."""
        parts = self.dist.gather_objects(self._local_state())
        merged = {"added": self.added, "all_keys": self.all_keys}
        parts = [p for p in parts if p is not None]
        if parts:
            entries = Rollout.cat([p["data"] for p in parts])
            keys = torch.cat([p["keys"] for p in parts])
            width = entries.mask.shape[1]
            adv = torch.cat([torch.nn.functional.pad(p["adv"], (0, width - p["adv"].shape[1])) for p in parts])
            order = torch.argsort(keys)
            d = entries[order]
            merged.update(keys=keys[order], group_id=d.group_id, old_logp=d.old_logp, mask=d.mask, replay=d.replay, adv=adv[order])
        return merged

    def _local_state(self):
        if self.data is None:
            return None
        return {"data": self.data, "adv": self.adv, "keys": self.keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Entry i of the saved memory goes to process i mod the number of processes."""
        self.added = int(state.get("added", 0))
        self.all_keys = state.get("all_keys", torch.zeros(0, dtype=torch.long))
        self.data, self.adv, self.keys = None, None, torch.zeros(0, dtype=torch.long)
        if "mask" not in state:
            return
        data = Rollout(group_id=state["group_id"], old=OldLogProbs(state["old_logp"]), mask=state["mask"], replay=state["replay"])
        mine = torch.arange(data.batch_size) % self.dist.world == self.dist.rank
        if mine.any():
            self.data, self.adv, self.keys = data[mine], state["adv"][mine], state["keys"][mine]


def imitation_steps(learner, step: int, spare: Rollout | None = None) -> dict[str, float]:
    """``self_imitation.steps`` optimizer steps of the learner's ``self_imitation`` loss
    (``learner.imitation``), each on ``self_imitation.batch`` samples drawn from its memory
    (``learner.memory``) by a generator every process seeds alike; a process that holds none
    of a draw runs a masked spare sample, which keeps the all-reduce in step."""
    cfg, dist, device = learner.cfg, learner.dist, learner.accelerator.device
    si, imitation = cfg.algo.self_imitation, learner.imitation
    gen = torch.Generator().manual_seed(group_seed(cfg.seed, step, _STREAM))
    losses = []
    for _ in range(si.steps):
        batch, adv = learner.memory.sample(si.batch, gen)
        if batch is None or batch.batch_size == 0:  # none of the draws lives here
            batch, adv = spare, torch.zeros_like(spare.mask)
        batch, targets = batch.to(device), Targets(adv.to(device))
        norm = {"count": dist.sum(imitation.counts(batch, targets)).clamp_min(imitation.count_floor).to(device) / dist.world}
        k = speedups.num_pieces(cfg, device, learner.policy, batch, dist)
        pieces = speedups.pieces_of(batch, targets, k, spare.to(device) if spare is not None else None)
        total = []

        def loss_of(piece):
            out = imitation(learner.model, piece[0], piece[1], norm)
            total.append(out.loss.detach().cpu())
            return out.loss

        optimizer_step(learner.accelerator, learner.model, learner.optimizer, pieces, loss_of, "self-imitation loss", step, cfg.optim.max_grad_norm)
        losses.append(float(dist.sum(sum(total)) / dist.world))
    return {"loss/self_imitation": sum(losses) / len(losses)}
