"""What the learner optimizes and how: the trained module (the policy, with a critic beside
it), its parameter groups and optimizer, frozen prefixes, the learning-rate schedule, and
one optimizer step over the pieces of a minibatch."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import torch

from mmrl.core.critic import ActorCritic, build_critic
from mmrl.errors import ConfigError, NonFiniteError


def trained_module(cfg, policy: torch.nn.Module, critic_cfg) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The module the optimizer trains (the policy, or an :class:`ActorCritic` holding a
    critic built from ``critic_cfg``) and its AdamW over the parameters that need a
    gradient (a critic with ``critic.lr`` gets a parameter group of its own). Freezes
    ``optim.frozen`` first."""
    freeze(policy, cfg.optim.frozen)
    trained: torch.nn.Module = policy
    if critic_cfg is not None:  # a learned value baseline: the critic trains in the same steps
        first = next(policy.parameters())
        # the critic's dtype follows the policy's, but never below float32: a VLM held in
        # bf16 hands its value head float32 features
        dtype = first.dtype if first.dtype.itemsize >= 4 else torch.float32
        trained = ActorCritic(policy, build_critic(critic_cfg, policy).to(first.device, dtype))
    params: list = [p for p in trained.parameters() if p.requires_grad]
    if critic_cfg is not None and critic_cfg.lr is not None:  # the critic's own rate: a second parameter group
        critic_ids = {id(p) for p in trained.critic.parameters()}
        params = [
            {"params": [p for p in params if id(p) not in critic_ids], "base_lr": cfg.optim.lr},
            {"params": [p for p in params if id(p) in critic_ids], "base_lr": critic_cfg.lr},
        ]
    o = cfg.optim
    return trained, torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.adam_eps, weight_decay=o.weight_decay)


def frozen_reference(policy: torch.nn.Module) -> torch.nn.Module:
    """The frozen reference of KL terms and regularizers: the policy's own (e.g. with its
    adapters disabled, sharing the base weights), else a copy of its current weights."""
    reference = policy.reference() or copy.deepcopy(policy)
    return reference.requires_grad_(False).eval()


def optimizer_step(accelerator, model, optimizer, pieces: list, loss_of, what: str, step: int, max_grad_norm: float | None, drop=None, proceed=None) -> torch.Tensor | None:
    """One optimizer step: backward of ``loss_of(piece)`` for each piece (the distributed
    wrapper all-reduces once, after the last), gradient clipping, step. Serves every loss
    alike. ``drop`` (parameters) loses its gradients before the step (a critic warm-up drops
    the policy's). ``proceed`` (called after the backward passes, the same answer in every
    process) returning False drops all gradients instead: no step. Returns the gradient
    norm before clipping (None without clipping or without a step)."""
    for i, piece in enumerate(pieces):
        loss = loss_of(piece)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"step {step + 1}: {what} is {loss.item()}")
        with accelerator.no_sync(model) if i + 1 < len(pieces) else nullcontext():
            accelerator.backward(loss)
    if proceed is not None and not proceed():
        optimizer.zero_grad(set_to_none=True)
        return None
    for p in drop or ():  # AdamW leaves a parameter without a gradient as it is
        p.grad = None
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = torch.as_tensor(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)).detach().cpu()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def lr_factor(step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0, final_ratio: float = 0.0) -> float:
    """Learning rate of training step ``step`` (0-based) as a fraction of ``optim.lr``.

    Warm-up: ``(step + 1) / (warmup_steps + 1)`` for the first ``warmup_steps`` steps. Then,
    with progress ``p = (step - warmup) / max(1, total - warmup - 1)`` in [0, 1]:
    constant 1; linear ``1 - (1 - r) p``; cosine ``r + (1 - r) (1 + cos(pi p)) / 2``, where
    ``r`` is ``final_ratio``. A pure function of the step, so ``--resume`` needs no scheduler
    state and continues the schedule exactly.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))
    if schedule == "linear":
        return 1.0 - (1.0 - final_ratio) * p
    if schedule == "cosine":
        return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def freeze(policy: torch.nn.Module, prefixes: list[str]) -> None:
    """Stop gradients to the parameters whose names start with one of ``prefixes``."""
    names = [n for n, _ in policy.named_parameters()]
    for i, prefix in enumerate(prefixes):
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            modules = sorted({n.split(".")[0] for n in names})
            raise ConfigError(f"optim.frozen[{i}]", prefix, f"matches no parameter of the policy (its top-level modules: {modules})")
    for name, param in policy.named_parameters():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            param.requires_grad_(False)
