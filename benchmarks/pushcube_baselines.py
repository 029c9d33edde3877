"""ManiSkill3 PushCube-v1 from state: shipped recipes side by side over the same training
seeds, in one benchmark run: the group baseline (GRPO) against the learned value baseline
(GAE and a critic) by default, or RLPD (SAC on a replay buffer with scripted demonstrations)
against GAE, on one or both kernel sets.

    python benchmarks/pushcube_baselines.py                          # GRPO vs GAE, seeds 0 1 2, two runs at a time
    python benchmarks/pushcube_baselines.py --seeds 0 --jobs 1       # one seed of each
    python benchmarks/pushcube_baselines.py --baselines rlpd gae --seeds 0   # the main job against PPO, one seed each
    python benchmarks/pushcube_baselines.py --baselines rlpd --seeds 0 1 2 3 4 --kernels default avx2  # the 10-run check
    python benchmarks/pushcube_baselines.py --baselines interventions online --seeds 0 1 2   # a scripted intervener vs none
    python benchmarks/pushcube_baselines.py --report-only            # read the run directories again

A baseline whose config trains with demonstrations (``algo.loss.demos``) gets them collected
once, by `mmrl collect --config` into OUT/demos (as `make train` does), and the env steps they
took are printed beside its curve. ``--kernels`` runs each (baseline, seed) under each
``ATEN_CPU_CAPABILITY`` named (run directories NAME_KERNEL_sS).

Each (config, seed) is ``mmrl train CONFIG seed=S --run-dir OUT/NAME_sS`` in its own process
with one intra-op thread; ``--jobs`` of them run at once, the two baselines interleaved in the
queue (GRPO seed 0, GAE seed 0, GRPO seed 1, ...) so that both meet the same machine load.
The shipped configs are used unchanged: their own evaluation (mean action, 100 episodes, the
same episode seeds at every evaluation) gives each seed's curve.

Printed, per seed and baseline: the evaluation curve against env steps, the env steps at which
it first reaches ``--target``, the training wall-clock up to that evaluation (the sum of the
updates' ``time/step_s``: sampling and update, evaluations left out because the two configs
evaluate at different intervals), the whole run's wall-clock, and the final evaluation. Then
the means and the ratios GRPO / GAE (above 1: the value baseline gets there sooner).
``--stop-at-target grpo`` ends the GRPO runs at their first evaluation at or above the target
(they take 2-3x the env steps of the others). A run cut off (by the machine, say) resumes from its last
checkpoint when the script is run again; its whole-run wall-clock is then not reported. A seed
that never reaches the target counts as not reached; the ratio is then taken over the seeds
where both did, and says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from mmrl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BASELINES = {  # name -> shipped config
    "grpo": "configs/maniskill_pushcube_grpo.yaml",
    "gae": "configs/maniskill_pushcube_gae.yaml",
    "rlpd": "configs/maniskill_pushcube_rlpd.yaml",
    "sac": "configs/maniskill_pushcube_sac.yaml",
    "interventions": "configs/maniskill_pushcube_interventions.yaml",
    "online": "configs/maniskill_pushcube_interventions.yaml",  # the same SAC, nobody intervening
}
OVERRIDES = {"online": ["sampler.intervener=null"]}  # a baseline that is a shipped config with options changed
WITH_DEMOS = {"rlpd"}  # baselines whose config reads algo.loss.demos
PACKAGES = ("mani_skill", "sapien", "torch", "gymnasium", "numpy")


def run_name(name: str, seed: int, kernel: str | None) -> str:
    return f"{name}_{kernel}_s{seed}" if kernel else f"{name}_s{seed}"


def collect_demos(out: Path, name: str, overrides: list[str]) -> tuple[Path, int]:
    """The demonstrations of ``name``'s config, collected once into OUT/demos; their env steps."""
    demos = out / "demos"
    if not (demos / "index.json").is_file():
        cmd = [sys.executable, "-m", "mmrl", "collect", "--config", BASELINES[name], "--out", str(demos), *overrides]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    import json

    index = json.loads((demos / "index.json").read_text())
    import numpy as np

    steps = sum(int(np.load(demos / e)["action"].shape[0]) for e in index["episodes"])
    return demos, steps


def run_one(name: str, seed: int, out: Path, overrides: list[str], stop_at: float | None = None, kernel: str | None = None) -> float:
    """Train one baseline at one seed; returns its wall-clock seconds. Output goes to
    ``OUT/NAME_sS.log``; a run that finished before (its ``.wall`` file is there) is not run
    again, and one that was cut off (checkpoints, no ``.wall``) resumes from its last
    checkpoint (its metrics after that checkpoint are redone). ``stop_at``: stop the run (SIGTERM: it
    writes its checkpoint and exits 143) once an evaluation reaches this success."""
    run_dir = out / run_name(name, seed, kernel)
    log, wall_file = out / f"{run_dir.name}.log", out / f"{run_dir.name}.wall"
    if wall_file.exists():
        return float(wall_file.read_text().split()[0])
    resumed = (run_dir / "checkpoints").is_dir()
    cmd = [sys.executable, "-m", "mmrl", "train", BASELINES[name], f"seed={seed}", "--run-dir", str(run_dir), "log.progress=false", *OVERRIDES.get(name, []), *overrides]
    if resumed:
        cmd.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **({"ATEN_CPU_CAPABILITY": kernel} if kernel else {})}
    t0 = time.time()
    with open(log, "a" if resumed else "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        stopped = False
        while proc.poll() is None:
            time.sleep(5)
            if stop_at is not None and not stopped and (run_dir / "metrics.jsonl").exists() and read_run(run_dir, stop_at)["first"] is not None:
                proc.send_signal(signal.SIGTERM)
                stopped = True
    wall = time.time() - t0
    if proc.returncode != 0 and not (stopped and proc.returncode == 128 + signal.SIGTERM):
        raise SystemExit(f"{name} seed {seed}: `{' '.join(cmd)}` exited {proc.returncode}; see {log}")
    wall_file.write_text(f"{wall:.1f}{' resumed' if resumed else ''}{' stopped-at-target' if stopped else ''}\n")
    return wall


def read_run(run_dir: Path, target: float) -> dict:
    """The evaluation curve of one run and where it first reaches ``target``."""
    records = read_metrics(run_dir)
    curve, train_s, first, env_steps = [], 0.0, None, {0: 0}
    for r in records:  # an evaluation is logged with its update's record, or after it (the final one, at the start)
        if "time/step_s" in r:
            train_s += float(r["time/step_s"])
        if "env_steps" in r:
            env_steps[int(r["step"])] = int(r["env_steps"])
        if "eval/success_rate" in r and int(r["step"]) in env_steps:
            success = float(r["eval/success_rate"])
            if curve and curve[-1][0] == env_steps[int(r["step"])]:
                continue  # the final evaluation repeats the last update's
            curve.append((env_steps[int(r["step"])], success))
            if first is None and success >= target - 1e-6:  # success is a float32 fraction (0.9 reads 0.89999998)
                first = {"env_steps": curve[-1][0], "train_s": train_s, "success": success}
    wall_file = run_dir.parent / f"{run_dir.name}.wall"
    wall, note = None, ""
    if wall_file.exists():
        seconds, *notes = wall_file.read_text().split()
        wall, note = (None if "resumed" in notes else float(seconds)), " ".join(notes)
    return {"curve": curve, "first": first, "train_s": train_s, "wall_s": wall, "note": note, "final": curve[-1][1] if curve else None}


def versions() -> str:
    found = []
    for package in PACKAGES:
        try:
            found.append(f"{package} {metadata.version(package.replace('_', '-'))}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} (not installed)")
    return ", ".join(found)


def report(out: Path, seeds: list[int], target: float, baselines: list[str] | None = None, kernels: list[str | None] | None = None, hold: float = 0.85) -> None:
    baselines, kernels = baselines or ["grpo", "gae"], kernels or [None]
    runs = {(name, k, s): read_run(out / run_name(name, s, k), target) for name in baselines for k in kernels for s in seeds
            if (out / run_name(name, s, k) / "metrics.jsonl").exists()}
    if not runs:
        raise SystemExit(f"no runs under {out}")
    print(f"# PushCube-v1: {' vs '.join(baselines)}, target {target} mean-action success (100 episodes)")
    print(f"# {versions()}; one intra-op thread per run")
    if any(name in WITH_DEMOS for name in baselines) and (out / "demos" / "index.json").is_file():
        _, steps = collect_demos(out, next(n for n in baselines if n in WITH_DEMOS), [])
        print(f"# demonstrations: {steps:,} env steps, not counted in the curves' env steps")
    print()
    for (name, k, seed), run in runs.items():
        points = " ".join(f"{steps // 1000}k:{success:.2f}" for steps, success in run["curve"])
        print(f"{run_name(name, seed, k)}: {points}")
    print()
    print(f"| baseline | kernels | seed | first >= target (env steps) | lowest after it | training wall-clock to it (s) | training (s) | whole run (s) | final eval |")
    print("|---|---|---|---|---|---|---|---|---|")
    kept = 0
    for (name, k, seed), run in runs.items():
        first = run["first"]
        reached = f"{first['env_steps']:,}" if first else "not reached"
        after = [success for steps, success in run["curve"] if first and steps >= first["env_steps"]]
        lowest = f"{min(after):.2f}" if after else "—"
        kept += bool(after) and min(after) >= hold - 1e-6
        to_target = f"{first['train_s']:.0f}" if first else "—"
        wall = f"{run['wall_s']:.0f}" if run["wall_s"] is not None else "—"
        final = ("—" if run["final"] is None else f"{run['final']:.2f}") + (" (stopped at the target)" if "stopped-at-target" in run["note"] else "")
        print(f"| {name} | {k or 'native'} | {seed} | {reached} | {lowest} | {to_target} | {run['train_s']:.0f} | {wall} | {final} |")
    print()
    for name in baselines:
        mine = [r for (n, _, _), r in runs.items() if n == name]
        firsts = [r["first"] for r in mine if r["first"]]
        held = sum(1 for r in mine if r["first"] and min(v for st, v in r["curve"] if st >= r["first"]["env_steps"]) >= hold - 1e-6)
        if firsts:
            print(f"{name}: reached {target} in {len(firsts)} of {len(mine)} runs, holding >= {hold} after it in {held}; mean {statistics.mean(f['env_steps'] for f in firsts):,.0f} env steps, "
                  f"{statistics.mean(f['train_s'] for f in firsts):.0f} s of training; training s per 1,000 env steps "
                  f"{statistics.mean(r['train_s'] / max(r['curve'][-1][0], 1) * 1000 for r in mine if r['curve']):.1f}")
        else:
            print(f"{name}: reached {target} in 0 of {len(mine)} runs")
    if len(baselines) >= 2:
        a, b = baselines[0], baselines[-1]
        both = [(k, s) for k in kernels for s in seeds if all((n, k, s) in runs and runs[(n, k, s)]["first"] for n in (a, b))]
        if both:
            steps = statistics.mean(runs[(a, k, s)]["first"]["env_steps"] / max(runs[(b, k, s)]["first"]["env_steps"], 1) for k, s in both)
            secs = statistics.mean(runs[(a, k, s)]["first"]["train_s"] / max(runs[(b, k, s)]["first"]["train_s"], 1e-9) for k, s in both)
            print(f"ratio {a} / {b} over {len(both)} runs (per-run ratios, mean): env steps to {target} {steps:.2f}x, training wall-clock to it {secs:.2f}x")
        same = [(k, s) for k in kernels for s in seeds if all((n, k, s) in runs and runs[(n, k, s)]["curve"] for n in (a, b))]
        if same:
            per = statistics.mean((runs[(a, k, s)]["train_s"] / runs[(a, k, s)]["curve"][-1][0]) / (runs[(b, k, s)]["train_s"] / runs[(b, k, s)]["curve"][-1][0]) for k, s in same)
            print(f"ratio {a} / {b}: training wall-clock per env step {per:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_pushcube_baselines")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each on one thread)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--report-only", action="store_true", help="read the run directories, train nothing")
    parser.add_argument("--baselines", nargs="+", default=["grpo", "gae"], choices=sorted(BASELINES), help="shipped recipes to run side by side (ratios: first / last)")
    parser.add_argument("--kernels", nargs="+", default=[None], choices=["default", "avx2", "avx512"], help="ATEN_CPU_CAPABILITY of each run (default: the machine's own)")
    parser.add_argument("--stop-at-target", nargs="*", default=[], choices=sorted(BASELINES), metavar="BASELINE",
                        help="stop these baselines' runs at their first evaluation >= target (their curves end there)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides given to every config")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        extra = {name: list(args.overrides) for name in args.baselines}
        for name in args.baselines:
            if name in WITH_DEMOS:
                demos, _ = collect_demos(args.out, name, [])
                extra[name].append(f"algo.loss.demos={demos}")
        queue = [(name, kernel, seed) for seed in args.seeds for kernel in args.kernels for name in args.baselines]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            stop = {name: args.target if name in args.stop_at_target else None for name in args.baselines}
            for future in [pool.submit(run_one, name, seed, args.out, extra[name], stop[name], kernel) for name, kernel, seed in queue]:
                future.result()
    report(args.out, args.seeds, args.target, args.baselines, args.kernels)


if __name__ == "__main__":
    main()
