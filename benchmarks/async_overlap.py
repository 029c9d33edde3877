"""Sync against async (one-step-off) rollouts on this machine, as ratios measured in one run.

    python benchmarks/async_overlap.py throughput --demo text --updates 12
    python benchmarks/async_overlap.py quality --demo text --seeds 0 1 2

``throughput`` runs the demo's shipped config for ``--updates`` updates twice, one after
the other: sync on every core (today's loop, ``OMP_NUM_THREADS`` = the core count), then
``rollout.mode=async rollout.max_staleness=1`` with one learner and one worker process
sharing those cores (one thread each; ``--async-threads`` changes that). It prints updates
per hour of each, their ratio, and the seconds of each role per update: the learner's
sampling (sync) or waiting for samples (async: idle), its update, and the worker's
sampling and idle time. The first ``--skip`` updates are left out (start-up, and the first
async step waits for the worker's first samples).

``quality`` trains the demo's full shipped config per seed in both modes and prints the
held-out accuracy or success at the end with its 95% Wilson interval, per seed and pooled.

Demos: ``text`` (configs/text_arithmetic_grpo.yaml, from the SFT run ``--init``, trained
here first by configs/text_arithmetic_sft.yaml when it does not exist), ``shapes``
(configs/image_shapes_flow_grpo.yaml, from the shipped word-level flow model) and
``tabletop`` (configs/tabletop_spatial_flow_vla_grpo.yaml; from ``--init``, the SFT run of
configs/tabletop_spatial_flow_vla_sft.yaml: from the untrained miniature every episode fails,
every advantage is 0 and the update has nothing to do) and ``pushcube``
(configs/maniskill_pushcube_grpo.yaml). ``--modes`` picks what is compared (the first is the
baseline): ``sync`` (in the learner's process, every core), ``async`` (k = 1 with
``--workers`` worker processes) and ``sync-workers`` (sync with ``--workers`` processes: more
parallel envs); ``--engine ray`` runs those workers as Ray actors, and ``--engine local ray`` runs each such
mode once per engine (the ratios of Ray actors against local processes, in one invocation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMOS = {
    "text": ("configs/text_arithmetic_grpo.yaml", "accuracy"),
    "shapes": ("configs/image_shapes_flow_grpo.yaml", "accuracy"),
    "tabletop": ("configs/tabletop_spatial_flow_vla_grpo.yaml", "success_rate"),
    "pushcube": ("configs/maniskill_pushcube_grpo.yaml", "success_rate"),
}
QUIET = ["log.progress=false", "log.tensorboard=false"]
ASYNC = ["rollout.mode=async", "rollout.max_staleness=1"]


def mmrl(args: list[str], threads: int, out: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "mmrl", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mmrl {' '.join(args)}: {proc.stderr[-3000:]}")
    return time.time() - t0


def start_overrides(demo: str, init: str | None, work: Path) -> list[str]:
    if demo == "text":
        init = init or str(ROOT / "runs" / "text_arithmetic_sft")
        if not (Path(init) / "config.yaml").exists():
            print(f"training the SFT start {init} (configs/text_arithmetic_sft.yaml) ...", flush=True)
            mmrl(["train", "configs/text_arithmetic_sft.yaml", "--run-dir", init, *QUIET], os.cpu_count() or 1, work)
        return [f"policy.pretrained={init}"]
    if demo == "tabletop":
        return [f"policy.pretrained={init}"] if init else ["policy.pretrained=null"]
    return []


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def modes(args, cores: int) -> list[tuple[str, list[str], int]]:
    """(name, overrides, OMP threads of the learner process) of each compared mode; the modes
    with workers run once per ``--engine``, in that order."""
    w = args.workers
    threads = f"{args.learner_threads or args.async_threads}+{w}x{args.async_threads} threads"
    learner = args.learner_threads or args.async_threads
    out = []
    for m in args.modes:
        if m == "sync":
            out.append((f"sync, {cores} threads", [], cores))
            continue
        for engine in args.engine:
            extra = [f"rollout.workers={w}", f"rollout.worker_threads={args.async_threads}", *args.worker_overrides, f"rollout.engine={engine}"]
            name = f"async k=1, {threads}" if m == "async" else f"sync, {threads}"
            out.append((f"{name}, {engine}", [*ASYNC, *extra] if m == "async" else extra, learner))
    return out


def throughput(args) -> None:
    config, _ = DEMOS[args.demo]
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = [*start_overrides(args.demo, args.init, work), *QUIET, f"total_steps={args.updates}", "eval.at_start=false", "eval.at_end=false",
                "eval.every=0", "checkpoint.every=0", *args.overrides]
        rows = {}
        for i, (mode, extra, threads) in enumerate(modes(args, cores)):
            run_dir = work / f"mode{i}"
            mmrl(["train", config, "--run-dir", str(run_dir), *base, *extra], threads, work)
            steps = [r for r in records(run_dir) if "time/step_s" in r][args.skip:]
            mean = lambda k: sum(r.get(k, 0.0) for r in steps) / len(steps)  # noqa: E731
            rows[mode] = {
                "updates/h": 3600 / mean("time/step_s"), "step_s": mean("time/step_s"), "learner_sample_or_wait_s": mean("time/sample_s"),
                "learner_update_s": mean("time/update_s"), "worker_sample_s": mean("time/worker_sample_s"), "worker_idle_s": mean("time/worker_idle_s"),
                "lag_mean": mean("staleness/lag_mean"),
            }
    import torch

    print(f"# {args.demo}: {config}, {args.updates} updates (first {args.skip} left out), {cores} cores, torch {torch.__version__}")
    print("| mode | updates/h | s/update | learner: sampling or waiting | learner: update | worker: sampling | worker: idle | lag |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['updates/h']:.0f} | {r['step_s']:.2f} | {r['learner_sample_or_wait_s']:.2f} | {r['learner_update_s']:.2f} | "
              f"{r['worker_sample_s']:.2f} | {r['worker_idle_s']:.2f} | {r['lag_mean']:.2f} |")
    first = next(iter(rows))
    for mode in list(rows)[1:]:
        print(f"ratio {mode} / {first} updates per hour: {rows[mode]['updates/h'] / rows[first]['updates/h']:.2f}")


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def quality(args) -> None:
    config, metric = DEMOS[args.demo]
    cores = os.cpu_count() or 1
    out = Path(args.out)
    start = start_overrides(args.demo, args.init, out)
    results: dict[str, list[tuple[float, int]]] = {"sync": [], "async": []}
    for seed in args.seeds:
        engine = args.engine[0]
        workers = [f"rollout.workers={args.workers}", f"rollout.worker_threads={args.async_threads}", *args.worker_overrides, f"rollout.engine={engine}"]
        for mode, extra, threads in (("sync", [], cores), ("async", [*ASYNC, *workers], args.learner_threads or args.async_threads)):
            run_dir = out / f"{args.demo}_{mode}{'' if mode == 'sync' or engine == 'local' else '_' + engine}_s{seed}"
            if not (run_dir / "checkpoints" / "latest").exists():
                wall = mmrl(["train", config, "--run-dir", str(run_dir), f"seed={seed}", *start, *QUIET, *args.overrides, *extra], threads, out)
                print(f"{mode} seed {seed}: {wall / 60:.1f} min", flush=True)
            final = [r for r in records(run_dir) if f"eval/{metric}" in r][-1]
            n = int(final.get("eval/episodes", args.n))
            results[mode].append((final[f"eval/{metric}"], n))
    print(f"# {args.demo}: held-out {metric} after the shipped config's updates; seeds {args.seeds}")
    print("| mode | " + " | ".join(f"seed {s}" for s in args.seeds) + " | pooled (95% interval) |")
    print("|---|" + "---|" * (len(args.seeds) + 1))
    for mode, vals in results.items():
        k = sum(v * n for v, n in vals)
        n = sum(n for _, n in vals)
        lo, hi = wilson(k, n)
        print(f"| {mode} | " + " | ".join(f"{v:.3f}" for v, _ in vals) + f" | {k / n:.3f} [{lo:.3f}, {hi:.3f}] |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("throughput", "quality"):
        s = sub.add_parser(name)
        s.add_argument("--demo", choices=sorted(DEMOS), required=True)
        s.add_argument("--init", default=None, help="the run directory the demo starts from (text, tabletop)")
        s.add_argument("--async-threads", type=int, default=1, help="torch threads of the learner and of each worker when workers are processes")
        s.add_argument("--learner-threads", type=int, default=None, help="torch threads of the learner when workers are processes (default: --async-threads)")
        s.add_argument("--worker-overrides", nargs="*", default=[], help="config overrides of the modes with worker processes (e.g. env.num_envs=32: each worker's share)")
        s.add_argument("--engine", nargs="+", default=["local"], help="rollout.engine of the modes with workers (local, ray); throughput runs them once per engine given")
        s.add_argument("--workers", type=int, default=1, help="worker processes of the async (and sync-workers) mode")
        s.add_argument("overrides", nargs="*", help="config overrides for both modes")
    sub.choices["throughput"].add_argument("--updates", type=int, default=12)
    sub.choices["throughput"].add_argument("--modes", nargs="+", choices=["sync", "async", "sync-workers"], default=["sync", "async"])
    sub.choices["throughput"].add_argument("--skip", type=int, default=2)
    sub.choices["quality"].add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sub.choices["quality"].add_argument("--out", default=str(ROOT / "runs" / "async_overlap"))
    sub.choices["quality"].add_argument("--n", type=int, default=0, help="evaluation samples, when the metrics do not say")
    args = p.parse_args()
    throughput(args) if args.what == "throughput" else quality(args)


if __name__ == "__main__":
    main()
