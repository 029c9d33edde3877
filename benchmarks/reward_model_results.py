"""Held-out pairwise accuracy of reward-model runs (``mmrl train-reward``), one row per run
and the mean over them, as a Markdown table.

    python benchmarks/reward_model_results.py runs/rm_seed0 runs/rm_seed1 runs/rm_seed2

Reads each run's ``metrics.jsonl`` (the last evaluation, and every evaluation step's
accuracy) and ``config.yaml`` (the seed); the training-pair count comes from the data
directory's ``info.json``. With ``--shuffled-prompts`` it also loads each run's latest
checkpoint and scores the first 500 train and held-out pairs twice, with their own prompts
and with the prompts permuted among the pairs (seed 0): how much of the accuracy the prompt
carries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def last_eval(run: Path) -> tuple[dict, list[tuple[int, float]]]:
    evals = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "eval/pairwise_accuracy" in r]
    if not evals:
        raise SystemExit(f"{run}: no evaluation in metrics.jsonl yet")
    return evals[-1], [(r["step"], r["eval/pairwise_accuracy"]) for r in evals]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--shuffled-prompts", action="store_true", help="also score pairs with their prompts permuted")
    args = parser.parse_args(argv)
    rows, accuracies = [], []
    for run in args.runs:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        info = json.loads((Path(cfg["data"]["path"]) / "info.json").read_text())
        final, curve = last_eval(run)
        accuracies.append(final["eval/pairwise_accuracy"])
        rows.append(
            f"| {cfg['seed']} | {info['train']} | {final['eval/pairs']} | {final['step']} | {final['eval/pairwise_accuracy']:.3f} "
            f"| [{final['eval/pairwise_accuracy_ci_low']:.3f}, {final['eval/pairwise_accuracy_ci_high']:.3f}] "
            f"| {' / '.join(f'{a:.3f}' for _, a in curve)} |"
        )
    print("| seed | train pairs | held-out pairs | step | held-out accuracy | 95% Wilson | at each evaluation |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nmean over {len(accuracies)} runs: {sum(accuracies) / len(accuracies):.3f}")
    if args.shuffled_prompts:
        print("\n| run | split | pairs | own prompts | prompts permuted |\n|---|---|---|---|---|")
        for run in args.runs:
            for split, own, permuted, n in prompt_check(run):
                print(f"| {run.name} | {split} | {n} | {own:.3f} | {permuted:.3f} |")
    return 0


def prompt_check(run: Path, limit: int = 500) -> list[tuple[str, float, float, int]]:
    """(split, accuracy with the pairs' own prompts, with permuted prompts, pairs)."""
    import numpy as np
    import torch

    from mmrl.core.weights import load_pretrained
    from mmrl.data.preferences import read_pairs

    model = load_pretrained(run).eval()
    path = yaml.safe_load((run / "config.yaml").read_text())["data"]["path"]
    out = []
    for split in ("train", "held_out"):
        pairs = read_pairs(path, split)
        n = min(limit, len(pairs))
        prompts = pairs.prompts[:n]
        chosen, rejected = (pairs.chosen[:n], pairs.rejected[:n]) if pairs.kind == "text" else (torch.from_numpy(pairs.chosen[:n]), torch.from_numpy(pairs.rejected[:n]))
        shuffled = [prompts[i] for i in np.random.RandomState(0).permutation(n)]
        with torch.no_grad():
            own = (model.score(prompts, chosen) > model.score(prompts, rejected)).float().mean().item()
            permuted = (model.score(shuffled, chosen) > model.score(shuffled, rejected)).float().mean().item()
        out.append((split, own, permuted, n))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
