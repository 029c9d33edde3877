"""Verifier-labelled preference pairs of the shapes world (images or image sets): the better
by ``shapes_geneval`` chosen (``python -m mmrl pairs shapes``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmrl.data.preferences import flip_labels, write_preferences
from mmrl.tasks.shapes.rewards import check_criteria, detect_shapes
from mmrl.tasks.shapes.world import MISTAKES, balanced, mistaken_scene, render_scene, split_scenes


def write_shapes_pairs(
    out: str | Path, *, size: int = 32, num_train: int = 2000, num_held_out: int = 500, set_size: int = 0,
    flip: float = 0.0, pixel_noise: float = 0.0, seed: int = 0, held_out_fraction: float = 0.2, pairs_per_prompt: int = 1,
    held_out_prompts: str = "held_out", render_seed: int | None = None,
) -> dict:
    """Write shapes preference pairs (see docs/reward_models.md); returns ``info``.
    ``held_out_prompts: train`` draws the held-out pairs from the *train* prompts instead
    (new images of seen prompts: in-distribution accuracy); ``render_seed`` (default
    seed + 7) seeds the renders and candidates apart from the split."""
    if set_size == 1 or set_size < 0:
        raise ValueError(f"set size must be 0 (single images) or at least 2, not {set_size}")
    if not 0 <= flip < 0.5:
        raise ValueError(f"flip must lie in [0, 0.5), not {flip}")
    if held_out_prompts not in ("held_out", "train"):
        raise ValueError(f"held-out prompts come from the held_out or the train split, not {held_out_prompts!r}")
    train_scenes, held_scenes = split_scenes(held_out_fraction, seed)
    if held_out_prompts == "train":
        held_scenes = train_scenes
    rng = np.random.RandomState(seed + 7 if render_seed is None else render_seed)
    images: list[np.ndarray] = []

    def render(scene, correct: bool) -> tuple[int, float]:
        """Row of a new image of ``scene`` (or of a mistake of it) and its verifier score."""
        while True:
            target = scene
            if not correct:
                options = [m for m in (mistaken_scene(scene, mistake, int(rng.randint(1 << 30))) for mistake in MISTAKES) if m is not None and m.groups]
                target = options[rng.randint(len(options))]
            try:
                image = render_scene(target, size, int(rng.randint(1 << 30)))
            except ValueError:  # a mistake with four objects may not fit a small image
                continue
            if pixel_noise > 0:
                image = np.clip(image + rng.normal(0.0, pixel_noise, image.shape), 0, 255).astype(np.uint8)
            met = check_criteria(scene, detect_shapes(image, min_chroma=60, min_area=0.01, min_fill=0.8)).values()
            images.append(image)
            return len(images) - 1, sum(met) / len(met)

    def candidate(scene, first: bool):
        if set_size == 0:
            return render(scene, correct=first and rng.rand() < 0.5)
        p_correct = rng.rand()
        members = [render(scene, correct=rng.rand() < p_correct) for _ in range(set_size)]
        return [row for row, _ in members], float(np.mean([score for _, score in members]))

    def pairs(scenes, n, per_prompt) -> list[dict]:
        rows = []
        for scene in [s for s in balanced(scenes, n) for _ in range(per_prompt)]:
            while True:
                (a, score_a), (b, score_b) = candidate(scene, True), candidate(scene, False)
                if abs(score_a - score_b) > 1e-9:
                    break
            chosen, rejected = (a, b) if score_a > score_b else (b, a)
            rows.append({"prompt": scene.text(), "chosen": chosen, "rejected": rejected,
                         "metadata": {"category": scene.category, "scores": [max(score_a, score_b), min(score_a, score_b)]}})
        return rows

    splits = {"train": pairs(train_scenes, num_train, pairs_per_prompt), "held_out": pairs(held_scenes, num_held_out, 1)}
    flip_labels(splits["train"], flip, np.random.RandomState(seed + 11))
    kind = "image_set" if set_size else "image"
    extra = {"source": "shapes", "size": size, "pairs_per_prompt": pairs_per_prompt, "held_out_prompts": held_out_prompts, "render_seed": render_seed, "set_size": set_size, "flip": flip, "pixel_noise": pixel_noise, "seed": seed}
    return write_preferences(out, kind, splits, images, **extra)


# ---------------------------------------------------------------- a policy's samples
