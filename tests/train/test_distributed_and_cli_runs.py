"""Runs through the real command line: two processes vs one, SIGTERM + resume, train → eval → plot."""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmrl.train.metrics import read_metrics
from tests.conftest import ROOT, live_processes_in_group, point_reach_config, run_mmrl, start_train_in_own_group


def _sequence_config(tmp_path, **algo):
    data = yaml.safe_load((ROOT / "configs" / "toy_sequence_grpo.yaml").read_text())
    data["defaults"] = str(ROOT / "configs" / "presets" / "lite_ppo.yaml")  # batch std: a global statistic
    data.update(total_steps=3, log={"progress": False, "tensorboard": False}, eval={"at_end": False})
    data["algo"].update(groups_per_step=4, group_size=4, ppo_epochs=2, **algo)
    # one batched policy.sample call per 2 groups: each of two processes' calls then hold the
    # same groups as one process's, the condition for identical samples
    data["sampler"]["batch_groups"] = 2
    path = tmp_path / "seq.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.numerics
def test_two_processes_match_one_process(tmp_path):
    """DDP over two gloo processes (each sampling half of the groups) ends with the same
    parameters as one process on the whole batch.

    In float64: the all-reduce sums the two halves' gradients in another order than one
    process does, and Adam turns a rounding difference in a near-zero gradient entry into a
    step of up to lr, so in float32 the weights after 6 updates differ by ~3e-6 on some CPUs
    (1 of 3072 entries). In float64 that rounding is ~1e-16 relative; what remains to compare
    is the algorithm, and a real mismatch (a normalizer, a sample, a seed) moves weights by
    ~lr = 1e-2."""
    cfg = _sequence_config(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "mmrl", "train", cfg, "--run-dir", tmp_path / "one", "policy.dtype=float64"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531", "-m", "mmrl", "train", cfg,
         "--run-dir", tmp_path / "two", "policy.dtype=float64"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_file(str(tmp_path / "one/checkpoints/step_00000003/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000003/model.safetensors"))
    assert a["head.weight"].dtype == torch.float64
    for k in a:  # measured: at most 5e-15 under ATEN_CPU_CAPABILITY default, avx2 and avx512
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)
    ra, rb = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["reward/total"] for r in ra if "reward/total" in r] == [r["reward/total"] for r in rb if "reward/total" in r]


def _one_and_two_processes(tmp_path, cfg, port):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "mmrl", "train", cfg, "--run-dir", tmp_path / "one"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), "-m", "mmrl", "train", cfg, "--run-dir", tmp_path / "two"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    return read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")


@pytest.mark.numerics
def test_dynamic_sampling_with_two_processes_matches_one_process(tmp_path):
    """DAPO: the zero-variance filter keeps different numbers of samples on each process and
    refill rounds top the batch up; with global refill decisions, global minibatches and
    global normalizers, two processes end with one process's parameters and metrics."""
    data = yaml.safe_load((ROOT / "configs" / "toy_sequence_grpo.yaml").read_text())
    data["defaults"] = str(ROOT / "configs" / "presets" / "dapo.yaml")
    data.update(total_steps=4, log={"progress": False, "tensorboard": False}, eval={"at_end": False})
    # reward 0/1: many groups have zero variance; float64 as in test_two_processes_match_one_process
    data["policy"].update(seq_len=1, vocab_size=4, dtype="float64")
    data["rewards"] = [{"type": "token_fraction", "token": 3}]
    data["sampler"]["batch_groups"] = 2  # calls within each process's 2 groups (see mmrl/samplers/prompt.py)
    data["algo"].update(groups_per_step=4, group_size=4, ppo_epochs=2, num_minibatches=2, micro_batches=2, resample_rounds=2)
    path = tmp_path / "dapo.yaml"
    path.write_text(yaml.safe_dump(data))
    ra, rb = _one_and_two_processes(tmp_path, path, 29533)
    a = load_file(str(tmp_path / "one/checkpoints/step_00000004/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000004/model.safetensors"))
    for k in a:  # float64 rounding amplified by Adam (as in test_two_processes_match_one_process)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)
    ra, rb = [r for r in ra if "filter/kept_fraction" in r], [r for r in rb if "filter/kept_fraction" in r]  # the training steps
    kept = [r["filter/kept_fraction"] for r in ra]
    assert any(k < 1.0 for k in kept), kept  # the filter did drop groups
    assert kept == [r["filter/kept_fraction"] for r in rb]
    for key in ("reward/total", "loss/policy", "approx_kl", "objective/clipped", "grad_norm"):
        for x, y in zip(ra, rb):
            assert math.isclose(x[key], y[key], rel_tol=1e-9, abs_tol=1e-12), (key, x[key], y[key])


@pytest.mark.numerics
def test_knapsack_budgets_with_two_processes_match_one_process(tmp_path):
    """Knapsack budgets and DAPO refill rounds: each process observes every process's samples
    (so both share each round's samples alike), groups of different sizes are split between
    them, and the kept batch ends at a whole group; the result is one process's, to float64
    rounding."""
    data = yaml.safe_load((ROOT / "configs" / "toy_sequence_grpo.yaml").read_text())
    data["defaults"] = str(ROOT / "configs" / "presets" / "dapo.yaml")
    data.update(total_steps=5, log={"progress": False, "tensorboard": False}, eval={"at_end": False})
    data["policy"].update(seq_len=1, vocab_size=4, dtype="float64")
    data["rewards"] = [{"type": "token_fraction", "token": 3}]
    # 4 records, 4 groups a step: every record is back each step with its pass rate
    data["sampler"].update(batch_groups=2, data={"num_prompts": 4}, budget={"type": "knapsack", "min_history": 4})
    data["algo"].update(groups_per_step=4, group_size=4, ppo_epochs=2, num_minibatches=2, resample_rounds=2)
    path = tmp_path / "knapsack.yaml"
    path.write_text(yaml.safe_dump(data))
    ra, rb = _one_and_two_processes(tmp_path, path, 29537)
    a = load_file(str(tmp_path / "one/checkpoints/step_00000005/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000005/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)
    ra, rb = [r for r in ra if "budget/group_size" in r], [r for r in rb if "budget/group_size" in r]
    assert max(r["budget/group_size"] for r in ra) > 4  # the groups were uneven
    assert len(ra) == len(rb) == 5
    for key in ("budget/group_size", "filter/kept_fraction", "reward/total", "decisions", "adv/informative_groups", "loss/policy", "grad_norm"):
        for x, y in zip(ra, rb):
            assert (key in x) == (key in y), key  # a step whose filter kept nothing has no loss
            assert key not in x or math.isclose(x[key], y[key], rel_tol=1e-9, abs_tol=1e-12), (key, x[key], y[key])
    assert sum("loss/policy" in r for r in ra) >= 3


def test_the_robot_configuration_shape_with_two_processes_matches_one_process(tmp_path, write_config):
    """Env sampler, observation normalization and an annealed noise clock (running statistics),
    two minibatches of two micro-batches, the zero-variance filter without refill and
    self-imitation: two processes end with one process's parameters, statistics and
    metrics, and checkpoint a memory that one process resumes from."""
    data = point_reach_config(
        total_steps=4, checkpoint={"every": 2},
        policy={"type": "gaussian_mlp", "hidden_sizes": [16, 16], "obs_norm": True, "final_log_std": -1.5, "log_std_anneal_decisions": 200},
        rewards=[{"type": "success"}],
        algo={"group_size": 4, "groups_per_step": 4, "ppo_epochs": 2, "num_minibatches": 2, "micro_batches": 2,
              "filters": [{"type": "zero_variance"}], "self_imitation": {"size": 16, "steps": 2, "batch": 8}},
        optim={"lr": 0.01},
    )
    ra, rb = _one_and_two_processes(tmp_path, write_config(data), 29535)
    a = load_file(str(tmp_path / "one/checkpoints/step_00000004/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000004/model.safetensors"))
    assert "obs_stats.mean" in a and "sampled_decisions.value" in a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert any(r.get("filter/kept_fraction", 1) < 1 for r in ra) and any("loss/self_imitation" in r for r in ra)
    for x, y in zip(ra, rb):
        assert set(x) == set(y)
        for key in x:
            if not key.startswith("time/"):
                assert math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-6), (x["step"], key, x[key], y[key])
    # the two-process checkpoint holds the memory of both processes: one process resumes it
    two = torch.load(tmp_path / "two/checkpoints/step_00000004/state.pt", weights_only=True)["self_imitation_memory"]
    one = torch.load(tmp_path / "one/checkpoints/step_00000004/state.pt", weights_only=True)["self_imitation_memory"]
    assert torch.equal(two["keys"], one["keys"]) and torch.equal(two["all_keys"], one["all_keys"])
    torch.testing.assert_close(two["adv"], one["adv"])


def test_sigterm_writes_a_final_checkpoint_and_resume_finishes(tmp_path, write_config):
    path = write_config(point_reach_config(total_steps=500))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mmrl", "train", path, "--run-dir", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "--resume" in err
    latest = (run / "checkpoints/latest").read_text()
    stopped_at = int(latest.split("_")[1])
    assert stopped_at >= 2
    finish = run_mmrl("train", run, "total_steps=" + str(stopped_at + 2), "--resume")
    assert finish.returncode == 0, finish.stderr[-2000:]
    steps = [r["step"] for r in read_metrics(run) if "reward/total" in r]
    assert steps == list(range(1, stopped_at + 3))


def test_sigterm_to_the_process_group_of_a_run_with_async_envs_checkpoints_cleanly(tmp_path, write_config):
    """Ctrl-C, ``timeout`` and schedulers signal the whole group, the env workers too. They
    leave the signal to the trainer, which finishes its step, checkpoints and closes them: no
    traceback, no step lost, no process left."""
    path = write_config(point_reach_config(total_steps=500, env={"num_envs": 4, "vectorization": "async", "context": "fork"}, eval={"at_start": False, "at_end": False}))
    run = tmp_path / "run"
    proc = start_train_in_own_group(path, run, logged_lines=2)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "--resume" in err, err[-2000:]
    stopped = int((run / "checkpoints/latest").read_text().split("_")[1])
    assert stopped == max(r["step"] for r in read_metrics(run)) >= 2
    time.sleep(0.5)
    alive = live_processes_in_group(proc.pid)
    assert alive == [], alive


def test_train_then_eval_then_plot(tmp_path, write_config):
    path = write_config(point_reach_config(total_steps=2))
    run = tmp_path / "run"
    proc = run_mmrl("train", path, "--run-dir", run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "eval success" in proc.stdout
    ev = run_mmrl("eval", run, "--episodes", "6")
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert (run / "eval" / "eval.md").read_text().count("|") > 4
    assert "success_ci95" in (run / "eval" / "eval.json").read_text()
    pl = run_mmrl("plot", run)
    assert pl.returncode == 0, pl.stderr[-2000:]
    png = run / "plots" / "learning_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _image_runs_with_one_and_two_processes_match(tmp_path, name: str, algo: dict, port: int) -> None:
    """A tiny image-policy run (JPEG reward, 2 steps) with ``algo`` on one and on two
    processes: the same weights and logged reward, loss and gradient norm."""
    pytest.importorskip("diffusers")
    pytest.importorskip("cv2")
    data = {
        "name": name, "seed": 0, "total_steps": 2,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "denoising": {"num_inference_steps": 4, "logp_reduction": "mean"}},
        "sampler": {"type": "prompt", "data": {"num_prompts": 3}, "batch_groups": 2},
        "rewards": [{"type": "jpeg_compressibility"}],
        "algo": {"group_size": 2, "groups_per_step": 4, **algo},
        "optim": {"lr": 1e-3}, "eval": {"every": 0, "at_end": False}, "checkpoint": {"every": 2},
        "log": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    ra, rb = _one_and_two_processes(tmp_path, path, port)
    a = load_file(str(tmp_path / "one/checkpoints/step_00000002/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000002/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-4)
    # the training steps (eval.at_start logs an evaluation at step 0, without reward or loss)
    ra, rb = [r for r in ra if "reward/total" in r], [r for r in rb if "reward/total" in r]
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2]
    for key in ("reward/total", "loss/policy", "grad_norm"):
        for x, y in zip(ra, rb):
            assert math.isclose(x[key], y[key], rel_tol=1e-4, abs_tol=1e-7), (key, x[key], y[key])


@pytest.mark.slow
def test_micro_batches_by_the_activation_estimate_with_two_processes_match_one_process(tmp_path):
    """algo.micro_batches null with an image policy: one process cuts its 8 samples into 7
    pieces, each of two processes its 4 into 4 (the largest count over processes); the
    updates agree (float32 sums in another order, magnified by Adam on tiny gradients)."""
    # 8 KiB a sample (4 steps x 8 channels x 8 x 8 x 4 bytes); pieces of at most 0.01 MiB
    _image_runs_with_one_and_two_processes_match(tmp_path, "pieces", {"micro_batch_mb": 0.01, "reuse_sampling_graph": False}, 29537)


@pytest.mark.slow
def test_a_reused_sampling_graph_with_two_processes_matches_one_process(tmp_path):
    """algo.reuse_sampling_graph true with an image policy: each process backpropagates
    through its own samples' sampling graph, passed through the distributed wrapper's
    forward, so the gradients are all-reduced as a recompute's would be (without that, each
    process would step on its own gradient and rank 0's weights would differ)."""
    _image_runs_with_one_and_two_processes_match(tmp_path, "reuse", {"reuse_sampling_graph": True}, 29539)
