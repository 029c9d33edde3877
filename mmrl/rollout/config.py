"""The ``rollout:`` section: where samples are collected and how far they may lag behind the
learner (``docs/architecture.md``, "Rollouts and the learner")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError


@dataclass
class RolloutConfig:
    """Rollout workers and the learner: sync (sample, then update) or async (workers sample
    the next steps while the learner updates)."""

    mode: Literal["sync", "async"] = option(
        "sync",
        "sync: each step's samples come from the weights the learner has just published, then the workers wait (bit for bit the single-process loop); async: workers sample ahead while the learner updates, at most max_staleness versions behind",
    )
    engine: str = option("local", "where workers run (mmrl list engines): local = in this process (workers: 0) or in spawned processes sharing weights through shared memory")
    workers: int | None = option(
        None, "worker processes, each sampling its share of every step's groups; 0 = sample in the learner's process with its own policy object (sync only); null = 0 in sync mode, 1 in async mode", ge=0
    )
    max_staleness: int = option(1, "async: the most versions a trained sample may lag behind the learner's weights (k; 1 = one-step-off)", ge=0)
    schedule: Literal["lockstep", "free"] = option(
        "lockstep",
        "async: lockstep = step s always trains on samples of weights max(0, s - max_staleness), deterministic; free = workers sample with the newest weights whenever they have room (prefetch), so what lags how much depends on timing",
    )
    prefetch: int | None = option(
        None, "async free: steps a worker may sample ahead of the learner, the most versions its samples can lag (null = max_staleness, at least 1; lockstep: leave null)", ge=1
    )
    stale: Literal["drop", "correct"] = option(
        "drop",
        "async free: drop = a sample older than max_staleness versions is dropped (counted in staleness/dropped); correct = nothing is dropped (prefetch at most max_staleness, so no sample lags more) and algo.correction / decoupled_ppo weights the stale ones (lockstep: leave drop)",
    )
    score_on: Literal["worker", "learner"] = option(
        "worker", "worker processes: where rewards score samples (and filters run); learner: in the learner's process with its policy and device (a reward model on the learner's GPU)"
    )
    worker_device: str | None = option(None, "device of the worker processes' policy copies: cpu, cuda, cuda:N (null = the learner process's device; e.g. cuda:1 samples beside a learner on cuda:0; engine ray: cuda gives each actor a GPU of its own, cuda:N puts every actor on GPU N of its node)", choices=None)
    worker_threads: int | None = option(None, "torch threads of each worker process (null = the learner process's count)", ge=1)
    over_provision: float = option(
        1.0,
        "partial rollouts (APRIL): start this many times a step's groups; when groups_per_step have finished, the rest pause and continue in the next step where they stopped (text: the generated prefix; env episodes keep stepping), each decision tagged with the version that sampled it; 1 = off",
        ge=1,
    )
    start_timeout_s: float = option(600.0, "seconds a worker process may take to build its sampler, policy and rewards", gt=0)

    @property
    def num_workers(self) -> int:
        return self.workers if self.workers is not None else (0 if self.mode == "sync" else 1)

    @property
    def lags(self) -> bool:
        """Whether trained samples may lag behind the learner's weights (async workers, or
        partial rollouts carried over from earlier steps): the staleness metrics are logged."""
        return self.mode == "async" or self.over_provision > 1

    @property
    def lag(self) -> int:
        """Versions between the weights that sample a step and the learner's at that step
        (lockstep); 0 in sync mode."""
        return self.max_staleness if self.mode == "async" else 0

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.mode == "async" and self.workers == 0:
            raise ConfigError(p + "workers", 0, "async mode samples in worker processes: use 1 or more (or mode: sync to sample in the learner's process)")
        if self.worker_device is not None and self.worker_device not in ("cpu", "mps") and not self.worker_device.startswith("cuda"):
            raise ConfigError(p + "worker_device", self.worker_device, "allowed: cpu, cuda, cuda:N, mps, or null for the learner's device")
        if self.schedule == "free" and self.mode != "async":
            raise ConfigError(p + "schedule", "free", "free-running workers need mode: async")
        if self.schedule == "lockstep":  # each step samples exactly `lag` versions behind: nothing runs ahead, nothing is dropped
            if self.prefetch is not None:
                raise ConfigError(p + "prefetch", self.prefetch, "only free-running workers sample ahead; lockstep samples each step at a fixed lag (async: max_staleness, sync: 0): leave it null, or use mode: async with schedule: free")
            if self.stale != "drop":
                raise ConfigError(p + "stale", self.stale, "lockstep samples each step at a fixed lag (async: max_staleness, sync: 0), so no sample is staler than that to drop or correct: leave it drop, or use mode: async with schedule: free")
        elif self.stale == "correct":  # free: what a worker samples lags at most its prefetch; nothing is dropped
            if self.max_staleness == 0:
                raise ConfigError(p + "max_staleness", 0, "stale: correct drops nothing, and a free-running worker samples at least one step ahead (its samples lag up to 1): use 1 or more, or stale: drop")
            if self.prefetch is not None and self.prefetch > self.max_staleness:
                raise ConfigError(
                    p + "prefetch", self.prefetch,
                    f"stale: correct drops nothing, so samples lag up to prefetch versions, past max_staleness ({self.max_staleness}): use prefetch <= max_staleness (or null), or stale: drop",
                )
        if self.num_workers == 0:  # the learner's process samples with its own policy object: no worker process to place
            for name, default in (("score_on", "worker"), ("worker_threads", None), ("worker_device", None)):
                if getattr(self, name) != default:
                    raise ConfigError(
                        p + name, getattr(self, name),
                        f"sets up worker processes, and with workers: {self.workers if self.workers is not None else 'null (0 in sync mode)'} the learner's process samples and scores on its own device and threads: leave it {'null' if default is None else default}, or use workers: 1 or more",
                    )


def check_refill_rounds(rollout: RolloutConfig, resample_rounds: int, learner_processes: int = 1) -> None:
    """Refill rounds (``algo.resample_rounds``, DAPO dynamic sampling) decide over all of a
    step's groups at once and score while they sample: worker processes can run them only
    as one worker that scores, beside one learner process. The run config checks this when
    it is validated (one learner process), the process engine again with the processes
    launched."""
    if not resample_rounds or rollout.num_workers == 0:
        return
    if rollout.num_workers > 1:
        raise ConfigError("rollout.workers", rollout.num_workers, f"refill rounds (algo.resample_rounds: {resample_rounds}) decide over one worker's groups: use 1 worker, or no refill rounds")
    if learner_processes > 1:
        raise ConfigError("rollout.workers", rollout.num_workers, f"refill rounds (algo.resample_rounds) decide over all {learner_processes} learner processes' groups, which worker processes cannot; use workers: 0")
    if rollout.score_on == "learner":
        raise ConfigError("rollout.score_on", "learner", "refill rounds (algo.resample_rounds) score while they sample: use score_on: worker, or no refill rounds")
