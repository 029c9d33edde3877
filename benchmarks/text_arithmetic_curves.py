"""Curves and the table of the text demo (SFT → GRPO on 2-digit addition) from its runs.

For each variant (a run-directory prefix, e.g. runs/text_arithmetic_grpo_s → seeds _s0, _s1 …)
plots the training reward (exact match of sampled completions) and the held-out greedy
accuracy against the update, one line per seed, into one PNG; prints a markdown table of the
held-out accuracy and reasoning → answer consistency at the last evaluation of each run, with
the SFT start as the first row.

    .venv/bin/python benchmarks/text_arithmetic_curves.py --sft runs/text_arithmetic_sft \\
        --variant GRPO=runs/text_arithmetic_grpo_s --variant GRPO-CARE=runs/text_arithmetic_grpo_care_s \\
        --out benchmarks/text_arithmetic.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mmrl.train.metrics import read_metrics


def last_eval(run: Path) -> dict:
    evals = [m for m in read_metrics(run) if "eval/accuracy" in m]
    return evals[-1] if evals else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT run the variants start from")
    parser.add_argument("--sft-eval", type=float, nargs=2, metavar=("ACCURACY", "CONSISTENCY"), help="the SFT model's held-out accuracy and consistency (from mmrl eval), if its run did not log the consistency")
    parser.add_argument("--variant", action="append", required=True, help="NAME=run-directory prefix (seeds are prefix0, prefix1, ...)")
    parser.add_argument("--out", default="benchmarks/text_arithmetic.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sft = last_eval(Path(args.sft))
    start_acc, start_cons = args.sft_eval if args.sft_eval else (sft.get("eval/accuracy"), sft.get("eval/reward/arithmetic_consistency"))
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(10, 3.6))
    print("| model | seed | held-out accuracy | consistency | Δ accuracy vs SFT |")
    print("|---|---|---|---|---|")
    print(f"| SFT (start) | 0 | {start_acc:.3f} | {start_cons:.3f} | — |")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for v, spec in enumerate(args.variant):
        name, prefix = spec.split("=", 1)
        runs = sorted(Path(prefix).parent.glob(Path(prefix).name + "[0-9]*"))
        accs, conss = [], []
        for run in runs:
            if not last_eval(run):
                continue  # still running
            metrics = read_metrics(run)
            train = [(m["step"], m["reward/exact_match"]) for m in metrics if "reward/exact_match" in m and "eval/accuracy" not in m]
            evals = [(0, start_acc)] + [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
            seed = run.name[len(Path(prefix).name):]
            ax_train.plot(*zip(*train), color=colors[v], alpha=0.6, label=f"{name}" if seed == "0" else None)
            ax_eval.plot(*zip(*evals), color=colors[v], marker="o", alpha=0.8, label=f"{name}" if seed == "0" else None)
            final = last_eval(run)
            acc, cons = final["eval/accuracy"], final.get("eval/reward/arithmetic_consistency", float("nan"))
            accs.append(acc)
            conss.append(cons)
            print(f"| {name} | {seed} | {acc:.3f} | {cons:.3f} | {acc - start_acc:+.3f} |")
        if runs:
            print(f"| {name} | mean of {len(accs)} | {statistics.mean(accs):.3f} | {statistics.mean(conss):.3f} | {statistics.mean(accs) - start_acc:+.3f} |")
    ax_train.set(xlabel="update", ylabel="training reward (exact match, sampled)", title="training")
    ax_eval.set(xlabel="update", ylabel="held-out accuracy (greedy)", title="held-out", ylim=(0, 1))
    ax_eval.axhline(start_acc, color="gray", linestyle=":", label="SFT start")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
