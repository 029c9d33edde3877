"""Rewards served over HTTP: the ``remote`` reward (rewards/remote.py) against loopback
servers in this process, and ``mmrl serve-reward`` (mmrl/commands/serve_reward.py) serving a run
config's rewards over the same protocol (docs/reward_models.md, "Rewards served over HTTP")."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import mmrl.commands.serve_reward
from mmrl.cli import main
from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, RewardSet, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError, UserCodeError
from mmrl.registry import REWARDS
from mmrl.rewards.remote import RemoteRewardError, decode_samples, encode_samples, request_rows
from mmrl.commands.serve_reward import build_server
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.rollout.test_engine import _same, _steps, toy

FAST = {"timeout_s": 2.0, "retries": 0, "backoff_s": 0.01}


def reward(name: str, **options):
    return build_reward(from_dict(REWARDS.entry(name).config, {"type": name, **options}), RewardContext())


def image_rollout(images: np.ndarray, group_size: int, **info) -> Rollout:
    n = len(images)
    return Rollout(group_id=torch.arange(n) // group_size, old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info={"images": torch.from_numpy(images), **info})


def images(n: int, seed: int = 0) -> np.ndarray:
    """Images of different JPEG sizes: noise of several amplitudes over a colour ramp."""
    rng = np.random.RandomState(seed)
    ramp = np.arange(40, dtype=np.float64)[None, :, None] * 6
    return np.stack([np.clip(ramp + rng.randint(0, 8 + 30 * i, (32, 40, 3)), 0, 255).astype(np.uint8) for i in range(n)])


@contextmanager
def serving(data: dict):
    """``mmrl serve-reward``'s server for run config ``data`` (what the CLI builds), scoring in a thread."""
    server = build_server(from_dict(TrainConfig, data), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(10)


class _Scripted(BaseHTTPRequestHandler):
    """Answers each POST as ``server.answer(attempt, request) -> (status, body bytes, delay s)`` says."""

    def do_POST(self):
        self.server.attempts += 1
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(request)
        self.server.headers.append(dict(self.headers))
        status, body, delay = self.server.answer(self.server.attempts, request)
        time.sleep(delay)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up waiting (the timeout test)
            pass

    def log_message(self, format, *args):
        pass


@contextmanager
def scripted(answer):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    httpd.daemon_threads = True
    httpd.attempts, httpd.requests, httpd.headers, httpd.answer = 0, [], [], answer
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}/score"
    finally:
        httpd.shutdown()
        httpd.server_close()


def scores(values) -> bytes:
    return json.dumps({"scores": values}).encode()  # json writes NaN / Infinity as Python does


def one_line_error(url: str, rollout: Rollout, **options) -> str:
    """The error a rollout's scoring ends with, through the run's RewardSet as a run scores it."""
    cfg = from_dict(REWARDS.entry("remote").config, {"type": "remote", "url": url, **FAST, **options})
    with pytest.raises(UserCodeError) as e:
        RewardSet([cfg], "weighted_sum", RewardContext()).score(rollout)
    message = str(e.value)
    assert "\n" not in message and message.startswith("reward 'remote' (rewards[0]) raised RemoteRewardError: ")
    assert url in message
    assert isinstance(e.value.__cause__, RemoteRewardError)
    return message


# ---------------------------------------------------------------- the round trip


def test_served_image_reward_gives_exactly_the_local_scores():
    """``mmrl serve-reward``'s server scores images with jpeg_compressibility; the remote
    reward's scores equal that reward's called locally, bit for bit, in one request and in
    several (whole groups per request); a weighted sum of two served components is combined
    as a run combines them."""
    rollout = image_rollout(images(12), group_size=3, prompt=[f"prompt {i // 3}" for i in range(12)])
    local = reward("jpeg_compressibility")(rollout)
    assert len(set(local.tolist())) > 8  # scores that tell the images apart
    with serving(toy(rewards=[{"type": "jpeg_compressibility"}])) as server:
        assert torch.equal(reward("remote", url=server.url, **FAST)(rollout), local)
        split = reward("remote", url=server.url, batch_size=5, **FAST)
        assert torch.equal(split(rollout), local)
        assert split.requests == 4 and server.requests == 1 + 4  # groups of 3 in requests of at most 5: 3 + 3 + 3 + 3
    two = [{"type": "jpeg_compressibility", "weight": 0.5}, {"type": "jpeg_incompressibility", "quality": 50, "weight": 2.0}]
    expected = RewardSet(from_dict(TrainConfig, toy(rewards=two)).rewards, "weighted_sum", RewardContext())
    with serving(toy(rewards=two)) as server:
        assert torch.equal(reward("remote", url=server.url, **FAST)(rollout), expected.combine(expected.score(rollout), rollout.group_id))
        with urllib.request.urlopen(server.url, timeout=5) as response:  # GET: what is served
            assert json.loads(response.read()) == {"version": 1, "rewards": ["jpeg_compressibility", "jpeg_incompressibility"], "weights": [0.5, 2.0], "aggregation": "weighted_sum"}


def test_samples_decode_back_into_the_rollout_the_rewards_read():
    """Images and video frames come back pixel for pixel, tokens without their padding,
    texts, records and per-sample numbers as they were."""
    rng = np.random.RandomState(2)
    videos = torch.from_numpy(rng.randint(0, 256, (4, 3, 8, 10, 3)).astype(np.uint8))
    tokens = torch.tensor([[3, 1, 0, 0], [3, 3, 3, 2], [1, 0, 0, 0], [2, 3, 3, 0]])
    mask = (torch.arange(4)[None] < torch.tensor([2, 4, 1, 3])[:, None]).float()
    rollout = Rollout(
        group_id=torch.tensor([0, 0, 1, 1]), old=OldLogProbs(torch.zeros(4, 4)), mask=mask, replay={},
        info={
            "images": videos[:, 0], "videos": videos, "tokens": tokens, "completions": ["a", "b", "c", "d"],
            "prompt": ["p0", "p0", "p1", "p1"], "answer": ["4", "4", None, None], "metadata": [{"k": 1}] * 2 + [{}] * 2,
            "record_id": torch.tensor([7, 7, 9, 9]), "success": torch.tensor([True, False, True, True]), "return": torch.tensor([0.5, -1.0, 2.0, 0.0]),
            "unsendable": [object()] * 4,
        },
    )
    request = json.loads(json.dumps({"version": 1, "samples": encode_samples(rollout)}))
    back = decode_samples(request["samples"])
    assert torch.equal(back.group_id, rollout.group_id)
    assert torch.equal(back.info["images"], videos[:, 0]) and torch.equal(back.info["videos"], videos)
    assert torch.equal(back.info["tokens"] * back.mask.long(), tokens * mask.long()) and torch.equal(back.mask, mask)
    for key in ("completions", "prompt", "answer", "metadata"):
        assert back.info[key] == rollout.info[key], key
    assert back.info["record_id"].tolist() == [7, 7, 9, 9]
    assert back.info["success"].tolist() == [True, False, True, True] and back.info["return"].tolist() == [0.5, -1.0, 2.0, 0.0]
    assert "unsendable" not in back.info
    assert reward("token_fraction", token=3)(back).tolist() == reward("token_fraction", token=3)(rollout).tolist()


@pytest.mark.parametrize(
    "groups, batch_size, expected",
    [
        ([0, 0, 1, 1, 2, 2], None, [(0, 6)]),
        ([0, 0, 1, 1, 2, 2], 6, [(0, 6)]),
        ([0, 0, 1, 1, 2, 2], 5, [(0, 4), (4, 6)]),
        ([0, 0, 1, 1, 2, 2], 2, [(0, 2), (2, 4), (4, 6)]),
        ([0, 0, 0, 0, 0, 1, 2], 2, [(0, 2), (2, 4), (4, 5), (5, 7)]),  # a group larger than a request is cut
        ([0, 1, 1, 1, 1, 1, 2], 3, [(0, 1), (1, 4), (4, 6), (6, 7)]),
    ],
)
def test_requests_hold_whole_groups_where_they_fit(groups, batch_size, expected):
    assert [(r.start, r.stop) for r in request_rows(groups, batch_size)] == expected


# ---------------------------------------------------------------- failures: one line naming the URL


def test_a_scorer_that_does_not_answer_in_time_is_a_timeout_naming_the_url():
    rollout = image_rollout(images(2), group_size=2)
    with scripted(lambda attempt, request: (200, scores([0.0, 0.0]), 2.0)) as (httpd, url):
        start = time.monotonic()
        message = one_line_error(url, rollout, timeout_s=0.2, retries=1, backoff_s=0.05)
        assert time.monotonic() - start < 1.5  # two attempts of 0.2 s, not the scorer's 2 s
        assert message.endswith(f"{url}: no answer after 2 attempts: no complete answer within timeout_s=0.2 s")
        assert httpd.attempts == 2


@contextmanager
def trickling(answer: bytes, seconds_per_byte: float):
    """A scorer on 127.0.0.1 that reads each request and sends ``answer`` (a whole HTTP
    response) one byte at a time; yields its URL and the bytes sent so far."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent = [0]

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener closed: the test is over
                return
            with conn:
                conn.settimeout(5)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                try:
                    for i in range(len(answer)):
                        conn.sendall(answer[i : i + 1])
                        sent[0] += 1
                        time.sleep(seconds_per_byte)
                except OSError:  # the client gave up
                    pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/score", sent
    finally:
        listener.close()


def http_answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)


def test_a_scorer_that_trickles_its_answer_fails_at_the_requests_deadline_not_per_byte():
    rollout = image_rollout(images(2), group_size=2)
    with trickling(http_answer(scores([0.0, 0.0])), seconds_per_byte=0.1) as (url, sent):  # ~10 s for the whole answer
        start = time.monotonic()
        message = one_line_error(url, rollout, timeout_s=1.0, retries=0)
        elapsed = time.monotonic() - start
    assert elapsed < 3.0, elapsed  # the deadline, although a byte came every 0.1 s (well within 1 s per read)
    assert sent[0] >= 3
    assert message.endswith(f"{url}: no answer after 1 attempt (retries: 0): no complete answer within timeout_s=1 s")


def test_a_slow_answer_that_completes_within_the_deadline_is_scored():
    rollout = image_rollout(images(2), group_size=2)
    with trickling(http_answer(scores([0.25, 0.75])), seconds_per_byte=0.002) as (url, _):
        assert reward("remote", url=url, **{**FAST, "timeout_s": 5.0})(rollout).tolist() == [0.25, 0.75]


def test_http_500_is_retried_with_backoff_then_one_line_naming_the_url_and_the_cause(monkeypatch):
    rollout = image_rollout(images(3), group_size=3)
    body = json.dumps({"error": "CUDA out of memory\n(traceback follows)"}).encode()
    with scripted(lambda attempt, request: (500, body, 0.0)) as (httpd, url):
        start = time.monotonic()
        message = one_line_error(url, rollout, retries=3, backoff_s=0.02)
        assert time.monotonic() - start >= 0.02 + 0.04 + 0.08  # exponential back-off
        assert httpd.attempts == 4
        assert message.endswith(f"{url}: no answer after 4 attempts: HTTP 500 Internal Server Error: CUDA out of memory (traceback follows)")
    # the scorer recovers: a later attempt's answer is the scores; configured headers go along, ${NAME} from the environment
    monkeypatch.setenv("SCORER_TOKEN", "s3cret")
    headers = {"Authorization": "Bearer ${SCORER_TOKEN}"}
    with scripted(lambda attempt, request: (503, b"busy", 0.0) if attempt < 3 else (200, scores([1, 2.5, -3]), 0.0)) as (httpd, url):
        assert reward("remote", url=url, headers=headers, **{**FAST, "retries": 2})(rollout).tolist() == [1.0, 2.5, -3.0]
        assert httpd.attempts == 3
        assert httpd.requests[0]["version"] == 1 and len(httpd.requests[0]["samples"]) == 3 and "image" in httpd.requests[0]["samples"][0]
        assert httpd.headers[0]["Authorization"] == "Bearer s3cret" and httpd.headers[0]["Content-Type"].startswith("application/json")
    monkeypatch.delenv("SCORER_TOKEN")
    with pytest.raises(ConfigError, match="environment variable SCORER_TOKEN is not set"):
        reward("remote", url="http://127.0.0.1:9/", headers=headers)
    # a client error is not retried
    with scripted(lambda attempt, request: (400, json.dumps({"error": "unknown protocol version"}).encode(), 0.0)) as (httpd, url):
        assert one_line_error(url, rollout, retries=3).endswith(f"{url}: HTTP 400 Bad Request: unknown protocol version (not retried)")
        assert httpd.attempts == 1


@pytest.mark.parametrize(
    "answer, cause",
    [
        (scores([0.5, 1.0]), "answered 2 scores for 3 samples; expected one per sample"),
        (scores([0.5, float("nan"), 1.0]), "scores[1] is nan (1 of 3 scores not finite); expected finite numbers"),
        (scores([0.5, 1.0, float("inf")]), "scores[2] is inf (1 of 3 scores not finite); expected finite numbers"),
        (scores([0.5, "1.0", 2]), 'scores[1] is "1.0", not a number'),
        (json.dumps({"score": [1, 2, 3]}).encode(), "the answer has no 'scores' (got an object with keys ['score'])"),
        (b"<html>ok</html>", "the answer is not JSON: '<html>ok</html>'"),
    ],
)
def test_an_answer_that_is_not_one_finite_score_per_sample_is_one_line_naming_the_url(answer, cause):
    rollout = image_rollout(images(3), group_size=3)
    with scripted(lambda attempt, request: (200, answer, 0.0)) as (httpd, url):
        message = one_line_error(url, rollout, retries=2)
        assert f"{url}: {cause}" in message
        assert httpd.attempts == 1  # an answer that came is never asked again


def test_the_served_rewards_refuse_a_request_without_what_they_read():
    """jpeg_compressibility served, a request without images: HTTP 422 naming the reward, not retried."""
    rollout = Rollout(group_id=torch.zeros(2, dtype=torch.long), old=OldLogProbs(torch.zeros(2, 1)), mask=torch.ones(2, 1), replay={}, info={"completions": ["a", "b"]})
    with serving(toy(rewards=[{"type": "jpeg_compressibility"}])) as server:
        message = one_line_error(server.url, rollout, retries=3)
    assert "HTTP 422 Unprocessable Entity: rewards: got 'jpeg_compressibility'; scores images and needs rollout.info['images']" in message
    assert message.endswith("(not retried)")


@pytest.mark.parametrize(
    "body, status, error",
    [
        ({"version": 2, "samples": [{"group": 0}]}, 400, "protocol version 2; this server speaks version 1"),
        ({"version": 1, "samples": []}, 400, "'samples' must be a non-empty list of objects"),
        ({"version": 1, "samples": [{"image": "not base64!"}]}, 400, "samples[0].image is not base64 text"),
        ({"version": 1, "samples": [{"image": "aGVsbG8="}]}, 400, "samples[0].image is not an image OpenCV can decode (PNG expected)"),
        ({"version": 1, "samples": [{"tokens": [1, 2]}, {"group": 0}]}, 400, "samples[1] has no 'tokens' while samples[0] has one; every sample or none"),
        ({"version": 1, "samples": [{"tokens": [3, 1]}, {"tokens": [3]}]}, 200, None),
    ],
)
def test_the_server_answers_a_malformed_request_with_400_saying_what_is_wrong(body, status, error):
    with serving(toy()) as server:
        request = urllib.request.Request(server.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                got, answer = response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            got, answer = e.code, json.loads(e.read())
    assert got == status
    assert answer == {"error": error} if error else answer["scores"] == [0.5, 1.0]


# ---------------------------------------------------------------- a run whose scorer dies


def test_a_run_whose_scorer_dies_stops_with_one_line_and_keeps_a_loadable_checkpoint(tmp_path):
    """The scorer serves token_fraction for two steps and stops: the run's third step ends
    with the remote reward's one-line error naming the URL; checkpoint 2 is on disk, whole:
    a run resumes from it with the reward scored locally. The two served steps trained
    exactly as a run scoring token_fraction itself."""
    plain = {"eval": {"at_start": False, "at_end": False, "episodes": 8}, "checkpoint": {"every": 1}}
    with serving(toy(**plain)) as server:
        score = server.score

        def score_then_stop(rollout):
            answer = score(rollout)
            if server.requests + 1 == 2:
                server.close()  # the second request is answered, and nothing listens any more
            return answer

        server.score = score_then_stop
        remote = [{"type": "remote", "url": server.url, "timeout_s": 2.0, "retries": 1, "backoff_s": 0.05}]
        with pytest.raises(UserCodeError) as e:
            train(from_dict(TrainConfig, toy(total_steps=5, rewards=remote, **plain)), tmp_path / "remote")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("reward 'remote' (rewards[0], sampler 'prompt', seed 0")
    assert f"raised RemoteRewardError: {server.url}: no answer after 2 attempts: connection refused (is the scorer running?)" in message
    run = tmp_path / "remote"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert load_file(str(run / "checkpoints" / "step_00000002" / "model.safetensors"))
    train(from_dict(TrainConfig, toy(total_steps=2, **plain)), tmp_path / "local")
    _same(_steps(read_metrics(run)), _steps(read_metrics(tmp_path / "local")), skip=("time/", "reward/token_fraction", "reward/remote"))
    resumed = Trainer(from_dict(TrainConfig, toy(total_steps=3, **plain)), run, resume=True)
    assert resumed.start_step == 2
    assert resumed.train()["step"] == 3


# ---------------------------------------------------------------- the command


def test_the_command_serves_until_stopped_and_refuses_a_bad_config_with_exit_2(tmp_path, write_config, capsys, monkeypatch):
    """``mmrl serve-reward CONFIG --port 0``: prints where it serves, scores, exits 0 when
    stopped; a reward it cannot serve (one that reads the policy) is one line and exit 2."""
    servers = []

    def build(*args, **kwargs):
        servers.append(build_server(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(mmrl.commands.serve_reward, "build_server", build)
    path = write_config(toy(rewards=[{"type": "token_fraction", "token": 1}]))
    codes = []
    thread = threading.Thread(target=lambda: codes.append(main(["serve-reward", str(path), "rewards=[{type: token_fraction, token: 3}]", "--port", "0", "--quiet"])))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not servers and time.monotonic() < deadline:
            time.sleep(0.02)
        rollout = Rollout(group_id=torch.zeros(2, dtype=torch.long), old=OldLogProbs(torch.zeros(2, 3)), mask=torch.ones(2, 3), replay={}, info={"tokens": torch.tensor([[3, 3, 1], [1, 2, 1]])})
        assert reward("remote", url=servers[0].url, **FAST)(rollout).tolist() == pytest.approx([2 / 3, 0.0])  # the override applies
    finally:
        if servers:
            servers[0].shutdown()
        thread.join(10)
    assert codes == [0]
    out = capsys.readouterr().out
    assert f"mmrl: serving token_fraction (weight 1), combined by weighted_sum, at {servers[0].url} (protocol version 1)" in out
    assert "stopped serving after 1 requests" in out

    bad = write_config(toy(rewards=[{"type": "exact_match"}, {"type": "grpo_care"}]), "bad.yaml")
    assert main(["serve-reward", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert err.startswith("mmrl: error: rewards[1].type: got 'grpo_care'; scores with the policy being trained")
    assert main(["serve-reward", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"mmrl: error: config: got '{tmp_path / 'missing.yaml'}'; no such file or run directory"
    with pytest.raises(ConfigError, match="^rewards\\[0\\].url: got ''; required"):
        from_dict(TrainConfig, toy(rewards=[{"type": "remote"}]))
