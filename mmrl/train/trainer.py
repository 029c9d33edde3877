"""The one training loop. Nothing here knows whether a decision is a token, a denoising
step or an action chunk; read it top to bottom.

    for step in range(total_steps):
        rollout = collect(step)                  # sampler: whole groups; rewards: [B, K]; filters (+ refill)
        adv, keep = advantages(rollout)          # group-relative, over the samples of all processes
        rollout.mask = train_mask(rollout, keep) # truncation, top-entropy, pivots
        update(rollout, adv)                     # epochs x minibatches of objective -> aggregation (+ KL)
        self_imitation()                         # optional: supervised steps on remembered good samples
        log(); maybe_eval(); maybe_checkpoint()

Everything modality-specific sits behind a hook: the sampler (``collect``, ``metrics``,
``counters``, ``evaluate``), the policy (``log_prob`` as its forward, ``sft_loss``, ``media``,
``exact_kl``), the reward components, and the SFT data source. The algorithm's math is in
``mmrl/algo``; each axis gets exactly its own config section's options.

N processes = 1 process: every process samples whole groups seeded by their global index;
rewards, advantages and filter decisions are taken over the samples of all processes; the
minibatches are slices of one global permutation, each process taking its own rows; loss
normalizers and logged metrics are global (``docs/architecture.md``).
"""

from __future__ import annotations

import copy
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from mmrl import registry
from mmrl.algo.advantage import AdvantageConfig, best_worst, clip_advantages, discounted_returns
from mmrl.algo.filters import FilterConfig
from mmrl.algo.masks import top_entropy_mask, truncation_mask
from mmrl.algo.objective import ObjectiveConfig
from mmrl.config import own_options, to_dict
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import build_sampler, group_seed
from mmrl.core.statistics import commit_statistics
from mmrl.core.weights import build_policy
from mmrl.errors import ConfigError, NonFiniteError
from mmrl.media import write_media
from mmrl.train import self_imitation as sil
from mmrl.train.checkpoint import Checkpointer, rng_state, set_rng_state
from mmrl.train.run_config import TrainConfig
from mmrl.train.distributed import Collectives, local_rows
from mmrl.train.metrics import MetricsWriter

_UPDATE_STREAM = 1 << 40  # group index reserved for the minibatch-order seed of a step
_SELF_IMITATION_STREAM = 1 << 41  # ... and for the draws from the self-imitation memory


@dataclass
class StopRequest:
    signum: int | None = None


@dataclass
class Collected:
    """A step's kept samples, plus sums over everything collected (for the metrics)."""

    rollout: Rollout
    spare: Rollout  # one collected sample with an empty mask: a no-op forward for DDP
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # metric -> [sum, count]
    num_collected: int = 0


def _add(sums: dict[str, torch.Tensor], name: str, values: torch.Tensor) -> None:
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1).cpu()
    pair = torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=torch.float64)])
    sums[name] = sums[name] + pair if name in sums else pair


def _freeze(policy: torch.nn.Module, prefixes: list[str]) -> None:
    """Stop gradients to the parameters whose names start with one of ``prefixes``."""
    names = [n for n, _ in policy.named_parameters()]
    for i, prefix in enumerate(prefixes):
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            modules = sorted({n.split(".")[0] for n in names})
            raise ConfigError(f"optim.frozen[{i}]", prefix, f"matches no parameter of the policy (its top-level modules: {modules})")
    for name, param in policy.named_parameters():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            param.requires_grad_(False)


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


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: str | os.PathLike | None = None, resume: bool = False):
        from accelerate import Accelerator

        self.cfg = cfg
        algo = cfg.algo
        self.run_dir = Path(run_dir or cfg.run_dir or Path("runs") / cfg.name)
        cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=cfg.mixed_precision)
        self.dist = Collectives(self.accelerator)
        self.world, self.rank = self.dist.world, self.dist.rank
        if algo.groups_per_step % self.world:
            raise ConfigError("algo.groups_per_step", algo.groups_per_step, f"must be divisible by the number of processes ({self.world})")
        self.local_groups = algo.groups_per_step // self.world
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep)
        latest = self.checkpointer.latest()
        if resume and latest is None:
            raise ConfigError("--resume", str(self.run_dir), "no checkpoint to resume from in this run directory")
        if not resume and latest is not None:
            raise ConfigError("run_dir", str(self.run_dir), "already holds a run; pass --resume to continue it or choose another run_dir")

        torch.manual_seed(cfg.seed)  # identical initial weights in every process and on resume
        # supervised runs may have no sampler: no rollouts, evaluation by the data source alone
        self.sampler = build_sampler(cfg)
        self.spec = self.sampler.policy_spec()
        policy = build_policy(cfg.policy, self.spec)
        self.reference = None
        if algo.kl.coef > 0:
            self.reference = policy.reference() or copy.deepcopy(policy)
            self.reference.requires_grad_(False).eval()
        si = algo.self_imitation
        if si.size and si.loss == "sft" and not _overrides(policy, "imitation_batch"):
            raise ConfigError("algo.self_imitation.loss", "sft", f"policy {cfg.policy.type!r} cannot turn its replay into a supervised batch; use loss: logp")
        if algo.kl.coef > 0 and algo.kl.type == "exact" and not _overrides(policy, "exact_kl"):
            raise ConfigError("algo.kl.type", "exact", f"policy {cfg.policy.type!r} has no closed-form per-decision KL; use k1, k2 or k3")
        _freeze(policy, cfg.optim.frozen)
        optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.adam_eps, weight_decay=cfg.optim.weight_decay
        )
        self.model, self.optimizer = self.accelerator.prepare(policy, optimizer)
        if self.reference is not None:
            self.reference.to(self.accelerator.device)

        context = RewardContext(device=self.accelerator.device, run_dir=self.run_dir, seed=cfg.seed)
        self.rewards = RewardSet(cfg.rewards, algo.reward_aggregation, context, algo.log_tamed_threshold)
        self.advantage_fn = registry.ADVANTAGES.get(algo.advantage.type)
        self.objective_fn = registry.OBJECTIVES.get(algo.objective.type)
        self.aggregate_fn = registry.AGGREGATIONS.get(algo.aggregation.type)
        self.kl_fn = registry.KL_ESTIMATORS.get(algo.kl.type) if algo.kl.type != "exact" else None
        self.filters = [(registry.FILTERS.get(f.type), own_options(f, FilterConfig)) for f in algo.filters]

        self.data = registry.DATA_SOURCES.get(cfg.data.type, "data.type")(cfg.data, self.policy, cfg.seed, self.world, self.rank) if algo.type == "sft" else None
        self.reuse_graph = algo.type == "rl" and self._reuses_sampling_graph(policy)
        self.memory = sil.SelfImitationMemory(si.size, self.dist) if si.size and algo.type == "rl" else None
        self.start_step = 0
        self.stop = StopRequest()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        if resume:
            self._resume(latest)
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(self.config_text)
        self.metrics = MetricsWriter(self.run_dir, cfg.log.tensorboard, enabled=self.rank == 0)
        if resume:
            self.metrics.truncate_after(self.start_step)

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model)

    def _reuses_sampling_graph(self, policy) -> bool:
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
        capable = getattr(policy, "keeps_sampling_graph", False) and getattr(self.sampler, "keeps_sampling_graph", False)
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

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self._install_signal_handlers()
        progress = None
        if cfg.log.progress and self.rank == 0:
            from tqdm.auto import tqdm

            progress = tqdm(total=cfg.total_steps, initial=self.start_step, desc=cfg.name, dynamic_ncols=True)
        last_eval: dict[str, Any] = {}
        step = self.start_step
        t_start = time.time()
        try:
            if cfg.eval.at_start and self.start_step == 0 and cfg.total_steps > 0:
                self.metrics.write(0, {f"eval/{k}": v for k, v in self.evaluate_aside(0).items()})
            for step in range(self.start_step, cfg.total_steps):
                lr = cfg.optim.lr * lr_factor(step, cfg.total_steps, cfg.optim.lr_schedule, cfg.optim.warmup_steps, cfg.optim.final_lr_ratio)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                metrics = self.sft_step(step) if self.data is not None else self.rl_step(step)
                metrics["optim/lr"] = lr
                done = step + 1
                evaluated = bool(cfg.eval.every) and done % cfg.eval.every == 0 and done < cfg.total_steps
                if evaluated:
                    last_eval = self.evaluate(done)
                    metrics.update({f"eval/{k}": v for k, v in last_eval.items()})
                if evaluated or done % cfg.log.every == 0 or done == cfg.total_steps:  # an evaluation is always logged
                    self.metrics.write(done, metrics)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(_postfix(metrics), refresh=False)
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
                    self.save(done)
                if self.stop.signum is not None:
                    self.save(done)
                    raise KeyboardInterrupt(self.stop.signum)
            step = cfg.total_steps
            if cfg.eval.at_end:
                last_eval = self.evaluate(step)
                self.metrics.write(step, {f"eval/{k}": v for k, v in last_eval.items()})
            self.save(step)
        finally:
            if progress is not None:
                progress.close()
            self.metrics.close()
            self.sampler.close()
        return {"step": step, "eval": last_eval, "wall_clock": time.time() - t_start, "run_dir": str(self.run_dir)}

    def rl_step(self, step: int) -> dict[str, Any]:
        t0 = time.time()
        collected = self.collect(step)
        commit_statistics(self.policy, self.dist.sum)  # what the step's samples taught running statistics
        t_sample = time.time() - t0
        rollout = collected.rollout
        if rollout.old_logp_deferred and self.cfg.algo.kl.in_reward_penalty:
            rollout = self.exact_old_logp(rollout)  # the KL penalty in the reward reads them now
        adv, keep = self.advantages(rollout)
        rollout = rollout.with_(mask=self.train_mask(rollout, keep))
        stats = self.update(rollout, adv, collected.spare, step) if self.dist.sum(rollout.mask.sum()) > 0 else {}
        rollout = rollout.with_(sampling_graph_logp=None)  # nothing after the update may hold the graph
        if self.memory is not None:
            stats["self_imitation/added"] = float(self.memory.add(rollout, adv, step))
            stats["self_imitation/size"] = float(len(self.memory))
            if len(self.memory):
                stats.update(self.self_imitation(step, collected.spare))
        return self._rl_metrics(collected, rollout, adv, stats, t_sample, time.time() - t0)

    # ------------------------------------------------------------------ collect, score, filter

    def collect(self, step: int) -> Collected:
        """Whole groups for this process, scored and filtered. With ``resample_rounds``
        (DAPO dynamic sampling) more groups are collected until the processes together keep
        ``groups_per_step`` groups; the kept samples are the first ones in (round, process)
        order, which is the order one process would collect them in."""
        cfg = self.cfg.algo
        target = cfg.groups_per_step * cfg.group_size
        policy = self.policy
        sums: dict[str, torch.Tensor] = {}
        kept_parts: list[Rollout] = []
        kept_total, num_collected, spare = 0, 0, None
        keep_graph = {"keep_graph": True} if self.reuse_graph else {}  # only samplers that keep it take the argument
        with torch.no_grad():
            for round_ in range(cfg.resample_rounds + 1 if self.filters else 1):
                # refill groups get indices past the step's batch: every process count draws the same groups
                offset = round_ * cfg.groups_per_step + self.rank * self.local_groups
                part = self.score(self.sampler.collect(policy, self.local_groups, cfg.group_size, step, offset, **keep_graph), step)
                num_collected += part.batch_size
                for name, values in self.sampler.metrics(part).items():
                    _add(sums, name, values)
                combined = self.rewards.combine(part.rewards, part.group_id)
                for k, name in enumerate(self.rewards.names):
                    _add(sums, f"reward/{name}", part.rewards[:, k])
                _add(sums, "reward/total", combined)
                if spare is None:
                    spare = part[:1].with_(mask=torch.zeros_like(part.mask[:1]))
                if not self.filters:
                    kept_parts.append(part)
                    break
                kept = part[self._keep(combined, part.group_id)]
                sizes = self.dist.sizes(kept.batch_size)
                room = max(0, target - kept_total - self.dist.offset(sizes))
                kept_parts.append(kept[: min(kept.batch_size, room)])
                kept_total += sum(sizes)
                if kept_total >= target:
                    break
        return Collected(Rollout.cat(kept_parts), spare, sums, num_collected)

    def score(self, rollout: Rollout, step: int) -> Rollout:
        """Reward columns [B, K] and, for a sampled-log-prob KL, the reference's log-probs."""
        rewards = self.rewards.score(rollout, policy=self.policy, reference=self.reference, step=step)
        rollout = rollout.with_(rewards=rewards, reward_names=list(self.rewards.names))
        if self.reference is not None and self.kl_fn is not None:
            ref_logp = self.reference.log_prob(rollout.to(self.accelerator.device).replay).detach().cpu()
            rollout = rollout.with_(ref_logp=ref_logp)
        return rollout

    def _keep(self, reward: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(reward.shape[0], dtype=torch.bool)
        for fn, options in self.filters:
            keep &= fn(reward, group_id, **options).cpu()
        return keep

    # ------------------------------------------------------------------ advantages and masks

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
            kl = (self.kl_fn(rollout.old_logp, rollout.ref_logp) * rollout.mask).sum(1).cpu()
            reward = reward - cfg.kl.coef * gather(kl)
        options = own_options(cfg.advantage, AdvantageConfig)
        if cfg.advantage.level == "step":
            step_rewards = gather(pad(rollout.step_rewards)) if rollout.step_rewards is not None else None
            adv, keep = self._step_advantages(reward, groups, gather(pad(rollout.mask)), step_rewards, options)
            adv = adv[:, : rollout.num_decisions]
        else:
            adv, keep = self.advantage_fn(reward, groups, **options)
        adv, keep = best_worst(clip_advantages(adv, cfg.advantage.clip), keep, reward, groups, cfg.advantage.best_worst)
        return adv[rows], keep[rows]

    def _step_advantages(self, terminal, groups, mask, step_rewards, options):
        """Per-decision advantages [B, T]: the combined terminal reward sits on each sample's
        last decision, env step rewards (``step_reward_weight``) on every decision; the
        discounted returns-to-go of decision t are compared within (group, t) by the
        configured advantage function."""
        cfg = self.cfg.algo.advantage
        B, T = mask.shape
        per_step = torch.zeros(B, T)
        last = (mask * torch.arange(1, T + 1)).argmax(1)
        per_step[torch.arange(B), last] = terminal
        if cfg.step_reward_weight > 0:
            if step_rewards is None:
                raise ConfigError("algo.advantage.step_reward_weight", cfg.step_reward_weight, "needs a sampler that records step rewards (the env sampler)")
            per_step = per_step + cfg.step_reward_weight * step_rewards
        returns = discounted_returns(per_step, mask, cfg.gamma)
        valid = mask.reshape(-1) > 0
        cell = (groups[:, None] * T + torch.arange(T)).reshape(-1)
        adv_valid, keep_valid = self.advantage_fn(returns.reshape(-1)[valid], cell[valid], **options)
        adv = torch.zeros(B * T)
        adv[valid] = adv_valid
        keep = torch.zeros(B * T, dtype=torch.bool)
        keep[valid] = keep_valid
        return adv.view(B, T), keep.view(B, T).any(1)

    def train_mask(self, rollout: Rollout, keep: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg.algo
        mask = rollout.mask * keep[:, None].to(rollout.mask.dtype)
        if cfg.mask_truncated and "truncated" in rollout.info:
            mask = truncation_mask(mask, torch.as_tensor(rollout.info["truncated"], dtype=torch.bool))
        if cfg.top_entropy_rho is not None and rollout.entropy is not None:
            mask = top_entropy_mask(mask, rollout.entropy, cfg.top_entropy_rho)
        return mask

    # ------------------------------------------------------------------ the update

    def optimizer_step(self, pieces: list, loss_of, what: str, step: int) -> torch.Tensor | None:
        """One optimizer step: backward of ``loss_of(piece)`` for each piece (the distributed
        wrapper all-reduces once, after the last), gradient clipping, step. Serves the RL
        update, self-imitation and SFT alike. Returns the gradient norm before clipping."""
        for i, piece in enumerate(pieces):
            loss = loss_of(piece)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"step {step + 1}: {what} is {loss.item()}")
            with self.accelerator.no_sync(self.model) if i + 1 < len(pieces) else nullcontext():
                self.accelerator.backward(loss)
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
        steps = 0
        for _ in range(cfg.ppo_epochs):
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
                if first:
                    old = rollout.old_logp.clone()
                    old[trained.to(old.device)] = first_logp.to(old)
                    rollout = rollout.with_(old_logp=old, old_logp_deferred=bool((~active).any()))
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        if source.old_logp_deferred:  # hand the exact old log-probs on (self-imitation memory)
            source.old_logp, source.old_logp_deferred = rollout.old_logp.to(source.old_logp.device), rollout.old_logp_deferred
        return {k: float(v) / steps for k, v in sums.items()}

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
        if cfg.kl.in_loss_term and self.kl_fn is None:
            logp, kl = self.model(batch.replay, mode="log_prob_and_kl", reference=self.reference, **sampled)
        else:
            logp = self.model(batch.replay, **sampled)
            if cfg.kl.in_loss_term:
                kl = self.kl_fn(logp, batch.ref_logp)
        old = logp.detach() if at_sampling_weights else batch.old_logp
        options = own_options(cfg.objective, ObjectiveConfig)
        options["log_ratio_clamp"] = cfg.objective.log_ratio_clamp
        if getattr(self.objective_fn, "needs_proximal", False):
            options["prox_logp"] = logp.detach() if at_sampling_weights else batch.info["_prox_logp"]
        per_decision, stats = self.objective_fn(logp, old, adv, mask=mask, **options)
        loss = self.aggregate_fn(per_decision, mask, **agg)
        parts = {"loss/policy": loss.detach()}
        if kl is not None:
            kl_loss = self.aggregate_fn(kl, mask, **agg)
            loss = loss + cfg.kl.coef * kl_loss
            parts["kl/ref"] = kl_loss.detach()
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
        if self.accelerator.device.type != "cpu" or not _overrides(self.policy, "activation_bytes"):
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
        pieces = [(mb[i], adv[i.to(adv.device)]) for i in _pieces(mb.batch_size, 1 if self.reuse_graph else self.num_pieces(mb))]
        pieces = [p if p[0].batch_size else (spare, torch.zeros_like(spare.mask)) for p in pieces]
        sums: dict[str, torch.Tensor] = {}
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
                    parts[f"_objective/{k}"] = (v * m).sum()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.detach().cpu()
            return loss

        grad_norm = self.optimizer_step(pieces, loss_of, f"loss ({cfg.objective.type}, {cfg.aggregation.type})", step)
        # global values: a process's loss is its share of the global loss x processes
        out = {k: self.dist.sum(v) / self.world for k, v in sums.items() if not k.startswith("_")}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        count = self.dist.sum(sums["_count"]).clamp_min(1)
        out["approx_kl"] = self.dist.sum(sums["_approx_kl"]) / count
        for k, v in sums.items():
            if k.startswith("_objective/"):
                out[k[1:]] = self.dist.sum(v) / count
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
            pieces = [(batch[i], adv[i.to(device)]) if i.numel() else (spare.to(device), torch.zeros_like(spare.mask, device=device)) for i in _pieces(batch.batch_size, self.num_pieces(batch))]
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

    # ------------------------------------------------------------------ supervised fine-tuning

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
        return out

    # ------------------------------------------------------------------ evaluation, checkpoints

    def evaluate(self, step: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.rank == 0:
            self.policy.eval()
            with torch.no_grad():
                result = self.sampler.evaluate(self.policy, self.cfg.eval.episodes, seed=self.cfg.seed + 1_000_003, rewards=self.rewards)
                if self.data is not None:  # the data source's held-out metrics (e.g. pairwise accuracy)
                    result.update(self.data.evaluate(self.policy))
                media = result.pop("media", None)
                if media:  # sample images / videos the policy asks to keep (mmrl.media)
                    write_media(self.run_dir / "samples" / f"step_{step:06d}", media)
                    self.metrics.add_media(step, media)
                result = {k: v for k, v in result.items() if isinstance(v, (int, float))}  # per-episode lists stay out of the metrics
            self.policy.train()
        self.accelerator.wait_for_everyone()
        return result

    def evaluate_aside(self, step: int) -> dict[str, Any]:
        """``evaluate``, leaving every random stream as it was: a run with an evaluation before
        training trains exactly as one without it."""
        state = rng_state()
        try:
            return self.evaluate(step)
        finally:
            set_rng_state(state)

    def save(self, step: int) -> None:
        self.accelerator.wait_for_everyone()
        keep_memory = self.memory is not None and self.cfg.algo.self_imitation.in_checkpoint
        memory = self.memory.state_dict() if keep_memory else None  # gathers from every process
        if self.rank == 0:
            state = {"sampler": self.sampler.state_dict(), "rewards": self.rewards.state_dict()}
            if keep_memory:
                state["self_imitation_memory"] = memory
            self.checkpointer.save(step, self.policy, _inner(self.optimizer), state, self.config_text)
        self.accelerator.wait_for_everyone()

    def _resume(self, path: Path) -> None:
        state = Checkpointer.load(path, self.policy, _inner(self.optimizer))
        self.sampler.load_state_dict(state.get("sampler", {}))
        self.rewards.load_state_dict(state.get("rewards", {}))
        if self.memory is not None:
            # "replay_memory": the key of checkpoints written before the memory had its own name
            self.memory.load_state_dict(state.get("self_imitation_memory", state.get("replay_memory", {})))
        set_rng_state(state["rng"])
        self.start_step = int(state["step"])

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self.stop.signum is not None:  # second signal: give up waiting for the step
                raise KeyboardInterrupt(signum)
            self.stop.signum = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass

    # ------------------------------------------------------------------ metrics

    def _rl_metrics(self, collected: Collected, rollout: Rollout, adv: torch.Tensor, update: dict[str, float], t_sample: float, t_step: float) -> dict[str, Any]:
        """Global values: sums and counts of every process, reduced."""
        out: dict[str, Any] = {}
        for name, pair in collected.sums.items():
            total, count = self.dist.sum(pair).tolist()
            out[name] = total / max(count, 1.0)
        kept, num_collected = self.dist.sum(rollout.batch_size).item(), self.dist.sum(collected.num_collected).item()
        if self.filters:
            out["filter/kept_fraction"] = kept / max(num_collected, 1.0)
        out["adv/abs_mean"] = (self.dist.sum(adv.abs().sum()) / max(self.dist.sum(adv.numel()).item(), 1.0)).item()
        out["decisions"] = self.dist.sum(rollout.mask.sum()).item()
        if rollout.entropy is not None:
            # the sampling policy's entropy per decision (sharpening or spreading under RL)
            mask = rollout.mask.to(rollout.entropy.device)
            out["entropy"] = (self.dist.sum((rollout.entropy * mask).sum()) / self.dist.sum(mask.sum()).clamp_min(1)).item()
        out.update(update)
        for name, value in self.sampler.counters().items():
            out[name] = self.dist.sum(value).item()
        out["time/sample_s"] = t_sample
        out["time/step_s"] = t_step
        return out


def _pieces(n: int, k: int) -> list[torch.Tensor]:
    """Row indices of ``n`` rows in exactly ``k`` pieces (some empty when n < k): every
    process runs the same number of forward/backward passes, as the distributed wrapper
    requires, whatever its number of rows."""
    return [torch.arange(n)[i * n // k : (i + 1) * n // k] for i in range(k)]


def _inner(optimizer):
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def _overrides(policy, method: str) -> bool:
    """Whether the policy implements an optional hook of :class:`PolicyModule`."""
    from mmrl.core.policy import PolicyModule

    impl = getattr(type(policy), method, None)
    return impl is not None and impl is not getattr(PolicyModule, method, None)


def _postfix(metrics: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key, short in (("success_rate", "success"), ("reward/total", "reward"), ("loss/sft", "loss"), ("eval/success_rate", "eval_success"), ("eval/accuracy", "eval_acc")):
        if key in metrics and isinstance(metrics[key], float) and math.isfinite(metrics[key]):
            out[short] = f"{metrics[key]:.3f}"
    return out


def train(cfg: TrainConfig, run_dir: str | os.PathLike | None = None, resume: bool = False) -> dict[str, Any]:
    """Build everything from ``cfg`` and run the loop; returns a summary."""
    return Trainer(cfg, run_dir, resume).train()
