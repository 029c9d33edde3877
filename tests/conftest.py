import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MUJOCO_GL", "egl")
ROOT = Path(__file__).resolve().parents[1]

# Two cores shared with simulators and subprocesses: one intra-op thread is much
# faster and steadier than two under load (tests measure behaviour, never speed).
import torch  # noqa: E402

torch.set_num_threads(1)

# MMRL_SHAPE_KERNELS=1: every float GEMM sums in an order chosen from its row count, as MKL's
# do on some CPUs, so an exact-equality test between two batch layouts fails here as it would
# there (tests/kernel_emulation). Spawned workers enter the same mode through PYTHONPATH.
if os.environ.get("MMRL_SHAPE_KERNELS") == "1":
    from tests.kernel_emulation import enable as _shape_kernels

    _here = str(ROOT / "tests" / "kernel_emulation")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_here, os.environ.get("PYTHONPATH")) if p)
    _shape_kernels()

# Learning tests (marker `learning`) train from this seed: `scripts/learning_spread.py` runs them
# over several seeds and CPU kernels (ATEN_CPU_CAPABILITY) to measure each threshold's margin.
LEARNING_SEED = int(os.environ.get("MMRL_LEARNING_SEED", "0"))


def _checkout_entries() -> set[str] | None:
    """What git sees in the checkout besides its tracked files (untracked and ignored entries),
    less what installing and importing leave by design; None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=normal"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    entries = {line[3:] for line in out.stdout.splitlines() if line[:2] in ("??", "!!")}
    return {e for e in entries if "__pycache__" not in e and not e.startswith(".venv") and not e.endswith(".egg-info/")}


def pytest_sessionstart(session):
    session.config._checkout_before = _checkout_entries()


def pytest_sessionfinish(session, exitstatus):
    # `make test` leaves nothing in the checkout: a test that writes a run directory, demos or
    # plots must write them under its tmp_path
    before = getattr(session.config, "_checkout_before", None)
    after = _checkout_entries() if before is not None else None
    if after is not None and after - before:
        print(f"\ntests left files in the checkout: {sorted(after - before)}", file=sys.stderr)
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    # a learning test's result depends on float kernels as much as any tolerance does
    for item in items:
        if item.get_closest_marker("learning") is not None and item.get_closest_marker("numerics") is None:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture
def learning_seed() -> int:
    """The training seed of a learning test (0 unless ``MMRL_LEARNING_SEED`` says otherwise)."""
    return LEARNING_SEED


@pytest.fixture
def learned(request):
    """``learned(value, threshold, higher=True, name="")``: assert that a learning test's
    measured ``value`` clears ``threshold`` and, where ``MMRL_LEARNING_LOG`` names a file, append
    it there (one JSON line) so the spread over seeds and kernels can be read off."""
    import json

    def check(value: float, threshold: float, higher: bool = True, name: str = "") -> None:
        log = os.environ.get("MMRL_LEARNING_LOG")
        if log:
            record = {"test": request.node.nodeid, "name": name, "value": float(value), "threshold": float(threshold), "higher": higher,
                      "seed": LEARNING_SEED, "capability": torch.backends.cpu.get_cpu_capability()}
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
        met = value >= threshold if higher else value <= threshold
        assert met, f"{name or 'value'} {value:.4g} {'<' if higher else '>'} threshold {threshold:.4g} (seed {LEARNING_SEED})"

    return check


def point_reach_config(**sections) -> dict:
    """A tiny env run as a plain dict (what a YAML file would hold)."""
    cfg = {
        "name": "tiny",
        "seed": 0,
        "total_steps": 3,
        "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 8},
        "policy": {"type": "gaussian_mlp", "hidden_sizes": [16, 16]},
        "sampler": {"type": "env"},
        "rewards": [{"type": "success"}, {"type": "return", "weight": 0.05}],
        "algo": {"group_size": 4, "groups_per_step": 2, "ppo_epochs": 2},
        "eval": {"episodes": 4},
        "log": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def point_reach_success_before_after(run_dir, policy: dict, total_steps: int, optim: dict, seed: int = 0, groups_per_step: int = 8) -> tuple[float, float]:
    """Eval success (64 episodes) of ``policy`` on mmrl/PointReach-v0 before and after
    ``total_steps`` GRPO updates from the binary success reward alone (``groups_per_step`` groups of 8, 4 PPO
    epochs, no KL): the end-to-end check that a policy family learns under RL. ``seed`` is
    the run's (initial weights, training and evaluation episodes)."""
    from mmrl.config import from_dict
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    cfg = point_reach_config(
        name="rl_check", seed=seed, total_steps=total_steps, run_dir=str(run_dir),
        env={"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 32},
        rewards=[{"type": "success"}],
        algo={"group_size": 8, "groups_per_step": groups_per_step, "ppo_epochs": 4, "num_minibatches": 4, "kl": {"coef": 0.0}},
        optim=optim, eval={"every": 1000, "episodes": 64, "at_start": False}, checkpoint={"every": 1000},
    )
    cfg["policy"] = policy
    trainer = Trainer(from_dict(TrainConfig, cfg))
    before = trainer.evaluate(0)["success_rate"]
    trainer.train()
    return before, trainer.evaluate(total_steps)["success_rate"]


@pytest.fixture
def write_config(tmp_path):
    import yaml

    def write(data: dict, name: str = "cfg.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return write


def run_mmrl(*args, cwd=None, timeout=300, env=None):
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "mmrl", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def start_train_in_own_group(config_path, run, logged_lines: int):
    """``mmrl train config_path --run-dir run`` in a session (process group) of its own, as a
    scheduler starts it; returned once ``metrics.jsonl`` holds ``logged_lines`` lines (or 120 s
    passed), stderr piped, for a test that then signals the whole group."""
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mmrl", "train", config_path, "--run-dir", run], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= logged_lines):
        time.sleep(0.05)
    return proc


def live_processes_in_group(pgid: int) -> list[str]:
    """``ps`` lines of the processes of group ``pgid`` that are still alive (a zombie is gone,
    waiting for the container's init to reap it)."""
    import subprocess

    group = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout.splitlines()
    return [line for line in group if line.split()[1][0] != "Z"]


def assert_kept_sampling_graph_matches_recompute(build, inputs) -> None:
    """In float64: ``build()``'s ``sample(inputs, keep_graph=True)`` gives the log-probs that
    ``log_prob(replay)`` recomputes, with the same gradient for every parameter, and keeps
    no graph on its output or its stored latents."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        policy = build()
        sample = policy.sample(inputs, torch.Generator().manual_seed(1), keep_graph=True)
        assert sample.logp.requires_grad and not sample.output.requires_grad and not sample.replay["chain"]["latents"].requires_grad
        weights = torch.randn(sample.logp.shape, generator=torch.Generator().manual_seed(2))
        kept = torch.autograd.grad((weights * sample.logp).sum(), list(policy.parameters()), allow_unused=True)
        logp = policy.log_prob(sample.replay)
        recomputed = torch.autograd.grad((weights * logp).sum(), list(policy.parameters()), allow_unused=True)
    finally:
        torch.set_default_dtype(previous)
    torch.testing.assert_close(sample.logp.detach(), logp.detach(), rtol=1e-12, atol=1e-9)
    scale = max(float(g.abs().max()) for g in recomputed if g is not None)
    assert scale > 0
    for a, b in zip(kept, recomputed):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * scale)
