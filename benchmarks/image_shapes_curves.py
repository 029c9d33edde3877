"""Curves and the table of the shapes image demo (pretraining → RL with the verifier) from its runs.

Plots, into one PNG: the pretraining run's held-out accuracy against its step (left; left out
without --sft), and
for each RL variant (a run-directory prefix, e.g. runs/image_shapes_flow_grpo_s → seeds _s0,
_s1 …) the training reward (the run's own reward, sampled images; middle) and the held-out accuracy
(deterministic images; right) against the update, one line per seed. Prints a markdown table
of each run's held-out accuracy before (the pretrained model, given by --start or read from
the run's own evaluation at step 0 when it has one) and after, with 95% Wilson intervals, the
steps and the wall-clock time of the run.

    .venv/bin/python benchmarks/image_shapes_curves.py --sft runs/image_shapes_flow_sft \\
        --variant Flow-GRPO=runs/image_shapes_flow_grpo_s --start Flow-GRPO=0.193,0.114,0.2 --out benchmarks/image_shapes.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mmrl.train.metrics import read_metrics


def evals(run: Path) -> list[dict]:
    return [m for m in read_metrics(run) if "eval/accuracy" in m]


def interval(m: dict) -> str:
    return f"{m['eval/accuracy']:.3f} [{m['eval/accuracy_ci_low']:.2f}, {m['eval/accuracy_ci_high']:.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", action="append", default=[], help="NAME=pretraining run directory (its held-out accuracy over its steps)")
    parser.add_argument("--variant", action="append", default=[], help="NAME=run-directory prefix (seeds are prefix0, prefix1, ...)")
    parser.add_argument("--start", action="append", default=[], help="NAME=A0,A1,...: held-out accuracy of the starting model evaluated with seed 0, 1, ... (mmrl eval CONFIG seed=S: the evaluation noise follows the seed)")
    parser.add_argument("--out", default="benchmarks/image_shapes.png")
    args = parser.parse_args()
    starts = {k: [float(a) for a in v.split(",")] for k, v in (s.split("=", 1) for s in args.start)}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.sft:
        fig, (ax_sft, ax_train, ax_eval) = plt.subplots(1, 3, figsize=(13, 3.6))
    else:  # no pretraining run: the two RL panels only
        fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(9, 3.6))
        ax_sft = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, spec in enumerate(args.sft):
        name, run = spec.split("=", 1)
        points = [(m["step"], m["eval/accuracy"]) for m in evals(Path(run))]
        if points:
            ax_sft.plot(*zip(*points), marker="o", color=colors[i], label=name)
    print("| variant | seed | held-out accuracy before | after | Δ | steps | wall-clock |")
    print("|---|---|---|---|---|---|---|")
    for v, spec in enumerate(args.variant):
        name, prefix = spec.split("=", 1)
        runs = sorted(p for p in Path(prefix).parent.glob(Path(prefix).name + "[0-9]*") if p.is_dir())
        afters, deltas, befores = [], [], []
        for run in runs:
            metrics = read_metrics(run)
            done = evals(run)
            if not done:
                continue
            seed = run.name[len(Path(prefix).name):]
            train = [(m["step"], m["reward/total"]) for m in metrics if "reward/total" in m and "eval/accuracy" not in m]
            start = starts[name][int(seed)] if name in starts and seed.isdigit() and int(seed) < len(starts[name]) else None
            points = ([(0, start)] if start is not None else []) + [(m["step"], m["eval/accuracy"]) for m in done]
            ax_train.plot(*zip(*train), color=colors[v], alpha=0.5, label=name if seed == "0" else None)
            ax_eval.plot(*zip(*points), color=colors[v], marker="o", alpha=0.8, label=name if seed == "0" else None)
            final = done[-1]
            seconds = sum(m.get("time/step_s", 0.0) for m in metrics)
            delta = final["eval/accuracy"] - start if start is not None else float("nan")
            afters.append(final["eval/accuracy"])
            deltas.append(delta)
            befores.append(start if start is not None else float("nan"))
            before = f"{start:.3f}" if start is not None else "—"
            print(f"| {name} | {seed} | {before} | {interval(final)} | {delta:+.3f} | {final['step']} | {seconds / 60:.0f} min |")
        if afters:
            print(f"| {name} | mean of {len(afters)} | {statistics.mean(befores):.3f} | {statistics.mean(afters):.3f} | {statistics.mean(deltas):+.3f} | | |")
    if ax_sft is not None:
        ax_sft.set(xlabel="pretraining step", ylabel="held-out accuracy (deterministic)", title="pretraining", ylim=(0, 1))
    ax_train.set(xlabel="update", ylabel="training reward (sampled)", title="RL: training prompts", ylim=(0, 1))
    ax_eval.set(xlabel="update", ylabel="held-out accuracy (deterministic)", title="RL: held-out prompts", ylim=(0, 1))
    ax_eval.axhline(0.9, color="gray", linestyle=":")
    for ax in [a for a in (ax_sft, ax_train, ax_eval) if a is not None]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
