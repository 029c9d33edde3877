"""Reward hacking check of RL with a learned reward: the learned score against the verifier.

Reads a run of configs/image_shapes_flow_grpo_pairwise.yaml (or any run whose rewards log a
learned component and a weight-0 verifier monitor) and plots, into one small PNG, against
the update: the learned reward's mean score on each step's samples (left) and the verifier's
accuracy on the same samples and on the held-out evaluations (right), with optional starting
points (the pretrained model's held-out figures, from `mmrl eval CONFIG`) and an optional
verifier-reward run for comparison. Prints the first and last five steps' means of both.

    .venv/bin/python benchmarks/pairwise_rl_curves.py runs/image_shapes_flow_grpo_pairwise \\
        --start-verifier 0.193 --out benchmarks/image_shapes_pairwise_rl.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mmrl.train.metrics import read_metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory")
    parser.add_argument("--learned", default="pairwise_preference", help="the learned reward component's name")
    parser.add_argument("--verifier", default="shapes_geneval", help="the verifier monitor's name")
    parser.add_argument("--start-verifier", type=float, default=None, help="held-out verifier accuracy of the starting model (step 0)")
    parser.add_argument("--start-learned", type=float, default=None, help="held-out mean learned score of the starting model (step 0)")
    parser.add_argument("--verifier-run", default=None, help="a run with the verifier as its reward, for comparison (its eval/accuracy)")
    parser.add_argument("--out", default="benchmarks/image_shapes_pairwise_rl.png")
    args = parser.parse_args()
    metrics = read_metrics(args.run)
    train = [m for m in metrics if f"reward/{args.learned}" in m]
    evals = [m for m in metrics if f"eval/reward/{args.verifier}" in m]
    steps = [m["step"] for m in train]
    learned = [m[f"reward/{args.learned}"] for m in train]
    verifier = [m[f"reward/{args.verifier}"] for m in train]
    for name, values in ((f"learned score ({args.learned})", learned), (f"verifier accuracy ({args.verifier}, sampled)", verifier)):
        first, last = statistics.mean(values[:5]), statistics.mean(values[-5:])
        print(f"{name}: steps 1-5 {first:.3f}, last 5 {last:.3f}, change {last - first:+.3f}")
    for m in evals:
        print(f"step {m['step']}: held-out verifier {m[f'eval/reward/{args.verifier}']:.3f}, held-out learned {m.get(f'eval/reward/{args.learned}', float('nan')):.3f}")
    print(f"wall-clock: {sum(m.get('time/step_s', 0.0) for m in metrics) / 60:.1f} min over {len(train)} steps")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_v) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax_l.plot(steps, learned, color="C0", alpha=0.8, label="sampled, train prompts")
    points = ([(0, args.start_learned)] if args.start_learned is not None else []) + [(m["step"], m[f"eval/reward/{args.learned}"]) for m in evals if f"eval/reward/{args.learned}" in m]
    if points:
        ax_l.plot(*zip(*points), color="C0", marker="o", linestyle="--", label="held-out (deterministic)")
    ax_v.plot(steps, verifier, color="C1", alpha=0.8, label="sampled, train prompts")
    points = ([(0, args.start_verifier)] if args.start_verifier is not None else []) + [(m["step"], m[f"eval/reward/{args.verifier}"]) for m in evals]
    if points:
        ax_v.plot(*zip(*points), color="C1", marker="o", linestyle="--", label="held-out (deterministic)")
    if args.verifier_run:
        ref = [(m["step"], m["eval/accuracy"]) for m in read_metrics(args.verifier_run) if "eval/accuracy" in m]
        if args.start_verifier is not None:
            ref = [(0, args.start_verifier)] + ref
        ax_v.plot(*zip(*ref), color="C2", marker="s", linestyle=":", label="verifier-reward run, held-out")
    ax_l.set(xlabel="update", ylabel="learned reward score", title="pairwise reward model (the RL reward)")
    ax_v.set(xlabel="update", ylabel="verifier accuracy (strict)", title="shapes verifier (weight-0 monitor)", ylim=(0, 1))
    for ax in (ax_l, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=72)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} kB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
