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
class Rollout:
    """B samples of T decisions each.

    ``decision`` is whatever the policy chose: a token, a denoising step, an action chunk.
    ``replay`` holds what the policy needs to recompute the same decisions' log-probs under
    its current parameters (token ids; the latent chain; observations and actions).
    ``info`` holds per-sample extras (episode success/return/length, texts, images) and
    is sliced along with the tensors when its leaves have B rows.
    """

    group_id: Tensor  # [B] long
    old_logp: Tensor  # [B, T]
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
    # old_logp is provisional; the exact values are the policy's log_prob(replay) at the
    # sampling parameters, computed by the trainer (docs/architecture.md)
    old_logp_deferred: bool = False
    # [B, T] the sampling pass's log-probs still attached to the autograd graph of the
    # policy's parameters (the trainer asked for them: algo.reuse_sampling_graph); old_logp
    # is their detached copy
    sampling_graph_logp: Tensor | None = None
    # [B] long: the version of the learner's weights that sampled each sample
    policy_version: Tensor | None = None
    # [B, T] the sampler's own log-probs, kept beside the learner's exact old_logp when an
    # off-policy correction (algo.correction) reads both
    behaviour_logp: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.group_id.shape[0]

    @property
    def num_decisions(self) -> int:
        return self.old_logp.shape[1]

    # slicing, moving and concatenating keep autograd history (sampling_graph_logp) even
    # where the caller runs without grad, as the trainer's collection does
    @torch.enable_grad()
    def _apply(self, fn) -> "Rollout":
        b = self.batch_size
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value if f.name == "reward_names" else _map(value, fn, b)
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
            elif f.name == "old_logp_deferred":
                out[f.name] = any(values)
            elif values[0] is None:
                out[f.name] = None
            else:
                out[f.name] = _cat(values, sizes)
        return Rollout(**out)
