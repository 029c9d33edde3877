"""Options do what they say: an option that would be accepted and then ignored in the
configured combination is refused at validation with one line naming it (field: got
value; why and what instead), or does what it says (``rollout.worker_device: cuda:N``
under ``engine: ray``; ``max_staleness`` under ``stale: correct``)."""

from pathlib import Path

import pytest
import torch

from mmrl.config import from_dict
from mmrl.errors import ConfigError
from mmrl.registry import SAMPLERS
from mmrl.rollout.ray_engine import NOSET_CUDA_VISIBLE_DEVICES, actor_placement
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from tests.conftest import point_reach_config
from tests.rollout.test_engine import _steps, _train, toy

ROOT = Path(__file__).resolve().parents[1]
FREE = {"mode": "async", "schedule": "free"}
TIS = {"correction": {"type": "tis", "level": "token", "cap": 2.0}}


def refused(data: dict, field: str, value) -> str:
    """The one-line ConfigError ``data`` is refused with, checked to name ``field`` and ``value``."""
    with pytest.raises(ConfigError) as e:
        from_dict(TrainConfig, data)
    message = str(e.value)
    assert (e.value.field, e.value.value) == (field, value), message
    assert message.startswith(f"{field}: got {value!r}; ") and "\n" not in message
    return message


# ---------------------------------------------------------------- 1. rollout.worker_device under engine: ray


@pytest.mark.parametrize(
    "worker_device, learner, options, device",
    [
        ("cuda:1", "cpu", {"num_gpus": 0, "runtime_env": {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}}, "cuda:1"),
        ("cuda:0", "cuda:0", {"num_gpus": 0, "runtime_env": {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}}, "cuda:0"),
        ("cuda", "cpu", {"num_gpus": 1}, "cuda"),
        (None, "cuda:1", {"num_gpus": 1}, "cuda"),  # null: the learner's kind of device, a GPU of the actor's own
        ("cpu", "cuda:0", {"num_gpus": 0}, "cpu"),
        (None, "cpu", {"num_gpus": 0}, "cpu"),
    ],
)
def test_ray_worker_device_cuda_n_keeps_its_gpu_index(worker_device, learner, options, device):
    """``cuda:N`` used to become ``cuda`` in the actor (a GPU Ray picked); now the copy goes
    to ``cuda:N`` with no GPU reserved by Ray, which is told to leave CUDA_VISIBLE_DEVICES
    alone, so N counts the node's GPUs as the learner's process does."""
    assert actor_placement(worker_device, torch.device(learner)) == (options, device)


def test_a_ray_actor_placed_on_cuda_n_sees_the_gpus_the_learner_sees(monkeypatch):
    """On a Ray instance of two (logical) GPUs that blanks CUDA_VISIBLE_DEVICES of actors
    without a GPU (as Ray before 2.5x did by default), an actor placed for ``cuda:1`` still
    sees the learner's GPUs "3,5", so its cuda:1 is the learner's cuda:1 (GPU 5)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray instance of another test is running")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")  # the old default: num_gpus 0 -> CUDA_VISIBLE_DEVICES=""

    class Probe:
        def visible(self):
            import os

            return os.environ.get("CUDA_VISIBLE_DEVICES")

    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        options, device = actor_placement("cuda:1", torch.device("cpu"))
        placed = ray.remote(Probe).options(num_cpus=0.5, **options).remote()
        bare = ray.remote(Probe).options(num_cpus=0.5, num_gpus=0).remote()
        assert device == "cuda:1"
        assert ray.get(placed.visible.remote(), timeout=300) == "3,5"
        assert ray.get(bare.visible.remote(), timeout=300) == ""  # what the actor saw before: no GPU at all
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- 2. rollout.max_staleness under stale: correct


@pytest.mark.parametrize(
    "rollout, field, value",
    [
        ({**FREE, "stale": "correct", "max_staleness": 0}, "rollout.max_staleness", 0),
        ({**FREE, "stale": "correct", "max_staleness": 1, "prefetch": 3}, "rollout.prefetch", 3),
        ({**FREE, "stale": "correct", "max_staleness": 2, "prefetch": 4}, "rollout.prefetch", 4),
    ],
)
def test_stale_correct_refuses_a_prefetch_past_max_staleness(rollout, field, value):
    """stale: correct drops nothing, and a free-running worker's samples lag up to its
    prefetch: a prefetch past max_staleness (or max_staleness 0) would leave it bounding
    nothing."""
    assert "max_staleness" in refused(toy(algo=TIS, rollout=rollout), field, value)


def test_stale_correct_trains_no_sample_older_than_max_staleness(tmp_path):
    """max_staleness now bounds stale: correct too: workers allowed 2 steps ahead (prefetch
    null = max_staleness 2) train stale samples, none lagging by more than 2, none dropped."""
    _, records, _ = _train(tmp_path, "corr", toy(total_steps=6, algo=TIS, rollout={**FREE, "stale": "correct", "max_staleness": 2}))
    steps = _steps(records)
    assert len(steps) == 6 and all(r["staleness/dropped"] == 0 for r in steps)
    assert all(r["staleness/lag_max"] <= 2 for r in steps)
    assert max(r["staleness/lag_max"] for r in steps) >= 1  # stale samples were trained (and weighted)


# ---------------------------------------------------------------- 3. prefetch and stale under lockstep


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("option, value", [("prefetch", 2), ("stale", "correct")])
def test_prefetch_and_stale_are_refused_under_lockstep(mode, option, value):
    message = refused(toy(rollout={"mode": mode, "schedule": "lockstep", option: value}), f"rollout.{option}", value)
    assert "schedule: free" in message


# ---------------------------------------------------------------- 4. worker options with workers: 0


@pytest.mark.parametrize("workers", [{"workers": 0}, {}])  # {}: null, 0 in sync mode
@pytest.mark.parametrize("option, value", [("score_on", "learner"), ("worker_threads", 2), ("worker_device", "cpu"), ("worker_device", "cuda:1")])
def test_worker_options_are_refused_without_worker_processes(workers, option, value):
    message = refused(toy(rollout={**workers, option: value}), f"rollout.{option}", value)
    assert "workers: 1 or more" in message
    from_dict(TrainConfig, toy(rollout={"workers": 1, option: value}))  # with a worker process it applies


# ---------------------------------------------------------------- 5. algo.advantage.level with gae

GAE = {"advantage": {"type": "gae", "gamma": 0.99, "lam": 0.95}, "group_size": 4, "groups_per_step": 2}


def gae(advantage: dict | None = None, **sections) -> dict:
    algo = {**GAE, "advantage": {**GAE["advantage"], **(advantage or {})}}
    return point_reach_config(algo=algo, critic={"type": "mlp", "hidden_sizes": [8]}, **sections)


def test_a_sequence_level_is_refused_with_gae():
    message = refused(gae({"level": "sequence"}), "algo.advantage.level", "sequence")
    assert "leave it step" in message
    assert from_dict(TrainConfig, gae({"level": "step"})).algo.advantage.level == "step"


# ---------------------------------------------------------------- 6. bootstrap_truncated without a final replay


@SAMPLERS.register("_test_env_without_final_replay", config=EnvSamplerConfig)
class _EnvWithoutFinalReplay(EnvSampler):
    """Test-only: an env sampler that records step rewards but no final observations."""

    records_final_replay = False


def test_bootstrap_truncated_is_refused_where_the_sampler_records_no_final_replay():
    data = gae({"bootstrap_truncated": True}, sampler={"type": "_test_env_without_final_replay"})
    assert "'_test_env_without_final_replay'" in refused(data, "algo.advantage.bootstrap_truncated", True)
    from_dict(TrainConfig, gae({"bootstrap_truncated": False}, sampler={"type": "_test_env_without_final_replay"}))
    from_dict(TrainConfig, gae({"bootstrap_truncated": True}))  # the env sampler records it


# ---------------------------------------------------------------- 7. a text backend that cannot pause, with partial rollouts


class NoPauseBackend:
    """Test-only: a generation backend whose generate takes no prefixes= and stop=."""

    def __init__(self, policy):
        self.policy = policy

    def generate(self, prompt_ids, options, generator, deterministic):
        raise AssertionError("never called: the run is refused first")


class PausingBackend(NoPauseBackend):
    def generate(self, prompt_ids, options, generator, deterministic, model_inputs=None, prefixes=None, stop=None):
        raise AssertionError("never called")


def no_pause_backend(policy):
    return NoPauseBackend(policy)


def annotated_no_pause_backend(policy) -> NoPauseBackend:
    return NoPauseBackend(policy)


def text(backend: str, **rollout) -> dict:
    return {
        "name": "text", "seed": 0, "total_steps": 1,
        "policy": {"type": "text_lm", "tiny": {"hidden_size": 16, "num_heads": 2, "intermediate_size": 32}, "generation": {"max_new_tokens": 4, "backend": backend}},
        "sampler": {"type": "prompt", "data": {"train": str(ROOT / "examples/arithmetic/train.jsonl")}},
        "rewards": [{"type": "token_fraction", "token": 3}],
        "algo": {"group_size": 2, "groups_per_step": 2}, "rollout": {"over_provision": 2.0, **rollout},
        "eval": {"at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    }


@pytest.mark.parametrize("factory", ["NoPauseBackend", "annotated_no_pause_backend"])
def test_a_text_backend_that_cannot_pause_is_refused_at_validation_for_partial_rollouts(factory):
    """The config names the backend's class (or a factory annotated with it): its generate
    takes no prefixes= / stop=, so partial rollouts are refused before anything is built."""
    spec = f"{__name__}:{factory}"
    assert "rollout.over_provision 1" in refused(text(spec), "policy.generation.backend", spec)
    from_dict(TrainConfig, text(f"{__name__}:PausingBackend"))
    from_dict(TrainConfig, text("builtin"))
    from_dict(TrainConfig, {**text(spec), "rollout": {"over_provision": 1.0}})  # whole-batch decoding needs neither


@pytest.mark.parametrize("workers", [0, 1])
def test_a_text_backend_from_a_plain_factory_is_refused_before_sampling(tmp_path, workers):
    """A factory function tells its backend's class only once called: the check runs on the
    built policy, before any worker starts or anything is sampled (it was a TypeError at
    the first partial collection)."""
    pytest.importorskip("transformers")
    from mmrl.train.trainer import Trainer

    spec = f"{__name__}:no_pause_backend"
    cfg = from_dict(TrainConfig, text(spec, workers=workers))  # the config alone cannot tell
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, tmp_path / "run")
    assert (e.value.field, e.value.value) == ("policy.generation.backend", spec) and "prefixes=" in str(e.value)
    assert not (tmp_path / "run" / "config.yaml").exists()
