"""Reward hacking check of RL with a learned reward: the learned score against the verifier.

Reads a run of configs/image_shapes_flow_grpo_pairwise.yaml (or any run whose rewards log a
learned component and a weight-0 verifier monitor) and plots, into one small PNG, against
the update, one colour per run (e.g. per seed): the learned reward's mean score (left) and
the verifier's accuracy (right) on each step's samples (thin) and on the held-out
evaluations (dots), with optional starting points (the pretrained model's held-out figures,
from `mmrl eval CONFIG`). Prints the first and last five steps' means of both.

    .venv/bin/python benchmarks/pairwise_rl_curves.py runs/image_shapes_flow_grpo_pairwise runs/image_shapes_flow_grpo_pairwise_s1 \\
        --start-verifier 0.193 --out benchmarks/image_shapes_pairwise_rl.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mmrl.train.metrics import read_metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (e.g. the seeds of one config)")
    parser.add_argument("--learned", default="pairwise_preference", help="the learned reward component's name")
    parser.add_argument("--verifier", default="shapes_geneval", help="the verifier monitor's name")
    parser.add_argument("--start-verifier", type=float, default=None, help="held-out verifier accuracy of the starting model (step 0)")
    parser.add_argument("--start-learned", type=float, default=None, help="held-out mean learned score of the starting model (step 0)")
    parser.add_argument("--out", default="benchmarks/image_shapes_pairwise_rl.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_v) = plt.subplots(1, 2, figsize=(9, 3.2))
    for i, run in enumerate(args.runs):
        metrics = read_metrics(run)
        train = [m for m in metrics if f"reward/{args.learned}" in m]
        evals = [m for m in metrics if f"eval/reward/{args.verifier}" in m]
        steps = [m["step"] for m in train]
        learned = [m[f"reward/{args.learned}"] for m in train]
        verifier = [m[f"reward/{args.verifier}"] for m in train]
        print(run)
        for name, values in ((f"  learned score ({args.learned}, sampled)", learned), (f"  verifier accuracy ({args.verifier}, sampled)", verifier)):
            first, last = statistics.mean(values[:5]), statistics.mean(values[-5:])
            print(f"{name}: steps 1-5 {first:.3f}, last 5 {last:.3f}, change {last - first:+.3f}")
        for m in evals:
            print(f"  step {m['step']}: held-out verifier {m[f'eval/reward/{args.verifier}']:.3f}, held-out learned {m.get(f'eval/reward/{args.learned}', float('nan')):.3f}")
        print(f"  wall-clock: {sum(m.get('time/step_s', 0.0) for m in metrics) / 60:.1f} min over {len(train)} steps")
        label = Path(run).name
        ax_l.plot(steps, learned, color=f"C{i}", alpha=0.35, linewidth=0.8)
        ax_v.plot(steps, verifier, color=f"C{i}", alpha=0.35, linewidth=0.8)
        for ax, key, start in ((ax_l, args.learned, args.start_learned), (ax_v, args.verifier, args.start_verifier)):
            points = ([(0, start)] if start is not None else []) + [(m["step"], m[f"eval/reward/{key}"]) for m in evals if f"eval/reward/{key}" in m]
            if points:
                ax.plot(*zip(*points), color=f"C{i}", marker="o", label=f"{label}: held-out")
    ax_l.set(xlabel="update", ylabel="learned reward score", title="pairwise reward model (the RL reward)")
    ax_v.set(xlabel="update", ylabel="verifier accuracy (strict)", title="shapes verifier (weight-0 monitor)", ylim=(0, 0.5))
    for ax in (ax_l, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.text(0.5, 0.005, "thin: training samples (stochastic, train prompts); dots: held-out prompts (deterministic)", ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=72)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
