"""``rollout.engine: ray``: rollout workers as Ray actors (the ``ray`` extra).

Each actor builds what a ``local`` worker process builds (:func:`~mmrl.rollout.engine.build_worker`)
and samples its share of a step's groups when asked. Weights travel through Ray's object
store: each version the learner publishes is put there once and handed to an actor with
its next request when that actor's last weights are older. The schedule is ``local``'s
lockstep, so sync mode and one-step-off give the runs of ``engine: local`` bit for bit; the
collection, staleness metrics, checkpoints and resume are :class:`ProcessEngine`'s.

On one machine the engine starts a local Ray instance (or joins the one ``RAY_ADDRESS``
names); on a cluster start Ray on every node (``ray start --head`` on one, ``ray start
--address HEAD:6379`` on the others) and run ``mmrl train`` on the head node with
``RAY_ADDRESS=auto`` (docs/architecture.md). ``rollout.worker_device: cuda`` places each
actor on a GPU of its own; ``cuda:N`` places every actor on GPU N of its node, as the local
engine's worker processes (:func:`actor_placement`).
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import torch

from mmrl.errors import ConfigError, MissingExtraError, RolloutWorkerError
from mmrl.registry import ENGINES
from mmrl.rollout.engine import ProcessEngine, _WorkerSpec, build_worker, describe, sample_message


# set in an actor's environment, Ray leaves its CUDA_VISIBLE_DEVICES as the node's (Ray >= 1.6)
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def actor_placement(worker_device: str | None, learner_device: torch.device) -> tuple[dict[str, Any], str]:
    """(Ray actor options, device of the actor's policy copy) of ``rollout.worker_device``.

    - ``cuda`` (or null beside a learner on a GPU): a GPU of its own per actor: Ray reserves
      one (``num_gpus: 1``) and its CUDA_VISIBLE_DEVICES names only that one, so the copy goes
      to ``cuda``;
    - ``cuda:N``: GPU N as the node numbers its GPUs (one machine: as the learner's process
      does), whichever GPU Ray would pick: Ray reserves none (``num_gpus: 0``) and is told to
      leave CUDA_VISIBLE_DEVICES as it is, so the copy goes to ``cuda:N`` and every actor
      shares GPU N, as the local engine's worker processes do;
    - ``cpu`` / ``mps`` (or null beside a learner on one): no GPU.
    """
    device = worker_device or ("cuda" if learner_device.type == "cuda" else learner_device.type)
    if device == "cuda":
        return {"num_gpus": 1}, "cuda"
    if device.startswith("cuda:"):
        return {"num_gpus": 0, "runtime_env": {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}}, device
    return {"num_gpus": 0}, device


class RayWorker:
    """A rollout worker in a Ray actor: a policy copy, a sampler and the rewards."""

    def __init__(self, spec: _WorkerSpec, reference_state):
        self.spec, self.error = spec, None
        try:
            self.sampler, self.policy, self.rewards, self.worker = build_worker(spec, reference_state)
        except ConfigError as e:
            self.error = {"config_error": (e.field, e.value, e.allowed), "error": str(e)}
        except Exception as e:  # noqa: BLE001 - reported by ready()
            self.error = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}

    def ready(self) -> dict[str, Any] | None:
        return self.error

    def sample(self, batch: int, version: int, weights: dict[str, torch.Tensor] | None) -> bytes:
        t0 = time.monotonic()
        if weights is not None:
            self.policy.load_state_dict(weights)
            self.worker.load_weights(None, version)
        return pickle.dumps({"worker": self.spec.index, **sample_message(self.spec, self.sampler, self.policy, self.rewards, self.worker, batch, version, time.monotonic() - t0)})


@ENGINES.register("ray")
def ray_engine(cfg, *, sampler, policy, rewards, reference, dist, device, keep_graph, run_dir):
    """Workers as Ray actors (one machine or a cluster), weights through the object store;
    sync and lockstep async."""
    from mmrl.rollout.engine import RolloutWorker, check_partial_rollouts

    check_partial_rollouts(policy, cfg)
    scorer = RolloutWorker(sampler, policy, rewards, cfg.algo, dist, reference=reference, device=device) if cfg.rollout.score_on == "learner" else None
    return RayEngine(cfg, policy=policy, sampler=sampler, rewards=rewards, reference=reference, dist=dist, run_dir=run_dir, scorer=scorer)


class RayEngine(ProcessEngine):
    """``rollout.workers`` Ray actors sampling in lockstep (sync or k-steps-off)."""

    def __init__(self, cfg, **kwargs):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise MissingExtraError("ray", "ray", "rollout.engine: ray") from None
        if cfg.rollout.num_workers == 0:
            raise ConfigError("rollout.workers", 0, "the ray engine runs workers as actors: use 1 or more (workers: 0 samples in the learner's process with engine: local)")
        if cfg.rollout.mode == "async" and cfg.rollout.schedule == "free":
            raise ConfigError("rollout.schedule", "free", "the ray engine runs lockstep schedules (sync, k-steps-off); free-running workers run with engine: local")
        super().__init__(cfg, **kwargs)

    def start(self, start_step: int, version: int) -> None:
        import ray

        self.ray = ray
        self.own_ray = not ray.is_initialized()
        if self.own_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.start_step, self.next_batch, self.offset = start_step, start_step, version - start_step
        current = {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}
        sequence = [(int(h["version"]), h["weights"]) for h in self.resume.get("history", [])] + [(version, current)]
        self.history = type(self.history)(sequence)
        threads = self.ro.worker_threads or torch.get_num_threads()
        placement, device = actor_placement(self.ro.worker_device, self.dist.device)
        states = self.resume.get("workers") or [{} for _ in range(self.m)]
        if len(states) != self.m:
            raise ConfigError("rollout.workers", self.m, f"the checkpoint was written with {len(states)} workers; resume with as many")
        config = pickle.dumps(self.cfg)
        # one CPU of the cluster for placement, or a share of them where actors outnumber CPUs
        # (an actor that cannot be placed would wait for ever)
        cpus = min(1.0, ray.cluster_resources().get("CPU", 1.0) / self.m)
        actor = ray.remote(RayWorker).options(num_cpus=cpus, **placement)
        reference = ray.put(self.reference) if self.reference is not None else None
        self.actors = []
        for j in range(self.m):
            spec = _WorkerSpec(j, self.groups[j], config, self.modules, str(self.run_dir), start_step, self.cfg.total_steps, self.lag, self.offset, False,
                               self.scorer is None, threads, device, states[j])
            self.actors.append(actor.remote(spec, reference))
        for j, a in enumerate(self.actors):
            error = self._get(a.ready.remote(), j, "starting", timeout=self.ro.start_timeout_s)
            if error is not None:
                self._fail({"worker": j, "batch": start_step, **error})
        self.refs: dict[int, Any] = {}
        self.sent = [-1] * self.m
        self.futures: dict[tuple[int, int], Any] = {}
        self.next_issue = start_step
        for v, weights in sequence:
            self._write(v, weights)

    def close(self) -> None:
        if not getattr(self, "actors", None):
            return
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.own_ray:
            self.ray.shutdown()

    def _needed(self, step: int) -> int:
        return self.offset + max(0, step - self.lag)

    def _write(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Put ``version`` in the object store and ask for every step it is the weights of."""
        self.refs[version] = self.ray.put({k: v.detach().to("cpu") for k, v in state.items()})
        while self.next_issue < self.cfg.total_steps and self._needed(self.next_issue) in self.refs:
            step, u = self.next_issue, self._needed(self.next_issue)
            for j, a in enumerate(self.actors):
                weights = self.refs[u] if self.sent[j] != u else None
                self.sent[j] = u
                self.futures[(step, j)] = a.sample.remote(step, u, weights)
            self.next_issue += 1
        for v in [v for v in self.refs if v < self._needed(self.next_issue) and v != version]:
            del self.refs[v]  # no step left to ask for samples of it

    def _part(self, batch: int, worker: int) -> dict[str, Any]:
        return pickle.loads(self._get(self.futures.pop((batch, worker)), worker, f"sampling step {batch}"))

    def _get(self, ref, worker: int, doing: str, timeout: float | None = None):
        ray = self.ray
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RolloutWorkerError(f"rollout worker {worker} (ray actor, {describe(self.cfg)}) did not start within rollout.start_timeout_s ({timeout:g} s): not enough resources in the Ray cluster?") from None
        except ray.exceptions.RayActorError as e:
            g = self.groups[worker]
            raise RolloutWorkerError(f"rollout worker {worker} (ray actor, {describe(self.cfg)}, groups {g[0]}-{sum(g) - 1}) died while {doing}: {str(e).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, ConfigError):
                raise ConfigError(cause.field, cause.value, cause.allowed) from None
            self._fail({"worker": worker, "batch": doing.rpartition(" ")[2], "error": f"{type(cause).__name__}: {cause}".splitlines()[0]})
