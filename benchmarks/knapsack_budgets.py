"""Knapsack rollout budgets against fixed groups on the text arithmetic demo, at equal samples
per step: the share of trained samples with a non-zero advantage, and held-out accuracy
against samples drawn.

    python benchmarks/knapsack_budgets.py                       # seeds 0 1 2, 50 updates each
    python benchmarks/knapsack_budgets.py --seeds 0 --updates 20 --variant knapsack=sampler.budget.type=knapsack

Every run is ``configs/text_arithmetic_grpo.yaml`` (16 prompts x 8 samples a step) from the same
SFT model (``--init``, default ``runs/text_arithmetic_sft``; trained with
``configs/text_arithmetic_sft.yaml`` first when it is missing; a checkpoint directory of it
also works), on a pool of ``--pool`` train problems (the first of ``--pool-from``, default
``examples/arithmetic/train.jsonl``) so that each problem comes back
every pool / groups_per_step updates and has a pass rate to share by; held-out accuracy is on the 200
held-out problems, every ``--eval-every`` updates. A variant is NAME=override[,override...];
the default pair is fixed groups and ``sampler.budget.type=knapsack``. Prints one row per run
and the mean per variant, and the relative change of the non-zero share against the first
variant, with the held-out accuracy at the end and its mean over the evaluations after the start
(the curve's area per sample drawn: less noisy than one evaluation); ``--out`` writes the
rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from mmrl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ["fixed=sampler.budget.type=fixed", "knapsack=sampler.budget.type=knapsack"]


def mmrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mmrl", *args], check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--pool", type=int, default=128, help="train problems the runs draw from")
    ap.add_argument("--pool-from", default="examples/arithmetic/train.jsonl", help="the problems the pool is the first --pool of")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--init", default="runs/text_arithmetic_sft", help="the SFT run (or one of its checkpoints) every run starts from")
    ap.add_argument("--variant", action="append", help="NAME=override[,override...] (repeatable)")
    ap.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the per-run rows here (JSON)")
    args = ap.parse_args()
    variants = [(v.split("=", 1)[0], [o for o in v.split("=", 1)[1].split(",") if o]) for v in (args.variant or DEFAULT_VARIANTS)]

    init = ROOT / args.init
    if not (init / "checkpoints").exists() and not (init / "model.safetensors").exists():
        if init.exists() and any(init.iterdir()):
            ap.error(f"--init: {args.init} holds neither a run's checkpoints nor a model.safetensors")
        mmrl("train", "configs/text_arithmetic_sft.yaml", "log.progress=false", "--run-dir", str(init))
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="knapsack_"))
    work.mkdir(parents=True, exist_ok=True)
    pool = work / "pool.jsonl"
    lines = (ROOT / args.pool_from).read_text().splitlines()[: args.pool]
    pool.write_text("\n".join(lines) + "\n")

    rows = []
    for seed in args.seeds:
        for name, overrides in variants:
            run = work / f"{name}_s{seed}"
            if not (run / "metrics.jsonl").exists() or not any("eval/accuracy" in r and r.get("step") == args.updates for r in read_metrics(run)):
                mmrl(
                    "train", "configs/text_arithmetic_grpo.yaml", f"seed={seed}", f"total_steps={args.updates}", f"policy.pretrained={init}",
                    f"sampler.data.train={pool}", f"eval.every={args.eval_every}", "eval.at_start=true", "checkpoint.every=0", "log.progress=false",
                    *overrides, "--run-dir", str(run),
                )
            metrics = read_metrics(run)
            steps = [r for r in metrics if "adv/nonzero_fraction" in r]
            evals = {r["step"]: r["eval/accuracy"] for r in metrics if "eval/accuracy" in r}
            algo = yaml.safe_load((run / "config.yaml").read_text())["algo"]
            samples = algo["group_size"] * algo["groups_per_step"]  # the step's samples (128 in the shipped config)
            row = {
                "variant": name, "seed": seed, "samples_per_step": samples,
                "nonzero_share": statistics.mean(r["adv/nonzero_fraction"] for r in steps),
                "nonzero_share_after_epoch": statistics.mean(r["adv/nonzero_fraction"] for r in steps[args.pool // algo["groups_per_step"] :]),
                "group_size_spread": statistics.mean(r.get("budget/group_size", float(algo["group_size"])) for r in steps),
                "accuracy": {str(step * samples): acc for step, acc in sorted(evals.items())},
                "final_accuracy": evals.get(args.updates),
                # the curve's mean after the start (its area over the samples drawn, per sample):
                # one evaluation moves by up to ±0.1 between neighbours, the mean of ten much less
                "mean_accuracy": statistics.mean(acc for step, acc in evals.items() if step > 0) if any(step > 0 for step in evals) else None,
                "seconds": sum(r.get("time/step_s", 0.0) for r in steps),
            }
            rows.append(row)
            print(f"{name:>10} seed {seed}: non-zero share {row['nonzero_share']:.3f} (after the first pass over the pool {row['nonzero_share_after_epoch']:.3f}), "
                  f"mean group size of a sample {row['group_size_spread']:.1f}, held-out accuracy by samples drawn "
                  + " ".join(f"{k}:{v:.3f}" for k, v in row["accuracy"].items()), flush=True)
    print()
    if len({r["samples_per_step"] for r in rows}) > 1:
        print("note: the variants draw different samples per step: " + ", ".join(sorted({f"{r['variant']} {r['samples_per_step']}" for r in rows})))
    first = variants[0][0]
    base = statistics.mean(r["nonzero_share_after_epoch"] for r in rows if r["variant"] == first)
    for name, _ in variants:
        mine = [r for r in rows if r["variant"] == name]
        share = statistics.mean(r["nonzero_share_after_epoch"] for r in mine)
        final = [r["final_accuracy"] for r in mine if r["final_accuracy"] is not None]
        area = [r["mean_accuracy"] for r in mine if r["mean_accuracy"] is not None]
        print(f"{name:>10}: non-zero share after the first pass {share:.3f} ({(share / base - 1) * 100:+.1f}% against {first}), "
              f"final held-out accuracy {' / '.join(f'{a:.3f}' for a in final)} (mean {statistics.mean(final):.3f}), "
              f"mean over the curve {' / '.join(f'{a:.3f}' for a in area)} (mean {statistics.mean(area):.3f})" if final and area else "")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
