"""Curves and the table of the text demo (SFT → GRPO on 2-digit addition) from its runs.

Run directories are named by a prefix and the seed: ``--sft runs/text_arithmetic_sft_s`` finds
``runs/text_arithmetic_sft_s0``, ``_s1`` …, and ``--variant GRPO=runs/text_arithmetic_grpo_s``
the stage-2 runs of each seed; stage-2 seed s is compared with SFT seed s (an ``--sft`` that
is itself a run directory is the shared start of every seed). For each run the held-out
greedy evaluation is read from its metrics (the last one logged, which is what
``mmrl eval RUN`` reproduces).

Plots, one line per seed, the training reward (exact match of the sampled completions), the
held-out accuracy and the held-out reasoning → answer consistency against the update, with
each seed's SFT model at update 0, into one PNG; prints a markdown table per seed and the
mean: held-out accuracy and consistency of the SFT model and after stage 2, and their change.

    .venv/bin/python benchmarks/text_arithmetic_curves.py --sft runs/text_arithmetic_sft_s \\
        --variant GRPO=runs/text_arithmetic_grpo_s --variant GRPO-CARE=runs/text_arithmetic_grpo_care_s \\
        --out benchmarks/text_arithmetic.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mmrl.train.metrics import read_metrics

ACC, CONS = "eval/accuracy", "eval/reward/arithmetic_consistency"


def evals(run: Path) -> list[dict]:
    return [m for m in read_metrics(run) if ACC in m] if (run / "metrics.jsonl").is_file() else []


def seeds_of(prefix: str) -> dict[str, Path]:
    """Seed → run directory for the runs named prefix0, prefix1, … that have an evaluation."""
    base = Path(prefix)
    runs = {p.name[len(base.name):]: p for p in base.parent.glob(base.name + "[0-9]*") if p.name[len(base.name):].isdigit()}
    return {s: runs[s] for s in sorted(runs, key=int) if evals(runs[s])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT runs: a prefix (seed s of a variant starts from prefix+s) or one run directory shared by every seed")
    parser.add_argument("--variant", action="append", required=True, help="NAME=run-directory prefix (seeds are prefix0, prefix1, ...)")
    parser.add_argument("--out", default="benchmarks/text_arithmetic.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared = Path(args.sft) if evals(Path(args.sft)) else None
    sft = {} if shared else {s: evals(run)[-1] for s, run in seeds_of(args.sft).items()}

    def start(seed: str) -> dict:
        return evals(shared)[-1] if shared else sft[seed]

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    ax_train, ax_acc, ax_cons = axes
    print("| model | seed | held-out accuracy (SFT → after) | Δ accuracy | consistency (SFT → after) | Δ consistency |")
    print("|---|---|---|---|---|---|")
    if not shared:
        for s, m in sft.items():
            print(f"| SFT (start) | {s} | {m[ACC]:.3f} | — | {m[CONS]:.3f} | — |")
        print(f"| SFT (start) | mean of {len(sft)} | {statistics.mean(m[ACC] for m in sft.values()):.3f} | — | {statistics.mean(m[CONS] for m in sft.values()):.3f} | — |")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for v, spec in enumerate(args.variant):
        name, prefix = spec.split("=", 1)
        rows = []
        for s, run in seeds_of(prefix).items():
            if not shared and s not in sft:
                continue
            metrics = read_metrics(run)
            s0 = start(s)
            train = [(m["step"], m["reward/exact_match"]) for m in metrics if "reward/exact_match" in m]
            ev = [(0, s0)] + [(m["step"], m) for m in metrics if ACC in m]
            label = name if not rows else None
            ax_train.plot(*zip(*train), color=colors[v], alpha=0.5, linewidth=1, label=label)
            ax_acc.plot([t for t, _ in ev], [m[ACC] for _, m in ev], color=colors[v], marker="o", markersize=3, alpha=0.8, label=label)
            ax_cons.plot([t for t, _ in ev], [m[CONS] for _, m in ev], color=colors[v], marker="o", markersize=3, alpha=0.8, label=label)
            end = ev[-1][1]
            rows.append((s0[ACC], end[ACC], s0[CONS], end[CONS]))
            print(f"| {name} | {s} | {s0[ACC]:.3f} → {end[ACC]:.3f} | {end[ACC] - s0[ACC]:+.3f} | {s0[CONS]:.3f} → {end[CONS]:.3f} | {end[CONS] - s0[CONS]:+.3f} |")
        if rows:
            mean = [statistics.mean(r[k] for r in rows) for k in range(4)]
            print(f"| **{name}** | **mean of {len(rows)}** | {mean[0]:.3f} → {mean[1]:.3f} | **{mean[1] - mean[0]:+.3f}** | {mean[2]:.3f} → {mean[3]:.3f} | {mean[3] - mean[2]:+.3f} |")
    ax_train.set(xlabel="update", ylabel="exact match of sampled completions", title="training reward")
    ax_acc.set(xlabel="update (0 = SFT model)", ylabel="held-out accuracy (greedy)", title="held-out accuracy", ylim=(0, 1))
    ax_cons.set(xlabel="update (0 = SFT model)", ylabel="answer = what the reasoning computes", title="held-out consistency", ylim=(0, 1))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
