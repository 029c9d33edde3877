"""Does a commit train exactly as another one? Runs N updates of the toy, point_reach (also
with self-imitation), text-demo, shapes and PushCube (GAE) configs at two commits of this repository on this machine and compares
every logged metric (less wall-clock times; a metric only one commit logs is listed, not
compared) and the final weights bit for bit.

    python benchmarks/sync_equivalence.py --old f205c0b [--new HEAD] [--steps 3]

Each commit runs from a git worktree in a temporary directory, with this interpreter and
that worktree first on the import path. A result holds for one machine: float kernels
differ between CPUs, so recorded numbers never go into a test (the test of the same claim
compares two code paths in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cases(steps: int) -> list[tuple[str, str, list[str], str | None]]:
    """(name, config, overrides, the case whose run directory is the policy's start)."""
    quiet = ["log.progress=false", "log.tensorboard=false", "eval.at_start=true", "eval.at_end=true", "eval.episodes=8", f"total_steps={steps}"]
    return [
        ("toy_sequence", "configs/toy_sequence_grpo.yaml", quiet, None),
        ("point_reach", "configs/point_reach_grpo.yaml", quiet, None),
        ("point_reach_self_imitation", "configs/point_reach_grpo.yaml", [*quiet, "algo.self_imitation.size=512", "algo.self_imitation.steps=2"], None),
        ("text_sft", "configs/text_arithmetic_sft.yaml", [*quiet, f"total_steps={10 * steps}"], None),
        ("text_grpo", "configs/text_arithmetic_grpo.yaml", [*quiet, "algo.groups_per_step=4"], "text_sft"),
        ("shapes_flow_grpo", "configs/image_shapes_flow_grpo.yaml", [*quiet, "algo.groups_per_step=4"], None),
        ("pushcube_gae", "configs/maniskill_pushcube_gae.yaml", quiet, None),  # a critic, GAE, 4 epochs x 32 minibatches
    ]


def run(tree: Path, out: Path, name: str, config: str, overrides: list[str], start: Path | None) -> Path:
    run_dir = out / name
    extra = [f"policy.pretrained={start}"] if start is not None else []
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mmrl", "train", str(tree / config), "--run-dir", str(run_dir), *overrides, *extra],
                          cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} at {tree}: {proc.stderr[-2000:]}")
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    import torch

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    tensors = load_file(str(latest / "model.safetensors"))
    critic = torch.load(latest / "state.pt", weights_only=True).get("critic", {})  # a critic's weights live beside the policy's
    return {**tensors, **{f"critic.{k}": v for k, v in critic.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit to compare against")
    parser.add_argument("--new", default="HEAD", help="the commit under test")
    parser.add_argument("--steps", type=int, default=3, help="updates per RL run (SFT: 10x)")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trees = {}
        for label, ref in (("old", args.old), ("new", args.new)):
            trees[label] = tmp / label
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[label]), ref], cwd=ROOT, check=True, capture_output=True)
        try:
            print(f"| case | metric records | metrics equal | weight tensors | weights equal | metrics new / gone |  ({args.old} vs {args.new}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})")
            print("|---|---|---|---|---|---|")
            runs: dict[str, dict[str, Path]] = {"old": {}, "new": {}}
            for name, config, overrides, start in cases(args.steps):
                for label in ("old", "new"):
                    # a later stage starts from the old commit's run of the earlier one: the same start for both
                    begin = runs["old"][start] if start else None
                    runs[label][name] = run(trees[label], tmp / f"runs_{label}", name, config, overrides, begin)
                a, b = metrics(runs["old"][name]), metrics(runs["new"][name])
                wa, wb = weights(runs["old"][name]), weights(runs["new"][name])
                same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
                # a metric one commit logs and the other does not is listed, not counted as a difference
                keys_a, keys_b = set().union(*a) if a else set(), set().union(*b) if b else set()
                shared = keys_a & keys_b
                equal = len(a) == len(b) and all({k: v for k, v in x.items() if k in shared} == {k: v for k, v in y.items() if k in shared} for x, y in zip(a, b))
                changed = ", ".join([*(f"+{k}" for k in sorted(keys_b - keys_a)), *(f"-{k}" for k in sorted(keys_a - keys_b))]) or "none"
                print(f"| {name} | {len(a)} | {equal} | {len(wa)} | {same_weights} | {changed} |")
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
