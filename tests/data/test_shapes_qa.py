"""Questions about rendered shapes scenes: exact answers, the written prompt sets and their split."""

import json

import numpy as np
import pytest

from mmrl.tasks.shapes.world import COLOURS, SHAPES, Scene, all_scenes, parse_prompt, render_scene
from mmrl.tasks.shapes_qa.world import CATEGORIES, main, questions


def test_questions_have_the_answers_the_scene_implies():
    scene = parse_prompt("two red circles above a blue square")
    asked = {(q["category"], q["question"]): q["answer"] for q in questions(scene)}
    assert asked == {
        ("count", "How many circles are in the image?"): "2",
        ("count", "How many squares are in the image?"): "1",
        ("colour", "What colour are the circles?"): "red",
        ("colour", "What colour is the square?"): "blue",
        ("shape", "What shape are the red objects?"): "circle",
        ("shape", "What shape is the blue object?"): "square",
        ("position", "Are the red circles above or below the blue square?"): "above",
    }
    # a shape in two groups has no single colour, a colour in two groups no single shape
    shared = {(q["category"], q["answer"]) for q in questions(parse_prompt("a red circle left of a blue circle"))}
    assert shared == {("count", "2"), ("shape", "circle"), ("position", "left")}
    assert {(q["category"], q["answer"]) for q in questions(parse_prompt("a green triangle and a green square"))} == {
        ("count", "1"), ("colour", "green")
    }


def test_every_scene_has_count_colour_or_shape_questions_whose_answers_are_words_of_the_world():
    allowed = {"count": {"1", "2", "3"}, "colour": set(COLOURS), "shape": set(SHAPES), "position": {"above", "below", "left", "right"}}
    for scene in all_scenes():
        asked = questions(scene)
        assert {q["category"] for q in asked} >= {"count"} and len({q["question"] for q in asked}) == len(asked)
        assert all(q["answer"] in allowed[q["category"]] for q in asked)
        assert any(q["category"] == "position" for q in asked) == (scene.relation is not None)
        total = {s: sum(g.count for g in scene.groups if g.shape == s) for s in SHAPES}
        assert all(q["answer"] == str(total[q["question"].split()[2][:-1]]) for q in asked if q["category"] == "count")


def test_the_writer_renders_each_scene_once_and_holds_out_unseen_combinations(tmp_path, capsys):
    pytest.importorskip("cv2")
    pytest.importorskip("PIL")
    from PIL import Image

    assert main(["--out", str(tmp_path), "--num-train", "12", "--num-eval", "4"]) == 0
    assert "train and" in capsys.readouterr().out
    splits = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()] for name in ("train", "held_out")}
    scenes = {name: {r["scene_id"] for r in rows} for name, rows in splits.items()}
    assert len(scenes["train"]) == 12 and len(scenes["held_out"]) == 4 and not scenes["train"] & scenes["held_out"]
    assert {r["category"] for r in splits["train"]} == set(CATEGORIES)
    ordered = list(all_scenes())
    for rows in splits.values():
        for r in rows:
            scene = Scene.from_dict(r["scene"])
            assert ordered[r["scene_id"]] == scene and r["completion"] == r["answer"]
            assert r["image"] == f"images/{r['scene_id']:05d}.png" and {"prompt": r["prompt"], "answer": r["answer"], "category": r["category"]} in [
                {"prompt": q["question"], "answer": q["answer"], "category": q["category"]} for q in questions(scene)
            ]
            image = np.asarray(Image.open(tmp_path / r["image"]))
            assert np.array_equal(image, render_scene(scene, size=32, seed=r["scene_id"]))  # lossless PNG of the seeded render
    seen_combos = {(g["colour"], g["shape"], g["count"]) for r in splits["train"] for g in r["scene"]["groups"]}
    assert all(any((g["colour"], g["shape"], g["count"]) not in seen_combos for g in r["scene"]["groups"]) for r in splits["held_out"])
