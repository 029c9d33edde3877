"""The shapes_geneval verifier: accepts rendered ground truth, rejects deliberately wrong
images, scores criteria in partial mode, reads the scene from metadata or the prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.tasks.shapes.world import CATEGORIES, MISTAKES, ObjectGroup, Scene, all_scenes, draw, layout, mistaken_scene, render_scene
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.tasks.shapes.rewards import UNRECOGNISED, ShapesGenevalConfig, detect_shapes

DEFAULTS = ShapesGenevalConfig()
BY_CATEGORY = {c: [s for s in all_scenes() if s.category == c] for c in CATEGORIES}


def scenes_across_the_grammar(n: int, seed: int) -> list[Scene]:
    """n scenes, the categories in turn, each drawn uniformly within its category."""
    rng = np.random.RandomState(seed)
    return [BY_CATEGORY[c][rng.randint(len(BY_CATEGORY[c]))] for c in (CATEGORIES[k % 4] for k in range(n))]


def detect(image: np.ndarray):
    return detect_shapes(image, min_chroma=DEFAULTS.min_chroma, min_area=DEFAULTS.min_area, min_fill=DEFAULTS.min_fill)


def verify(scenes, images, *, metadata: bool = True, prompts=None, **options) -> torch.Tensor:
    n = len(scenes)
    info = {
        "images": torch.from_numpy(np.stack(images)),
        "prompt": prompts if prompts is not None else [s.text() for s in scenes],
        "metadata": [{"category": s.category, "scene": s.to_dict()} if metadata else {} for s in scenes],
        "record_id": torch.arange(n) + 100,
    }
    rollout = Rollout(group_id=torch.arange(n), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info=info)
    cfg = from_dict(REWARDS.entry("shapes_geneval").config, {"type": "shapes_geneval", **options})
    return build_reward(cfg, RewardContext())(rollout)


@pytest.mark.parametrize("size, n", [(32, 240), (64, 160)])
def test_the_verifier_accepts_rendered_ground_truth(size, n):
    # benchmarks/shapes_verifier.py: 2000 of 2000 at each size
    scenes = scenes_across_the_grammar(n, seed=size)
    accepted = verify(scenes, [render_scene(s, size, seed=k) for k, s in enumerate(scenes)])
    assert accepted.mean().item() >= 0.99
    assert set(accepted.tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_the_verifier_rejects_images_of_deliberately_wrong_scenes(mistake):
    # benchmarks/shapes_verifier.py: 0 accepted of 8,500 at each size
    pairs = [(s, mistaken_scene(s, mistake, k)) for k, s in enumerate(scenes_across_the_grammar(160, seed=7))]
    pairs = [(s, wrong) for s, wrong in pairs if wrong is not None]
    assert len(pairs) >= 40
    accepted = verify([s for s, _ in pairs], [render_scene(wrong, 32, seed=k) for k, (_, wrong) in enumerate(pairs)])
    assert accepted.mean().item() <= 0.01


def test_partial_mode_scores_the_fraction_of_criteria_met():
    pair = Scene((ObjectGroup(1, "yellow", "square"), ObjectGroup(2, "blue", "circle")))
    above = Scene((ObjectGroup(2, "red", "circle"), ObjectGroup(1, "blue", "square")), "above")
    wrong_colour = Scene((ObjectGroup(1, "green", "square"), ObjectGroup(2, "blue", "circle")))
    images = [render_scene(pair, 64, 0), render_scene(wrong_colour, 64, 1), render_scene(Scene(above.groups, "below"), 64, 2), render_scene(above, 64, 3)]
    scenes = [pair, pair, above, above]
    # a wrong colour keeps the count (1 of 2 criteria); the swapped relation keeps count and colour (2 of 3)
    assert verify(scenes, images, mode="partial").tolist() == pytest.approx([1.0, 0.5, 2 / 3, 1.0])
    assert verify(scenes, images).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_objects_mode_scores_the_matched_fraction_of_objects():
    three = Scene((ObjectGroup(3, "purple", "triangle"),))
    one_off = Scene((ObjectGroup(2, "purple", "triangle"), ObjectGroup(1, "purple", "square")))
    above = Scene((ObjectGroup(2, "red", "circle"), ObjectGroup(1, "blue", "square")), "above")
    images = [render_scene(three, 64, 0), render_scene(one_off, 64, 1), render_scene(Scene((ObjectGroup(2, "purple", "triangle"),)), 64, 2),
              render_scene(Scene((ObjectGroup(4, "purple", "triangle"),)), 64, 3), render_scene(Scene((ObjectGroup(3, "green", "circle"),)), 64, 4),
              render_scene(Scene(above.groups, "below"), 64, 5), render_scene(above, 64, 6)]
    scenes = [three] * 5 + [above] * 2
    # a square for a triangle: 2 of 3; one missing: 2 of 3; one extra: 3 of 4; none right: 0;
    # all objects right but the relation swapped: (1 + 0) / 2
    assert verify(scenes, images, mode="objects").tolist() == pytest.approx([1.0, 2 / 3, 2 / 3, 3 / 4, 0.0, 0.5, 1.0])
    assert verify(scenes, images).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_the_scene_comes_from_the_record_metadata_and_else_from_the_prompt_text():
    shown = Scene((ObjectGroup(3, "cyan", "triangle"),))
    other = Scene((ObjectGroup(2, "cyan", "triangle"),))
    images = [render_scene(shown, 32, 4)] * 2
    # the metadata wins over a prompt text that disagrees with it
    assert verify([shown, other], images, prompts=[other.text(), shown.text()]).tolist() == [1.0, 0.0]
    # without metadata the prompt text is parsed
    assert verify([shown, shown], images, metadata=False, prompts=[shown.text(), other.text()]).tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError, match=r"record 101 is not a shapes scene: 'a photo of a dog' is not a shapes prompt"):
        verify([shown, shown], images, metadata=False, prompts=[shown.text(), "a photo of a dog"])
    rollout = Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"images": torch.from_numpy(images[0][None])})
    with pytest.raises(ConfigError, match="sampler.type: prompt"):
        build_reward(from_dict(REWARDS.entry("shapes_geneval").config, {"type": "shapes_geneval"}), RewardContext())(rollout)


def test_detections_name_each_objects_colour_shape_and_box():
    scene = Scene((ObjectGroup(1, "purple", "triangle"), ObjectGroup(2, "green", "square")), "right of")
    placed = layout(scene, 64, np.random.RandomState(0))
    found = detect(draw(placed, 64, background=200))
    assert sorted((d.colour, d.shape) for d in found) == sorted(scene.objects())
    for p in placed:
        (d,) = [d for d in found if (d.colour, d.shape) == (p.colour, p.shape) and abs(d.centre[0] - (p.box()[0] + p.box()[2]) / 2) < 2]
        x0, y0, x1, y1 = p.box()
        assert abs(d.box[0] - x0) <= 1.5 and abs(d.box[1] - y0) <= 1.5
        assert abs(d.box[0] + d.box[2] - x1) <= 1.5 and abs(d.box[1] + d.box[3] - y1) <= 1.5


def test_specks_are_ignored_but_an_unrecognised_blob_is_an_extra_object():
    scene = Scene((ObjectGroup(1, "red", "circle"),))
    image = render_scene(scene, 64, seed=1)
    specked = image.copy()
    specked[0:2, 0:2] = (255, 0, 0)  # 4 pixels, under min_area (1% of 4096)
    cross = image.copy()
    cross[40:44, 2:22] = cross[32:52, 10:14] = (0, 0, 255)  # a blue plus sign, no circle/square/triangle
    assert UNRECOGNISED in {d.shape for d in detect(cross)}
    assert verify([scene] * 3, [image, specked, cross]).tolist() == [1.0, 1.0, 0.0]


def test_objects_of_one_colour_touching_only_at_a_corner_stay_two_objects():
    image = np.full((40, 40, 3), 128, dtype=np.uint8)
    image[8:18, 8:18] = image[18:28, 18:28] = (230, 20, 20)  # two red squares meeting corner to corner
    assert [(d.colour, d.shape) for d in detect(image)] == [("red", "square")] * 2
