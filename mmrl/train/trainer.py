"""The one training loop. It wires the roles and knows nothing of what a decision is (a
token, a denoising step, an action chunk); read it top to bottom.

    for step in range(total_steps):
        collected = engine.collect(step, learner.version)  # whole groups, scored, filtered, tagged with their version
        rollout, adv, stats = learner.learn(collected)     # advantages, masks, update, self-imitation: a new version
        engine.publish(policy, learner.version)            # the workers' next weights
        log(); maybe_eval(); maybe_checkpoint()

The roles have one home each: the rollout workers (``mmrl/rollout/worker.py``: a policy, a
sampler and the rewards), run by an engine (``rollout.engine``, ``mmrl/rollout/engine.py``:
in this process, or in spawned processes that sample ahead in async mode), and the learner
(``mmrl/train/learner.py``: advantages, the update and its speed-ups, self-imitation, SFT
steps, the optimizer). Everything modality-specific sits behind a hook: the sampler
(``collect``, ``metrics``, ``counters``, ``evaluate``), the policy (``log_prob`` as its
forward, ``sft_loss``, ``media``, ``exact_kl``), the reward components, and the SFT data
source.

N processes = 1 process: every process samples whole groups seeded by their global index;
rewards, advantages and filter decisions are taken over the samples of all processes; the
minibatches are slices of one global permutation, each process taking its own rows; loss
normalizers and logged metrics are global (``docs/architecture.md``).
"""

from __future__ import annotations

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
from mmrl.config import to_dict
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.sampler import build_sampler
from mmrl.core.statistics import add_pending, commit_statistics
from mmrl.core.weights import build_policy
from mmrl.errors import ConfigError, fault_context, run_source
from mmrl.media import write_media
from mmrl.train.checkpoint import Checkpointer, rng_state, set_rng_state
from mmrl.train.distributed import Collectives
from mmrl.train.learner import Learner
from mmrl.train.metrics import MetricsWriter, rl_metrics
from mmrl.train.run_config import TrainConfig


@dataclass
class StopRequest:
    signum: int | None = None


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
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep)
        latest = self.checkpointer.latest()
        if resume and latest is None:
            raise ConfigError("--resume", str(self.run_dir), "no checkpoint to resume from in this run directory")
        if not resume and latest is not None:
            raise ConfigError("run_dir", str(self.run_dir), "already holds a run; pass --resume to continue it or choose another run_dir")

        torch.manual_seed(cfg.seed)  # identical initial weights in every process and on resume
        # supervised runs may have no sampler: no rollouts, evaluation by the data source alone
        self.sampler = build_sampler(cfg)
        policy = build_policy(cfg.policy, self.sampler.policy_spec())
        context = RewardContext(device=self.accelerator.device, run_dir=self.run_dir, seed=cfg.seed)
        self.rewards = RewardSet(cfg.rewards, algo.reward_aggregation, context, algo.log_tamed_threshold)
        data = registry.DATA_SOURCES.get(cfg.data.type, "data.type")(cfg.data, policy, cfg.seed, self.world, self.rank) if algo.type == "sft" else None
        keeps_graph = getattr(self.sampler, "keeps_sampling_graph", False) and cfg.rollout.num_workers == 0  # a graph stays in its process
        self.learner = Learner(cfg, policy, self.accelerator, self.dist, data, sampler_keeps_graph=keeps_graph)
        # the rollout workers: in this process with the learner's own policy object (sync,
        # workers: 0), or spawned with copies of it (rollout.engine, mmrl/rollout/engine.py)
        self.engine = registry.ENGINES.get(cfg.rollout.engine, "rollout.engine")(
            cfg, sampler=self.sampler, policy=self.policy, rewards=self.rewards, reference=self.learner.reference,
            dist=self.dist, device=self.accelerator.device, keep_graph=self.learner.reuse_graph, run_dir=self.run_dir,
        )
        self.start_step = 0
        self.stop = StopRequest()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        if resume:
            self._resume(latest)
        if algo.type == "rl":
            self.engine.start(self.start_step, self.learner.version)
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(self.config_text)
        self.metrics = MetricsWriter(self.run_dir, cfg.log.tensorboard, enabled=self.rank == 0)
        if resume:
            self.metrics.truncate_after(self.start_step)

    @property
    def policy(self):
        return self.learner.policy

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
                lr = self.learner.set_lr(step)
                metrics = self.learner.sft_step(step) if self.learner.data is not None else self.rl_step(step)
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
                    progress.set_postfix(_postfix(metrics, self.sampler.progress_metrics), refresh=False)
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
            self.engine.close()
            self.sampler.close()
        return {"step": step, "eval": last_eval, "wall_clock": time.time() - t_start, "run_dir": str(self.run_dir)}

    def rl_step(self, step: int) -> dict[str, Any]:
        t0, version = time.time(), self.learner.version
        collected = self.engine.collect(step, version)
        add_pending(self.policy, collected.statistics)  # what a worker's policy copy observed
        commit_statistics(self.policy, self.dist.sum)  # what the step's samples taught running statistics
        t_sample = time.time() - t0
        rollout, adv, stats = self.learner.learn(collected.rollout, collected.spare, step)
        t_update = time.time() - t0 - t_sample
        self.engine.publish(self.policy, self.learner.version)  # inline: the same policy object, only the version moves
        times = {"time/sample_s": t_sample, "time/update_s": t_update, "time/step_s": time.time() - t0}
        staleness = version if self.cfg.rollout.lags else None
        return rl_metrics(self.dist, collected, rollout, adv, stats, bool(self.cfg.algo.filters), self.engine.counters(), staleness, times)

    # ------------------------------------------------------------------ evaluation, checkpoints

    def evaluate(self, step: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.rank == 0:
            self.policy.eval()
            phase = f"evaluation after update {step}" if step else "evaluation before training"
            with torch.no_grad(), fault_context(source=run_source(self.cfg), seed=self.cfg.seed, phase=phase):
                result = self.sampler.evaluate(self.policy, self.cfg.eval.episodes, seed=self.cfg.seed + 1_000_003, rewards=self.rewards)
                if self.learner.data is not None:  # the data source's held-out metrics (e.g. pairwise accuracy)
                    result.update(self.learner.data.evaluate(self.policy))
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
        keep_memory = self.learner.memory is not None and self.cfg.algo.self_imitation.in_checkpoint
        memory = self.learner.memory.state_dict() if keep_memory else None  # gathers from every process
        if self.rank == 0:
            state = {**self.engine.state_dict(), **self.learner.state_dict(), "policy_version": self.learner.version}
            if keep_memory:
                state["self_imitation_memory"] = memory
            self.checkpointer.save(step, self.policy, _inner(self.learner.optimizer), state, self.config_text)
        self.accelerator.wait_for_everyone()

    def _resume(self, path: Path) -> None:
        state = Checkpointer.load(path, self.policy, _inner(self.learner.optimizer))
        self.engine.load_state_dict(state)
        self.learner.load_state_dict(state)
        if self.learner.memory is not None:
            # "replay_memory": the key of checkpoints written before the memory had its own name
            self.learner.memory.load_state_dict(state.get("self_imitation_memory", state.get("replay_memory", {})))
        set_rng_state(state["rng"])
        self.start_step = int(state["step"])
        self.learner.version = int(state.get("policy_version", self.start_step))

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

def _inner(optimizer):
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def _postfix(metrics: dict[str, Any], shown: dict[str, str]) -> dict[str, str]:
    """The progress bar's numbers: what the advantages are computed from, the SFT loss and
    what the sampler shows (success). A run whose advantages add the env's step rewards
    (GAE, step level) shows its episode return as they weight it (``return``:
    ``trained_return``, the weighted reward components included); any other run its combined
    reward (``reward``: ``reward/total``). A single component is never shown: one logged with
    weight 0 is not what the run learns from."""
    trained = {"return": "trained_return"} if "trained_return" in metrics else {"reward": "reward/total"}
    out = {}
    for short, key in {**trained, "loss": "loss/sft", **shown}.items():
        if key in metrics and isinstance(metrics[key], float) and math.isfinite(metrics[key]):
            out[short] = f"{metrics[key]:.3f}"
    return out


def train(cfg: TrainConfig, run_dir: str | os.PathLike | None = None, resume: bool = False) -> dict[str, Any]:
    """Build everything from ``cfg`` and run the loop; returns a summary."""
    return Trainer(cfg, run_dir, resume).train()
