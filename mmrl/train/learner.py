"""The learner: advantages, masks, the update (epochs x minibatches, pieces, DDP), the
self-imitation and SFT steps, and the optimizer. It owns the model and the optimizer, and it
publishes its weights with a version number, which every sample a rollout worker collects
carries (``Rollout.policy_version``).

One update, on the samples of all processes:

    adv, keep = advantages(rollout)          # group-relative, over all processes' samples
    rollout.mask = train_mask(rollout, keep) # truncation, top-entropy, pivots
    update(rollout, adv)                     # epochs x minibatches of objective -> aggregation (+ KL)
    self_imitation()                         # optional: supervised steps on remembered good samples

The update's speed-ups, each exact (``docs/architecture.md``): deferred old log-probs (the
first minibatch's own forward at the sampling weights), the reused sampling graph (one
backward through the sampling pass), idle samples left out of the passes, activation
pieces, and DDP spare samples (a masked no-op forward where a process has no rows).
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from typing import Any

import torch

from mmrl import registry
from mmrl.algo.advantage import AdvantageConfig, best_worst, clip_advantages, decision_rewards, step_advantages
from mmrl.algo.value import value_loss
from mmrl.core.critic import ActorCritic, build_critic
from mmrl.algo.correction import CorrectionConfig, apply_correction
from mmrl.algo.kl import kl_in_reward
from mmrl.algo.masks import top_entropy_mask, truncation_mask
from mmrl.algo.objective import ObjectiveConfig
from mmrl.config import own_options
from mmrl.core.policy import PolicyModule
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.core.statistics import commit_statistics
from mmrl.errors import ConfigError, NonFiniteError
from mmrl.train import self_imitation as sil
from mmrl.train.distributed import local_rows
from mmrl.train.run_config import TrainConfig

_UPDATE_STREAM = 1 << 40  # group index reserved for the minibatch-order seed of a step
_SELF_IMITATION_STREAM = 1 << 41  # ... and for the draws from the self-imitation memory


class Learner:
    """Owns the trained model (wrapped by ``accelerator``), its optimizer and the frozen
    reference; ``version`` counts the optimizer's published states (0: the initial weights)."""

    def __init__(self, cfg: TrainConfig, policy: PolicyModule, accelerator, dist, rewards, data=None, sampler_keeps_graph: bool = False):
        """``rewards`` (a RewardSet) combines the reward columns; ``data`` is the SFT data source
        of ``algo.type: sft`` (None for RL)."""
        algo = cfg.algo
        self.cfg, self.accelerator, self.dist, self.rewards, self.data = cfg, accelerator, dist, rewards, data
        self.world, self.rank = dist.world, dist.rank
        self.reference = None
        if algo.kl.coef > 0:
            self.reference = policy.reference() or copy.deepcopy(policy)
            self.reference.requires_grad_(False).eval()
        si = algo.self_imitation
        if si.size and si.loss == "sft" and not overrides(policy, "imitation_batch"):
            raise ConfigError("algo.self_imitation.loss", "sft", f"policy {cfg.policy.type!r} cannot turn its replay into a supervised batch; use loss: logp")
        if algo.kl.coef > 0 and algo.kl.type == "exact" and not overrides(policy, "exact_kl"):
            raise ConfigError("algo.kl.type", "exact", f"policy {cfg.policy.type!r} has no closed-form per-decision KL; use k1, k2 or k3")
        freeze(policy, cfg.optim.frozen)
        trained: torch.nn.Module = policy
        self.critic_cfg = cfg.critic if cfg.critic.type != "none" and algo.type == "rl" else None
        if self.critic_cfg is not None:  # a learned value baseline: the critic trains in the same steps
            first = next(policy.parameters())
            # the critic's dtype follows the policy's, but never below float32: a VLM held in
            # bf16 hands its value head float32 features
            dtype = first.dtype if first.dtype.itemsize >= 4 else torch.float32
            trained = ActorCritic(policy, build_critic(cfg.critic, policy).to(first.device, dtype))
        params: list = [p for p in trained.parameters() if p.requires_grad]
        if self.critic_cfg is not None and self.critic_cfg.lr is not None:  # the critic's own rate: a second parameter group
            critic_ids = {id(p) for p in trained.critic.parameters()}
            params = [
                {"params": [p for p in params if id(p) not in critic_ids], "base_lr": cfg.optim.lr},
                {"params": [p for p in params if id(p) in critic_ids], "base_lr": self.critic_cfg.lr},
            ]
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.adam_eps, weight_decay=cfg.optim.weight_decay)
        self.model, self.optimizer = accelerator.prepare(trained, optimizer)
        if self.reference is not None:
            self.reference.to(accelerator.device)
        self.advantage_fn = registry.ADVANTAGES.get(algo.advantage.type)
        self.objective_fn = registry.OBJECTIVES.get(algo.objective.type)
        self.aggregate_fn = registry.AGGREGATIONS.get(algo.aggregation.type)
        self.kl_fn = registry.KL_ESTIMATORS.get(algo.kl.type) if algo.kl.type != "exact" else None
        entry = registry.CORRECTIONS.entry(algo.correction.type, "algo.correction.type")
        # a correction that reads the sampler's log-probs keeps them beside the exact old ones
        self.correction_fn = entry.obj if entry.traits.get("needs_behaviour", False) else None
        self.correction_options = {**own_options(algo.correction, CorrectionConfig), "log_ratio_clamp": algo.correction.log_ratio_clamp}
        self.reuse_graph = algo.type == "rl" and self._reuses_sampling_graph(policy, sampler_keeps_graph)
        self.critic_only = False  # set during a critic warm-up update (learn)
        self.memory = sil.SelfImitationMemory(si.size, dist) if si.size and algo.type == "rl" else None
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
        """What a checkpoint keeps of the learner beyond the policy and the optimizer: the
        critic's weights."""
        critic = self.critic
        return {"critic": {k: v.detach().cpu() for k, v in critic.state_dict().items()}} if critic is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        critic = self.critic
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

    def learn(self, rollout: Rollout, spare: Rollout, step: int) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
        """One RL update on ``rollout`` (this process's kept samples): advantages, masks, the
        update, the self-imitation memory and its steps. Returns the rollout with its training
        mask, the advantages and the update's metrics."""
        if rollout.policy_version is not None and bool((rollout.policy_version != self.version).any()) and self.correction_fn is None:
            # samples of an earlier version (async rollouts): the sampler's numbers are the
            # behaviour policy's and, without a correction, the old log-probs of the ratio
            # (decoupled_ppo: the behaviour side of its weight); nothing is recomputed
            rollout = rollout.with_(old_logp_deferred=False)
        if self.correction_fn is not None and rollout.behaviour_logp is None:
            # the sampler's numbers are the behaviour policy's; the exact old log-probs (the
            # learner's current weights: the sampling version in sync mode, the proximal
            # policy of an async sample) are computed as deferred ones are
            rollout = rollout.with_(behaviour_logp=rollout.old_logp.clone(), old_logp_deferred=True)
        if rollout.old_logp_deferred and self.cfg.algo.kl.in_reward_penalty:
            rollout = self.exact_old_logp(rollout)  # the KL penalty in the reward reads them now
        adv, keep = self.advantages(rollout)
        rollout = rollout.with_(mask=self.train_mask(rollout, keep))
        # critic warm-up (critic.warmup_steps): the first updates of a run train the critic only
        warming = self.critic_cfg is not None and step < self.critic_cfg.warmup_steps
        self.critic_only = warming
        try:
            stats = self.update(rollout, adv, spare, step) if self.dist.sum(rollout.mask.sum()) > 0 else {}
        finally:
            self.critic_only = False
        rollout = rollout.with_(sampling_graph_logp=None)  # nothing after the update may hold the graph
        if warming:
            stats["critic/warmup"] = 1.0
        elif self.memory is not None:
            stats["self_imitation/added"] = float(self.memory.add(rollout, adv, step))
            stats["self_imitation/size"] = float(len(self.memory))
            if len(self.memory):
                stats.update(self.self_imitation(step, spare))
        self.publish()
        return rollout, adv, stats

    def _reuses_sampling_graph(self, policy, sampler_keeps_graph: bool) -> bool:
        """Whether the update backpropagates through the sampling pass's own log-probs
        (``algo.reuse_sampling_graph``). With one on-policy pass the recompute forward would
        evaluate the policy at the sampling weights on the sampled inputs: its log-probs and
        their gradient are the sampling pass's, so a policy and sampler that can keep that
        graph save the forward. ``auto`` leaves it off where it would save nothing or not be
        the same computation: explicit micro-batches (a memory bound the whole graph cannot
        keep), the exact KL in the loss (its forward runs anyway), mixed precision (the
        sampling pass runs outside autocast)."""
        cfg = self.cfg
        algo = cfg.algo
        if algo.reuse_sampling_graph is False:
            return False
        capable = getattr(policy, "keeps_sampling_graph", False) and sampler_keeps_graph
        if algo.reuse_sampling_graph is True:  # the single pass and micro-batches are checked by AlgoConfig.validate
            if not capable:
                raise ConfigError(
                    "algo.reuse_sampling_graph", True,
                    f"policy {cfg.policy.type!r} with sampler {cfg.sampler.type!r} cannot keep the sampling graph (keeps_sampling_graph); use auto or false",
                )
            return True
        single_pass = algo.ppo_epochs == 1 and algo.num_minibatches == 1 and algo.micro_batches in (None, 1)
        exact_kl_forward = algo.kl.in_loss_term and algo.kl.type == "exact"
        return capable and single_pass and not exact_kl_forward and cfg.mixed_precision == "no"

    def advantages(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Group-relative advantages ([B] or [B, T]) and the per-sample keep mask, computed on
        the samples of all processes (batch statistics are global); each process then takes
        its own rows."""
        cfg = self.cfg.algo
        sizes = self.dist.sizes(rollout.batch_size)
        start = self.dist.offset(sizes)
        rows = slice(start, start + rollout.batch_size)
        width = self.dist.max(rollout.num_decisions)
        pad = lambda t: torch.nn.functional.pad(t.cpu(), (0, width - t.shape[1]))  # noqa: E731
        gather = lambda t: self.dist.gather_rows(t.cpu(), sizes)  # noqa: E731
        groups = gather(rollout.group_id)
        reward = self.rewards.combine(gather(rollout.rewards), groups)
        if cfg.kl.in_reward_penalty:
            # PPO-RLHF: r - coef * sum_t KL(old || ref) of the sampled decisions
            # on the CPU, beside the rewards: the scorer keeps ref_logp there, the sampler may
            # leave old_logp and the mask on the policy's device
            penalty = kl_in_reward(torch.zeros(rollout.batch_size), rollout.old_logp.cpu(), rollout.ref_logp.cpu(), rollout.mask.cpu(), cfg.kl.coef, cfg.kl.type)
            reward = reward + gather(penalty)
        options = own_options(cfg.advantage, AdvantageConfig)
        if self.critic_cfg is not None:  # a learned value baseline (GAE): per decision
            adv, keep = self._value_advantages(rollout, reward, groups, gather, pad, rows, options)
        elif cfg.advantage.level == "step":
            step_rewards = gather(pad(rollout.step_rewards)) if rollout.step_rewards is not None else None
            if cfg.advantage.step_reward_weight > 0 and step_rewards is None:
                raise ConfigError("algo.advantage.step_reward_weight", cfg.advantage.step_reward_weight, "needs a sampler that records step rewards (the env sampler)")
            adv, keep = step_advantages(
                self.advantage_fn, reward, groups, gather(pad(rollout.mask)), step_rewards,
                gamma=cfg.advantage.gamma, step_reward_weight=cfg.advantage.step_reward_weight, **options,
            )
            adv = adv[:, : rollout.num_decisions]
        else:
            adv, keep = self.advantage_fn(reward, groups, **options)
        adv, keep = best_worst(clip_advantages(adv, cfg.advantage.clip), keep, reward, groups, cfg.advantage.best_worst)
        return adv[rows], keep[rows]

    def _value_advantages(self, rollout: Rollout, reward, groups, gather, pad, rows, options) -> tuple[torch.Tensor, torch.Tensor]:
        """An advantage that reads values (``needs_values``): the critic's values of every
        decision (one no-grad pass at the current weights), the per-decision rewards as the
        step-level returns compose them, over all processes' samples. Keeps this process's
        critic targets and values in ``rollout.info`` for the value loss."""
        cfg = self.cfg.algo
        on_device = rollout.to(self.accelerator.device)
        with torch.no_grad():
            values = self.model(on_device.replay, mode="value").detach().float().cpu()
            bootstrap = torch.zeros(rollout.batch_size)
            if options.get("bootstrap_truncated") and "final_replay" in rollout.info:  # episodes a time limit cut: V of the final observation
                final = self.model(on_device.info["final_replay"], mode="value").detach().float().cpu()[:, 0]
                cut = torch.as_tensor(rollout.info["truncated"], dtype=torch.bool).cpu()
                bootstrap = torch.where(cut, final, bootstrap)
        mask = gather(pad(rollout.mask))
        step_rewards = gather(pad(rollout.step_rewards)) if rollout.step_rewards is not None else None
        per_decision = decision_rewards(reward, mask, step_rewards, cfg.advantage.step_reward_weight)
        gamma: float | torch.Tensor = cfg.advantage.gamma
        if "decision_steps" in rollout.info:  # an action chunk of k env steps: the next decision is k steps away
            gamma = cfg.advantage.gamma ** gather(pad(torch.as_tensor(rollout.info["decision_steps"]).cpu())).double()
        adv, keep, returns = self.advantage_fn(
            per_decision.double(), groups, values=gather(pad(values)).double(), mask=mask, gamma=gamma, bootstrap=gather(bootstrap).double(), **options,
        )
        width = rollout.num_decisions
        rollout.info["_returns"] = returns[rows, :width].float()
        rollout.info["_old_values"] = values
        return adv[:, :width].float(), keep

    def train_mask(self, rollout: Rollout, keep: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg.algo
        # the advantages (and keep) are worked out on the CPU; the rollout stays where its
        # sampler left it (the policy's device)
        mask = rollout.mask * keep[:, None].to(rollout.mask.device, rollout.mask.dtype)
        if cfg.mask_truncated and "truncated" in rollout.info:
            mask = truncation_mask(mask, torch.as_tensor(rollout.info["truncated"], dtype=torch.bool, device=mask.device))
        if cfg.top_entropy_rho is not None and rollout.entropy is not None:
            mask = top_entropy_mask(mask, rollout.entropy, cfg.top_entropy_rho)
        return mask

    def optimizer_step(self, pieces: list, loss_of, what: str, step: int, proceed=None) -> torch.Tensor | None:
        """One optimizer step: backward of ``loss_of(piece)`` for each piece (the distributed
        wrapper all-reduces once, after the last), gradient clipping, step. Serves the RL
        update, self-imitation and SFT alike. Returns the gradient norm before clipping.
        ``proceed`` (called after the backward passes, the same answer in every process)
        returning False drops the gradients instead: no step, and None is returned."""
        for i, piece in enumerate(pieces):
            loss = loss_of(piece)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"step {step + 1}: {what} is {loss.item()}")
            with self.accelerator.no_sync(self.model) if i + 1 < len(pieces) else nullcontext():
                self.accelerator.backward(loss)
        if proceed is not None and not proceed():
            self.optimizer.zero_grad(set_to_none=True)
            return None
        if self.critic_only:  # the policy's gradients are dropped: AdamW leaves a parameter without one as it is
            for p in self.policy.parameters():
                p.grad = None
        grad_norm = None
        if self.cfg.optim.max_grad_norm is not None:
            grad_norm = torch.as_tensor(self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)).detach().cpu()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def update(self, rollout: Rollout, adv: torch.Tensor, spare: Rollout, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of ``num_minibatches`` optimizer steps. Each minibatch is a
        slice of one permutation (seeded by the step) of the global batch in group order, so
        N processes take the same minibatches one process would, each its own rows of them.

        Samples that the loss cannot see — advantage 0 on every valid decision, under an
        objective that is then 0 (``zero_at_zero_advantage``) and without a KL term in the
        loss — are left out of the passes; the normalizers still count them, so the loss and
        its gradient are those of the whole minibatch; the objective's metrics (approx_kl,
        clipped, ratio) are over the decisions that ran.

        A rollout with deferred old log-probs (``old_logp_deferred``) gets its exact ones
        here, written back into ``rollout.old_logp``: the first minibatch runs at the sampling
        weights, so its own forward gives its rows' (every ratio 1); the other rows' come from
        one no-grad pass before the first optimizer step (none with a single step). Samples
        left out keep the provisional numbers (the flag then stays set; nothing reads them:
        the self-imitation memory keeps samples with a positive advantage only).

        With ``algo.reuse_sampling_graph`` engaged (one pass, :meth:`_reuses_sampling_graph`)
        the loss takes the rollout's ``sampling_graph_logp`` as its log-probs, their detached
        values as the old (and proximal) ones, and runs one backward through the sampling
        graph: no forward, no proximal pass, one piece (the graph is whole already)."""
        cfg = self.cfg.algo
        device = self.accelerator.device
        source, rollout = rollout, rollout.to(device)
        adv = adv.to(device)
        adv = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] broadcasts over decisions for free
        deferred = rollout.old_logp_deferred
        # samples the loss cannot see (advantage 0 on every valid decision, with an objective
        # that is 0 there and no KL term in the loss) are left out of every pass: the same
        # loss and gradient (normalizers count them), less compute
        idle_skipped = getattr(self.objective_fn, "zero_at_zero_advantage", False) and not cfg.kl.in_loss_term
        active = ((adv * rollout.mask) != 0).any(1).cpu() if idle_skipped else torch.ones(rollout.batch_size, dtype=torch.bool)
        if getattr(self.objective_fn, "needs_proximal", False) and not self.reuse_graph:
            with torch.no_grad():
                rollout.info["_prox_logp"] = self.model(rollout.replay).detach()
            if deferred:  # that pass ran at the sampling weights: it is the old log-probs too
                rollout, deferred = rollout.with_(old_logp=rollout.info["_prox_logp"], old_logp_deferred=False), False
        sizes = self.dist.sizes(rollout.batch_size)
        start, total = self.dist.offset(sizes), sum(sizes)
        # the batch in the order one process holds it (by global group index), as rows of
        # the rank-major gathered batch
        canonical = torch.sort(self.dist.gather_rows(rollout.group_id.cpu(), sizes), stable=True).indices
        gen = torch.Generator().manual_seed(group_seed(self.cfg.seed, step, _UPDATE_STREAM))
        sums: dict[str, torch.Tensor] = {}
        steps, stopped = 0, False
        for _ in range(cfg.ppo_epochs):
            if stopped:
                break
            order = torch.randperm(total, generator=gen) if cfg.num_minibatches > 1 else torch.arange(total)
            for positions in order.chunk(cfg.num_minibatches):
                idx = local_rows(canonical[positions], start, rollout.batch_size)
                first = deferred and steps == 0
                trained = idx[active[idx]]
                if first and cfg.ppo_epochs * cfg.num_minibatches > 1:
                    # the rows of later minibatches, at the sampling weights, before they change
                    rest = active.clone()
                    rest[idx] = False
                    rollout = self.exact_old_logp(rollout, rest.nonzero().flatten(), spare.to(device))
                stats, first_logp = self._minibatch_step(
                    rollout[idx], adv[idx.to(device)], spare.to(device), step, at_sampling_weights=first or self.reuse_graph, rows=active[idx]
                )
                if stats is None:  # algo.target_kl: this minibatch went past it, the update ends
                    stopped = True
                    break
                if first:
                    old = rollout.old_logp.clone()
                    old[trained.to(old.device)] = first_logp.to(old)
                    rollout = rollout.with_(old_logp=old, old_logp_deferred=bool((~active).any()))
                for k, v in stats.items():  # means over the optimizer steps; a maximum stays one
                    sums[k] = torch.maximum(sums[k], v) if k.endswith("_max") and k in sums else sums.get(k, 0.0) + v
                steps += 1
        out = {k: float(v) if k.endswith("_max") else float(v) / steps for k, v in sums.items()}
        if cfg.target_kl is not None:
            out["update/steps_fraction"] = steps / (cfg.ppo_epochs * cfg.num_minibatches)
        if source.old_logp_deferred:  # hand the exact old log-probs on (self-imitation memory)
            # how far the sampler's provisional numbers were from the exact ones (the ratio a
            # first step would have started from without deferral), over the rows that ran
            replaced = rollout.mask.bool() & active.to(rollout.mask.device)[:, None]
            gap = (rollout.old_logp - source.old_logp.to(rollout.old_logp.device)).abs()
            out["old_logp/sampler_gap_max"] = self.dist.max(float(gap[replaced].max()) if replaced.any() else 0.0)
            source.old_logp, source.old_logp_deferred = rollout.old_logp.to(source.old_logp.device), rollout.old_logp_deferred
        return out

    def exact_old_logp(self, rollout: Rollout, rows: torch.Tensor | None = None, spare: Rollout | None = None) -> Rollout:
        """``rollout`` with the exact old log-probs of ``rows`` (all by default): one no-grad
        pass of the policy's ``log_prob`` at the current (= sampling) weights. A process
        without such rows runs ``spare`` instead, so that every process makes the same calls."""
        with torch.no_grad():
            if rows is None:
                return rollout.with_(old_logp=self.model(rollout.replay).detach(), old_logp_deferred=False)
            if rows.numel() == 0:
                self.model(spare.replay)
                return rollout
            part = rollout[rows]
            old = rollout.old_logp.clone()
            old[rows.to(old.device)] = self.model(part.replay).detach().to(old)
        return rollout.with_(old_logp=old)

    def normalizers(self, mb: Rollout) -> dict[str, Any]:
        """The aggregation's normalizers for minibatch ``mb``: token count, sequence count and
        length, over all processes. Each process divides by (global count / processes), so the
        distributed wrapper's gradient average equals one process's loss on the whole batch."""
        agg = self.cfg.algo.aggregation
        return {
            # a minibatch without valid decisions (e.g. all truncated) gives loss 0, not 0/0
            "num_tokens": max(self.dist.sum(mb.mask.sum()).item(), 1.0) / self.world,
            "num_seqs": self.dist.sum(mb.batch_size).item() / self.world,
            "max_len": getattr(agg, "max_len", None) or self.dist.max(mb.mask.shape[1]),
        }

    def policy_loss(self, batch: Rollout, adv: torch.Tensor, agg: dict[str, Any], at_sampling_weights: bool = False):
        """The training loss of ``batch`` (objective, aggregation with normalizers ``agg``,
        KL term): (loss, logp, objective stats, detached loss parts for the metrics).
        ``at_sampling_weights`` takes the current log-probs as the old (and proximal) ones,
        i.e. every ratio is 1 — the gradient of a first PPO step. With the sampling graph
        reused the log-probs are the batch's ``sampling_graph_logp`` (through the model's
        forward, so that a distributed wrapper sees their backward)."""
        cfg = self.cfg.algo
        mask = batch.mask
        kl = None
        sampled = {"sampled_logp": batch.sampling_graph_logp} if self.reuse_graph else {}
        value = {"value": True} if self.critic_cfg is not None else {}  # the values come from the same forward
        values = None
        if cfg.kl.in_loss_term and self.kl_fn is None:
            out = self.model(batch.replay, mode="log_prob_and_kl", reference=self.reference, **sampled, **value)
            (logp, kl), values = out if value else (out, None)
        else:
            out = self.model(batch.replay, **sampled, **value)
            logp, values = out if value else (out, None)
            if cfg.kl.in_loss_term:
                kl = self.kl_fn(logp, batch.ref_logp)
        old = logp.detach() if at_sampling_weights else batch.old_logp
        options = own_options(cfg.objective, ObjectiveConfig)
        options["log_ratio_clamp"] = cfg.objective.log_ratio_clamp
        if getattr(self.objective_fn, "needs_proximal", False):
            options["prox_logp"] = logp.detach() if at_sampling_weights else batch.info["_prox_logp"]
        per_decision, stats = self.objective_fn(logp, old, adv, mask=mask, **options)
        if self.correction_fn is not None:
            # stop-gradient weights of pi_old / mu, per decision, on the objective's loss only
            # (the normalizers keep the batch's mask: a removed decision counts with weight 0)
            weight, kept, _ = self.correction_fn(old, batch.behaviour_logp, mask, **self.correction_options)
            per_decision = apply_correction(per_decision, weight)
            stats = {**stats, "correction/weight_mean": weight, "correction/weight_max": weight, "correction/removed_fraction": (mask.bool() & ~kept).float()}
        loss = self.aggregate_fn(per_decision, mask, **agg)
        parts = {"loss/policy": loss.detach()}
        if kl is not None:
            kl_loss = self.aggregate_fn(kl, mask, **agg)
            loss = loss + cfg.kl.coef * kl_loss
            parts["kl/ref"] = kl_loss.detach()
        if values is not None:
            c = self.critic_cfg
            if "_returns" in batch.info:
                per = value_loss(values, batch.info["_old_values"].to(values), batch.info["_returns"].to(values), c.value_clip)
                v_loss = (per * mask).sum() / agg["num_tokens"]  # mean over the minibatch's valid decisions, all processes
            else:  # the no-op piece of a process without rows
                v_loss = values.sum() * 0.0
            loss = loss + c.value_coef * v_loss
            parts["loss/value"] = v_loss.detach()
        return loss, logp, stats, parts

    def num_pieces(self, batch: Rollout) -> int:
        """The forward/backward pieces of this process's rows ``batch`` of one optimizer step:
        ``algo.micro_batches``, or when it is null, on a CPU, as many as keep each piece's
        share of the policy's activation estimate (``policy.activation_bytes``, bytes per
        sample) under ``algo.micro_batch_mb`` — one call whose tensors outgrow the cache runs
        slower than several that fit; elsewhere, or without an estimate, 1. The largest
        count over processes, so that every process runs the same passes."""
        cfg = self.cfg.algo
        if cfg.micro_batches is not None:
            return cfg.micro_batches
        if self.accelerator.device.type != "cpu" or not overrides(self.policy, "activation_bytes"):
            return 1  # the same in every process: no need to agree
        k = 1
        per_sample = self.policy.activation_bytes(batch.replay) if batch.batch_size else None
        if per_sample:
            k = min(batch.batch_size, max(1, math.ceil(batch.batch_size * per_sample / (cfg.micro_batch_mb * 2**20))))
        return self.dist.max(k)

    def _minibatch_step(
        self, mb: Rollout, adv: torch.Tensor, spare: Rollout, step: int, at_sampling_weights: bool = False, rows: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """One optimizer step on this process's rows ``mb`` of a global minibatch; with
        several pieces (:meth:`num_pieces`) the forward/backward runs in pieces whose losses
        use the whole minibatch's normalizers. ``rows`` (bool [len(mb)]) picks the rows that run, the others
        adding nothing to the loss (``update``). A process without rows runs a no-op piece so
        that every process takes part in the gradient all-reduce. Returns the metrics and,
        with ``at_sampling_weights`` (old log-probs = the forward's own, see ``policy_loss``),
        the detached log-probs of the rows that ran."""
        cfg = self.cfg.algo
        agg = self.normalizers(mb)
        if rows is not None and not bool(rows.all()):
            mb, adv = mb[rows], adv[rows.to(adv.device)]
        # a reused sampling graph is backpropagated once, whole: one piece
        pieces = [(mb[i], adv[i.to(adv.device)]) for i in split_rows(mb.batch_size, 1 if self.reuse_graph else self.num_pieces(mb))]
        pieces = [p if p[0].batch_size else (spare, torch.zeros_like(spare.mask)) for p in pieces]
        sums: dict[str, torch.Tensor] = {}
        maxima: dict[str, float] = {}
        forward_logp: list[torch.Tensor] = []

        def loss_of(piece):
            batch, piece_adv = piece
            loss, logp, stats, parts = self.policy_loss(batch, piece_adv, agg, at_sampling_weights=at_sampling_weights)
            with torch.no_grad():
                m = batch.mask
                if at_sampling_weights:
                    if batch is not spare:
                        forward_logp.append(logp.detach())
                    log_ratio = torch.zeros_like(m)
                else:
                    log_ratio = (logp.detach() - batch.old_logp) * m
                parts["_approx_kl"] = ((torch.exp(log_ratio) - 1 - log_ratio) * m).sum()
                parts["_count"] = m.sum()
                for k, v in stats.items():
                    if k.endswith("_max"):  # a maximum over the valid decisions, not a mean
                        maxima[k] = max(maxima.get(k, float("-inf")), float(v[m.bool()].max()) if m.any() else float("-inf"))
                    else:
                        parts[k if k.startswith("correction/") else f"_objective/{k}"] = (v * m).sum()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.detach().cpu()
            return loss

        kl: list[torch.Tensor] = []
        verdict: list[bool] = []

        def within_target() -> bool:  # algo.target_kl: this minibatch's approximate KL, all processes
            kl.append(self.dist.sum(sums["_approx_kl"]) / self.dist.sum(sums["_count"]).clamp_min(1))
            verdict.append(cfg.target_kl is None or at_sampling_weights or float(kl[0]) <= cfg.target_kl)
            return verdict[0]

        grad_norm = self.optimizer_step(pieces, loss_of, f"loss ({cfg.objective.type}, {cfg.aggregation.type})", step, proceed=within_target)
        if not verdict[0]:
            return None, None  # past the target: the update stops before this step
        # global values: a process's loss is its share of the global loss x processes
        out = {k: self.dist.sum(v) / self.world for k, v in sums.items() if not k.startswith(("_", "correction/"))}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        count = self.dist.sum(sums["_count"]).clamp_min(1)
        out["approx_kl"] = kl[0]
        for k, v in sums.items():
            if k.startswith("_objective/"):
                out[k[1:]] = self.dist.sum(v) / count
            elif k.startswith("correction/"):  # masked means over the decisions, not loss parts
                out[k] = self.dist.sum(v) / count
        for k, v in maxima.items():
            out[k] = torch.tensor(self.dist.max(v))
        if not at_sampling_weights:
            return out, None
        return out, torch.cat(forward_logp) if forward_logp else mb.old_logp.new_zeros(mb.old_logp.shape)

    def self_imitation(self, step: int, spare: Rollout | None = None) -> dict[str, float]:
        """``self_imitation.steps`` optimizer steps of the self-imitation loss on
        ``self_imitation.batch`` samples drawn from the memory of all processes each
        (forward/backward in ``micro_batches`` pieces); returns the mean loss
        (``mmrl/train/self_imitation.py``)."""
        cfg = self.cfg.algo
        si = cfg.self_imitation
        device = self.accelerator.device
        gen = torch.Generator().manual_seed(group_seed(self.cfg.seed, step, _SELF_IMITATION_STREAM))  # the same draws in every process
        losses = []
        for _ in range(si.steps):
            batch, adv = self.memory.sample(si.batch, gen)
            if batch is None or batch.batch_size == 0:  # none of the draws lives here
                batch, adv = spare, torch.zeros_like(spare.mask)
            batch, adv = batch.to(device), adv.to(device)
            # an empty piece runs a masked spare sample: it keeps the all-reduce in step
            pieces = [(batch[i], adv[i.to(device)]) if i.numel() else (spare.to(device), torch.zeros_like(spare.mask, device=device)) for i in split_rows(batch.batch_size, self.num_pieces(batch))]
            if si.loss == "sft":
                count = self.dist.sum((adv * batch.mask).sum()).clamp_min(1e-8).to(device) / self.world
                loss_fn = lambda p: sil.sft_loss(self.model, self.policy, p[0].replay, p[1] * p[0].mask, count)  # noqa: E731
            else:
                count = self.dist.sum(batch.mask.sum()).clamp_min(1).to(device) / self.world
                loss_fn = lambda p: sil.logp_loss(self.model, p[0].replay, p[0].mask, p[1], count)  # noqa: E731
            total = []

            def loss_of(piece):
                loss = loss_fn(piece)
                total.append(loss.detach().cpu())
                return loss

            self.optimizer_step(pieces, loss_of, "self-imitation loss", step)
            losses.append(float(self.dist.sum(sum(total)) / self.world))
        return {"loss/self_imitation": sum(losses) / len(losses)}

    def sft_step(self, step: int) -> dict[str, float]:
        """One optimizer step of ``policy.sft_loss`` on the data source's batch for this step
        (each process its share; the distributed wrapper averages the gradients)."""
        t0 = time.time()
        batch = self.data.batch(step, self.accelerator.device)
        losses = []

        def loss_of(piece):
            loss = self.model(piece, mode="sft")
            losses.append(loss.detach().cpu())
            return loss

        grad_norm = self.optimizer_step([batch], loss_of, "sft loss", step)
        commit_statistics(self.policy, self.dist.sum)
        out = {"loss/sft": float(self.dist.sum(losses[0]) / self.world)}
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        out["time/step_s"] = time.time() - t0
        self.publish()
        return out


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


def split_rows(n: int, k: int) -> list[torch.Tensor]:
    """Row indices of ``n`` rows in exactly ``k`` pieces (some empty when n < k): every
    process runs the same number of forward/backward passes, as the distributed wrapper
    requires, whatever its number of rows."""
    return [torch.arange(n)[i * n // k : (i + 1) * n // k] for i in range(k)]


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


def overrides(policy, method: str) -> bool:
    """Whether the policy implements an optional hook of :class:`PolicyModule`."""
    impl = getattr(type(policy), method, None)
    return impl is not None and impl is not getattr(PolicyModule, method, None)
