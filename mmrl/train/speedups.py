"""The update's speed-ups, each exact (the same loss and gradient as without it) and each
applying where its docstring says. The learner's loop calls them; a loss module declares
what it reads (:class:`mmrl.algo.losses.Loss`), which decides where they apply.

- **Deferred old log-probs** (:func:`exact_old_logp`): the sampler's numbers are
  provisional; the first minibatch's own forward at the sampling weights gives its rows'
  old log-probs (every first ratio exactly 1), one no-grad pass the other rows'.
- **The reused sampling graph** (:func:`reuses_sampling_graph`): one backward through the
  sampling pass's own log-probs instead of a recompute forward.
- **Idle samples left out** (:func:`active_rows`): samples the loss cannot see are not run.
- **Pieces** (:func:`num_pieces`, :func:`split_rows`): a minibatch's forward/backward in
  pieces that fit the cache (CPU) or memory, before its one optimizer step.
- **The spare sample** (:func:`pieces_of`): a process without rows runs a masked no-op
  piece, so every process makes the same calls (the distributed wrapper's all-reduce).
"""

from __future__ import annotations

import math

import torch

from mmrl.algo.losses import Targets
from mmrl.core.policy import overrides
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError


def reuses_sampling_graph(cfg, loss, policy, sampler_keeps_graph: bool) -> bool:
    """Whether the update backpropagates through the sampling pass's own log-probs
    (``algo.reuse_sampling_graph``). Applies to a loss that can read them
    (``reads_sampling_graph``) in a run of one on-policy pass: the recompute forward would
    evaluate the policy at the sampling weights on the sampled inputs, so its log-probs and
    their gradient are the sampling pass's, and a policy and sampler that can keep that graph
    save the forward. ``auto`` leaves it off where it would save nothing or not be the same
    computation: explicit micro-batches (a memory bound the whole graph cannot keep), the
    exact KL in the loss (its forward runs anyway), mixed precision (the sampling pass runs
    outside autocast)."""
    algo = cfg.algo
    if algo.reuse_sampling_graph is False or algo.type != "rl":
        return False
    capable = policy.keeps_sampling_graph and sampler_keeps_graph
    if algo.reuse_sampling_graph is True:  # the single pass and micro-batches are checked by AlgoConfig.validate
        if not loss.reads_sampling_graph:
            raise ConfigError("algo.reuse_sampling_graph", True, f"loss {algo.loss.type!r} does not read the sampling pass's log-probs; use auto or false")
        if not capable:
            raise ConfigError(
                "algo.reuse_sampling_graph", True,
                f"policy {cfg.policy.type!r} with sampler {cfg.sampler.type!r} cannot keep the sampling graph (keeps_sampling_graph); use auto or false",
            )
        return True
    capable = capable and loss.reads_sampling_graph
    single_pass = algo.ppo_epochs == 1 and algo.num_minibatches == 1 and algo.micro_batches in (None, 1)
    exact_kl_forward = algo.kl.in_loss_term and algo.kl.type == "exact"
    return capable and single_pass and not exact_kl_forward and cfg.mixed_precision == "no"


def old_logp_roles(rollout: Rollout, version: int, correcting: bool) -> Rollout:
    """What the sampler's log-probs are to the update of learner version ``version``."""
    if rollout.policy_version is not None and bool((rollout.policy_version != version).any()) and not correcting:
        # samples of an earlier version (async rollouts): the sampler's numbers are the
        # behaviour policy's and, without a correction, the old log-probs of the ratio
        # (decoupled_ppo: the behaviour side of its weight); nothing is recomputed
        return rollout.with_(old=rollout.old.with_(deferred=False))
    if correcting and rollout.old.behaviour is None:
        # the sampler's numbers are the behaviour policy's; the exact old log-probs (the
        # learner's current weights: the sampling version in sync mode, the proximal policy
        # of an async sample) are computed as deferred ones are
        return rollout.with_(old=rollout.old.with_(behaviour=rollout.old.values.clone(), deferred=True))
    return rollout


def exact_old_logp(model, rollout: Rollout, rows: torch.Tensor | None = None, spare: Rollout | None = None) -> Rollout:
    """``rollout`` with the exact old log-probs of ``rows`` (all by default): one no-grad
    pass of the policy's ``log_prob`` at the current (= sampling) weights. Applies to a
    rollout whose old log-probs are deferred (``old.deferred``) and a loss that reads
    them. A process without such rows runs ``spare`` instead, so that every process makes
    the same calls."""
    with torch.no_grad():
        if rows is None:
            return rollout.with_(old=rollout.old.with_(values=model(rollout.replay).detach(), deferred=False))
        if rows.numel() == 0:
            model(spare.replay)
            return rollout
        part = rollout[rows]
        old = rollout.old_logp.clone()
        old[rows.to(old.device)] = model(part.replay).detach().to(old)
    return rollout.with_(old=rollout.old.with_(values=old))


def active_rows(loss, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The samples the update runs (bool [B], on the CPU). Samples the loss cannot see —
    advantage 0 on every valid decision, under a loss that is then exactly 0 with a zero
    gradient (``zero_at_zero_advantage``) — are left out of the passes; the normalizers still
    count them, so the loss and its gradient are those of the whole minibatch."""
    if getattr(loss, "zero_at_zero_advantage", False):
        return ((adv * mask) != 0).any(1).cpu()
    return torch.ones(mask.shape[0], dtype=torch.bool)


def num_pieces(cfg, device: torch.device, policy, batch: Rollout, dist, loss=None) -> int:
    """The forward/backward pieces of this process's rows ``batch`` of one optimizer step:
    ``algo.micro_batches``, or when it is null, on a CPU, as many as keep each piece's share
    of the activation estimate (the loss's ``activation_bytes``, else the policy's: bytes
    per sample) under ``algo.micro_batch_mb`` — one call whose tensors outgrow the cache runs slower than
    several that fit; elsewhere, or without an estimate, 1. The largest count over
    processes, so that every process runs the same passes."""
    algo = cfg.algo
    if algo.micro_batches is not None:
        return algo.micro_batches
    estimate = getattr(loss, "activation_bytes", None)
    if estimate is None and overrides(policy, "activation_bytes"):
        estimate = policy.activation_bytes
    if device.type != "cpu" or estimate is None:
        return 1  # the same in every process: no need to agree
    k = 1
    per_sample = estimate(batch.replay) if batch.batch_size else None
    if per_sample:
        k = min(batch.batch_size, max(1, math.ceil(batch.batch_size * per_sample / (algo.micro_batch_mb * 2**20))))
    return dist.max(k)


def split_rows(n: int, k: int) -> list[torch.Tensor]:
    """Row indices of ``n`` rows in exactly ``k`` pieces (some empty when n < k): every
    process runs the same number of forward/backward passes, as the distributed wrapper
    requires, whatever its number of rows."""
    return [torch.arange(n)[i * n // k : (i + 1) * n // k] for i in range(k)]


def pieces_of(batch: Rollout, targets: Targets, k: int, spare: Rollout) -> list[tuple[Rollout, Targets]]:
    """``batch`` and its targets in ``k`` pieces; an empty piece becomes the spare sample
    with advantage 0 (a masked no-op forward/backward that keeps the processes in step)."""
    pieces = [(batch[i], targets[i]) for i in split_rows(batch.batch_size, k)]
    if batch.old.behaviour is not None and spare.old.behaviour is None:  # a correction reads the behaviour's too
        spare = spare.with_(old=spare.old.with_(behaviour=spare.old.values))
    return [p if p[0].batch_size else (spare, Targets.none_for(spare)) for p in pieces]

