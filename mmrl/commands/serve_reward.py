"""``mmrl serve-reward``: the rewards of a run config served over HTTP.

The server speaks the protocol of the ``remote`` reward (``rewards/remote.py``;
docs/reward_models.md, "Rewards served over HTTP"): a ``POST`` of
``{"version": 1, "samples": [...]}`` at any path is decoded back into a Rollout (images into
the uint8 [B, H, W, 3] tensor the image rewards read), scored by the config's ``rewards:``
as a run scores them (:class:`~mmrl.core.reward.RewardSet`: every component, then
``algo.reward_aggregation`` with the components' weights) and answered with
``{"version": 1, "scores": [...], "components": {name: [...]}}``. ``GET`` at any path
answers what is served (a health check).

Requests are read and decoded in a thread each (:class:`http.server.ThreadingHTTPServer`),
but scored one at a time in the thread that called :meth:`RewardServer.serve_forever` (the
main thread under the CLI): reward components need not be thread-safe, a model stays on one
device, and a reward that times itself with SIGALRM (``math_answer``) works.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch

from mmrl.core.reward import RewardContext, RewardSet
from mmrl.errors import ConfigError, MissingExtraError

# the largest request body read (a batch of large images as PNG fits easily)
MAX_BODY_BYTES = 1 << 30


def served_rewards(cfg) -> RewardSet:
    """The reward set of a run config (``TrainConfig``), built as the trainer builds it
    (device from ``cfg.device``, ``cfg.seed``), refused with a one-line ConfigError where a
    component cannot be served: one that reads the policy being trained or its reference
    model, or one that learns from each step's samples (the server sees neither)."""
    if not cfg.rewards:
        raise ConfigError("rewards", [], "serve-reward serves a run config's rewards: list at least one")
    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    device = torch.device("cpu") if cpu else torch.device("cuda" if cfg.device == "auto" else cfg.device)
    rewards = RewardSet(cfg.rewards, cfg.algo.reward_aggregation, RewardContext(device=device, run_dir=None, seed=cfg.seed), cfg.algo.log_tamed_threshold)
    for i, (name, component) in enumerate(zip(rewards.names, rewards.components)):
        if component.needs_policy or component.needs_reference:
            raise ConfigError(f"rewards[{i}].type", name, "scores with the policy being trained or its reference model, which a reward server does not have; keep it in the run's own rewards")
        if component.learns:
            raise ConfigError(f"rewards[{i}].type", name, "learns from each step's samples during RL, which a reward server does not see; keep it in the run's own rewards")
    return rewards


class _Job:
    """One decoded request waiting to be scored by the serving thread."""

    def __init__(self, rollout):
        self.rollout = rollout
        self.done = threading.Event()
        self.status = 200
        self.answer: dict[str, Any] = {}


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"
    timeout = 600  # seconds a connection may sit idle mid-request before its thread gives up

    def log_message(self, format: str, *args) -> None:
        if self.server.owner.log is not None:
            self.server.owner.log(f"{self.address_string()} {format % args}")

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        body = json.dumps(answer, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if status >= 400:  # a body left unread must not be taken for the next request
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        owner = self.server.owner
        self._send(200, {"version": owner.version, "rewards": owner.rewards.names, "weights": owner.rewards.weights, "aggregation": owner.rewards.aggregation})

    def do_POST(self) -> None:
        from mmrl.rewards.remote import decode_samples

        owner = self.server.owner
        kind = self.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
        if kind != "application/json":
            return self._send(415, {"error": f"Content-Type {kind!r}; send application/json"})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._send(411, {"error": "a Content-Length header is required"})
        if int(length) > MAX_BODY_BYTES:
            return self._send(413, {"error": f"a request body of {length} bytes; at most {MAX_BODY_BYTES}"})
        try:
            request = json.loads(self.rfile.read(int(length)))
        except ValueError as e:
            return self._send(400, {"error": f"the body is not JSON: {e}"})
        if not isinstance(request, dict):
            return self._send(400, {"error": 'the body must be a JSON object {"version": 1, "samples": [...]}'})
        if request.get("version") != owner.version:
            return self._send(400, {"error": f"protocol version {request.get('version')!r}; this server speaks version {owner.version}"})
        try:
            rollout = decode_samples(request.get("samples"))
        except (ValueError, MissingExtraError) as e:
            return self._send(400, {"error": str(e)})
        job = _Job(rollout)
        if not owner.submit(job):
            return self._send(503, {"error": "the reward server is shutting down"})
        job.done.wait()
        self._send(job.status, job.answer)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: "RewardServer"


class RewardServer:
    """A :class:`RewardSet` served over HTTP at ``host:port`` (port 0: a free port; ``url``
    says which). Listening starts when it is built; :meth:`serve_forever` scores requests
    until :meth:`shutdown`. ``log`` receives one line per request (None: silent)."""

    def __init__(self, rewards: RewardSet, host: str = "127.0.0.1", port: int = 8000, log: Callable[[str], None] | None = None):
        from mmrl.rewards.remote import PROTOCOL_VERSION

        self.rewards = rewards
        self.version = PROTOCOL_VERSION
        self.log = log
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.requests = 0  # requests scored (answered 200)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        if not 0 <= port <= 65535:
            raise ConfigError("--port", port, "a TCP port: 0 to 65535 (0: a free one)")
        try:
            self.httpd = _HTTPServer((host, port), _Handler)
        except OSError as e:
            raise ConfigError("--port", port, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.httpd.owner = self
        # poll_interval: how soon close() stops the listener (a connection wakes it at once)
        self.listener = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="mmrl-serve-reward-http", daemon=True)
        self.listener.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def submit(self, job: _Job) -> bool:
        """Queue ``job`` for scoring; False once the server is shutting down."""
        with self._lock:
            if self._closed.is_set():
                return False
            self.jobs.put(job)
            return True

    def score(self, rollout) -> dict[str, Any]:
        """The answer to one request: the combined score per sample and each component's."""
        from mmrl.errors import NonFiniteError

        columns = self.rewards.score(rollout)
        total = self.rewards.combine(columns, rollout.group_id)
        if not torch.isfinite(total).all():
            raise NonFiniteError(f"the combined reward ({self.rewards.aggregation}) is not finite for {int((~torch.isfinite(total)).sum())} of {total.numel()} samples")
        return {"version": self.version, "scores": total.tolist(), "components": {name: columns[:, k].tolist() for k, name in enumerate(self.rewards.names)}}

    def _run(self, job: _Job) -> None:
        try:
            job.answer = self.score(job.rollout)
            self.requests += 1
        except (ConfigError, MissingExtraError) as e:  # the request lacks what a reward reads
            job.status, job.answer = 422, {"error": str(e)}
        except Exception as e:  # a reward that raised, a non-finite score: the request's answer, not the server's end
            job.status, job.answer = 500, {"error": " ".join(f"{type(e).__name__}: {e}".split())}
        finally:
            job.done.set()

    def serve_forever(self) -> None:
        """Score queued requests in this thread until :meth:`shutdown`; then stop listening
        and answer requests still queued with 503."""
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    break
                self._run(job)
        finally:
            self.close()

    def shutdown(self) -> None:
        """Ask :meth:`serve_forever` to return after the request it is scoring (any thread)."""
        self.jobs.put(None)

    def close(self) -> None:
        """Stop listening (later connections are refused) and answer queued requests with 503."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.status, job.answer = 503, {"error": "the reward server is shutting down"}
                job.done.set()


def build_server(cfg, host: str = "127.0.0.1", port: int = 8000, log: Callable[[str], None] | None = None) -> RewardServer:
    """The rewards of run config ``cfg`` (:func:`served_rewards`), listening at ``host:port``."""
    return RewardServer(served_rewards(cfg), host, port, log)
