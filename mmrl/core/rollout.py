"""``Rollout``: the tensors of B sampled decisions sequences (B = groups × G)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


def _map(obj, fn, batch_size: int):
    """Apply ``fn`` to every per-sample leaf (tensor or list whose first dim is B)."""
    if isinstance(obj, Tensor):
        return fn(obj) if obj.dim() > 0 and obj.shape[0] == batch_size else obj
    if isinstance(obj, dict):
        return {k: _map(v, fn, batch_size) for k, v in obj.items()}
    if isinstance(obj, list) and len(obj) == batch_size:
        return fn(obj)
    return obj


def _take(idx: Tensor):
    def take(x):
        if isinstance(x, Tensor):
            return x[idx.to(x.device)]
        return [x[i] for i in idx.tolist()]

    return take


def _cat(values: list, batch_sizes: list[int]):
    first = values[0]
    if isinstance(first, Tensor) and first.dim() > 0 and first.shape[0] == batch_sizes[0]:
        width = max(v.shape[1] for v in values) if first.dim() > 1 else None
        if width is not None and any(v.shape[1] != width for v in values):
            values = [torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1])) for v in values]
        return torch.cat(values)
    if isinstance(first, dict):
        return {k: _cat([v[k] for v in values], batch_sizes) for k in first}
    if isinstance(first, list) and len(first) == batch_sizes[0]:
        return [x for v in values for x in v]
    return first


@dataclass
class OldLogProbs:
    """A rollout's old log-probs, all in one place.

    ``values`` [B, T]: the log-probs of the sampled decisions that the loss's ratio compares
    with, exact at the sampling weights — or provisional while ``deferred`` (the sampler's
    own numbers; the learner recomputes the exact ones with the policy's ``log_prob`` before
    the loss reads them, docs/architecture.md). ``graph`` [B, T]: the sampling pass's
    log-probs still attached to the autograd graph of the policy's parameters, when the
    learner reuses that graph (``algo.reuse_sampling_graph``; ``values`` is their detached
    copy). ``behaviour`` [B, T]: the sampler's own log-probs, kept beside the exact ones when
    an off-policy correction (``algo.correction``) reads both."""

    values: Tensor
    deferred: bool = False
    graph: Tensor | None = None
    behaviour: Tensor | None = None

    def with_(self, **changes) -> "OldLogProbs":
        return replace(self, **changes)

    def map(self, fn, batch_size: int) -> "OldLogProbs":
        return OldLogProbs(
            _map(self.values, fn, batch_size), self.deferred,
            None if self.graph is None else _map(self.graph, fn, batch_size), None if self.behaviour is None else _map(self.behaviour, fn, batch_size),
        )

    @staticmethod
    def cat(olds: list["OldLogProbs"], batch_sizes: list[int]) -> "OldLogProbs":
        def joined(name):
            values = [getattr(o, name) for o in olds]
            return None if any(v is None for v in values) else _cat(values, batch_sizes)

        return OldLogProbs(_cat([o.values for o in olds], batch_sizes), any(o.deferred for o in olds), joined("graph"), joined("behaviour"))


@dataclass
class Rollout:
    """B samples of T decisions each.

    ``decision`` is whatever the policy chose: a token, a denoising step, an action chunk.
    ``replay`` holds what the policy needs to recompute the same decisions' log-probs under
    its current parameters (token ids; the latent chain; observations and actions).
    ``info`` holds per-sample extras (episode success/return/length, texts, images) and
    is sliced along with the tensors when its leaves have B rows.
    """

    group_id: Tensor  # [B] long
    old: OldLogProbs  # the old log-probs [B, T] and what the learner knows of them
    mask: Tensor  # [B, T] float, 1 for valid decisions
    replay: dict[str, Any]
    rewards: Tensor | None = None  # [B, K]
    reward_names: list[str] = field(default_factory=list)
    # [B] the one reward per sample that filters and advantages read: the columns combined by
    # the run's aggregation, once, where the samples are scored (RolloutWorker.score)
    reward: Tensor | None = None
    ref_logp: Tensor | None = None  # [B, T]
    step_rewards: Tensor | None = None  # [B, T]
    entropy: Tensor | None = None  # [B, T]
    info: dict[str, Any] = field(default_factory=dict)
    # [B] long: the version of the learner's weights that sampled each sample
    policy_version: Tensor | None = None

    @property
    def old_logp(self) -> Tensor:
        """[B, T] the old log-probs (``old.values``)."""
        return self.old.values

    @property
    def batch_size(self) -> int:
        return self.group_id.shape[0]

    @property
    def num_decisions(self) -> int:
        return self.old_logp.shape[1]

    # slicing, moving and concatenating keep autograd history (old.graph) even
    # where the caller runs without grad, as the trainer's collection does
    @torch.enable_grad()
    def _apply(self, fn) -> "Rollout":
        b = self.batch_size
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value if f.name == "reward_names" else value.map(fn, b) if f.name == "old" else _map(value, fn, b)
        return Rollout(**out)

    def __getitem__(self, idx) -> "Rollout":
        """Rows ``idx`` (slice, index tensor or bool mask) of every per-sample field."""
        if isinstance(idx, slice):
            idx = torch.arange(self.batch_size)[idx]
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().squeeze(1)
        return self._apply(_take(idx.cpu()))

    def to(self, device) -> "Rollout":
        return self._apply(lambda x: x.to(device) if isinstance(x, Tensor) else x)

    def with_(self, **changes) -> "Rollout":
        return replace(self, **changes)

    @staticmethod
    @torch.enable_grad()
    def cat(rollouts: list["Rollout"]) -> "Rollout":
        """Concatenate along the batch; decision axes of different lengths are right-padded
        (padding is masked out)."""
        if len(rollouts) == 1:
            return rollouts[0]
        sizes = [r.batch_size for r in rollouts]
        out = {}
        for f in fields(Rollout):
            values = [getattr(r, f.name) for r in rollouts]
            if f.name == "reward_names":
                out[f.name] = values[0]
            elif f.name == "old":
                out[f.name] = OldLogProbs.cat(values, sizes)
            elif values[0] is None:
                out[f.name] = None
            else:
                out[f.name] = _cat(values, sizes)
        return Rollout(**out)
