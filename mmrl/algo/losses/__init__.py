"""Loss modules (``algo.loss``), TorchRL's split of a loss from its loop: the learner runs
the epochs, minibatches, pieces and optimizer steps; a loss module turns one piece of a
minibatch into the scalar to backpropagate, its named parts and its metrics.

A loss module is a class registered in :data:`mmrl.registry.LOSSES` with its config (a
subclass of :class:`LossConfig`, the ``algo.loss`` section), built once by the learner ::

    loss = Entry.obj(algo, options, policy, reference=..., critic=..., sampling_graph=..., seed=...)
    loss.begin_update(step); loss.begin_epoch(epoch)                     # hooks, no-ops by default
    out = loss(model, batch, targets, norm, at_sampling_weights=False)  # -> LossOutput, per piece
    metrics = loss.end_update(step)                                      # after the update's last step

``model`` is the trained module as the distributed wrapper holds it (its forward takes the
policy's modes), ``batch`` a :class:`~mmrl.core.rollout.Rollout` piece with its training
mask, ``targets`` the learner's per-sample values of that piece (:class:`Targets`: the
advantages, and where the learner computed them the critic's targets and the proximal
log-probs), ``norm`` the aggregation's normalizers over the whole minibatch and all
processes. What a loss reads decides which of the learner's speed-ups apply; it says so in
its class attributes (:class:`Loss`). A new method is a new module in this package (or a
plugin's module that registers itself): the learner, the trainer and the run config stay
as they are.

An off-policy loss (``trains_from_buffer``, its config an :class:`OffPolicyConfig`) trains
from the replay buffer instead (``mmrl/train/replay_buffer.py``): each training step the
learner adds the step's transitions to the buffer and runs ``utd`` optimizer steps per new
transition, each on ``batch_size`` transitions drawn from it; the loss's own networks (critics,
their targets, a temperature) train in the same optimizer, as ``parameter_groups`` says, and
``after_optimizer_step`` moves what follows the weights (target networks).

Built in: ``policy_gradient`` (the clipped-ratio family: ``algo.objective``,
``aggregation``, ``kl``, ``correction``, and the value loss of a critic), ``sft`` (the
policy's own supervised loss), ``self_imitation`` (``algo.self_imitation``), ``nft``
(DiffusionNFT: a flow policy's final samples, no log-probs) and ``sac`` (Soft Actor-Critic
on the replay buffer). A loss with state of its own
(DiffusionNFT's old policy) returns it from ``state_dict``; checkpoints keep it.

What a loss needs elsewhere in the run config (DiffusionNFT: the flow ODE, one decision per
chain, no KL term) it declares once, as :class:`Requirement` s in its ``requires``; the run
config's validation reports every unmet one in a single error (:func:`check_requirements`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
from torch import Tensor

from mmrl.config import Component, option
from mmrl.errors import ConfigError


@dataclass
class LossConfig(Component):
    """``algo.loss``: the loss module (``type``) and its own options."""

    type: str = option("policy_gradient", "the loss module (mmrl list losses): policy_gradient is the ratio objective of algo.objective/aggregation/kl/correction")


@dataclass
class OffPolicyConfig(LossConfig):
    """The options every loss that trains from the replay buffer has: the buffer and how
    many optimizer steps each new transition buys."""

    gamma: float = option(0.99, "discount per env step of the transitions' rewards and bootstraps (the sampler discounts a chunk's rewards by it too)", gt=0, le=1)
    buffer_size: int = option(1_000_000, "transitions the replay buffer keeps (the oldest are overwritten)", ge=1)
    buffer_device: Literal["learner", "cpu"] = option("learner", "where the replay buffer lives: the learner's device, or the CPU (batches move to the learner)")
    n_step: int = option(1, "n-step returns: a transition's reward sums n decisions' discounted rewards and bootstraps after them", ge=1)
    batch_size: int = option(256, "transitions drawn from the buffer per optimizer step", ge=1)
    learning_starts: int = option(5000, "transitions in the buffer before the first optimizer step", ge=0)
    utd: float = option(1.0, "update-to-data ratio: optimizer steps per new transition (fractions carry over)", gt=0)
    demos: str | None = option(None, "demonstrations beside the online data (RLPD): a directory from `mmrl collect`, saved episodes or a LeRobotDataset v3 folder")
    demo_share: float = option(0.5, "with demos: the share of each batch drawn from the demonstrations (RLPD: 0.5)", ge=0, le=1)


@dataclass(frozen=True)
class Requirement:
    """A setting a loss needs elsewhere in the run config: the dotted ``field`` (from the
    config's root: ``policy.denoising.transition``) must equal ``value``; ``why`` says what
    for, as the end of "the loss needs it: ..."."""

    field: str
    value: Any
    why: str


_ABSENT = object()


def _lookup(config, dotted: str):
    node = config
    for name in dotted.split("."):
        node = getattr(node, name, _ABSENT)
        if node is _ABSENT:
            return _ABSENT
    return node


def _override(value) -> str:
    """``value`` as a command-line override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def check_requirements(loss_type: str, requires: tuple[Requirement, ...], config) -> None:
    """Raise one :class:`~mmrl.errors.ConfigError` for every ``requires`` that ``config`` (the
    run config, or anything with its sections as attributes) does not meet: naming the field
    where one is unmet, else ``algo.loss.type`` with each unmet field, its value and the
    overrides that meet them all."""
    unmet = [(r, _lookup(config, r.field)) for r in requires]
    unmet = [(r, found) for r, found in unmet if found is _ABSENT or found != r.value]
    if not unmet:
        return
    policy_type = getattr(getattr(config, "policy", None), "type", None)

    def got(found) -> str:
        return f"policy {policy_type} has no such field" if found is _ABSENT else f"got {found!r}"

    if len(unmet) == 1 and unmet[0][1] is not _ABSENT:
        (r, found), = unmet
        raise ConfigError(r.field, found, f"algo.loss {loss_type} needs {_override(r.value)}: {r.why}")
    needs = ", ".join(f"{r.field} {_override(r.value)} ({got(found)}; {r.why})" for r, found in unmet)
    overrides = " ".join(f"{r.field}={_override(r.value)}" for r, _ in unmet)
    raise ConfigError("algo.loss.type", loss_type, f"needs {needs}; override: {overrides}")


@dataclass
class Targets:
    """The learner's per-sample values of one update, row-aligned with its rollout: what a
    loss compares its forward against. ``adv`` is [B, 1] (a sequence advantage, broadcast
    over decisions) or [B, T]; ``returns`` and ``old_values`` ([B, T]) are a critic's targets
    and its values at sampling time; ``prox_logp`` ([B, T]) the proximal policy's log-probs
    of an objective that needs them. Fields a run does not use are None."""

    adv: Tensor
    returns: Tensor | None = None
    old_values: Tensor | None = None
    prox_logp: Tensor | None = None
    index: Tensor | None = None  # [B] each sample's position in the step's batch in group order, on every process alike

    def _apply(self, fn) -> "Targets":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None})

    def __getitem__(self, idx: Tensor) -> "Targets":
        return self._apply(lambda t: t[idx.to(t.device)])

    def to(self, device) -> "Targets":
        return self._apply(lambda t: t.to(device))

    @staticmethod
    def none_for(batch) -> "Targets":
        """The targets of a masked no-op piece (a process without rows): advantage 0."""
        return Targets(adv=torch.zeros_like(batch.mask))


@dataclass
class LossOutput:
    """``loss``: the scalar to backpropagate, already divided by the minibatch's normalizers
    (a piece's share). ``terms``: its detached named parts (``loss/policy``, ``kl/ref``),
    logged as their sum over pieces, averaged over processes. ``decision_stats``: [B, T]
    per-decision values logged as masked means over the minibatch's valid decisions (a key
    ending in ``_max``: the maximum instead). ``logp``: the forward's log-probs of the
    batch's decisions, where the loss computed them (the deferred old log-probs read them)."""

    loss: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)
    decision_stats: dict[str, Tensor] = field(default_factory=dict)
    logp: Tensor | None = None


class Loss:
    """Base of loss modules. Class attributes say what the loss reads, so that the learner
    knows which speed-ups apply:

    - ``reads_old_logp``: the ratio reads old log-probs; deferred old log-probs and the
      approximate KL (``algo.target_kl``) apply.
    - ``zero_at_zero_advantage``: the loss and its gradient are exactly 0 on a sample with
      advantage 0 on every valid decision, so such samples may be left out of the passes.
    - ``needs_proximal``: the loss reads ``targets.prox_logp`` (one no-grad pass before the
      epochs).
    - ``reads_sampling_graph``: it can take the sampling pass's own log-probs (with their
      graph) instead of a recompute forward.

    ``requires``: the settings it needs elsewhere in the run config (:class:`Requirement`),
    checked all at once when the run config is validated.
    """

    reads_old_logp: bool = False
    zero_at_zero_advantage: bool = False
    needs_proximal: bool = False
    reads_sampling_graph: bool = False
    # trains from the replay buffer (the module docstring), not from the step's rollout
    trains_from_buffer: bool = False
    requires: tuple[Requirement, ...] = ()

    @classmethod
    def wants_reference(cls, algo, options) -> bool:
        """Whether the learner should keep a frozen reference policy for this loss."""
        return algo.kl.coef > 0

    def __call__(self, model, batch, targets: Targets, norm: dict, at_sampling_weights: bool = False) -> LossOutput:
        raise NotImplementedError

    def begin_update(self, step: int) -> None:
        """Before update ``step``'s first minibatch."""

    def begin_epoch(self, epoch: int) -> None:
        """Before each pass over the update's batch."""

    def end_update(self, step: int) -> dict[str, float]:
        """After update ``step``'s last optimizer step; returns metrics to log."""
        return {}

    def parameter_groups(self) -> list[dict]:
        """The loss's own trained parameters as optimizer parameter groups (``params`` and
        ``base_lr``), beside the policy's; none by default."""
        return []

    def after_optimizer_step(self) -> None:
        """After each optimizer step of a loss that trains from the buffer."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the loss (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
