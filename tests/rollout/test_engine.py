"""``rollout:``: rollout workers in spawned processes, sync and async (lockstep and free),
their faults, and resume (mmrl/rollout/engine.py)."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import gymnasium
import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import from_dict, option
from mmrl.errors import ConfigError, RolloutWorkerError
from mmrl.policies.toy.config import CategoricalSequenceConfig
from mmrl.policies.toy.model import CategoricalSequencePolicy
from mmrl.registry import POLICIES, REWARDS
from mmrl.rewards.toy import TokenFractionConfig, token_fraction
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import train
from tests.conftest import live_processes_in_group, point_reach_config, run_mmrl, start_train_in_own_group


def toy(**sections) -> dict:
    cfg = {
        "name": "toy", "seed": 0, "total_steps": 5, "sampler": {"type": "prompt"},
        "policy": {"type": "categorical_sequence", "dtype": "float64"},
        "rewards": [{"type": "token_fraction", "token": 3}],
        "algo": {"group_size": 8, "groups_per_step": 4, "ppo_epochs": 2, "num_minibatches": 2},
        "optim": {"lr": 0.01}, "eval": {"at_start": False, "episodes": 8},
        "log": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def _train(tmp_path, name, data):
    out = train(from_dict(TrainConfig, data), tmp_path / name)
    return out, read_metrics(tmp_path / name), load_file(str(tmp_path / name / "checkpoints" / f"step_{data['total_steps']:08d}" / "model.safetensors"))


def _steps(records):
    return [r for r in records if "reward/total" in r]


def _same(a, b, skip=("time/",)):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(skip)}
        assert keys == {k for k in y if not k.startswith(skip)}
        for k in keys:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.numerics
def test_sync_mode_with_a_worker_process_equals_sampling_in_the_learners_process(tmp_path):
    """The worker process rebuilds sampler, policy and rewards, receives every version's
    weights through shared memory and samples the step the learner trains: bit for bit the
    inline run (same float kernels, same thread count)."""
    _, inline, w_inline = _train(tmp_path, "inline", toy())
    _, worker, w_worker = _train(tmp_path, "worker", toy(rollout={"workers": 1}))
    _same(inline, worker)
    for k in w_inline:
        assert torch.equal(w_inline[k], w_worker[k]), k


@pytest.mark.numerics
def test_sync_mode_with_a_worker_process_carries_running_statistics_and_env_counters(tmp_path):
    """An env sampler and a policy with running statistics (observation normalization and a
    decision clock): the worker's copy observes, the learner commits what it observed, and
    the env-step counter and the checkpointed sampler state come from the worker."""
    data = point_reach_config(
        total_steps=3, policy={"type": "gaussian_mlp", "hidden_sizes": [16, 16], "obs_norm": True, "final_log_std": -1.5, "log_std_anneal_decisions": 200},
        rewards=[{"type": "success"}], algo={"group_size": 4, "groups_per_step": 2, "ppo_epochs": 2, "filters": [{"type": "zero_variance"}]},
        eval={"at_start": False, "episodes": 4},
    )
    _, inline, w_inline = _train(tmp_path, "inline", data)
    _, worker, w_worker = _train(tmp_path, "worker", {**data, "rollout": {"workers": 1}})
    _same(inline, worker)
    assert "obs_stats.mean" in w_worker and float(w_worker["sampled_decisions.value"]) > 0
    for k in w_inline:
        assert torch.equal(w_inline[k], w_worker[k]), k
    state = torch.load(tmp_path / "worker/checkpoints/step_00000003/state.pt", weights_only=True)
    assert state["rollout"]["workers"][0]["sampler"]["env_steps"] == _steps(worker)[-1]["env_steps"] > 0


@REWARDS.register("pinned_token_fraction", config=TokenFractionConfig)
def _pinned_token_fraction(rollout, cfg):
    """token_fraction, from a scorer bound to the learner's process (a reward model on its GPU)."""
    return token_fraction(rollout, cfg)


_pinned_token_fraction.runs_in_worker = False


@pytest.mark.numerics
def test_scoring_on_the_learners_side_equals_scoring_in_the_worker(tmp_path):
    """rollout.score_on: learner: the worker returns unscored samples, the learner's process
    scores, measures and filters them: the same run bit for bit. A reward that cannot leave
    the learner's process is refused for worker scoring and runs there."""
    algo = {"filters": [{"type": "zero_variance"}]}
    _, inline, w_inline = _train(tmp_path, "inline", toy(algo=algo))
    rewards = [{"type": "pinned_token_fraction", "token": 3}]
    _, learner, w_learner = _train(tmp_path, "learner", toy(algo=algo, rewards=rewards, rollout={"workers": 1, "score_on": "learner"}))
    _same([{k.replace("pinned_", ""): v for k, v in r.items()} for r in learner], inline)
    for k in w_inline:
        assert torch.equal(w_inline[k], w_learner[k]), k
    with pytest.raises(ConfigError, match="^rewards\\[0\\].type: got 'pinned_token_fraction'; cannot score in a rollout worker process"):
        train(from_dict(TrainConfig, toy(rewards=rewards, rollout={"workers": 1})), tmp_path / "refused")


@pytest.mark.numerics
def test_two_worker_processes_sample_what_one_samples(tmp_path):
    """Each worker samples a fixed share of every step's groups, seeded by their global index:
    two workers give one worker's samples whenever their sampling calls hold the same groups
    (batch_groups 2, as with N learner processes; mmrl/samplers/prompt.py)."""
    sampler = {"type": "prompt", "batch_groups": 2}
    _, one, w_one = _train(tmp_path, "one", toy(sampler=sampler, rollout={"workers": 1}))
    _, two, w_two = _train(tmp_path, "two", toy(sampler=sampler, rollout={"workers": 2}))
    assert [r["reward/total"] for r in _steps(one)] == [r["reward/total"] for r in _steps(two)]
    for k in w_one:
        torch.testing.assert_close(w_one[k], w_two[k], rtol=0, atol=1e-12)


@pytest.mark.numerics
def test_two_learner_processes_with_a_worker_each_match_one_learner_sampling_inline(tmp_path, write_config):
    """torchrun: two learner processes, each with its own worker process for its half of the
    groups, end with one learner's weights and metrics (float64, as in
    tests/train/test_distributed_and_cli_runs.py)."""
    path = write_config(toy(sampler={"type": "prompt", "batch_groups": 2}, eval={"at_start": False, "at_end": False}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run_mmrl("train", path, "--run-dir", tmp_path / "one", env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541", "-m", "mmrl", "train", path,
         "--run-dir", tmp_path / "two", "rollout.workers=1"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_file(str(tmp_path / "one/checkpoints/step_00000005/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000005/model.safetensors"))
    for k in a:  # float64 rounding of the all-reduce, amplified by Adam: as in the two-process test
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)
    ra, rb = _steps(read_metrics(tmp_path / "one")), _steps(read_metrics(tmp_path / "two"))
    assert [r["reward/total"] for r in ra] == [r["reward/total"] for r in rb]


@pytest.mark.numerics
def test_one_step_off_trains_step_s_on_samples_of_version_s_minus_1_deterministically(tmp_path):
    """async lockstep with max_staleness 1: steps 0 and 1 both sample with the initial weights,
    step s >= 1 with version s - 1; the schedule does not depend on timing, so two runs are
    equal bit for bit, and its samples differ from sync mode's from step 1 on."""
    data = toy(total_steps=6, rollout={"mode": "async", "max_staleness": 1})
    _, a, wa = _train(tmp_path, "a", data)
    _, b, wb = _train(tmp_path, "b", data)
    _same(a, b)
    for k in wa:
        assert torch.equal(wa[k], wb[k])
    lags = [(r["staleness/lag_mean"], r["staleness/lag_max"]) for r in _steps(a)]
    assert lags == [(0.0, 0.0)] + [(1.0, 1.0)] * 5
    assert all(r["staleness/dropped"] == 0 for r in _steps(a))
    _, sync, _ = _train(tmp_path, "sync", toy(total_steps=6))
    rewards = [r["reward/total"] for r in _steps(sync)], [r["reward/total"] for r in _steps(a)]
    assert rewards[0][0] == rewards[1][0] and rewards[0][1:] != rewards[1][1:]


def test_two_steps_off_lags_by_two(tmp_path):
    _, records, _ = _train(tmp_path, "k2", toy(total_steps=5, rollout={"mode": "async", "max_staleness": 2}))
    assert [r["staleness/lag_max"] for r in _steps(records)] == [0, 1, 2, 2, 2]


def test_free_running_workers_never_train_on_samples_beyond_the_staleness_bound(tmp_path):
    """free: timing decides the versions; whatever it is, no trained sample lags by more than
    max_staleness (here 0, with workers allowed 3 steps ahead: what they sample ahead is
    dropped and counted). The worker samples steps 0-2 at once with the initial weights, so
    step 1's (lagging 1 when the learner takes it) is always dropped."""
    _, records, _ = _train(tmp_path, "free", toy(total_steps=8, rollout={"mode": "async", "schedule": "free", "max_staleness": 0, "prefetch": 3}))
    steps = _steps(records)
    assert len(steps) == 8 and all(r["staleness/lag_max"] == 0 for r in steps)
    dropped = sum(r["staleness/dropped"] for r in steps)
    assert dropped > 0 and dropped % 32 == 0  # samples were dropped, in whole steps of 4 groups x 8


def test_free_running_with_a_correction_keeps_stale_samples_and_weights_them(tmp_path):
    """Workers allowed 3 steps ahead (max_staleness 3, which stale: correct needs) sample
    steps 0-2 at once with the initial weights: from step 1 on the learner trains samples
    of older weights, drops none, and the correction weights them by pi_prox / mu != 1."""
    _, records, _ = _train(tmp_path, "corr", toy(
        total_steps=8, algo={"correction": {"type": "tis", "level": "token", "cap": 2.0}},
        rollout={"mode": "async", "schedule": "free", "max_staleness": 3, "prefetch": 3, "stale": "correct"},
    ))
    steps = _steps(records)
    assert len(steps) == 8 and all(r["staleness/dropped"] == 0 for r in steps)
    assert all(r["staleness/lag_max"] <= 3 for r in steps)
    stale = [r for r in steps if r["staleness/lag_max"] > 0]
    assert stale, "no sample was ever stale"
    assert all(0 < r["correction/weight_mean"] <= 2.0 for r in steps)
    assert any(abs(r["correction/weight_mean"] - 1.0) > 1e-6 for r in stale)  # stale samples were weighted


@pytest.mark.parametrize(
    "rollout, algo, field",
    [
        ({"max_staleness": -1}, {}, "rollout.max_staleness"),
        ({"mode": "async", "workers": 0}, {}, "rollout.workers"),
        ({"schedule": "free"}, {}, "rollout.schedule"),
        ({"mode": "async", "schedule": "free", "stale": "correct"}, {}, "rollout.stale"),
        ({"engine": "nowhere"}, {}, "rollout.engine"),
        ({"workers": 1, "worker_device": "gpu0"}, {}, "rollout.worker_device"),
        ({"workers": 2}, {"resample_rounds": 1, "filters": [{"type": "zero_variance"}]}, "rollout.workers"),
        ({"workers": 1, "score_on": "learner"}, {"resample_rounds": 1, "filters": [{"type": "zero_variance"}]}, "rollout.score_on"),
        ({"workers": 1}, {"reuse_sampling_graph": True}, "algo.reuse_sampling_graph"),
    ],
)
def test_bad_rollout_settings_are_one_line_errors_naming_the_field(rollout, algo, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}: got"):
        from_dict(TrainConfig, toy(rollout=rollout, algo=algo))


def test_the_command_line_refuses_a_negative_staleness_with_exit_2(tmp_path, write_config):
    proc = run_mmrl("train", write_config(toy()), "rollout.max_staleness=-1", "--run-dir", tmp_path / "run")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "rollout.max_staleness: got -1" in proc.stderr


@dataclass
class _PinnedConfig(CategoricalSequenceConfig):
    type: str = option("pinned_sequence", "registered name")


@POLICIES.register("pinned_sequence", config=_PinnedConfig)
class _PinnedSequence(CategoricalSequencePolicy):
    """A policy bound to its process (e.g. one holding a device handle)."""

    runs_in_worker = False


def test_async_with_a_policy_that_cannot_leave_its_process_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="^policy.type: got 'pinned_sequence'; cannot be copied into a rollout worker"):
        train(from_dict(TrainConfig, toy(policy={"type": "pinned_sequence"}, rollout={"mode": "async"})), tmp_path / "run")


class CrashingEnv(gymnasium.Wrapper):
    """A simulator that crashes in a rollout worker process at its 4th reset (each training
    step resets every env once), so that steps 0-2 train and checkpoint first; the learner's
    own copy, used for evaluation, never crashes."""

    resets = 0

    def reset(self, **kwargs):
        CrashingEnv.resets += 1
        if CrashingEnv.resets == 4 * 8 and multiprocessing.current_process().name.startswith("mmrl-rollout-worker"):
            raise RuntimeError("simulated simulator crash")
        return self.env.reset(**kwargs)


def test_a_worker_that_crashes_stops_the_run_naming_worker_env_and_seed_and_keeps_the_checkpoint(tmp_path, write_config):
    data = point_reach_config(
        total_steps=50, seed=7, checkpoint={"every": 1}, rollout={"mode": "async"}, eval={"at_start": False, "episodes": 4},
        env={"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 8, "wrappers": [{"type": "tests.rollout.test_engine:CrashingEnv"}]},
    )
    proc = run_mmrl("train", write_config(data), "--run-dir", tmp_path / "run")
    err = proc.stderr.strip()
    assert proc.returncode == 1, err[-2000:]
    assert err.splitlines() == [err]
    assert err.startswith("mmrl: stopped: rollout worker 0 (env 'mmrl/PointReach-v0', seed 7, step 3, groups 0-1) failed: RuntimeError: simulated simulator crash")
    assert "crash (in env.reset, env index " in err  # the worker's own line adds the call and which env raised
    assert err.endswith("the last checkpoint is left intact")
    latest = (tmp_path / "run/checkpoints/latest").read_text()
    assert latest in ("step_00000002", "step_00000003")
    resumed = run_mmrl("train", tmp_path / "run", "total_steps=4", "--resume")  # the checkpoint is whole: it resumes (the crash was in the worker)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_killed_worker_is_reported_with_its_signal(tmp_path):
    """SIGKILL (out of memory, a killed simulator): the learner notices the process is gone."""
    cfg = from_dict(TrainConfig, toy(total_steps=400, rollout={"mode": "async"}))
    from mmrl.train.trainer import Trainer

    trainer = Trainer(cfg, tmp_path / "run")
    procs = list(trainer.engine.procs)
    os.kill(procs[0].pid, signal.SIGKILL)
    with pytest.raises(RolloutWorkerError, match=rf"^rollout worker 0 \(pid {procs[0].pid}, sampler 'prompt', seed 0, groups 0-3\) died \(killed by SIGKILL\)"):
        trainer.train()
    assert not any(p.is_alive() for p in procs)


def test_sigterm_to_the_whole_process_group_checkpoints_and_leaves_no_worker(tmp_path, write_config):
    """A scheduler's SIGTERM reaches the learner and its workers: the workers ignore it, the
    learner finishes its step, writes a final checkpoint and stops them."""
    path = write_config(toy(total_steps=2000, rollout={"mode": "async", "workers": 2}, eval={"at_start": False, "at_end": False}))
    run = tmp_path / "run"
    proc = start_train_in_own_group(path, run, logged_lines=3)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped = int((run / "checkpoints/latest").read_text().split("_")[1])
    assert stopped >= 3
    time.sleep(0.5)
    alive = live_processes_in_group(proc.pid)
    assert alive == [], alive


@pytest.mark.numerics
@pytest.mark.parametrize("schedule", ["lockstep", "free"])
def test_a_sigkilled_async_run_resumes_from_its_checkpoint(tmp_path, write_config, schedule):
    """The learner is SIGKILLed mid-run (its workers notice and exit); --resume restarts the
    workers from the checkpoint. Lockstep resumes exactly: the checkpoint keeps the weights of
    the versions its next steps sample from, so the resumed run ends with the uninterrupted
    run's weights and metrics. Free-running resumes and finishes; its schedule was timing."""
    data = toy(total_steps=60, checkpoint={"every": 1}, rollout={"mode": "async", "schedule": schedule}, eval={"at_start": False, "at_end": False})
    path = write_config(data)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mmrl", "train", path, "--run-dir", run], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoints/latest").exists():
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    stopped = int((run / "checkpoints/latest").read_text().split("_")[1])
    assert 0 < stopped < 60, stopped
    time.sleep(1.0)  # the orphaned workers exit on their own
    resumed = run_mmrl("train", run, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [r["step"] for r in read_metrics(run) if "reward/total" in r]
    assert steps == list(range(1, 61))
    if schedule == "lockstep":
        straight = run_mmrl("train", path, "--run-dir", tmp_path / "straight")
        assert straight.returncode == 0, straight.stderr[-2000:]
        _same(_steps(read_metrics(run)), _steps(read_metrics(tmp_path / "straight")))
        a = load_file(str(run / "checkpoints/step_00000060/model.safetensors"))
        b = load_file(str(tmp_path / "straight/checkpoints/step_00000060/model.safetensors"))
        for k in a:
            assert torch.equal(a[k], b[k]), k
