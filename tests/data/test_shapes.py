"""The shapes world: grammar and prompts, the compositional held-out split, the prompt-set
files, deliberately wrong scenes and the seeded renderer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from mmrl.config import from_dict
from mmrl.data.prompts import PromptData, PromptDataConfig
from mmrl.tasks.shapes.world import (
    CATEGORIES,
    COLOURS,
    MISTAKES,
    SHAPES,
    ObjectGroup,
    Scene,
    all_scenes,
    held_out_combinations,
    layout,
    mistaken_scene,
    parse_prompt,
    render_scene,
    split_scenes,
    write_prompt_sets,
)
from mmrl.errors import MissingExtraError
from tests.conftest import ROOT

RED_CIRCLES_ABOVE_BLUE_SQUARE = Scene((ObjectGroup(2, "red", "circle"), ObjectGroup(1, "blue", "square")), "above")


def test_every_scene_of_the_grammar_reads_back_from_its_prompt():
    scenes = list(all_scenes())
    assert Counter(s.category for s in scenes) == {"single": 18, "count": 36, "colour": 918, "position": 3672}
    assert all(parse_prompt(s.text()) == s for s in scenes)
    assert all(Scene.from_dict(json.loads(json.dumps(s.to_dict()))) == s for s in scenes)
    assert RED_CIRCLES_ABOVE_BLUE_SQUARE.text() == "two red circles above a blue square"


def test_the_parser_reads_variants_and_rejects_what_the_grammar_does_not_allow():
    assert parse_prompt("Two red circles to the left of a blue square.") == Scene(
        (ObjectGroup(2, "red", "circle"), ObjectGroup(1, "blue", "square")), "left of"
    )
    assert parse_prompt("  3 green triangles ") == Scene((ObjectGroup(3, "green", "triangle"),))
    assert parse_prompt("one cyan square and a purple circle").relation is None
    for text, why in [
        ("a dog", "not a shapes prompt"),
        ("four red circles", "not a shapes prompt"),
        ("two red circles above", "not a shapes prompt"),
        ("a red circle and a red circle", "must differ"),
        ("two red circles above two blue squares", "at most 3 objects"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_prompt(text)
    with pytest.raises(ValueError, match="unknown colour 'pink'"):
        Scene.from_dict({"groups": [{"count": 1, "colour": "pink", "shape": "circle"}], "relation": None})
    with pytest.raises(ValueError, match="a relation needs two object groups"):
        Scene.from_dict({"groups": [{"count": 1, "colour": "red", "shape": "circle"}], "relation": "above"})
    with pytest.raises(ValueError, match="a scene is"):
        Scene.from_dict({"objects": []})


def test_held_out_prompts_combine_known_words_in_combinations_training_never_sees():
    held = held_out_combinations(0.2, seed=0)
    assert len(held) == round(0.2 * len(COLOURS) * len(SHAPES) * 3)
    train, held_out = split_scenes(0.2, seed=0)
    assert len(train) + len(held_out) == len(list(all_scenes()))
    assert all(any((g.colour, g.shape, g.count) in held for g in s.groups) for s in held_out)
    seen = {(g.colour, g.shape, g.count) for s in train for g in s.groups}
    assert not seen & held
    assert {c for c, _, _ in seen} == set(COLOURS) and {s for _, s, _ in seen} == set(SHAPES) and {n for _, _, n in seen} == {1, 2, 3}
    assert {(c, s) for c, s, _ in seen} == {(c, s) for c in COLOURS for s in SHAPES}
    assert {s.category for s in held_out} == set(CATEGORIES)
    assert split_scenes(0.2, seed=0) == (train, held_out)
    assert held_out_combinations(0.2, seed=1) != held
    with pytest.raises(ValueError, match="held-out fraction must be in"):
        held_out_combinations(1.0, seed=0)


def test_prompt_sets_are_jsonl_records_the_prompt_sampler_reads(tmp_path):
    counts = write_prompt_sets(tmp_path, seed=3, num_train=40, num_eval=20)
    assert counts == {"train": 40, "eval": 20}
    data = PromptData.load(from_dict(PromptDataConfig, {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")}))
    assert data.kind == "text" and len(data.train) == 40 and len(data.held_out) == 20
    assert Counter(r.metadata["category"] for r in data.train) == {c: 10 for c in CATEGORIES}
    for record in data.train + data.held_out:
        assert Scene.from_dict(record.metadata["scene"]) == parse_prompt(record.prompt)
        assert record.answer is None
    assert not {r.prompt for r in data.train} & {r.prompt for r in data.held_out}


def test_the_command_line_writes_the_prompt_sets(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mmrl.tasks.shapes.world", "--out", tmp_path / "shapes", "--num-train", "12", "--num-eval", "8"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 12 train and 8 held-out prompts" in proc.stdout
    lines = (tmp_path / "shapes" / "train.jsonl").read_text().splitlines()
    assert len(lines) == 12 and set(json.loads(lines[0])) == {"prompt", "metadata"}


def test_a_mistaken_scene_differs_from_the_prompt_in_exactly_the_named_way():
    scene = RED_CIRCLES_ABOVE_BLUE_SQUARE
    for seed in range(20):
        extra, missing = mistaken_scene(scene, "extra object", seed), mistaken_scene(scene, "missing object", seed)
        assert len(extra.objects()) == 4 and len(missing.objects()) == 2
        assert set(missing.objects()) <= set(scene.objects()) and set(extra.objects()) == set(scene.objects())
        colour, shape = mistaken_scene(scene, "wrong colour", seed), mistaken_scene(scene, "wrong shape", seed)
        for wrong, kept in ((colour, lambda g: g.shape), (shape, lambda g: g.colour)):
            changed = [(a, b) for a, b in zip(scene.groups, wrong.groups) if a != b]
            assert len(changed) == 1 and kept(changed[0][0]) == kept(changed[0][1])
            assert wrong.groups[0].key != wrong.groups[1].key and wrong.relation == "above"
    assert mistaken_scene(scene, "swapped position", 0) == Scene(scene.groups, "below")
    assert mistaken_scene(Scene((ObjectGroup(2, "red", "circle"),)), "swapped position", 0) is None
    assert mistaken_scene(Scene((ObjectGroup(1, "red", "circle"),)), "missing object", 0).objects() == []
    with pytest.raises(ValueError, match="unknown mistake"):
        mistaken_scene(scene, "upside down", 0)


@pytest.mark.parametrize("size", [32, 64])
def test_layouts_keep_objects_inside_apart_and_on_the_side_their_relation_names(size):
    # box = (x0, y0, x1, y1), y grows downwards; group 0's box must clear group 1's by 3 px
    clear = {
        "above": lambda a, b: a[3] + 3 <= b[1],
        "below": lambda a, b: b[3] + 3 <= a[1],
        "left of": lambda a, b: a[2] + 3 <= b[0],
        "right of": lambda a, b: b[2] + 3 <= a[0],
    }
    three_objects = [s for s in all_scenes() if s.category == "position" and len(s.objects()) == 3]
    for seed, scene in enumerate(three_objects[::23]):
        boxes = [p.box() for p in layout(scene, size, np.random.RandomState(seed))]
        assert all(0 <= b[0] and 0 <= b[1] and b[2] <= size - 1 and b[3] <= size - 1 for b in boxes)
        for i in range(3):
            for j in range(i + 1, 3):
                a, b = boxes[i], boxes[j]
                assert a[2] + 3 <= b[0] or b[2] + 3 <= a[0] or a[3] + 3 <= b[1] or b[3] + 3 <= a[1]
        n0 = scene.groups[0].count
        assert all(clear[scene.relation](a, b) for a in boxes[:n0] for b in boxes[n0:])


def test_rendering_is_seeded_and_draws_the_objects_in_their_colours():
    scene = RED_CIRCLES_ABOVE_BLUE_SQUARE
    image = render_scene(scene, 32, seed=5)
    assert image.dtype == np.uint8 and image.shape == (32, 32, 3)
    assert np.array_equal(image, render_scene(scene, 32, seed=5))
    assert not np.array_equal(image, render_scene(scene, 32, seed=6))
    assert render_scene(scene, 64, seed=5).shape == (64, 64, 3)
    pixels = image.reshape(-1, 3).astype(int)
    saturated = pixels[pixels.max(1) - pixels.min(1) > 100]
    reddish = (saturated[:, 0] > saturated[:, 2]).sum()
    assert reddish > 0 and len(saturated) - reddish > 0  # red circles and a blue square on grey
    four = render_scene(mistaken_scene(Scene((ObjectGroup(3, "green", "triangle"),)), "extra object", 0), 32, seed=0)
    assert four.shape == (32, 32, 3)


def test_rendering_without_opencv_names_the_image_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` now raises ImportError
    with pytest.raises(MissingExtraError, match=r"mmrl\[image\]"):
        render_scene(RED_CIRCLES_ABOVE_BLUE_SQUARE, 32, seed=0)
