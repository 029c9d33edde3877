"""The one training loop. Nothing here knows whether a decision is a token, a denoising
step or an action chunk; read it top to bottom.

    for step in range(total_steps):
        rollout = sampler.collect(policy, groups, G)        # whole groups per process
        rollout.rewards = rewards(rollout)                  # [B, K]
        rollout = filters(rollout)                          # e.g. drop zero-variance groups
        adv = advantage(rollout)                            # group-relative
        for epoch, minibatch: loss = aggregate(objective(...)) + kl; backward; step
        log(); maybe_eval(); maybe_checkpoint()
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mmrl import registry
from mmrl.algo import advantage as adv_mod
from mmrl.algo.masks import top_entropy_mask, truncation_mask
from mmrl.config import to_dict
from mmrl.core.policy import PolicyModule
from mmrl.core.weights import build_policy
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError, NonFiniteError
from mmrl.train.checkpoint import Checkpointer
from mmrl.train.config import TrainConfig
from mmrl.train.metrics import MetricsWriter
from mmrl.train.replay import SelfImitationMemory

_UPDATE_STREAM = 1 << 40  # group index reserved for the minibatch-shuffle seed of a step
_REPLAY_STREAM = 1 << 41  # ... and for the draws from the self-imitation memory


def _kwargs_for(fn, source, **extra) -> dict[str, Any]:
    """The keyword arguments of ``fn`` that the algo config (or ``extra``) provides."""
    params = inspect.signature(fn).parameters
    out = {k: getattr(source, k) for k in params if hasattr(source, k)}
    out.update({k: v for k, v in extra.items() if k in params})
    return out


@dataclass
class StopRequest:
    signum: int | None = None


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
        self.run_dir = Path(run_dir or cfg.run_dir or Path("runs") / cfg.name)
        cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=cfg.mixed_precision)
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        algo = cfg.algo
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
        self.sampler = registry.SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, cfg)
        self.spec = self.sampler.policy_spec()
        policy = build_policy(cfg.policy, self.spec)
        self.reference = None
        if algo.kl_coef > 0:
            self.reference = policy.reference() or copy.deepcopy(policy)
            self.reference.requires_grad_(False).eval()
        if algo.replay_size and algo.replay_loss == "sft" and getattr(type(policy), "imitation_batch", None) in (None, PolicyModule.imitation_batch):
            raise ConfigError("algo.replay_loss", "sft", f"policy {cfg.policy.type!r} cannot turn its replay into a supervised batch; use replay_loss: logp")
        _freeze(policy, cfg.optim.frozen)
        optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.adam_eps, weight_decay=cfg.optim.weight_decay
        )
        self.model, self.optimizer = self.accelerator.prepare(policy, optimizer)
        if self.reference is not None:
            self.reference.to(self.accelerator.device)

        self.rewards = [(registry.REWARDS.get(r.type, f"rewards[{i}].type"), r) for i, r in enumerate(cfg.rewards)]
        self.reward_names = [r.type for r in cfg.rewards]
        self.advantage_fn = registry.ADVANTAGES.get(algo.advantage)
        self.objective_fn = registry.OBJECTIVES.get(algo.objective)
        self.aggregate_fn = registry.AGGREGATIONS.get(algo.aggregation)
        self.kl_fn = registry.KL_ESTIMATORS.get(algo.kl_estimator)
        self.filters = [(registry.FILTERS.get(name), name) for name in algo.filters]

        self.demos = self._load_demos() if algo.type == "sft" else None
        self.memory = SelfImitationMemory(algo.replay_size) if algo.replay_size and algo.type == "rl" else None
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

    # ------------------------------------------------------------------ sampling and scoring

    def collect(self, step: int) -> Rollout:
        """Whole groups for this process, scored, filtered and refilled (DAPO) if asked."""
        cfg = self.cfg.algo
        offset = self.rank * self.local_groups
        policy = self.policy
        with torch.no_grad():
            rollout = self._score(self.sampler.collect(policy, self.local_groups, cfg.group_size, step, offset), step)
            if not self.filters:
                return rollout
            kept = rollout[self._keep(rollout)]
            for round_ in range(1, cfg.resample_rounds + 1):
                if kept.batch_size >= self.local_groups * cfg.group_size:
                    break
                # refill groups get indices past this step's batch, so every process count
                # draws the same groups
                extra = self.sampler.collect(policy, self.local_groups, cfg.group_size, step, offset + round_ * cfg.groups_per_step)
                extra = self._score(extra, step)
                kept = Rollout.cat([kept, extra[self._keep(extra)]])
            n = min(kept.batch_size, self.local_groups * cfg.group_size)
            kept = kept[:n]
            kept.info["_collected"] = torch.full((n,), float(rollout.batch_size))
            return kept

    def _keep(self, rollout: Rollout) -> torch.Tensor:
        reward = self._combined_reward(rollout)
        keep = torch.ones(rollout.batch_size, dtype=torch.bool)
        for fn, _ in self.filters:
            keep &= fn(reward, rollout.group_id, **_kwargs_for(fn, self.cfg.algo, lo=self.cfg.algo.accuracy_lo, hi=self.cfg.algo.accuracy_hi)).cpu()
        return keep

    def _combined_reward(self, rollout: Rollout) -> torch.Tensor:
        weights = torch.tensor([r.weight for _, r in self.rewards], dtype=rollout.rewards.dtype)
        return rollout.rewards @ weights

    def _score(self, rollout: Rollout, step: int) -> Rollout:
        columns = []
        for (fn, rcfg), name in zip(self.rewards, self.reward_names):
            r = torch.as_tensor(fn(rollout, rcfg), dtype=torch.float32).reshape(-1).cpu()
            bad = ~torch.isfinite(r)
            if bad.any():
                raise NonFiniteError(f"step {step + 1}: reward '{name}' is {r[bad][0].item()} for {int(bad.sum())} of {r.numel()} samples")
            columns.append(r)
        rollout = rollout.with_(rewards=torch.stack(columns, dim=1), reward_names=list(self.reward_names))
        if self.reference is not None:
            ref_logp = self.reference.log_prob(rollout.to(self.accelerator.device).replay).detach().cpu()
            rollout = rollout.with_(ref_logp=ref_logp)
        return rollout

    # ------------------------------------------------------------------ advantages and masks

    def advantages(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Group-relative advantages [B] and the per-sample keep mask. Rewards are gathered
        from all processes so batch-level statistics (batch std) are global; each process
        then takes its own rows."""
        cfg = self.cfg.algo
        rewards = rollout.rewards
        weights = [r.weight for _, r in self.rewards]
        if cfg.kl_coef > 0 and cfg.kl_in_reward:
            # PPO-RLHF style: the sequence KL is one more reward component, weighted -coef
            kl = (self.kl_fn(rollout.old_logp, rollout.ref_logp) * rollout.mask).sum(1, keepdim=True)
            rewards = torch.cat([rewards, kl], dim=1)
            weights = weights + [-cfg.kl_coef]
        gather = lambda t: self.accelerator.gather(t.to(self.accelerator.device)).cpu()  # noqa: E731
        rewards_all, groups_all = gather(rewards), gather(rollout.group_id)
        kw = _kwargs_for(self.advantage_fn, cfg, eps=cfg.adv_eps)
        rows = slice(self.rank * rollout.batch_size, (self.rank + 1) * rollout.batch_size)
        if cfg.advantage_level == "step":
            adv, keep = self._step_advantages(rewards_all @ torch.tensor(weights), groups_all, gather(rollout.mask), rollout, gather, kw)
        else:
            adv, keep = adv_mod.combine_rewards(rewards_all, groups_all, weights, cfg.multi_reward, self.advantage_fn, **kw)
        adv = adv_mod.clip_advantages(adv, cfg.adv_clip)
        return adv[rows], keep[rows]

    def _step_advantages(self, terminal, groups, mask, rollout, gather, kw):
        """Per-decision advantages [B, T]: the weighted terminal reward sits on each sample's
        last decision, env step rewards (``step_reward_weight``) on every decision; the
        discounted returns-to-go of decision t are compared within (group, t) by the
        configured advantage function."""
        cfg = self.cfg.algo
        B, T = mask.shape
        per_step = torch.zeros(B, T)
        last = (mask * torch.arange(1, T + 1)).argmax(1)
        per_step[torch.arange(B), last] = terminal
        if cfg.step_reward_weight > 0:
            if rollout.step_rewards is None:
                raise ConfigError("algo.step_reward_weight", cfg.step_reward_weight, "needs a sampler that records step rewards (the env sampler)")
            per_step = per_step + cfg.step_reward_weight * gather(rollout.step_rewards)
        returns = adv_mod.discounted_returns(per_step, mask, cfg.gamma)
        valid = mask.reshape(-1) > 0
        cell = (groups[:, None] * T + torch.arange(T)).reshape(-1)
        adv_valid, keep_valid = self.advantage_fn(returns.reshape(-1)[valid], cell[valid], **kw)
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

    def update(self, rollout: Rollout, adv: torch.Tensor, step: int) -> dict[str, float]:
        cfg = self.cfg.algo
        device = self.accelerator.device
        rollout = rollout.to(device)
        adv = adv.to(device)
        adv = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] broadcasts over decisions for free
        if getattr(self.objective_fn, "needs_proximal", False):
            with torch.no_grad():
                rollout.info["_prox_logp"] = self.model(rollout.replay).detach()
        B = rollout.batch_size
        gen = torch.Generator().manual_seed(group_seed(self.cfg.seed, step, _UPDATE_STREAM + self.rank))
        totals: dict[str, float] = {}
        count = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(B, generator=gen) if cfg.num_minibatches > 1 else torch.arange(B)
            for idx in order.chunk(cfg.num_minibatches):
                mb = rollout[idx]
                mb_adv = adv[idx.to(device)]
                stats = self._minibatch_step(mb, mb_adv, step)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        return {k: v / max(count, 1) for k, v in totals.items()}

    def normalizers(self, mb: Rollout) -> dict[str, Any]:
        """The aggregation's normalizers for minibatch ``mb`` (token count, sequence count,
        max length). Global: each process divides by (global count / processes), so DDP's
        gradient average equals the single-process loss on the whole batch."""
        cfg = self.cfg.algo
        num_tokens = self.accelerator.reduce(mb.mask.sum().detach(), "sum") / self.world
        max_len = cfg.max_len or self._global_max(mb.mask.shape[1])
        return _kwargs_for(self.aggregate_fn, cfg, num_tokens=num_tokens, num_seqs=float(mb.batch_size), max_len=max_len)

    def policy_loss(self, batch: Rollout, adv: torch.Tensor, agg: dict[str, Any], at_sampling_weights: bool = False):
        """The training loss of ``batch`` (objective, aggregation with normalizers ``agg``,
        KL term): (loss, logp, objective stats, detached loss parts for the metrics).
        ``at_sampling_weights`` takes the current log-probs as the old (and proximal) ones,
        i.e. every ratio is 1 — the gradient of a first PPO step."""
        cfg = self.cfg.algo
        mask = batch.mask
        logp = self.model(batch.replay)
        old = logp.detach() if at_sampling_weights else batch.old_logp
        prox = logp.detach() if at_sampling_weights else batch.info.get("_prox_logp")
        per_decision, stats = self.objective_fn(logp, old, adv, **_kwargs_for(self.objective_fn, cfg, mask=mask, prox_logp=prox))
        loss = self.aggregate_fn(per_decision, mask, **agg)
        parts = {"loss/policy": loss.detach()}
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            kl = self.aggregate_fn(self.kl_fn(logp, batch.ref_logp), mask, **agg)
            loss = loss + cfg.kl_coef * kl
            parts["kl/ref"] = kl.detach()
        return loss, logp, stats, parts

    def _minibatch_step(self, mb: Rollout, adv: torch.Tensor, step: int) -> dict[str, float]:
        """One optimizer step on minibatch ``mb``; with ``algo.micro_batches`` > 1 its
        forward/backward runs in pieces whose losses use the whole minibatch's normalizers,
        so the accumulated gradient is the minibatch's."""
        cfg = self.cfg.algo
        agg = self.normalizers(mb)
        pieces = torch.arange(mb.batch_size).chunk(min(cfg.micro_batches, mb.batch_size))
        sums: dict[str, torch.Tensor] = {}
        for i, idx in enumerate(pieces):
            piece = mb if len(pieces) == 1 else mb[idx]
            piece_adv = adv if len(pieces) == 1 else adv[idx.to(adv.device)]
            mask = piece.mask
            loss, logp, stats, parts = self.policy_loss(piece, piece_adv, agg)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"step {step + 1}: loss ({cfg.objective}, {cfg.aggregation}) is {loss.item()}")
            if i + 1 < len(pieces):
                with self.accelerator.no_sync(self.model):  # DDP: all-reduce once, after the last piece
                    self.accelerator.backward(loss)
            else:
                self.accelerator.backward(loss)
            with torch.no_grad():
                log_ratio = (logp.detach() - piece.old_logp) * mask
                parts["_approx_kl"] = ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum()
                parts["_count"] = mask.sum()
                for k, v in stats.items():
                    parts[f"_objective/{k}"] = (v * mask).sum()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        out: dict[str, torch.Tensor] = {k: v for k, v in sums.items() if not k.startswith("_")}
        if self.cfg.optim.max_grad_norm is not None:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
            out["grad_norm"] = torch.as_tensor(grad_norm).detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = sums["_count"].clamp_min(1)
        out["approx_kl"] = sums["_approx_kl"] / n
        for k, v in sums.items():
            if k.startswith("_objective/"):
                out[k[1:]] = v / n
        return {k: float(v) for k, v in out.items()}

    def self_imitation(self, step: int) -> dict[str, float]:
        """``algo.replay_steps`` optimizer steps of the self-imitation loss over
        ``replay_batch`` samples drawn from the memory each (forward/backward in
        ``micro_batches`` pieces); returns the mean loss. ``replay_loss: logp``:
        ``-sum(A+ m logpi) / sum(m)``; ``sft``: the policy's supervised loss on the executed
        action chunks of the decisions with A+ > 0, each weighted by its A+ (a weighted mean,
        ``sum(A+ l) / sum(A+)``)."""
        cfg = self.cfg.algo
        device = self.accelerator.device
        gen = torch.Generator().manual_seed(group_seed(self.cfg.seed, step, _REPLAY_STREAM + self.rank))
        losses = []
        for _ in range(cfg.replay_steps):
            batch, adv = self.memory.sample(cfg.replay_batch, gen)
            batch, adv = batch.to(device), adv.to(device)
            if cfg.replay_loss == "sft":
                weight = adv * batch.mask
                count = self.accelerator.reduce(weight.sum(), "sum").clamp_min(1e-8) / self.world
            else:
                count = self.accelerator.reduce(batch.mask.sum(), "sum").clamp_min(1) / self.world
            pieces = torch.arange(batch.batch_size).chunk(min(cfg.micro_batches, batch.batch_size))
            total = torch.zeros((), device=device)
            for i, idx in enumerate(pieces):
                piece = batch[idx]
                if cfg.replay_loss == "sft":
                    loss = self._imitation_loss(piece.replay, weight[idx.to(device)], count)
                else:
                    loss = -(adv[idx.to(device)] * piece.mask * self.model(piece.replay)).sum() / count
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"step {step + 1}: self-imitation loss is {loss.item()}")
                if i + 1 < len(pieces):
                    with self.accelerator.no_sync(self.model):
                        self.accelerator.backward(loss)
                else:
                    self.accelerator.backward(loss)
                total = total + loss.detach()
            if self.cfg.optim.max_grad_norm is not None:
                self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(float(total))
        return {"loss/replay": sum(losses) / len(losses)}

    def _imitation_loss(self, replay: dict, weight: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """``sum(w l) / count`` over the decisions with weight w > 0, l the policy's
        supervised loss of one decision's executed chunk (``policy.imitation_batch``)."""
        flat = self.policy.imitation_batch(replay)
        w = weight.reshape(-1)
        rows = (w > 0).nonzero().squeeze(1)
        if rows.numel() == 0:  # keep every process's backward in step (DDP)
            return 0.0 * sum(p.sum() for p in self.model.parameters() if p.requires_grad)
        sub = {k: ([v[i] for i in rows.tolist()] if isinstance(v, list) else v[rows.to(v.device)]) for k, v in flat.items()}
        kept = w[rows]
        # sft_loss is the mean over its action_mask; weights scaled to a mean of 1 make it the
        # weighted mean sum(w l) / sum(w) (a mask summing below 1 would be clamped), then
        # rescale to ``count``
        sub["action_mask"] = (kept / kept.mean())[:, None].expand(-1, sub["actions"].shape[1])
        return self.model(sub, mode="sft") * (kept.sum() / count)

    def _global_max(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor(value, device=self.accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t)

    # ------------------------------------------------------------------ supervised fine-tuning

    def _load_demos(self) -> dict[str, Any]:
        """Every time step of the demonstrations as one SFT sample (observation, the next C
        actions, their mask), C = the policy's action chunk; tensors on the CPU."""
        import numpy as np

        from mmrl.demos import chunk_samples, read_demos

        data = self.cfg.data
        if data.batch_size % self.world:
            raise ConfigError("data.batch_size", data.batch_size, f"must be divisible by the number of processes ({self.world})")
        episodes = read_demos(data.path)
        if data.max_episodes_per_task is not None:
            per_task: dict[str, int] = {}
            kept = []
            for ep in episodes:
                per_task[ep.task] = per_task.get(ep.task, 0) + 1
                if per_task[ep.task] <= data.max_episodes_per_task:
                    kept.append(ep)
            episodes = kept
        if not episodes:
            raise ConfigError("data.path", data.path, "holds no demonstrations")
        chunk = int(getattr(self.policy.config, "action_chunk", 1) or 1)
        samples = chunk_samples(episodes, chunk)
        out = {k: (v if isinstance(v, list) else torch.as_tensor(np.asarray(v))) for k, v in samples.items()}
        self.demo_info = {"episodes": len(episodes), "samples": int(out["actions"].shape[0])}
        return out

    def sft_step(self, step: int) -> dict[str, float]:
        """One optimizer step of behaviour cloning on ``data.batch_size`` samples drawn (with
        replacement, seeded by run seed and step) from the demonstrations; each process takes
        its share, the distributed wrapper averages the gradients."""
        cfg = self.cfg
        n = self.demos["actions"].shape[0]
        gen = torch.Generator().manual_seed(group_seed(cfg.seed, step, _UPDATE_STREAM))
        idx = torch.randint(n, (cfg.data.batch_size,), generator=gen).chunk(self.world)[self.rank]
        batch = {k: ([v[i] for i in idx.tolist()] if isinstance(v, list) else v[idx].to(self.accelerator.device)) for k, v in self.demos.items()}
        loss = self.model(batch, mode="sft")
        if not torch.isfinite(loss):
            raise NonFiniteError(f"step {step + 1}: sft loss is {loss.item()}")
        self.accelerator.backward(loss)
        out = {"loss/sft": float(loss.detach())}
        if cfg.optim.max_grad_norm is not None:
            out["grad_norm"] = float(self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

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
            for step in range(self.start_step, cfg.total_steps):
                t0 = time.time()
                lr = cfg.optim.lr * lr_factor(step, cfg.total_steps, cfg.optim.lr_schedule, cfg.optim.warmup_steps, cfg.optim.final_lr_ratio)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                if self.demos is not None:
                    metrics = {**self.sft_step(step), "time/step_s": time.time() - t0}
                else:
                    rollout = self.collect(step)
                    t_sample = time.time() - t0
                    adv, keep = self.advantages(rollout) if rollout.batch_size else (torch.zeros(0), torch.zeros(0, dtype=torch.bool))
                    rollout = rollout.with_(mask=self.train_mask(rollout, keep))
                    update_stats = self.update(rollout, adv, step) if rollout.mask.sum() > 0 else {}
                    if self.memory is not None and rollout.batch_size:
                        update_stats["replay/added"] = float(self.memory.add(rollout, adv))
                        update_stats["replay/size"] = float(len(self.memory))
                        if len(self.memory):
                            update_stats.update(self.self_imitation(step))
                    metrics = self._metrics(rollout, adv, update_stats, t_sample, time.time() - t0)
                metrics["optim/lr"] = lr
                done = step + 1
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.total_steps:
                    last_eval = self.evaluate(done)
                    metrics.update({f"eval/{k}": v for k, v in last_eval.items()})
                if done % cfg.log.every == 0 or done == cfg.total_steps:
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

    def evaluate(self, step: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.rank == 0:
            self.policy.eval()
            with torch.no_grad():
                result = self.sampler.evaluate(self.policy, self.cfg.eval.episodes, seed=self.cfg.seed + 1_000_003)
                result = {k: v for k, v in result.items() if isinstance(v, (int, float))}  # per-episode lists stay out of the metrics
            self.policy.train()
        self.accelerator.wait_for_everyone()
        return result

    def save(self, step: int) -> None:
        self.accelerator.wait_for_everyone()
        if self.rank == 0:
            state = {"sampler": self.sampler.state_dict()}
            if self.memory is not None:
                state["replay_memory"] = self.memory.state_dict()
            self.checkpointer.save(step, self.policy, self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer, state, self.config_text)
        self.accelerator.wait_for_everyone()

    def _resume(self, path: Path) -> None:
        from mmrl.train.checkpoint import set_rng_state

        inner = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        state = Checkpointer.load(path, self.policy, inner)
        self.sampler.load_state_dict(state.get("sampler", {}))
        if self.memory is not None:
            self.memory.load_state_dict(state.get("replay_memory", {}))
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

    def _metrics(self, rollout: Rollout, adv: torch.Tensor, update: dict[str, float], t_sample: float, t_step: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if rollout.batch_size:
            rewards = self.accelerator.gather(rollout.rewards.to(self.accelerator.device)).cpu()
            for k, name in enumerate(self.reward_names):
                out[f"reward/{name}"] = rewards[:, k].mean().item()
            out["reward/total"] = (rewards @ torch.tensor([r.weight for _, r in self.rewards])).mean().item()
            for key, metric in (("success", "success_rate"), ("return", "episode_return"), ("length", "episode_length")):
                if key in rollout.info:
                    value = torch.as_tensor(rollout.info[key], dtype=torch.float32, device=self.accelerator.device)
                    out[metric] = self.accelerator.gather(value).mean().item()
            out["adv/abs_mean"] = adv.abs().mean().item() if adv.numel() else 0.0
            out["decisions"] = float(self.accelerator.reduce(rollout.mask.sum().to(self.accelerator.device), "sum"))
            if rollout.entropy is not None:
                # the sampling policy's entropy per decision (sharpening or spreading under RL)
                mask = rollout.mask.to(rollout.entropy.device)
                pair = torch.stack([(rollout.entropy * mask).sum(), mask.sum()]).to(self.accelerator.device)
                total, count = self.accelerator.reduce(pair, "sum").tolist()
                out["entropy"] = total / max(count, 1.0)
        collected = rollout.info.get("_collected")
        if collected is not None and len(collected):
            out["filter/kept_fraction"] = rollout.batch_size / float(collected[0])
        out.update(update)
        env_steps = self.sampler.state_dict().get("env_steps")
        if env_steps is not None:
            out["env_steps"] = int(self.accelerator.reduce(torch.tensor(env_steps, device=self.accelerator.device), "sum"))
        out["time/sample_s"] = t_sample
        out["time/step_s"] = t_step
        return out


def _postfix(metrics: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key, short in (("success_rate", "success"), ("reward/total", "reward"), ("loss/sft", "loss"), ("eval/success_rate", "eval_success")):
        if key in metrics and isinstance(metrics[key], float) and math.isfinite(metrics[key]):
            out[short] = f"{metrics[key]:.3f}"
    return out


def train(cfg: TrainConfig, run_dir: str | os.PathLike | None = None, resume: bool = False) -> dict[str, Any]:
    """Build everything from ``cfg`` and run the loop; returns a summary."""
    return Trainer(cfg, run_dir, resume).train()
