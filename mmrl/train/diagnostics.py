"""Diagnostics of a training set-up at its current weights.

:func:`gradient_agreement` answers "does one update's batch carry a learning signal?": it
draws several independent batches exactly as training would (same sampler, rewards,
advantages, masks, objective and aggregation), takes each batch's policy gradient at the
sampling weights (the gradient of the first PPO step, where every ratio is 1), and reports
the cosine similarity between the batches' gradients. If the expected gradient is g and one
batch's estimate is g + noise, the cosine between two independent estimates is about
|g|² / (|g|² + E|noise|²): near 1 when a batch pins the direction down, near 0 when updates
are mostly noise and more (or less noisy) samples are needed before learning can show.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import torch

from mmrl.train.trainer import Trainer


def _module_of(name: str) -> str:
    """Group parameters by their first two name components (``backbone.vision`` ...)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def batch_gradient(trainer: Trainer, step: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One training batch (groups seeded as training step ``step``) and its loss gradient at
    ratio 1, per parameter; plus the batch's success/reward statistics."""
    rollout = trainer.engine.collect(step, trainer.learner.version).rollout
    targets, keep = trainer.learner.advantage_stage(rollout, trainer.learner.model)
    device = trainer.accelerator.device
    sampled = rollout.mask
    rollout = rollout.with_(mask=trainer.learner.train_mask(rollout, keep)).to(device)
    targets = targets.to(device)
    adv = targets.adv = targets.adv[:, None] if targets.adv.dim() == 1 else targets.adv
    model = trainer.learner.model
    model.zero_grad(set_to_none=True)
    loss = trainer.learner.loss(model, rollout, targets, trainer.learner.normalizers(rollout, targets), at_sampling_weights=True).loss
    loss.backward()
    grads = {n: p.grad.detach().flatten().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    reward = rollout.reward.cpu()
    stats = {
        "reward": reward.mean().item(),
        "informative": (adv.abs().amax(1) > 0).float().mean().item(),  # samples with a non-zero advantage
    }
    if "success" in rollout.info:
        stats["success"] = torch.as_tensor(rollout.info["success"], dtype=torch.float32).mean().item()
    if rollout.entropy is not None:
        valid = sampled.to(rollout.entropy.device)
        stats["entropy"] = ((rollout.entropy * valid).sum() / valid.sum().clamp(min=1)).item()
    return grads, stats


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    va, vb = torch.cat(a), torch.cat(b)
    denom = va.norm() * vb.norm()
    return float((va @ vb) / denom) if denom > 0 else 0.0


def gradient_agreement(trainer: Trainer, num_batches: int = 3, first_step: int = 0) -> dict[str, Any]:
    """Pairwise cosines between the policy gradients of ``num_batches`` independent training
    batches at the trainer's current weights (the batches use training steps
    ``first_step``, ``first_step + 1``, ... so their groups' initial states differ).

    Returns {"cosine": mean over pairs, "pairs": the pairs' cosines, "modules": {module:
    mean cosine}, "grad_norm": mean norm of one batch's gradient, "batches": per-batch stats
    (reward, success, entropy per decision, fraction of samples with a non-zero advantage)}.
    """
    if num_batches < 2:
        raise ValueError(f"num_batches must be >= 2 to compare gradients, got {num_batches}")
    grads, batches = [], []
    for i in range(num_batches):
        g, stats = batch_gradient(trainer, first_step + i)
        grads.append(g)
        batches.append(stats)
    names = sorted(set.intersection(*(set(g) for g in grads)))
    pairs = list(combinations(range(num_batches), 2))
    cosines = [_cosine([grads[i][n] for n in names], [grads[j][n] for n in names]) for i, j in pairs]
    modules: dict[str, list[str]] = {}
    for n in names:
        modules.setdefault(_module_of(n), []).append(n)
    per_module = {
        m: sum(_cosine([grads[i][n] for n in ns], [grads[j][n] for n in ns]) for i, j in pairs) / len(pairs) for m, ns in sorted(modules.items())
    }
    norms = [torch.cat([g[n] for n in names]).norm().item() for g in grads]
    return {
        "cosine": sum(cosines) / len(cosines),
        "pairs": cosines,
        "modules": per_module,
        "grad_norm": sum(norms) / len(norms),
        "batches": batches,
    }
