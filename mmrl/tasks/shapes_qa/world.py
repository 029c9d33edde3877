"""Questions about rendered shapes scenes, with exact answers: prompt sets for vision-language RL.

Each scene of the shapes world (:mod:`mmrl.tasks.shapes.world`) is rendered once and asked every
question that has one exact answer in it; a record is the question, its answer, the image and
the metadata::

    image: images/00412.png   (two red circles above a blue square)
    count     How many circles are in the image?                -> 2
    colour    What colour are the circles?                      -> red
    shape     What shape is the blue object?                    -> square
    position  Are the red circles above or below the blue square? -> above

- ``count``: for each shape in the scene, how many objects have it (1–3).
- ``colour``: for each shape that only one object group has, that group's colour.
- ``shape``: for each colour that only one object group has, that group's shape.
- ``position``: for scenes with a relation, where group 0 lies relative to group 1
  (``above`` / ``below``, or ``left`` / ``right``).

``metadata.category`` is the question type (the key ``mmrl eval`` breaks accuracy down by),
``metadata.scene`` the scene (:meth:`~mmrl.tasks.shapes.world.Scene.to_dict`) and
``metadata.scene_id`` its index in :func:`~mmrl.tasks.shapes.world.all_scenes`, which also seeds its
rendering. Train and held-out scenes are the shapes world's compositional split
(:func:`~mmrl.tasks.shapes.world.split_scenes`): held-out images show (colour, shape, count)
combinations never seen in training. Each record's ``completion`` is its answer, the target of
supervised fine-tuning.

    python -m mmrl.tasks.shapes_qa.world --out data/shapes_qa [--num-train 400 --num-eval 100 --size 32 --seed 0]

writes ``images/*.png``, ``train.jsonl`` and ``held_out.jsonl``; ``--num-train`` / ``--num-eval``
cap the scenes of a split (balanced over the scene categories). Rendering needs the ``image``
extra (OpenCV), writing PNGs Pillow.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mmrl.tasks.shapes.world import Scene, all_scenes, balanced, render_scene, split_scenes

CATEGORIES: tuple[str, ...] = ("count", "colour", "shape", "position")


def _phrase(colour: str | None, shape: str | None, count: int) -> str:
    """'the red circle', 'the circles', 'the blue objects'."""
    noun = shape or "object"
    return " ".join(w for w in ("the", colour, noun + ("s" if count > 1 else "")) if w)


def questions(scene: Scene) -> list[dict[str, str]]:
    """Every question with one exact answer about ``scene``: ``{"category", "question", "answer"}``."""
    groups = scene.groups
    out = []
    shapes = list(dict.fromkeys(g.shape for g in groups))
    for shape in shapes:
        total = sum(g.count for g in groups if g.shape == shape)
        out.append({"category": "count", "question": f"How many {shape}s are in the image?", "answer": str(total)})
    for shape in shapes:
        having = [g for g in groups if g.shape == shape]
        if len(having) == 1:
            verb = "are" if having[0].count > 1 else "is"
            out.append({"category": "colour", "question": f"What colour {verb} {_phrase(None, shape, having[0].count)}?", "answer": having[0].colour})
    for colour in dict.fromkeys(g.colour for g in groups):
        having = [g for g in groups if g.colour == colour]
        if len(having) == 1:
            verb = "are" if having[0].count > 1 else "is"
            out.append({"category": "shape", "question": f"What shape {verb} {_phrase(colour, None, having[0].count)}?", "answer": having[0].shape})
    if scene.relation is not None:
        first, second = (_phrase(g.colour, g.shape, g.count) for g in groups)
        verb = "Are" if groups[0].count > 1 else "Is"
        if scene.relation in ("above", "below"):
            question, answer = f"{verb} {first} above or below {second}?", scene.relation
        else:
            question, answer = f"{verb} {first} left or right of {second}?", scene.relation.removesuffix(" of")
        out.append({"category": "position", "question": question, "answer": answer})
    return out


def records(scene: Scene, scene_id: int, image: str) -> list[dict[str, Any]]:
    """The JSONL records of a scene's questions, as the prompt sampler reads them."""
    meta = {"scene": scene.to_dict(), "scene_id": scene_id}
    return [{"prompt": q["question"], "answer": q["answer"], "completion": q["answer"], "image": image, "category": q["category"], **meta} for q in questions(scene)]


def write_prompt_sets(out_dir: str | Path, *, size: int = 32, held_out_fraction: float = 0.2, seed: int = 0, num_train: int | None = None, num_eval: int | None = None) -> dict[str, int]:
    """Render the scenes of the split (capped per split by :func:`~mmrl.tasks.shapes.world.balanced`)
    into ``out_dir/images`` and write ``train.jsonl`` and ``held_out.jsonl``; returns the number
    of records (questions) of each."""
    from PIL import Image

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    ids = {scene: i for i, scene in enumerate(all_scenes())}
    train, held_out = split_scenes(held_out_fraction, seed)
    counts = {}
    for name, scenes in (("train", balanced(train, num_train)), ("held_out", balanced(held_out, num_eval))):
        rows = []
        for scene in scenes:
            scene_id = ids[scene]
            image = f"images/{scene_id:05d}.png"
            Image.fromarray(render_scene(scene, size=size, seed=scene_id)).save(out / image)
            rows += records(scene, scene_id, image)
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        counts[name] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.shapes_qa.world", description="Write questions about rendered shapes scenes, with their images and answers (train and held-out JSONL).")
    parser.add_argument("--out", required=True, help="output directory (images/, train.jsonl, held_out.jsonl)")
    parser.add_argument("--size", type=int, default=32, help="side of the rendered images (pixels)")
    parser.add_argument("--held-out-fraction", type=float, default=0.2, help="fraction of (colour, shape, count) combinations whose scenes are held out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the scene order")
    parser.add_argument("--num-train", type=int, default=None, help="at most this many train scenes, balanced over scene categories (default: all)")
    parser.add_argument("--num-eval", type=int, default=None, help="at most this many held-out scenes (default: all)")
    args = parser.parse_args(argv)
    if args.size < 16:
        parser.error(f"--size {args.size}: images need at least 16 pixels a side for the objects to fit")
    try:
        counts = write_prompt_sets(args.out, size=args.size, held_out_fraction=args.held_out_fraction, seed=args.seed, num_train=args.num_train, num_eval=args.num_eval)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {counts['train']} train and {counts['held_out']} held-out questions to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
