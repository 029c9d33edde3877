"""ManiSkill3 PushCube-v1 from state: the group baseline (GRPO) against the learned value
baseline (GAE and a critic), each over the same training seeds, in one benchmark run.

    python benchmarks/pushcube_baselines.py                          # seeds 0 1 2, two runs at a time
    python benchmarks/pushcube_baselines.py --seeds 0 --jobs 1       # one seed of each
    python benchmarks/pushcube_baselines.py --report-only            # read the run directories again

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
}
PACKAGES = ("mani_skill", "sapien", "torch", "gymnasium", "numpy")


def run_one(name: str, seed: int, out: Path, overrides: list[str], stop_at: float | None = None) -> float:
    """Train one baseline at one seed; returns its wall-clock seconds. Output goes to
    ``OUT/NAME_sS.log``; a run that finished before (its ``.wall`` file is there) is not run
    again, and one that was cut off (checkpoints, no ``.wall``) resumes from its last
    checkpoint (its metrics after that checkpoint are redone). ``stop_at``: stop the run (SIGTERM: it
    writes its checkpoint and exits 143) once an evaluation reaches this success."""
    run_dir = out / f"{name}_s{seed}"
    log, wall_file = out / f"{name}_s{seed}.log", out / f"{name}_s{seed}.wall"
    if wall_file.exists():
        return float(wall_file.read_text().split()[0])
    resumed = (run_dir / "checkpoints").is_dir()
    cmd = [sys.executable, "-m", "mmrl", "train", BASELINES[name], f"seed={seed}", "--run-dir", str(run_dir), "log.progress=false", *overrides]
    if resumed:
        cmd.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
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


def report(out: Path, seeds: list[int], target: float) -> None:
    runs = {(name, s): read_run(out / f"{name}_s{s}", target) for name in BASELINES for s in seeds if (out / f"{name}_s{s}" / "metrics.jsonl").exists()}
    if not runs:
        raise SystemExit(f"no runs under {out}")
    print(f"# PushCube-v1: group baseline (GRPO) vs value baseline (GAE), target {target} mean-action success (100 episodes)")
    print(f"# {versions()}; one intra-op thread per run\n")
    for (name, seed), run in runs.items():
        points = " ".join(f"{steps // 1000}k:{success:.2f}" for steps, success in run["curve"])
        print(f"{name} seed {seed}: {points}")
    print()
    print("| baseline | seed | first >= target (env steps) | training wall-clock to it (s) | whole run (s) | final eval |")
    print("|---|---|---|---|---|---|")
    for (name, seed), run in runs.items():
        first = run["first"]
        reached = f"{first['env_steps']:,}" if first else "not reached"
        to_target = f"{first['train_s']:.0f}" if first else "—"
        wall = f"{run['wall_s']:.0f}" if run["wall_s"] is not None else "—"
        final = f"{run['final']:.2f}" + (" (stopped at the target)" if "stopped-at-target" in run["note"] else "")
        print(f"| {name} | {seed} | {reached} | {to_target} | {wall} | {final} |")
    print()
    both = [s for s in seeds if all((n, s) in runs and runs[(n, s)]["first"] for n in BASELINES)]
    for name in BASELINES:
        firsts = [runs[(name, s)]["first"] for s in seeds if (name, s) in runs and runs[(name, s)]["first"]]
        done = sum(1 for s in seeds if (name, s) in runs)
        if firsts:
            print(f"{name}: reached {target} in {len(firsts)} of {done} seeds; mean {statistics.mean(f['env_steps'] for f in firsts):,.0f} env steps, "
                  f"{statistics.mean(f['train_s'] for f in firsts):.0f} s of training")
        else:
            print(f"{name}: reached {target} in 0 of {done} seeds")
    if both:
        steps = statistics.mean(runs[("grpo", s)]["first"]["env_steps"] / max(runs[("gae", s)]["first"]["env_steps"], 1) for s in both)
        secs = statistics.mean(runs[("grpo", s)]["first"]["train_s"] / max(runs[("gae", s)]["first"]["train_s"], 1e-9) for s in both)
        print(f"ratio GRPO / GAE over seeds {both} (per-seed ratios, mean): env steps to {target} {steps:.2f}x, training wall-clock to it {secs:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_pushcube_baselines")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each on one thread)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--report-only", action="store_true", help="read the run directories, train nothing")
    parser.add_argument("--stop-at-target", nargs="*", default=[], choices=sorted(BASELINES), metavar="BASELINE",
                        help="stop these baselines' runs at their first evaluation >= target (their curves end there)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides given to both configs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        queue = [(name, seed) for seed in args.seeds for name in BASELINES]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            stop = {name: args.target if name in args.stop_at_target else None for name in BASELINES}
            for future in [pool.submit(run_one, name, seed, args.out, args.overrides, stop[name]) for name, seed in queue]:
                future.result()
    report(args.out, args.seeds, args.target)


if __name__ == "__main__":
    main()
