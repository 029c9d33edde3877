"""Rollout engines: where the rollout workers of a run sample (``rollout.engine``).

An engine gives the loop two calls: ``collect(step, version)`` returns the step's samples,
and ``publish(policy, version)`` hands the learner's new weights to the workers. ``local``
(registered below) runs the worker in the learner's process (``rollout.workers: 0``, sync:
the learner's own policy object, today's loop bit for bit) or in spawned processes
(:class:`ProcessEngine`), which share one copy of the weights through shared memory. A
second engine (Ray actors) registers beside it under its own name.

Timing of a worker process, per step of the loop (``docs/architecture.md`` draws it):

- sync (``lag`` 0): step s samples with version s, then the worker waits for s + 1;
- async lockstep (``lag`` k): step s samples with version max(0, s - k), so the workers
  sample steps s + 1 ... s + k while the learner trains step s; deterministic;
- async free: a worker samples its next step whenever it has room (``prefetch`` steps
  ahead of the learner) with the newest weights, so its samples lag by at most ``prefetch``
  versions; the learner drops the samples that lag by more than ``max_staleness``
  (``stale: correct`` keeps ``prefetch`` <= ``max_staleness``: none is dropped, and a
  correction weights the stale ones). What lags how much depends on timing.

In lockstep the learner publishes version v only once every worker has loaded v - 1, so
the one shared copy always holds the version the next step needs; the last k versions are
kept so that a checkpoint resumes the schedule exactly (:meth:`ProcessEngine.state_dict`).
"""

from __future__ import annotations

import atexit
import copy
import importlib
import os
import pickle
import queue
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import build_sampler
from mmrl.core.statistics import take_pending
from mmrl.core.weights import build_policy
from mmrl.errors import ConfigError, RolloutWorkerError, UserCodeError, fault_context, run_source
from mmrl.registry import ENGINES
from mmrl.rollout.config import check_refill_rounds
from mmrl.rollout.worker import Collected, OneProcess, RolloutWorker

_POLL_S = 0.05


class InlineEngine:
    """The worker samples in the learner's process with the learner's own policy object
    (sync, ``rollout.workers: 0``): nothing is copied, only the version moves."""

    in_process = True

    def __init__(self, worker: RolloutWorker, cfg):
        self.worker = worker
        self.where = {"source": run_source(cfg), "seed": cfg.seed}  # named in a simulator's or reward's fault, as a worker process's

    def start(self, start_step: int, version: int) -> None:
        self.worker.load_weights(None, version)

    def collect(self, step: int, version: int) -> Collected:
        with fault_context(**self.where):
            return self.worker.collect(step)

    def publish(self, policy, version: int) -> None:
        self.worker.load_weights(None, version)

    def counters(self) -> dict[str, float]:
        return self.worker.sampler.counters()

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.worker.sampler.state_dict(), "rewards": self.worker.rewards.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.sampler.load_state_dict(state.get("sampler", {}))
        self.worker.rewards.load_state_dict(state.get("rewards", {}))

    def close(self) -> None:
        pass


@ENGINES.register("local")
def local_engine(cfg, *, sampler, policy, rewards, reference, dist, device, keep_graph, run_dir):
    """Workers in this process (workers: 0, sync) or in spawned processes sharing weights
    through shared memory."""
    check_partial_rollouts(policy, cfg)
    if cfg.rollout.num_workers == 0:
        worker = RolloutWorker(sampler, policy, rewards, cfg.algo, dist, reference=reference, device=device, keep_graph=keep_graph)
        return InlineEngine(worker, cfg)
    # rollout.score_on: learner: this process scores, measures and filters what the workers sample
    scorer = RolloutWorker(sampler, policy, rewards, cfg.algo, dist, reference=reference, device=device) if cfg.rollout.score_on == "learner" else None
    return ProcessEngine(cfg, policy=policy, sampler=sampler, rewards=rewards, reference=reference, dist=dist, run_dir=run_dir, scorer=scorer)


def check_partial_rollouts(policy, cfg) -> None:
    """Partial rollouts (``rollout.over_provision``): what they need of the built policy
    that its config could not tell at validation (a text policy's generation backend that a
    factory function builds), a one-line error before anything is sampled: the policy class's
    ``check_partial_rollouts(config, policy=None)`` (declared on :class:`PolicyModule`)."""
    if cfg.rollout.over_provision > 1:
        type(policy).check_partial_rollouts(cfg.policy, policy)


def check_runs_in_worker(sampler, policy, rewards, cfg) -> None:
    """A one-line error where a component cannot be rebuilt in a worker process."""
    if not getattr(sampler, "runs_in_worker", True):
        raise ConfigError("sampler.type", cfg.sampler.type or None, f"cannot sample in a rollout worker process (rollout.workers: {cfg.rollout.num_workers}); use rollout.mode: sync with workers: 0")
    if not policy.runs_in_worker:
        raise ConfigError("policy.type", cfg.policy.type, f"cannot be copied into a rollout worker process (rollout.workers: {cfg.rollout.num_workers}); use rollout.mode: sync with workers: 0")
    for i, component in enumerate(rewards.components if rewards is not None else []):
        if component.learns:
            raise ConfigError(f"rewards[{i}].type", rewards.names[i], "learns from each step's samples, which worker processes would split between copies of it; use rollout.score_on: learner, or workers: 0")
        if not getattr(component, "runs_in_worker", getattr(getattr(component, "fn", None), "runs_in_worker", True)):
            raise ConfigError(f"rewards[{i}].type", rewards.names[i], "cannot score in a rollout worker process; use rollout.score_on: learner, or workers: 0")


@dataclass
class _WorkerSpec:
    """What a worker process builds itself from (pickled into the spawned process)."""

    index: int
    groups: tuple[int, int]
    config: bytes  # the pickled TrainConfig (after `modules` are imported)
    modules: list[str]
    run_dir: str
    start_step: int
    total_steps: int
    lag: int
    version_offset: int  # version - step at the start (lockstep: step s samples with offset + max(0, s - lag))
    free: bool
    score: bool  # rewards score (and filters run) in the worker
    threads: int
    device: str
    state: dict[str, Any] = field(default_factory=dict)  # sampler and rewards state to resume from


def describe(cfg) -> str:
    """The env (or sampler) and the seed a worker samples, for messages."""
    return f"{run_source(cfg)}, seed {cfg.seed}"


class ProcessEngine:
    """``rollout.workers`` spawned processes, each with a copy of the policy and its own
    sampler and rewards, sampling a fixed share of every step's groups (so M workers sample
    what one would). Weights travel through one shared-memory copy of the state dict."""

    in_process = False

    def __init__(self, cfg, *, policy, sampler, rewards, reference, dist, run_dir, scorer=None):
        ro = cfg.rollout
        self.scorer = scorer
        check_runs_in_worker(sampler, policy, rewards if scorer is None else None, cfg)
        self.cfg, self.ro, self.dist = cfg, ro, dist
        self.m = ro.num_workers
        local = cfg.algo.groups_per_step // dist.world
        if local < self.m:
            raise ConfigError("rollout.workers", self.m, f"at most the groups each learner process samples a step ({local})")
        if getattr(sampler, "observes_rewards", False) and (scorer is not None or self.m > 1 or dist.world > 1):
            why = "rollout.score_on: learner scores them in another process than the worker's sampler" if scorer is not None else (
                f"with {self.m} worker processes" + (f" per learner process ({dist.world})" if dist.world > 1 else "") + " each sees only its share")
            raise ConfigError("sampler.budget.type", getattr(getattr(cfg.sampler, "budget", None), "type", None), f"shares each step's samples by the rewards of every earlier sample, and {why}; use one worker process with score_on: worker, or workers: 0")
        check_refill_rounds(ro, cfg.algo.resample_rounds, dist.world)
        base = dist.rank * local
        self.groups = [(base + j * local // self.m, (j + 1) * local // self.m - j * local // self.m) for j in range(self.m)]
        self.free = ro.mode == "async" and ro.schedule == "free"
        self.lag = ro.lag
        self.prefetch = ro.prefetch or max(1, ro.max_staleness)
        self.policy, self.run_dir = policy, run_dir
        # a worker that scores needs the frozen reference (sampled-log-prob KL, rewards that read it)
        worker_reference = reference if reference is not None and scorer is None else None
        self.reference = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in worker_reference.state_dict().items()} if worker_reference is not None else None
        scoring = rewards.components if scorer is None else []
        self.modules = sorted({type(policy).__module__, type(sampler).__module__, *(getattr(c, "fn", c).__module__ for c in scoring)} - {"__main__"})
        self.history: deque[tuple[int, dict[str, torch.Tensor]]] = deque()  # lockstep: versions later steps still sample from
        self.worker_states: list[dict[str, Any]] = [{} for _ in range(self.m)]  # after the last consumed step
        self.worker_counters: list[dict[str, float]] = [{} for _ in range(self.m)]
        self.pending: dict[tuple[int, int], dict[str, Any]] = {}
        self.procs: list = []
        self.next_batch = 0
        self.resume: dict[str, Any] = {}

    # ------------------------------------------------------------------ life cycle

    def start(self, start_step: int, version: int) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.start_step, self.next_batch, self.offset = start_step, start_step, version - start_step
        current = {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}
        # lockstep: the versions the next steps sample from (a resumed run's), in order, then ours
        sequence = [(int(h["version"]), h["weights"]) for h in self.resume.get("history", [])] + [(version, current)]
        # the one copy of the weights every worker process reads
        self.shared = {k: v.clone().share_memory_() for k, v in sequence[0][1].items()}
        self.history = deque(sequence)
        self.version = ctx.Value("q", sequence[0][0])
        self.lock = ctx.Condition()  # guards the shared weights; notified at each publish
        self.stop = ctx.Event()
        self.loaded = [ctx.Value("q", -1) for _ in range(self.m)]
        self.credits = [ctx.Semaphore(self.prefetch) for _ in range(self.m)]
        self.results = ctx.Queue()
        config = pickle.dumps(self.cfg)
        threads = self.ro.worker_threads or torch.get_num_threads()
        device = self.ro.worker_device or ("cpu" if self.dist.device.type == "cpu" else str(self.dist.device))
        states = self.resume.get("workers") or [{} for _ in range(self.m)]
        if len(states) != self.m:
            raise ConfigError("rollout.workers", self.m, f"the checkpoint was written with {len(states)} workers; resume with as many")
        for j in range(self.m):
            spec = _WorkerSpec(
                j, self.groups[j], config, self.modules, str(self.run_dir), start_step, self.cfg.total_steps, self.lag, self.offset, self.free, self.scorer is None, threads, device, states[j],
            )
            args = (spec, self.shared, self.reference, self.version, self.lock, self.loaded[j], self.credits[j], self.stop, self.results)
            # not daemonic: a worker's simulator may start processes of its own
            proc = ctx.Process(target=worker_main, args=args, name=f"mmrl-rollout-worker-{j}")
            proc.start()
            self.procs.append(proc)
        # a learner that exits without closing (an error before the loop) must not wait on its
        # workers at exit: stop them first (atexit runs this before multiprocessing joins them)
        atexit.register(self.close)
        ready = 0
        deadline = time.monotonic() + self.ro.start_timeout_s
        while ready < self.m:
            msg = self._next(deadline, "starting")
            if msg["kind"] == "ready":
                ready += 1
            else:
                self.pending[(msg["batch"], msg["worker"])] = msg
        for v, weights in sequence[1:]:
            self._write(v, weights)

    def close(self) -> None:
        if not self.procs:
            return
        self.stop.set()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            while proc.is_alive() and time.monotonic() < deadline:
                try:  # drain, so that no worker blocks on a full pipe while exiting
                    self.results.get(timeout=_POLL_S)
                except queue.Empty:
                    pass
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        self.procs = []
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ the two calls

    def collect(self, step: int, version: int) -> Collected:
        """The step's samples from every worker (lockstep: sampled for this step; free: the
        next step each worker has ready, without the samples lagging by more than
        ``max_staleness``, which are dropped: with ``rollout.stale: correct`` no sample lags
        that much, as a worker samples at most ``prefetch`` <= ``max_staleness`` steps ahead)."""
        dropped, statistics = 0, []
        while True:
            batch = step if not self.free else self.next_batch
            parts = [self._part(batch, j) for j in range(self.m)]
            self.next_batch = batch + 1
            # what the policy copies observed counts, whether their samples are trained or dropped
            statistics = [sum(t) for t in zip(*(m["statistics"] for m in parts), *([statistics] if statistics else []))]
            for j, msg in enumerate(parts):
                self.worker_states[j], self.worker_counters[j] = msg["state"], msg["counters"]
                if self.free:
                    self.credits[j].release()
            kept = []
            for msg in parts:
                lag = version - msg["version"]
                # stale: correct keeps prefetch <= max_staleness (RolloutConfig.validate), so it drops nothing
                if self.free and lag > self.ro.max_staleness:
                    dropped += msg["collected"].rollout.batch_size
                else:
                    kept.append(msg)
            if kept:
                break
        out = _combine([m["collected"] for m in kept])
        if self.scorer is not None:
            with fault_context(source=run_source(self.cfg), seed=self.cfg.seed):
                out = self.scorer.finish(out, step)
        out.statistics = statistics
        out.dropped = dropped
        out.times = {k: sum(m["times"][k] for m in parts) / len(parts) for k in parts[0]["times"]}
        return out

    def publish(self, policy, version: int) -> None:
        state = {k: v.detach() for k, v in policy.state_dict().items()}
        if not self.free:  # lockstep: keep the versions the next `lag` steps sample from (for checkpoints)
            self.history.append((version, {k: v.to("cpu", copy=True) for k, v in state.items()} if self.lag else None))
            while len(self.history) > self.lag + 1:
                self.history.popleft()
        self._write(version, state)

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.worker_counters:
            for k, v in c.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def state_dict(self) -> dict[str, Any]:
        """The workers' sampler and rewards state after the last step the learner took, and
        (lockstep) the weights of the versions the next ``lag`` steps sample from."""
        state: dict[str, Any] = {"workers": self.worker_states}
        if self.scorer is not None:
            state["learner_rewards"] = self.scorer.rewards.state_dict()
        if not self.free:
            state["history"] = [{"version": v, "weights": w} for v, w in list(self.history)[:-1]]
        return {"rollout": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume = dict(state.get("rollout", {}))
        if self.free:
            self.resume.pop("history", None)  # free-running restarts from the learner's weights
        self.worker_states = list(self.resume.get("workers") or self.worker_states)
        if self.scorer is not None:
            self.scorer.rewards.load_state_dict(self.resume.get("learner_rewards", {}))

    # ------------------------------------------------------------------ internals

    def _write(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Put ``state`` in the shared copy as ``version``. Lockstep: first wait until every
        worker has loaded the previous version, if a step still samples from it."""
        if not self.free and version - 1 <= self.offset + max(0, self.cfg.total_steps - 1 - self.lag):
            while any(v.value < version - 1 for v in self.loaded):
                msg = self._poll()
                if msg is None:
                    self._check_alive(f"waiting for the workers to load version {version - 1}")
                else:
                    self.pending[(msg["batch"], msg["worker"])] = msg
        with self.lock:
            for k, v in state.items():
                self.shared[k].copy_(v)
            self.version.value = version
            self.lock.notify_all()

    def _part(self, batch: int, worker: int) -> dict[str, Any]:
        while (batch, worker) not in self.pending:
            msg = self._next(None, f"sampling step {batch}")
            self.pending[(msg["batch"], msg["worker"])] = msg
        return self.pending.pop((batch, worker))

    def _poll(self) -> dict[str, Any] | None:
        try:
            msg = pickle.loads(self.results.get(timeout=_POLL_S))
        except queue.Empty:
            return None
        if msg["kind"] == "error":
            self._fail(msg)
        return msg

    def _next(self, deadline: float | None, doing: str) -> dict[str, Any]:
        while True:
            msg = self._poll()
            if msg is not None:
                return msg
            self._check_alive(doing)
            if deadline is not None and time.monotonic() > deadline:
                raise RolloutWorkerError(f"rollout workers did not start within rollout.start_timeout_s ({self.ro.start_timeout_s:g} s; {describe(self.cfg)})")

    def _check_alive(self, doing: str) -> None:
        for j, proc in enumerate(self.procs):
            if proc.exitcode is not None and proc.exitcode != 0:
                code = proc.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
                raise RolloutWorkerError(
                    f"rollout worker {j} (pid {proc.pid}, {describe(self.cfg)}, groups {self.groups[j][0]}-{sum(self.groups[j]) - 1}) died ({how}) while {doing}"
                )

    def _fail(self, msg: dict[str, Any]) -> None:
        if msg.get("config_error"):
            raise ConfigError(*msg["config_error"])
        j = msg["worker"]
        error = RolloutWorkerError(f"rollout worker {j} ({describe(self.cfg)}, step {msg['batch']}, groups {self.groups[j][0]}-{sum(self.groups[j]) - 1}) failed: {msg['error']}")
        error.remote_traceback = msg.get("trace")  # the worker's own traceback, which MMRL_DEBUG=1 prints
        raise error


def _combine(parts: list[Collected]) -> Collected:
    sums: dict[str, torch.Tensor] = {}
    for p in parts:
        for k, v in p.sums.items():
            sums[k] = sums[k] + v if k in sums else v
    return Collected(Rollout.cat([p.rollout for p in parts]), parts[0].spare, sums, sum(p.num_collected for p in parts))


# ---------------------------------------------------------------------- the worker process


def worker_main(spec: _WorkerSpec, shared, reference_state, version, lock, loaded, credits, stop, results) -> None:
    """A worker process: build the sampler, policy and rewards, then sample steps."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or a scheduler's SIGTERM to the group: the learner checkpoints, then stops its workers
        signal.signal(sig, signal.SIG_IGN)
    send = lambda **msg: results.put(pickle.dumps({"worker": spec.index, **msg}))  # noqa: E731
    parent = os.getppid()
    orphaned = lambda: stop.is_set() or os.getppid() != parent  # noqa: E731 - a SIGKILLed learner leaves no worker behind
    batch = spec.start_step
    try:
        sampler, policy, rewards, worker = build_worker(spec, reference_state)
        send(kind="ready", batch=-1)
        while not orphaned() and (spec.free or batch < spec.total_steps):
            t0 = time.monotonic()
            if spec.free:
                while not credits.acquire(timeout=_POLL_S):
                    if orphaned():
                        return
                want = version.value
            else:
                want = spec.version_offset + max(0, batch - spec.lag)
                with lock:  # woken by the learner's publish (no polling while the learner updates)
                    while version.value < want:
                        if orphaned():
                            return
                        lock.wait(_POLL_S)
            if loaded.value != (version.value if spec.free else want):
                with lock:
                    want = version.value
                    policy.load_state_dict(shared)
                worker.load_weights(None, want)
                loaded.value = want
            send(**sample_message(spec, sampler, policy, rewards, worker, batch, want, time.monotonic() - t0))
            batch += 1
    except ConfigError as e:
        send(kind="error", batch=batch, error=str(e), config_error=(e.field, e.value, e.allowed))
        _flush_and_exit(results, 1)
    except UserCodeError as e:  # the simulator's or a reward's fault: what raised, and where as far as the learner's line does not say
        inner = e.context(skip=("source", "seed", "update", "groups"))
        send(kind="error", batch=batch, error=f"{e.error} (in {e.call}{', ' + inner if inner else ''})", trace=traceback.format_exc())
        _flush_and_exit(results, 1)
    except Exception as e:  # noqa: BLE001 - reported to the learner as one line, then this process ends
        send(kind="error", batch=batch, error=f"{type(e).__name__}: {e}".splitlines()[0], trace=traceback.format_exc())
        _flush_and_exit(results, 1)
    finally:
        try:
            sampler.close()  # noqa: F821 - may not exist if building failed
        except Exception:  # noqa: BLE001
            pass


def build_worker(spec: _WorkerSpec, reference_state):
    """Build a worker's sampler, policy copy and rewards from ``spec`` (in its process)."""
    torch.set_num_threads(spec.threads)
    for name in spec.modules:
        importlib.import_module(name)
    cfg = pickle.loads(spec.config)
    torch.manual_seed(cfg.seed)
    sampler = build_sampler(cfg)
    policy = build_policy(cfg.policy, sampler.policy_spec()).to(spec.device)
    rewards = None
    if spec.score:
        context = RewardContext(device=torch.device(spec.device), run_dir=Path(spec.run_dir), seed=cfg.seed)
        rewards = RewardSet(cfg.rewards, cfg.algo.reward_aggregation, context, cfg.algo.log_tamed_threshold)
        rewards.load_state_dict(spec.state.get("rewards", {}))
    sampler.load_state_dict(spec.state.get("sampler", {}))
    reference = None
    if reference_state is not None:
        reference = policy.reference() or copy.deepcopy(policy)
        reference.load_state_dict(reference_state)
        reference.requires_grad_(False).eval()
    worker = RolloutWorker(sampler, policy, rewards, cfg.algo, OneProcess(), reference=reference, device=torch.device(spec.device), groups=spec.groups)
    return sampler, policy, rewards, worker


def sample_message(spec: _WorkerSpec, sampler, policy, rewards, worker: RolloutWorker, batch: int, version: int, idle_s: float) -> dict[str, Any]:
    """Sample step ``batch`` with the worker's weights (``version``): the message a worker
    returns to the learner."""
    t0 = time.monotonic()
    collected = worker.collect(batch, score=spec.score)
    state = {"sampler": sampler.state_dict(), "rewards": rewards.state_dict() if rewards is not None else {}}
    return {
        "kind": "batch", "batch": batch, "version": version, "collected": collected, "statistics": take_pending(policy), "state": state,
        "counters": sampler.counters(), "times": {"worker_idle_s": idle_s, "worker_sample_s": time.monotonic() - t0},
    }


def _flush_and_exit(results, code: int) -> None:
    results.close()
    results.join_thread()
    os._exit(code)
