"""``rollout.engine: ray``: workers as Ray actors on a local Ray instance (mmrl/rollout/ray_engine.py)."""

import time

import pytest
import torch

from mmrl.config import from_dict
from mmrl.errors import ConfigError, RolloutWorkerError
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.rollout.test_engine import _same, _steps, _train, toy

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for the module (it takes seconds to start); the engine joins it."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.numerics
@pytest.mark.parametrize("rollout", [{"workers": 1}, {"workers": 2, "mode": "async", "max_staleness": 1}])
def test_ray_actors_train_as_the_local_engine_bit_for_bit(tmp_path, rollout):
    """The same lockstep schedule through the object store: sync with one actor, and
    one-step-off with two, equal the local engine's runs (metrics and weights)."""
    sampler = {"type": "prompt", "batch_groups": 2}
    _, local, w_local = _train(tmp_path, "local", toy(sampler=sampler, rollout=rollout))
    _, actors, w_actors = _train(tmp_path, "ray", toy(sampler=sampler, rollout={**rollout, "engine": "ray"}))
    _same(local, actors)
    for k in w_local:
        assert torch.equal(w_local[k], w_actors[k]), k


@pytest.mark.numerics
def test_a_ray_run_resumes_exactly(tmp_path):
    """One-step-off on actors: 3 steps, then --resume to 6, equals 6 steps straight."""
    data = toy(total_steps=6, checkpoint={"every": 3}, rollout={"engine": "ray", "workers": 1, "mode": "async", "max_staleness": 1}, eval={"at_start": False, "at_end": False})
    _, straight, w_straight = _train(tmp_path, "straight", data)
    train(from_dict(TrainConfig, {**data, "total_steps": 3}), tmp_path / "split")
    train(from_dict(TrainConfig, {**data, "total_steps": 6}), tmp_path / "split", resume=True)
    from mmrl.train.metrics import read_metrics
    from safetensors.torch import load_file

    _same(_steps(read_metrics(tmp_path / "split")), _steps(straight))
    w_split = load_file(str(tmp_path / "split/checkpoints/step_00000006/model.safetensors"))
    for k in w_straight:
        assert torch.equal(w_straight[k], w_split[k]), k


@pytest.mark.learning
def test_one_step_off_on_two_actors_learns_the_toy_task(tmp_path, learning_seed, learned):
    """Async (one-step-off) with two Ray actors raises the toy reward as the sync loop does.

    Measured (seeds 0-4, avx512; seed 0 also default and avx2): reward gain 0.74 to 0.80 over 25 updates (>= 0.4)."""
    data = toy(seed=learning_seed, total_steps=25, rollout={"engine": "ray", "workers": 2, "mode": "async", "max_staleness": 1}, checkpoint={"every": 25})
    _, records, _ = _train(tmp_path, "ray", data)
    rewards = [r["reward/total"] for r in _steps(records)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert [r["staleness/lag_max"] for r in _steps(records)][1:] == [1] * 24
    learned(last - first, 0.4, name="reward gain")


def test_a_dead_actor_stops_the_run_naming_it_and_the_checkpoint_resumes(tmp_path):
    """An actor killed mid-run (a node lost): one error naming the worker, its sampler and
    seed; the last checkpoint is whole, and ``--resume`` continues from it."""
    import threading

    data = toy(total_steps=400, checkpoint={"every": 1}, rollout={"engine": "ray", "workers": 1, "mode": "async"}, eval={"at_start": False, "at_end": False})
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / "run")
    latest = tmp_path / "run/checkpoints/latest"

    def kill_after_a_checkpoint():
        deadline = time.time() + 120
        while time.time() < deadline and not latest.exists():
            time.sleep(0.05)
        ray.kill(trainer.engine.actors[0])

    killer = threading.Thread(target=kill_after_a_checkpoint)
    killer.start()
    with pytest.raises(RolloutWorkerError, match=r"^rollout worker 0 \(ray actor, sampler 'prompt', seed 0, groups 0-3\) died while sampling step \d+"):
        trainer.train()
    killer.join()
    stopped = int(latest.read_text().split("_")[1])
    assert 1 <= stopped < 400
    train(from_dict(TrainConfig, {**data, "total_steps": stopped + 2}), tmp_path / "run", resume=True)
    assert latest.read_text() == f"step_{stopped + 2:08d}"


def test_free_running_is_refused_by_the_ray_engine(tmp_path):
    with pytest.raises(ConfigError, match="^rollout.schedule: got 'free'"):
        Trainer(from_dict(TrainConfig, toy(rollout={"engine": "ray", "mode": "async", "schedule": "free"})), tmp_path / "run")


def test_without_ray_installed_the_engine_names_the_extra(tmp_path, monkeypatch):
    import sys

    from mmrl.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'mmrl\[ray\]'"):
        Trainer(from_dict(TrainConfig, toy(rollout={"engine": "ray", "workers": 1})), tmp_path / "run")


@pytest.mark.numerics
def test_a_language_agent_trains_on_a_ray_actor_as_on_the_local_engine(tmp_path):
    """Multi-turn episodes of the text agent, sampled by a Ray actor (the env and the policy's
    copy in its process), give the local engine's weights, bit for bit."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.policies.test_text_agent import config

    runs = {}
    for name, engine in (("local", "local"), ("ray", "ray")):
        data = config(total_steps=2, rollout={"workers": 1, "engine": engine}, checkpoint={"every": 2})
        train(from_dict(TrainConfig, data), tmp_path / name)
        runs[name] = load_file(str(tmp_path / name / "checkpoints/step_00000002/model.safetensors"))
    assert runs["local"].keys() == runs["ray"].keys()
    assert all(torch.equal(runs["local"][k], runs["ray"][k]) for k in runs["local"])


@pytest.mark.parametrize("mode", [{}, {"mode": "async", "max_staleness": 2}], ids=["sync", "async"])
def test_sac_on_a_ray_actor_trains_as_on_the_local_engine(tmp_path, mode):
    """An off-policy run (algo.loss: sac): the actor's episodes fill the learner's replay
    buffer as the local engine's do, and the weights after the updates are the same; async
    (max_staleness 2, lockstep), the actor's transitions lag 0, 1, 2, 2 updates as a local
    worker's do."""
    from safetensors.torch import load_file

    from mmrl.train.metrics import read_metrics
    from tests.train.test_sac import sac_config

    data = sac_config(total_steps=4 if mode else 3, loss={"learning_starts": 100})
    for name, rollout in (("local", {**mode, "workers": 1} if mode else {}), ("ray", {**mode, "engine": "ray", "workers": 1})):
        train(from_dict(TrainConfig, {**data, "rollout": rollout}), tmp_path / name)
    last = f"step_{data['total_steps']:08d}"
    a, b = (load_file(tmp_path / name / "checkpoints" / last / "model.safetensors") for name in ("local", "ray"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    if mode:
        _same(_steps(read_metrics(tmp_path / "local")), _steps(read_metrics(tmp_path / "ray")))
        assert [r["staleness/lag_max"] for r in _steps(read_metrics(tmp_path / "ray"))] == [0, 1, 2, 2]
