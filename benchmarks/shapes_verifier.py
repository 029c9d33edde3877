"""Accuracy of the ``shapes_geneval`` verifier on rendered images of the shapes world.

For each image size, N scenes drawn evenly over the four categories (single, count, colour,
position; uniformly within a category) are rendered from their own seeds. The verifier
(strict mode, default options, through the registered reward on a rollout that carries the
records' scene metadata) should accept every ground-truth image and reject every image of a
deliberately wrong scene (``mmrl.tasks.shapes.world.mistaken_scene``: one object more or less,
another colour or shape for one group, the opposite relation), scored against the original
prompt. ``--noise`` adds rows for ground truth with Gaussian pixel noise of that std, a
stand-in for a generator's imperfect images. Prints one Markdown table per size.

    .venv/bin/python benchmarks/shapes_verifier.py                       # 2,000 scenes at 32 and 64
    .venv/bin/python benchmarks/shapes_verifier.py --scenes 500 --sizes 32 --noise 8 16
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.tasks.shapes.world import CATEGORIES, MISTAKES, all_scenes, mistaken_scene, render_scene
from mmrl.registry import REWARDS


def sample_scenes(n: int, seed: int):
    """n scenes, categories in turn, each uniform within its category."""
    by_category = defaultdict(list)
    for scene in all_scenes():
        by_category[scene.category].append(scene)
    rng = np.random.RandomState(seed)
    scenes = []
    for k in range(n):
        pool = by_category[CATEGORIES[k % len(CATEGORIES)]]
        scenes.append(pool[rng.randint(len(pool))])
    return scenes


def verify(reward, scenes, images) -> np.ndarray:
    """The reward of each image against its scene's prompt record."""
    n = len(scenes)
    rollout = Rollout(
        group_id=torch.arange(n), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={},
        info={
            "images": torch.from_numpy(np.stack(images)),
            "prompt": [s.text() for s in scenes],
            "metadata": [{"category": s.category, "scene": s.to_dict()} for s in scenes],
            "record_id": torch.arange(n),
        },
    )
    return reward(rollout).numpy()


def measure(size: int, n: int, seed: int, noise: list[float], min_fill: float = 0.8) -> list[tuple[str, int, int]]:
    """(row name, accepted, total) rows for one image size."""
    reward = build_reward(from_dict(REWARDS.entry("shapes_geneval").config, {"type": "shapes_geneval", "min_fill": min_fill}), RewardContext())
    scenes = sample_scenes(n, seed)
    truth = [render_scene(s, size, seed + k) for k, s in enumerate(scenes)]
    t0 = time.perf_counter()
    accepted = verify(reward, scenes, truth)
    per_image_ms = 1000 * (time.perf_counter() - t0) / n
    rows = [("ground truth, all", int(accepted.sum()), n)]
    for category in CATEGORIES:
        picked = [k for k, s in enumerate(scenes) if s.category == category]
        rows.append((f"ground truth, {category}", int(accepted[picked].sum()), len(picked)))
    rng = np.random.RandomState(seed + 1)
    for sigma in noise:
        noisy = [np.clip(image + rng.normal(0, sigma, image.shape), 0, 255).astype(np.uint8) for image in truth]
        rows.append((f"ground truth + noise σ={sigma:g}", int(verify(reward, scenes, noisy).sum()), n))
    for mistake in MISTAKES:
        pairs = [(s, mistaken_scene(s, mistake, seed + k)) for k, s in enumerate(scenes)]
        pairs = [(k, s, wrong) for k, (s, wrong) in enumerate(pairs) if wrong is not None]
        images = [render_scene(wrong, size, seed + k) for k, _, wrong in pairs]
        got = verify(reward, [s for _, s, _ in pairs], images)
        rows.append((f"wrong: {mistake}", int(got.sum()), len(pairs)))
    rows.append((f"verifier time per image: {per_image_ms:.2f} ms", 0, 0))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=2000, help="scenes per image size")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, nargs="*", default=[], help="pixel-noise stds for extra ground-truth rows")
    parser.add_argument("--min-fill", type=float, default=0.8, help="the verifier's min_fill (below it for every outline, an object is unrecognised)")
    args = parser.parse_args()
    for size in args.sizes:
        print(f"\n{size}x{size}, {args.scenes} scenes\n\n| images | accepted | of | rate |\n|---|---|---|---|")
        for name, accepted, total in measure(size, args.scenes, args.seed, args.noise, args.min_fill):
            print(f"| {name} | | | |" if total == 0 else f"| {name} | {accepted} | {total} | {accepted / total:.4f} |")


if __name__ == "__main__":
    main()
