"""The ``ocr`` reward (Flow-GRPO's text-rendering reward) with the real PP-OCRv4 model of
rapidocr-onnxruntime, on words rendered by OpenCV into images of the sizes mmrl's image
policies make (uint8 [B, H, W, 3], RGB; the shapes world's are 32×32 and 64×64)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import cv2
import numpy as np
import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import REWARDS
from mmrl.rewards.ocr import levenshtein, normalize_text, ocr_text_score, quoted_text
from tests.conftest import ROOT

SIMPLEX, DUPLEX, COMPLEX, TRIPLEX, PLAIN = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX, cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_PLAIN)
BLACK_ON_WHITE = ((0, 0, 0), (255, 255, 255))
RED_ON_CREAM = ((200, 30, 30), (240, 240, 200))
WHITE_ON_BLUE = ((255, 255, 255), (30, 60, 150))


def render(lines: str | list[str], size: int, font: int = SIMPLEX, colours=BLACK_ON_WHITE, width: float = 0.85) -> np.ndarray:
    """An RGB uint8 [size, size, 3] image with each line centred, the widest ``width`` × size
    wide, strokes as thick as the font scale (OpenCV's Hershey fonts)."""
    lines = [lines] if isinstance(lines, str) else lines
    fg, bg = colours
    image = np.full((size, size, 3), bg, dtype=np.uint8)
    scale = width * size / max(cv2.getTextSize(line, font, 1.0, 1)[0][0] for line in lines)
    thickness = max(1, round(scale))
    height = cv2.getTextSize(lines[0], font, scale, thickness)[0][1]
    gap = height // 2
    top = (size - len(lines) * height - (len(lines) - 1) * gap) // 2
    for k, line in enumerate(lines):
        w = cv2.getTextSize(line, font, scale, thickness)[0][0]
        cv2.putText(image, line, ((size - w) // 2, top + (k + 1) * height + k * gap), font, scale, fg, thickness, cv2.LINE_AA)
    return image


def image_rollout(images: np.ndarray, prompts: list[str], metadata: list[dict] | None = None) -> Rollout:
    n = len(images)
    info = {"images": torch.from_numpy(np.ascontiguousarray(images)), "prompt": prompts, "metadata": metadata or [{} for _ in range(n)], "record_id": list(range(n))}
    return Rollout(group_id=torch.zeros(n, dtype=torch.long), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info=info)


def ocr_reward(**options):
    return build_reward(from_dict(REWARDS.entry("ocr").config, {"type": "ocr", **options}), RewardContext())


@pytest.fixture(scope="module")
def reward():
    """One reward (one PP-OCRv4 engine) for the tests that read images."""
    return ocr_reward()


# ---------------------------------------------------------------- the formula, no model


@pytest.mark.parametrize(("a", "b", "distance"), [
    ("kitten", "sitting", 3),  # k→s, e→i, +g
    ("sitting", "kitten", 3),
    ("flaw", "lawn", 2),  # −f, +n
    ("robust", "robot", 2),  # u→o, −s
    ("gumbo", "gambol", 2),  # u→a, +l
    ("", "abc", 3),
    ("abc", "", 3),
    ("", "", 0),
    ("hello", "hello", 0),
    ("abc", "xyz", 3),
    ("ab", "ba", 2),  # no transpositions: two substitutions
])
def test_levenshtein_matches_hand_computed_distances(a, b, distance):
    assert levenshtein(a, b) == distance


def test_normalization_removes_spaces_and_lower_cases_as_flow_grpo():
    assert normalize_text("Hello World") == "helloworld"
    assert normalize_text("  A B  c ") == "abc"
    # only the space character, as Flow-GRPO's replace(' ', '')
    assert normalize_text("Tab\tNew\nLine") == "tab\tnew\nline"


def test_score_is_one_minus_capped_distance_over_target_length():
    assert ocr_text_score("robust", "robot") == pytest.approx(1 - 2 / 5)
    assert ocr_text_score("sitting", "kitten") == pytest.approx(1 - 3 / 6)
    assert ocr_text_score("Hello World", "hello world") == 1.0  # normalized on both sides
    assert ocr_text_score("HELLOWORLD", "Hello World") == 1.0
    assert ocr_text_score("", "robot") == 0.0  # nothing read: d = len(target)
    # many unrelated characters: the distance is capped at the target's length, never below 0
    assert ocr_text_score("abcdefghijklmnop", "cat") == 0.0
    assert ocr_text_score("xyz", "cat") == 0.0


def test_text_around_the_target_scores_one_unless_containment_is_off():
    assert ocr_text_score("The ROBOT here", "robot") == 1.0
    assert levenshtein("therobothere", "robot") == 7
    assert ocr_text_score("therobothere", "robot", contains=False) == 0.0  # d = 7, capped at 5
    assert ocr_text_score("robots", "robot", contains=False) == pytest.approx(1 - 1 / 5)


def test_an_empty_target_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        ocr_text_score("abc", "   ")


def test_the_target_is_the_text_between_the_first_double_quotes():
    assert quoted_text('New York Skyline with "Hello World" written with fireworks') == "Hello World"
    assert quoted_text('a sign "one" and "two"') == "one"
    assert quoted_text("a sign that says hello") is None


class FakeEngine:
    """Lines as RapidOCR returns them: [box, text, confidence], in reading order."""

    def __init__(self, lines):
        self.lines = lines

    def __call__(self, image):
        return self.lines, [0.0]


def test_min_confidence_drops_lines_below_it_and_confidence_zero_always():
    lines = [[[[0, 0]] * 4, "hel", 0.9], [[[0, 0]] * 4, "lo", 0.3], [[[0, 0]] * 4, "x", 0.0]]
    image = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    for floor, expected in [(0.5, "hel"), (0.3, "hello"), (0.0, "hello"), (0.95, "")]:
        reward = ocr_reward(min_confidence=floor)
        reward._engine = FakeEngine(lines)
        assert reward.read(image) == [expected]
    nothing = ocr_reward()
    nothing._engine = FakeEngine(None)
    assert nothing.read(image) == [""]


def test_targets_come_from_the_metadata_field_else_the_quoted_prompt_text():
    images = np.zeros((3, 8, 8, 3), dtype=np.uint8)
    prompts = ['a poster that says "Flow GRPO"', "a neon sign", 'a "quoted" sign']
    metadata = [{}, {"text": "tiger"}, {"word": "lemon"}]
    rollout = image_rollout(images, prompts, metadata)
    assert ocr_reward().targets(rollout) == ["Flow GRPO", "tiger", "quoted"]
    assert ocr_reward(target_field="word").targets(image_rollout(images[[0, 2]], [prompts[0], prompts[2]], [metadata[0], metadata[2]])) == ["Flow GRPO", "lemon"]
    with pytest.raises(ConfigError, match="record 1"):
        ocr_reward(target_field=None).targets(rollout)
    with pytest.raises(ConfigError, match="sampler.type: prompt"):
        ocr_reward().targets(Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"images": torch.zeros(1, 8, 8, 3, dtype=torch.uint8)}))


def test_images_must_be_uint8_rgb(reward):
    with pytest.raises(ConfigError, match="images"):
        reward(Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"prompt": ['"a"']}))
    rollout = image_rollout(np.zeros((1, 8, 8, 3), dtype=np.uint8), ['"a"'])
    rollout.info["images"] = rollout.info["images"].float()
    with pytest.raises(ValueError, match="uint8"):
        reward(rollout)


def test_missing_package_is_a_missing_extra_error_naming_ocr(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import raises ImportError
    with pytest.raises(MissingExtraError, match=r"mmrl\[ocr\]") as err:
        ocr_reward()
    assert err.value.extra == "ocr"
    assert "rapidocr-onnxruntime" in str(err.value)


# ---------------------------------------------------------------- the real PP-OCRv4 model

CLEAR = [  # (word, size, font, colours): each read exactly when measured
    ("robot", 64, SIMPLEX, BLACK_ON_WHITE),
    ("hello", 64, DUPLEX, RED_ON_CREAM),
    ("tiger", 64, COMPLEX, WHITE_ON_BLUE),
    ("water", 128, TRIPLEX, BLACK_ON_WHITE),
    ("ocean", 128, SIMPLEX, RED_ON_CREAM),
    ("robot", 128, PLAIN, WHITE_ON_BLUE),
    ("hello", 256, COMPLEX, BLACK_ON_WHITE),
    ("lemon", 256, DUPLEX, WHITE_ON_BLUE),
]


def test_the_model_reads_clearly_rendered_words_and_the_reward_is_one(reward):
    images = np.stack([render(word, size, font, colours) for word, size, font, colours in CLEAR if size == 64])
    words = [word for word, size, *_ in CLEAR if size == 64]
    assert [normalize_text(t) for t in reward.read(images)] == words
    for size in (128, 256):
        chosen = [(w, f, c) for w, s, f, c in CLEAR if s == size]
        images = np.stack([render(w, size, f, c) for w, f, c in chosen])
        prompts = [f'a sign that says "{w.upper()}"' for w, _, _ in chosen]
        assert reward(image_rollout(images, prompts)).tolist() == [1.0] * len(chosen)


def test_a_small_render_still_scores_high(reward):
    # words half the image wide at 64×64 (letters ~8 pixels tall): measured 147 of 150 read
    # exactly, the others one letter off (0.8); these read exactly
    images = np.stack([render(w, 64, f, c, width=0.5) for w, f, c in [("robot", DUPLEX, BLACK_ON_WHITE), ("tiger", SIMPLEX, RED_ON_CREAM), ("water", COMPLEX, WHITE_ON_BLUE)]])
    scores = reward(image_rollout(images, ['"robot"', '"tiger"', '"water"']))
    assert scores.min().item() >= 0.8


def test_two_lines_are_read_in_order_and_concatenated(reward):
    image = render(["hello", "world"], 256, DUPLEX)
    assert normalize_text(reward.read(image[None])[0]) == "helloworld"
    assert reward(image_rollout(image[None], ['a card that says "Hello World"'])).item() == 1.0
    assert reward(image_rollout(image[None], ['"world hello"'])).item() == pytest.approx(1 - levenshtein("helloworld", "worldhello") / 10)


def test_another_word_scores_by_the_edit_distance(reward):
    words = ["robust", "robots", "rocket", "tiger"]
    images = np.stack([render("robust", 128, DUPLEX), render("robots", 128, SIMPLEX), render("rocket", 128, TRIPLEX, RED_ON_CREAM), render("tiger", 128, COMPLEX)])
    read = [normalize_text(t) for t in reward.read(images)]
    assert read == words
    rollout = image_rollout(images, ['a sign that says "Robot"'] * 4)
    scores = reward(rollout).tolist()
    # robust → robot: u→o, −s (2 of 5); "robots" contains "robot"; rocket → robot: c→b, k→o, −e
    # (3 of 5); tiger → robot: 5 substitutions (5 of 5)
    assert scores == pytest.approx([1 - 2 / 5, 1.0, 1 - 3 / 5, 0.0])
    assert scores == pytest.approx([1.0 if "robot" in s else 1 - min(levenshtein(s, "robot"), 5) / 5 for s in read])
    plain = ocr_reward(contains=False)
    plain._engine = reward.engine
    assert plain(rollout).tolist() == pytest.approx([0.6, 0.8, 0.4, 0.0])


@pytest.mark.parametrize("size", [64, 128, 256])
def test_a_blank_image_scores_zero(reward, size):
    blanks = np.stack([np.full((size, size, 3), v, dtype=np.uint8) for v in (255, 0, 128)] + [np.full((size, size, 3), (30, 60, 150), dtype=np.uint8)])
    assert reward.read(blanks) == [""] * 4
    assert reward(image_rollout(blanks, ['"robot"'] * 4)).tolist() == [0.0] * 4


def test_a_batch_scores_what_each_image_scores_alone(reward):
    images = np.stack([render("robot", 128, SIMPLEX), render("robust", 128, DUPLEX, RED_ON_CREAM), np.full((128, 128, 3), 255, dtype=np.uint8), render("water", 128, COMPLEX, WHITE_ON_BLUE)])
    prompts = ['"robot"', '"robot"', '"robot"', 'the word "Water"']
    batch = reward(image_rollout(images, prompts))
    alone = torch.cat([reward(image_rollout(images[i : i + 1], prompts[i : i + 1])) for i in range(len(images))])
    assert torch.equal(batch, alone)
    assert batch.tolist() == pytest.approx([1.0, 0.6, 0.0, 1.0])
    assert batch.dtype == torch.float32


def test_a_pickled_reward_builds_its_own_engine_and_scores_the_same(reward):
    # rollout worker processes rebuild rewards from their config; a pickled copy must work too
    assert type(reward).runs_in_worker
    images = np.stack([render("hello", 128, DUPLEX), render("robust", 128, DUPLEX)])
    rollout = image_rollout(images, ['"hello"', '"robot"'])
    before = reward(rollout)
    copy = pickle.loads(pickle.dumps(reward))
    assert copy._engine is None
    assert torch.equal(copy(rollout), before)


def test_a_fresh_process_rebuilds_the_reward_from_its_config(reward, tmp_path):
    """What a rollout worker process does: unpickle the reward's config, build the reward
    (and, on its first call, its own engine, with the process's one thread) and score."""
    cfg = from_dict(REWARDS.entry("ocr").config, {"type": "ocr", "target_field": "word"})
    images = np.stack([render("hello", 128, DUPLEX), render("robust", 128, SIMPLEX, WHITE_ON_BLUE)])
    metadata = [{"word": "hello"}, {"word": "robot"}]
    (tmp_path / "job.pkl").write_bytes(pickle.dumps((cfg, images, metadata)))
    child = textwrap.dedent("""
        import pickle, sys, torch
        from mmrl.core.reward import RewardContext, build_reward
        from mmrl.core.rollout import OldLogProbs, Rollout
        torch.set_num_threads(1)
        cfg, images, metadata = pickle.loads(open(sys.argv[1], "rb").read())
        n = len(images)
        rollout = Rollout(group_id=torch.zeros(n, dtype=torch.long), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={},
                          info={"images": torch.from_numpy(images), "prompt": ["a sign"] * n, "metadata": metadata, "record_id": list(range(n))})
        print(build_reward(cfg, RewardContext())(rollout).tolist())
    """)
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "job.pkl")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([1.0, 0.6000000238418579])
    here = ocr_reward(target_field="word")
    here._engine = reward.engine
    assert here(image_rollout(images, ["a sign"] * 2, metadata)).tolist() == [1.0, 0.6000000238418579]
