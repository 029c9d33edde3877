"""A reward served over HTTP: the samples go to a scorer at a URL, one score comes back each.

The scorer may be written in any language and run anywhere reachable (a GPU box with a large
reward model, a service of another team); ``mmrl serve-reward CONFIG`` serves the rewards of
a run config over the same protocol. The protocol (docs/reward_models.md, "Rewards served
over HTTP"): each request is a ``POST`` of a JSON object

    {"version": 1, "samples": [{"group": 0, "prompt": "a red cube", "image": "<base64 PNG>", ...}, ...]}

and the answer a JSON object ``{"scores": [s_0, s_1, ...]}``, one finite number per sample,
in the order of ``samples``. What a sample carries is what its rollout has
(:func:`encode_samples`); :func:`decode_samples` turns a request's samples back into a
:class:`~mmrl.core.rollout.Rollout` that mmrl's own rewards score.

Each attempt of a request has ``timeout_s`` in all, to connect, send and read the whole answer:
a scorer that answers slowly (a byte at a time) fails at that deadline as one that does not
answer. A request that fails (no connection, a timeout, HTTP 5xx, 408 or 429) is sent again after an
exponential back-off; after the last attempt, and at once for an answer that is not one
finite score per sample, the reward raises :class:`RemoteRewardError`, one line naming the
URL and the cause, and the run stops as for any reward that raises (the last checkpoint is
left intact).
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import json
import math
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import Reward, RewardContext
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.images import opencv, rollout_images
from mmrl.rewards.video import rollout_videos

PROTOCOL_VERSION = 1
CONTENT_TYPE = "application/json"
# answers worth another attempt: the scorer is busy, restarting or overloaded
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# rollout.info keys a sample carries under a name of its own; other per-sample numbers go to "info"
_OWN_KEYS = {"images": "image", "videos": "video", "completions": "completion", "prompt": "prompt", "answer": "answer",
             "metadata": "metadata", "record_id": "record_id", "tokens": "tokens"}
_ENV_HEADER = re.compile(r"\$\{(\w+)\}")


class RemoteRewardError(RuntimeError):
    """A remote scorer gave no valid answer: one line naming the URL and the cause."""


@dataclass
class RemoteRewardConfig(RewardConfig):
    """A score per sample from a scorer served over HTTP (any language; `mmrl serve-reward` serves a run config's rewards)."""

    type: str = option("remote", "registered name of this component (see `mmrl list`)")
    url: str = option("", "the scorer's endpoint (http:// or https://); every request is a POST of JSON there (docs/reward_models.md, 'Rewards served over HTTP')")
    timeout_s: float = option(60.0, "seconds one attempt of a request may take in all (connect, send, read the whole answer) before it counts as failed", gt=0.0)
    retries: int = option(3, "further attempts of a request that failed (no connection, timeout, HTTP 5xx, 408 or 429); 0 = one attempt", ge=0)
    backoff_s: float = option(1.0, "seconds before the first retry; each next retry waits twice as long as the one before", ge=0.0)
    batch_size: int | None = option(None, "most samples per request, whole groups together where they fit (a larger group is split); null = a rollout in one request", ge=1)
    headers: dict[str, str] = option(factory=dict, doc="extra HTTP headers of every request, e.g. {Authorization: 'Bearer ${SCORER_TOKEN}'}; ${NAME} is read from the environment, so the secret stays out of config.yaml")

    def validate(self, path: str) -> None:
        where = f"{path}." if path else ""
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where}url", self.url, "required: the scorer's URL, http://host:port/path or https://...")
        for key, value in self.headers.items():
            if not isinstance(key, str) or not isinstance(value, str) or not key.strip():
                raise ConfigError(f"{where}headers", {key: value}, "each header is a name and a text value")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- what a request carries


def _png(image: np.ndarray) -> str:
    """An RGB uint8 image [H, W, 3] as a base64 PNG (lossless: the scorer sees the exact pixels)."""
    cv2 = opencv("the remote reward's image encoding")
    ok, encoded = cv2.imencode(".png", cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 1])
    if not ok:
        raise RuntimeError(f"OpenCV could not encode a {image.shape} image as PNG")
    return base64.b64encode(encoded.tobytes()).decode("ascii")


def _from_png(text: str, where: str) -> np.ndarray:
    """A base64 PNG (or any image format OpenCV reads) as an RGB uint8 image [H, W, 3]."""
    cv2 = opencv("decoding a remote reward request's images")
    try:
        data = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ValueError(f"{where} is not base64 text") from None
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError(f"{where} is not an image OpenCV can decode (PNG expected)")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _jsonable(value: Any) -> tuple[bool, Any]:
    """(True, plain JSON value) for a value JSON represents (tensors and NumPy values as lists
    or numbers), else (False, None)."""
    if isinstance(value, (Tensor, np.ndarray, np.generic)):
        value = value.tolist()
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False, None
    return True, value


def _rows(value: Any, batch_size: int) -> list | None:
    """The B per-sample values of an info entry (a list or a tensor with B rows), else None."""
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch_size:
        return list(value.detach().cpu())
    if isinstance(value, (list, tuple)) and len(value) == batch_size:
        return list(value)
    return None


def encode_samples(rollout: Rollout) -> list[dict[str, Any]]:
    """One JSON object per sample of ``rollout``, as the protocol sends them:

    - ``group``: the sample's group id (samples of a group share a prompt);
    - ``prompt``, ``answer``, ``metadata``, ``record_id``: the prompt sampler's record, each
      where the rollout has it and it is JSON (a text prompt; a toy sampler's prompt id);
    - ``image``: ``info["images"]`` as a base64 PNG of the RGB image;
    - ``video``: ``info["videos"]`` as a list of base64 PNG frames;
    - ``completion``: the decoded text ``info["completions"]``;
    - ``tokens``: ``info["tokens"]`` as a list of token ids, only the valid ones where the
      rollout's decision mask has the tokens' shape;
    - ``info``: every other per-sample number of ``rollout.info`` (an env rollout's
      ``success``, ``return``, ``length``; ``truncated``), by its key.
    """
    b = rollout.batch_size
    samples: list[dict[str, Any]] = [{"group": int(g)} for g in rollout.group_id.tolist()]
    info = rollout.info
    if "images" in info:
        for sample, image in zip(samples, rollout_images(rollout, "remote")):
            sample["image"] = _png(image)
    if "videos" in info:
        for sample, video in zip(samples, rollout_videos(rollout, "remote").numpy()):
            sample["video"] = [_png(frame) for frame in video]
    if "completions" in info:
        for sample, text in zip(samples, info["completions"]):
            sample["completion"] = str(text)
    if isinstance(info.get("tokens"), Tensor) and info["tokens"].dim() == 2 and info["tokens"].shape[0] == b:
        tokens = info["tokens"].detach().cpu()
        mask = rollout.mask.detach().cpu()
        same_shape = mask.shape == tokens.shape
        for i, sample in enumerate(samples):
            row = tokens[i][mask[i] > 0] if same_shape else tokens[i]
            sample["tokens"] = [int(t) for t in row.tolist()]
    for key in ("prompt", "answer", "metadata", "record_id"):
        rows = _rows(info.get(key), b)
        for sample, value in zip(samples, rows or []):
            ok, value = _jsonable(value)
            if ok:
                sample[key] = value
    for key, value in info.items():
        if key in _OWN_KEYS or not isinstance(value, Tensor) or value.dim() != 1 or value.shape[0] != b:
            continue
        numbers = value.detach().cpu()
        numbers = numbers.tolist() if numbers.dtype == torch.bool else numbers.double().tolist() if numbers.is_floating_point() else numbers.long().tolist()
        if all(not isinstance(x, float) or math.isfinite(x) for x in numbers):  # JSON has no NaN
            for sample, x in zip(samples, numbers):
                sample.setdefault("info", {})[key] = x
    return samples


def request_body(samples: list[dict[str, Any]]) -> bytes:
    """The JSON body of one request."""
    return json.dumps({"version": PROTOCOL_VERSION, "samples": samples}, allow_nan=False, separators=(",", ":")).encode("utf-8")


def decode_samples(samples: Any) -> Rollout:
    """The inverse of :func:`encode_samples`: a request's ``samples`` as a Rollout that mmrl's
    rewards score. ``images`` [B, H, W, 3] and ``videos`` [B, F, H, W, 3] become uint8 RGB
    tensors (every sample must then have one, all of one size), ``tokens`` a long tensor [B, L]
    right-padded with 0 with the decision mask marking the valid ones, ``prompt`` a long
    tensor where every prompt is an integer (else a list), ``answer`` / ``metadata`` lists
    (None / {} where a sample has none), ``record_id`` each sample's or its index, and each
    ``info`` key a tensor [B]. A malformed sample raises ValueError naming it."""
    if not isinstance(samples, list) or not samples:
        raise ValueError("'samples' must be a non-empty list of objects")
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise ValueError(f"samples[{i}] is {type(sample).__name__}, not an object")
    b = len(samples)

    def everyone(key: str) -> list:
        missing = [i for i, s in enumerate(samples) if key not in s]
        if missing:
            raise ValueError(f"samples[{missing[0]}] has no {key!r} while samples[{next(i for i in range(b) if i not in missing)}] has one; every sample or none")
        return [s[key] for s in samples]

    def stacked(arrays: list[np.ndarray], key: str) -> Tensor:
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"the samples' {key} differ in size ({', '.join(str(s) for s in sorted(shapes))}); one size per request")
        return torch.from_numpy(np.stack(arrays))

    groups = [s.get("group", 0) for s in samples]
    if not all(isinstance(g, int) and not isinstance(g, bool) for g in groups):
        raise ValueError("'group' must be an integer")
    info: dict[str, Any] = {}
    if any("image" in s for s in samples):
        info["images"] = stacked([_from_png(x, f"samples[{i}].image") for i, x in enumerate(everyone("image"))], "images")
    if any("video" in s for s in samples):
        videos = []
        for i, frames in enumerate(everyone("video")):
            if not isinstance(frames, list) or not frames:
                raise ValueError(f"samples[{i}].video must be a non-empty list of PNG frames")
            videos.append(np.stack([_from_png(x, f"samples[{i}].video[{t}]") for t, x in enumerate(frames)]))
        info["videos"] = stacked(videos, "videos")
    if any("completion" in s for s in samples):
        info["completions"] = [str(x) for x in everyone("completion")]
    mask = torch.ones(b, 1)
    if any("tokens" in s for s in samples):
        rows = everyone("tokens")
        for i, row in enumerate(rows):
            if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise ValueError(f"samples[{i}].tokens must be a list of integers")
        width = max(1, max(len(row) for row in rows))
        tokens = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, width)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1.0
        info["tokens"] = tokens
    if any("prompt" in s for s in samples):
        prompts = [s.get("prompt") for s in samples]
        ids = all(isinstance(p, int) and not isinstance(p, bool) for p in prompts)
        info["prompt"] = torch.tensor(prompts, dtype=torch.long) if ids else prompts
    if any(key in s for s in samples for key in ("answer", "metadata", "record_id")):
        info["answer"] = [s.get("answer") for s in samples]
        info["metadata"] = [s.get("metadata") or {} for s in samples]
        records = [s.get("record_id", i) for i, s in enumerate(samples)]
        info["record_id"] = torch.tensor([r if isinstance(r, int) and not isinstance(r, bool) else i for i, r in enumerate(records)], dtype=torch.long)
    extra = [s.get("info", {}) for s in samples]
    for i, entry in enumerate(extra):
        if not isinstance(entry, dict):
            raise ValueError(f"samples[{i}].info must be an object of numbers")
    for key in dict.fromkeys(k for entry in extra for k in entry):
        values = []
        for i, entry in enumerate(extra):
            if key not in entry:
                raise ValueError(f"samples[{i}].info has no {key!r} while other samples have; every sample or none")
            if not isinstance(entry[key], (int, float, bool)):
                raise ValueError(f"samples[{i}].info.{key} must be a number or true/false")
            values.append(entry[key])
        info[key] = torch.tensor(values)
    return Rollout(group_id=torch.tensor(groups, dtype=torch.long), old=OldLogProbs(torch.zeros_like(mask)), mask=mask, replay={}, info=info)


# ---------------------------------------------------------------- requests


def request_rows(group_id: list[int], batch_size: int | None) -> list[range]:
    """The samples of each request, in order: at most ``batch_size`` consecutive samples,
    cut between groups (a scorer that compares a sample with its group peers sees the whole
    group); a group larger than ``batch_size`` alone is cut into pieces of ``batch_size``."""
    n = len(group_id)
    if batch_size is None or n <= batch_size:
        return [range(n)]
    runs, start = [], 0
    for i in range(1, n + 1):
        if i == n or group_id[i] != group_id[start]:
            runs.append((start, i))
            start = i
    out: list[range] = []
    begin = end = 0
    for start, stop in runs:
        if stop - start > batch_size:
            if end > begin:
                out.append(range(begin, end))
            out += [range(s, min(s + batch_size, stop)) for s in range(start, stop, batch_size)]
            begin = end = stop
        elif stop - begin > batch_size:
            out.append(range(begin, end))
            begin, end = start, stop
        else:
            end = stop
    if end > begin:
        out.append(range(begin, end))
    return out


def _headers(cfg: RemoteRewardConfig, path: str) -> dict[str, str]:
    """The configured headers, ``${NAME}`` read from the environment (an unset name is an error)."""

    def expand(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(f"{path}.headers", f"${{{name}}}", f"the environment variable {name} is not set")
        return os.environ[name]

    return {key: _ENV_HEADER.sub(expand, value) for key, value in cfg.headers.items()}


def _failure(error: BaseException, timeout_s: float) -> str:
    """What went wrong with one attempt, in a few words."""
    if isinstance(error, urllib.error.HTTPError):
        body = ""
        try:
            raw = error.read().decode("utf-8", "replace")
            try:
                answer = json.loads(raw)
                body = answer.get("error", raw) if isinstance(answer, dict) else raw
            except ValueError:
                body = raw
        except OSError:
            pass
        return _one_line(f"HTTP {error.code} {error.reason}" + (f": {body}" if str(body).strip() else ""))
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no complete answer within timeout_s={timeout_s:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is the scorer running?)"
    if isinstance(reason, OSError) and reason.strerror:
        return _one_line(reason.strerror)
    return _one_line(f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__)


class _DeadlineReader(io.RawIOBase):
    """A socket's answer stream whose every read waits at most until ``deadline`` (monotonic
    seconds): a server that trickles its answer a byte at a time ends at the deadline, where a
    socket timeout alone would restart its wait at each byte."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self.sock, self.deadline = sock, deadline
        self.raw = sock.makefile("rb", buffering=0)  # holds the socket open until this stream closes, as http.client expects

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.sock.settimeout(_remaining(self.deadline))
        return self.raw.readinto(buffer)

    def close(self) -> None:
        self.raw.close()
        super().close()


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class _DeadlineSocket:
    """A connected socket whose sends and answer reads end at ``deadline``; otherwise the socket."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data) -> None:
        self._sock.settimeout(_remaining(self._deadline))  # since Python 3.5 a timeout bounds the whole sendall
        self._sock.sendall(data)

    def makefile(self, mode: str = "r", *args, **kwargs):
        if mode != "rb":
            return self._sock.makefile(mode, *args, **kwargs)
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _DeadlineConnection:
    """Mixed into http.client's connections: connect within what is left of ``deadline``, and
    every later send and read within it too."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = _remaining(self.deadline)
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTP(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPS(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHandler:
    """Mixed into urllib's HTTP(S) handlers: the connection ends at the request's ``deadline``
    (proxies from the environment, redirects and TLS stay urllib's)."""

    def do_open(self, http_class, req, **kwargs):
        deadline_class = _DeadlineHTTPS if issubclass(http_class, http.client.HTTPSConnection) else _DeadlineHTTP
        return super().do_open(functools.partial(deadline_class, deadline=req.deadline), req, **kwargs)


class _DeadlineHTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


class _DeadlineHTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
    pass


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> bytes:
    """The answer to one POST, all of it within ``timeout_s`` seconds from now (else TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    request.deadline = deadline
    with urllib.request.build_opener(_DeadlineHTTPHandler, _DeadlineHTTPSHandler).open(request, timeout=timeout_s) as response:
        return response.read()


def check_scores(answer: Any, n: int, url: str) -> list[float]:
    """The scores of a decoded answer: a JSON object whose ``scores`` is a list of exactly
    ``n`` finite numbers; anything else is a :class:`RemoteRewardError` saying what was wrong."""
    if not isinstance(answer, dict) or "scores" not in answer:
        what = f"an object with keys {sorted(answer)}" if isinstance(answer, dict) else f"a JSON {type(answer).__name__}"
        raise RemoteRewardError(f"{url}: the answer has no 'scores' (got {what}); expected {{\"scores\": [...]}}, one number per sample")
    scores = answer["scores"]
    if not isinstance(scores, list):
        raise RemoteRewardError(f"{url}: 'scores' is a JSON {type(scores).__name__}; expected a list of {n} numbers")
    if len(scores) != n:
        raise RemoteRewardError(f"{url}: answered {len(scores)} scores for {n} samples; expected one per sample")
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise RemoteRewardError(f"{url}: scores[{i}] is {_one_line(json.dumps(s), 40)}, not a number")
        if not math.isfinite(s):
            bad = sum(1 for x in scores if isinstance(x, float) and not math.isfinite(x))
            raise RemoteRewardError(f"{url}: scores[{i}] is {s} ({bad} of {n} scores not finite); expected finite numbers")
    return [float(s) for s in scores]


@REWARDS.register("remote", config=RemoteRewardConfig)
class RemoteReward(Reward):
    """A score per sample from a scorer served over HTTP (docs/reward_models.md, "Rewards served over HTTP")."""

    def __init__(self, cfg: RemoteRewardConfig, context: RewardContext):
        super().__init__(cfg, context)
        self.headers = {"Content-Type": f"{CONTENT_TYPE}; charset=utf-8", "Accept": CONTENT_TYPE, "User-Agent": "mmrl-remote-reward", **_headers(cfg, "rewards")}
        self.requests = 0  # requests sent, retries included

    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        samples = encode_samples(rollout)
        scores: list[float] = []
        for rows in request_rows(rollout.group_id.tolist(), self.config.batch_size):
            scores += self.post([samples[i] for i in rows])
        return torch.tensor(scores, dtype=torch.float32)

    def post(self, samples: list[dict[str, Any]]) -> list[float]:
        """The scores of one request's ``samples``: POSTed up to ``retries + 1`` times, with
        back-off ``backoff_s · 2^k`` before retry k + 1; an answer that arrives is checked
        (:func:`check_scores`) and never retried."""
        cfg = self.config
        body = request_body(samples)
        attempts = cfg.retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            self.requests += 1
            try:
                raw = _post(cfg.url, body, self.headers, cfg.timeout_s)
            except urllib.error.HTTPError as e:
                cause = _failure(e, cfg.timeout_s)
                if e.code not in RETRIED_STATUS:
                    raise RemoteRewardError(f"{cfg.url}: {cause} (not retried)") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # no connection, a timeout, a dropped connection
                cause = _failure(e, cfg.timeout_s)
            else:
                try:
                    answer = json.loads(raw)
                except ValueError:
                    raise RemoteRewardError(f"{cfg.url}: the answer is not JSON: {_one_line(raw.decode('utf-8', 'replace'), 80)!r}") from None
                return check_scores(answer, len(samples), cfg.url)
        tries = f"{attempts} attempts" if attempts > 1 else "1 attempt (retries: 0)"
        raise RemoteRewardError(f"{cfg.url}: no answer after {tries}: {cause}")
