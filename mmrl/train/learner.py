"""The learner: it owns the trained model, its optimizer and the frozen reference, runs the
update loop (epochs x minibatches x pieces) around a loss module (``algo.loss``), and
publishes its weights with a version number, which every sample a rollout worker collects
carries (``Rollout.policy_version``).

One update, on the samples of all processes:

    targets, keep = advantages(rollout)        # mmrl/train/advantage_stage.py: group-relative or GAE
    rollout.mask = train_mask(rollout, keep)   # truncation, top-entropy, pivots
    update(rollout, targets)                   # epochs x minibatches: loss(piece) -> optimizer step
    self_imitation()                           # optional: the self_imitation loss on remembered samples

A loss that trains from the replay buffer (``sac``) takes ``mmrl/train/off_policy.py``'s
update instead: the step's transitions join the buffer, and ``utd`` optimizer steps per new
transition each draw a batch from it. In N processes every process holds the whole buffer
(the step's transitions gathered) and trains on its 1/N share of each batch.

The loss turns a piece into its scalar and metrics (``mmrl/algo/losses/``); the optimizer
and the schedule live in ``mmrl/train/optimization.py``; the speed-ups, each exact, in
``mmrl/train/speedups.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mmrl import registry
from mmrl.algo.losses import Loss, Targets
from mmrl.core.critic import ActorCritic
from mmrl.core.policy import PolicyModule
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.core.statistics import commit_statistics
from mmrl.errors import ConfigError
from mmrl.train import self_imitation as sil
from mmrl.train import speedups
from mmrl.train.advantage_stage import AdvantageStage
from mmrl.train.distributed import local_rows, normalizers
from mmrl.train.metrics import MinibatchMetrics
from mmrl.train.optimization import frozen_reference, lr_factor, optimizer_step, trained_module
from mmrl.train.off_policy import BufferUpdates
from mmrl.train.run_config import TrainConfig

_UPDATE_STREAM = 1 << 40  # the group index reserved for the seed of a step's minibatch order


class Learner:
    """Owns the trained model (wrapped by ``accelerator``), its optimizer and the frozen
    reference; ``version`` counts the optimizer's published states (0: the initial weights)."""

    def __init__(self, cfg: TrainConfig, policy: PolicyModule, accelerator, dist, data=None, sampler_keeps_graph: bool = False):
        """``data`` is the SFT data source of ``algo.type: sft`` (None for RL). The rewards
        arrive combined, in each rollout's ``reward`` (scored by the rollout worker)."""
        algo = cfg.algo
        self.cfg, self.accelerator, self.dist, self.data = cfg, accelerator, dist, data
        self.world = dist.world
        loss_cls = registry.LOSSES.get(algo.loss.type, "algo.loss.type")
        # the frozen reference, built here once (the rollout workers get this one)
        self.reference = frozen_reference(policy) if loss_cls.wants_reference(algo, algo.loss) else None
        si = algo.self_imitation
        self.memory = sil.SelfImitationMemory(si.size, dist) if si.size and algo.type == "rl" else None
        if self.memory is not None:  # the self_imitation loss module, with the memory's options
            self.imitation = registry.LOSSES.get("self_imitation")(algo, registry.LOSSES.entry("self_imitation").config(loss=si.loss), policy, field="algo.self_imitation.loss")
        self.critic_cfg = cfg.critic if cfg.critic.type != "none" and algo.type == "rl" else None
        trained, optimizer = trained_module(cfg, policy, self.critic_cfg)
        self.model, self.optimizer = accelerator.prepare(trained, optimizer)
        self.reference = self.reference.to(accelerator.device) if self.reference is not None else None
        self.advantage_stage = AdvantageStage(cfg, dist, self.critic_cfg)
        self.reuse_graph = speedups.reuses_sampling_graph(cfg, loss_cls, policy, sampler_keeps_graph)
        self.loss: Loss = loss_cls(algo, algo.loss, policy, reference=self.reference, critic=self.critic_cfg, sampling_graph=self.reuse_graph, seed=cfg.seed, device=accelerator.device)
        for group in self.loss.parameter_groups():  # the loss's own networks (an off-policy loss's critics) train in the same optimizer
            inner = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
            inner.add_param_group({**group, "base_lr": group.get("base_lr") or cfg.optim.lr})
        self.off_policy = None  # the replay buffer and its updates, for a loss that trains from it
        if self.loss.trains_from_buffer:
            self.off_policy = BufferUpdates(cfg, accelerator.device, policy, dist)
        self.critic_only = False  # set during a critic warm-up update (learn)
        self.sft = registry.LOSSES.get("sft")(algo, None, policy) if data is not None else None
        self.version = 0

    @property
    def policy(self):
        model = self.accelerator.unwrap_model(self.model)
        return model.policy if isinstance(model, ActorCritic) else model

    @property
    def critic(self) -> torch.nn.Module | None:
        model = self.accelerator.unwrap_model(self.model)
        return model.critic if isinstance(model, ActorCritic) else None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps beyond the policy and the optimizer: the critic's weights
        and the loss module's own state."""
        critic, loss = self.critic, self.loss.state_dict()
        buffer = self.off_policy.state_dict() if self.off_policy is not None else {}
        return {**({"critic": {k: v.detach().cpu() for k, v in critic.state_dict().items()}} if critic is not None else {}), **({"loss": loss} if loss else {}), **buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        critic = self.critic
        if "loss" in state:
            self.loss.load_state_dict(state["loss"])
        if self.off_policy is not None:
            self.off_policy.load_state_dict(state)
        if critic is not None:
            if "critic" not in state:
                raise ConfigError("critic.type", self.cfg.critic.type, "the checkpoint holds no critic (it was written without one): resume without it, or start a new run")
            critic.load_state_dict(state["critic"])

    def set_lr(self, step: int) -> float:
        """Set the optimizer's learning rate for training step ``step``; returns the
        policy's (a critic with ``critic.lr`` follows the same schedule from its own rate)."""
        o = self.cfg.optim
        factor = lr_factor(step, self.cfg.total_steps, o.lr_schedule, o.warmup_steps, o.final_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = group.get("base_lr", o.lr) * factor
        return o.lr * factor

    def publish(self) -> int:
        """Mark the current weights as a new version (after an optimizer's update); returns it."""
        self.version += 1
        return self.version

    def advantages(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """The advantages of this process's rows and the keep mask (:class:`AdvantageStage`)."""
        targets, keep = self.advantage_stage(rollout, self.model)
        return targets.adv, keep

    def train_mask(self, rollout: Rollout, keep: torch.Tensor) -> torch.Tensor:
        return self.advantage_stage.train_mask(rollout, keep)

    def learn(self, rollout: Rollout, spare: Rollout, step: int) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
        """One RL update on ``rollout`` (this process's kept samples): advantages, masks, the
        update, the self-imitation memory and its steps. Returns the rollout with its training
        mask, the advantages and the update's metrics."""
        if self.off_policy is not None:
            out = self.off_policy.learn(self, rollout, step)
            self.publish()
            return out
        rollout = speedups.old_logp_roles(rollout, self.version, getattr(self.loss, "correction_fn", None) is not None)
        if rollout.old.deferred and self.cfg.algo.kl.in_reward_penalty:
            rollout = speedups.exact_old_logp(self.model, rollout)  # the KL penalty in the reward reads them now
        targets, keep = self.advantage_stage(rollout, self.model)
        rollout = rollout.with_(mask=self.train_mask(rollout, keep))
        # critic warm-up (critic.warmup_steps): the first updates of a run train the critic only
        warming = self.critic_cfg is not None and step < self.critic_cfg.warmup_steps
        self.critic_only = warming
        try:
            stats = self.update(rollout, targets, spare, step) if self.dist.sum(rollout.mask.sum()) > 0 else {}
        finally:
            self.critic_only = False
        rollout = rollout.with_(old=rollout.old.with_(graph=None))  # nothing after the update may hold the graph
        if warming:
            stats["critic/warmup"] = 1.0
        elif self.memory is not None:
            stats["self_imitation/added"] = float(self.memory.add(rollout, targets.adv, step))
            stats["self_imitation/size"] = float(len(self.memory))
            if len(self.memory):
                stats.update(self.self_imitation(step, spare))
        self.publish()
        return rollout, targets.adv, stats

    def update(self, rollout: Rollout, targets: Targets, spare: Rollout, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of ``num_minibatches`` optimizer steps, each minibatch a slice
        of one permutation (seeded by the step) of the global batch in group order: N
        processes take the minibatches one process would. ``algo.target_kl`` ends the passes
        before the first step whose minibatch is past it. Deferred old log-probs are made
        exact here and handed back in ``rollout.old_logp`` (``speedups``: the first
        minibatch's own forward, one no-grad pass for the other rows that run)."""
        cfg = self.cfg.algo
        device = self.accelerator.device
        source, rollout, spare = rollout, rollout.to(device), spare.to(device)
        targets = targets.to(device)
        if targets.adv.dim() == 1:  # [B, 1] broadcasts over decisions for free
            targets.adv = targets.adv[:, None]
        deferred = rollout.old.deferred and self.loss.reads_old_logp
        active = speedups.active_rows(self.loss, targets.adv, rollout.mask)
        if self.loss.needs_proximal:
            with torch.no_grad():
                targets.prox_logp = self.model(rollout.replay).detach()
            if deferred:  # that pass ran at the sampling weights: it is the old log-probs too
                rollout, deferred = rollout.with_(old=rollout.old.with_(values=targets.prox_logp, deferred=False)), False
        sizes = self.dist.sizes(rollout.batch_size)
        start, total = self.dist.offset(sizes), sum(sizes)
        # the batch in the order one process holds it (by global group index), as rows of
        # the rank-major gathered batch
        canonical = torch.sort(self.dist.gather_rows(rollout.group_id.cpu(), sizes), stable=True).indices
        targets.index = torch.empty_like(canonical).scatter_(0, canonical, torch.arange(total))[start : start + rollout.batch_size]
        self.loss.begin_update(step)
        gen = torch.Generator().manual_seed(group_seed(self.cfg.seed, step, _UPDATE_STREAM))
        sums: dict[str, torch.Tensor] = {}
        steps, stopped = 0, False
        for epoch in range(cfg.ppo_epochs):
            if stopped:
                break
            self.loss.begin_epoch(epoch)
            order = torch.randperm(total, generator=gen) if cfg.num_minibatches > 1 else torch.arange(total)
            for positions in order.chunk(cfg.num_minibatches):
                idx = local_rows(canonical[positions], start, rollout.batch_size)
                first = deferred and steps == 0
                trained = idx[active[idx]]
                if first and cfg.ppo_epochs * cfg.num_minibatches > 1:
                    # the rows of later minibatches, at the sampling weights, before they change
                    rest = active.clone()
                    rest[idx] = False
                    rollout = speedups.exact_old_logp(self.model, rollout, rest.nonzero().flatten(), spare)
                stats, first_logp = self._minibatch_step(rollout[idx], targets[idx], spare, step, at_sampling_weights=first or self.reuse_graph, rows=active[idx])
                if stats is None:  # algo.target_kl: this minibatch went past it, the update ends
                    stopped = True
                    break
                if first:
                    old = rollout.old_logp.clone()
                    old[trained.to(old.device)] = first_logp.to(old)
                    rollout = rollout.with_(old=rollout.old.with_(values=old, deferred=bool((~active).any())))
                for k, v in stats.items():  # means over the optimizer steps; a maximum stays one
                    sums[k] = torch.maximum(sums[k], v) if k.endswith("_max") and k in sums else sums.get(k, 0.0) + v
                steps += 1
        out = {k: float(v) if k.endswith("_max") else float(v) / steps for k, v in sums.items()} | self.loss.end_update(step)
        if cfg.target_kl is not None:
            out["update/steps_fraction"] = steps / (cfg.ppo_epochs * cfg.num_minibatches)
        if source.old.deferred and self.loss.reads_old_logp:  # hand the exact old log-probs on (self-imitation memory)
            # how far the sampler's provisional numbers were from the exact ones (the ratio a
            # first step would have started from without deferral), over the rows that ran
            replaced = rollout.mask.bool() & active.to(rollout.mask.device)[:, None]
            gap = (rollout.old_logp - source.old_logp.to(rollout.old_logp.device)).abs()
            out["old_logp/sampler_gap_max"] = self.dist.max(float(gap[replaced].max()) if replaced.any() else 0.0)
            source.old = source.old.with_(values=rollout.old.values.to(source.old.values.device), deferred=rollout.old.deferred)
        return out

    def normalizers(self, mb: Rollout, targets: Targets | None = None) -> dict[str, Any]:
        return normalizers(self.dist, mb, self.cfg.algo, targets)

    def _minibatch_step(self, mb: Rollout, targets: Targets, spare: Rollout, step: int, at_sampling_weights: bool = False, rows: torch.Tensor | None = None):
        """One optimizer step of the loss on this process's rows ``mb`` of a global minibatch,
        in pieces (:func:`speedups.num_pieces`) whose losses use the whole minibatch's
        normalizers. ``rows`` (bool [len(mb)]) picks the rows that run. Returns the metrics
        (None, None when ``algo.target_kl`` stops the update before this step) and, with
        ``at_sampling_weights``, the detached log-probs of the rows that ran."""
        cfg = self.cfg.algo
        norm = self.normalizers(mb, targets)
        if rows is not None and not bool(rows.all()):
            mb, targets = mb[rows], targets[rows]
        # a reused sampling graph is backpropagated once, whole: one piece
        k = 1 if self.reuse_graph else speedups.num_pieces(self.cfg, self.accelerator.device, self.policy, mb, self.dist, self.loss)
        metrics, forward_logp, proceed = MinibatchMetrics(), [], [True]

        def loss_of(piece):
            out = self.loss(self.model, piece[0], piece[1], norm, at_sampling_weights=at_sampling_weights)
            metrics.add(out, piece[0].mask)
            if at_sampling_weights and piece[0] is not spare and out.logp is not None:
                forward_logp.append(out.logp.detach())
            return out.loss

        def within_target() -> bool:  # algo.target_kl: this minibatch's approximate KL, all processes
            kl = None if cfg.target_kl is None or at_sampling_weights else metrics.mean(self.dist, "approx_kl")
            proceed[0] = kl is None or float(kl) <= cfg.target_kl
            return proceed[0]

        drop = list(self.policy.parameters()) if self.critic_only else None  # a critic warm-up drops the policy's gradients
        what = f"loss ({cfg.loss.type}: {cfg.objective.type}, {cfg.aggregation.type})"
        pieces = speedups.pieces_of(mb, targets, k, spare)
        grad_norm = optimizer_step(self.accelerator, self.model, self.optimizer, pieces, loss_of, what, step, self.cfg.optim.max_grad_norm, drop, within_target)
        if not proceed[0]:
            return None, None  # past the target: the update stops before this step
        out = metrics.result(self.dist)
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        if not at_sampling_weights:
            return out, None
        return out, torch.cat(forward_logp) if forward_logp else mb.old_logp.new_zeros(mb.old_logp.shape)

    def self_imitation(self, step: int, spare: Rollout | None = None) -> dict[str, float]:
        """``self_imitation.steps`` steps of the ``self_imitation`` loss on draws from the
        memory of all processes (:func:`mmrl.train.self_imitation.imitation_steps`)."""
        return sil.imitation_steps(self, step, spare)

    def sft_step(self, step: int) -> dict[str, float]:
        """One optimizer step of the ``sft`` loss on this process's share of the step's batch."""
        t0, batch, losses = time.time(), self.data.batch(step, self.accelerator.device), []

        def loss_of(piece):
            out = self.sft(self.model, piece, None, {})
            losses.append(out.loss.detach().cpu())
            return out.loss

        grad_norm = optimizer_step(self.accelerator, self.model, self.optimizer, [batch], loss_of, "sft loss", step, self.cfg.optim.max_grad_norm)
        commit_statistics(self.policy, self.dist.sum)
        out = {"loss/sft": float(self.dist.sum(losses[0]) / self.world)}
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        out["time/step_s"] = time.time() - t0
        self.publish()
        return out
