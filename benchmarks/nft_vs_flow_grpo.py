"""DiffusionNFT against Flow-GRPO on the shapes demo: held-out accuracy against updates,
denoiser evaluations (NFE) and wall-clock, from run directories.

    python benchmarks/nft_vs_flow_grpo.py --variant NFT=runs/image_shapes_nft_s \\
        --variant Flow-GRPO=runs/image_shapes_flow_grpo_s --seeds 0 1 2 --out benchmarks/image_shapes_nft.png

NFE per update is counted from each run's own config (``config.yaml``), as rows of the
denoiser's forward (a classifier-free-guided evaluation counts 2; backward passes are not
counted; evaluation is left out, the same for every method):

- sampling: samples x ``num_inference_steps``;
- policy_gradient (Flow-GRPO): per epoch, samples x the stochastic steps a sample trains
  (``window_size`` with an SDE window, else all steps), plus the deferred old log-probs' one
  no-grad pass over the rows of every minibatch but the first;
- nft: per epoch, samples x the trained noise levels x (1 with grad + 1 for the old policy,
  + 1 for the reference when ``ref_coef`` > 0).

Wall-clock is the sum of each update's ``time/step_s``: runs side by side on shared cores
slow each other, so compare runs made under the same load, or give ``--seconds NAME=S``, a
variant's seconds per update measured back to back with the others' (e.g. 4 updates each,
``total_steps=4 eval.at_start=false eval.at_end=false``), which then stand in for its runs' own. For each run the table gives the
first evaluation at or above ``--target`` (updates, NFE, minutes) and the last evaluation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from mmrl.train.metrics import read_metrics


def nfe_per_update(config: dict) -> tuple[float, float]:
    """(sampling NFE, training NFE) of one update of the run whose resolved config is ``config``."""
    algo, policy = config["algo"], config["policy"]
    denoising = policy.get("denoising", {})
    samples = algo["group_size"] * algo["groups_per_step"]
    guidance = 2 if float(policy.get("guidance_scale", 1.0)) != 1.0 else 1
    steps = int(denoising.get("num_inference_steps", 10))
    sampling = samples * steps * guidance
    epochs, minibatches = int(algo.get("ppo_epochs", 1)), int(algo.get("num_minibatches", 1))
    loss = algo.get("loss", {}) or {}
    if loss.get("type", "policy_gradient") == "nft":
        levels = int(float(loss.get("timestep_fraction", 0.99)) * steps)
        per_level = 2 + (1 if float(loss.get("ref_coef", 1e-4)) > 0 else 0)
        return sampling, epochs * samples * levels * per_level * guidance
    trained = int(denoising.get("window_size", steps)) if denoising.get("stochastic_steps") == "window" else steps
    deferred = denoising.get("old_logp", "deferred") == "deferred" and epochs * minibatches > 1
    extra = samples * trained * (minibatches - 1) / minibatches if deferred else 0.0
    return sampling, (epochs * samples * trained + extra) * guidance


def curve(run: Path, seconds: float | None = None) -> tuple[list[tuple[int, float, float, float]], float]:
    """[(update, held-out accuracy, NFE so far, minutes so far)] and the NFE of one update;
    ``seconds`` per update replaces the run's own step times."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    sampling, training = nfe_per_update(config)
    per_update = sampling + training
    minutes, points = {0: 0.0}, []
    total = 0.0
    for m in read_metrics(run):
        if "time/step_s" in m and "reward/total" in m:
            total += m["time/step_s"] / 60
            minutes[m["step"]] = total
        if "eval/accuracy" in m:
            step = m["step"]
            elapsed = step * seconds / 60 if seconds is not None else minutes.get(step, total)
            points.append((step, m["eval/accuracy"], step * per_update, elapsed))
    return points, per_update


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME=run-directory prefix (seed S is prefix + S)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--seconds", action="append", default=[], help="NAME=S: seconds per update of that variant, measured under the same load as the others'")
    parser.add_argument("--out", default=None, help="a PNG of the curves against updates, NFE and minutes")
    args = parser.parse_args()
    curves: dict[str, list] = {}
    seconds = {k: float(v) for k, v in (s.split("=", 1) for s in args.seconds)}
    print(f"| variant | seed | NFE per update | first >= {args.target}: update | NFE | minutes | last: update | held-out |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.variant:
        name, prefix = spec.split("=", 1)
        for seed in args.seeds:
            run = Path(f"{prefix}{seed}")
            if not (run / "metrics.jsonl").exists():
                continue
            points, per_update = curve(run, seconds.get(name))
            curves.setdefault(name, []).append(points)
            first = next((p for p in points if round(p[1] * 1000) >= round(args.target * 1000)), None)
            reach = f"{first[0]} | {first[2]:.3g} | {first[3]:.1f}" if first else "— | — | —"
            last = points[-1] if points else (0, float("nan"), 0, 0)
            print(f"| {name} | {seed} | {per_update:.0f} | {reach} | {last[0]} | {last[1]:.3f} |")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for c, (name, runs) in enumerate(curves.items()):
            for i, points in enumerate(runs):
                for ax, k in zip(axes, (0, 2, 3)):
                    ax.plot([p[k] for p in points], [p[1] for p in points], marker="o", ms=3, color=colors[c], alpha=0.8, label=name if i == 0 else None)
        for ax, label in zip(axes, ("updates", "denoiser evaluations (NFE)", "minutes of step time")):
            ax.set_xlabel(label)
            ax.axhline(args.target, color="grey", lw=0.8, ls="--")
        axes[0].set_ylabel("held-out accuracy")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"\n![curves]({Path(args.out).name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
