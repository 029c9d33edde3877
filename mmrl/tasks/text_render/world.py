"""The text-rendering world: prompts that ask for an image showing a given word, a renderer that
draws ground truth for them with OpenCV, and prompt sets.

Prompts. A prompt names a word from :data:`WORDS` (40 common English words of 3–4 letters)
and the colour of its letters from :data:`COLOURS`, in one of the paraphrases of
:data:`TEMPLATES`:

    an image that shows the word "cat" in red
    the word "cat" written in red
    a picture of the word "cat" in red letters

Records. :func:`write_prompt_sets` writes ``train.jsonl`` and ``eval.jsonl`` for the prompt
sampler: ``{"prompt": ..., "metadata": {"text": word, "colour": ..., "category": colour,
"template": k}}``. ``metadata.text`` is the field the ``ocr`` reward reads (its
``target_field`` default); the prompt also holds the word between double quotes, as
Flow-GRPO's OCR prompts do. The held-out split is compositional: for each word one of the four
colours is held out (each colour for 10 words, drawn from the split seed), so the held-out set
is 40 (word, colour) combinations never rendered in training, one record each (a seeded
template), and the train set is the other 120 combinations in every template (360 records).
Every word and every colour is seen in training; no held-out word is new. A tiny generator
that sees each word only as one token of a word-level vocabulary cannot spell a word it has
never been shown, so the held-out prompts test the combination, not the spelling
(benchmarks/results/images.md, "Text rendering").

Rendering (:func:`render_word`, needs the ``image`` extra: OpenCV) draws an RGB uint8 square of
any size: a light background (each channel 185–250, a random tint), the word in one of
:data:`FONTS` (Hershey triplex and complex, the serif fonts PP-OCR reads best at 32 pixels), a
scale that makes the word 78–92% of the side wide, stroke ``max(1, round(1.6 scale))``, its
colour jittered by ±20 per channel, and a seeded position that keeps the word inside the image
(a 1-pixel margin). At 32×32 PP-OCRv4 (``rewards/ocr.py``) reads these renderings exactly for
every word of the list (``tests/tasks/test_text_render.py``); the list was chosen for it.

Randomness comes from numpy's legacy ``RandomState``, whose streams numpy keeps fixed across
versions, so a seed names the same rendering and the same split after upgrades.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.errors import MissingExtraError

WORDS: tuple[str, ...] = (
    "cat", "dog", "sun", "hat", "cup", "box", "car", "bus", "map", "pen",
    "egg", "key", "bed", "fox", "owl", "bee", "cow", "pig", "ant", "jam",
    "tree", "book", "fish", "bird", "star", "cake", "rain", "snow", "wind", "door",
    "lamp", "milk", "road", "ship", "boat", "frog", "duck", "kite", "ring", "sock",
)  # fmt: skip
# RGB of each letter colour: dark enough for the reader on the light backgrounds
COLOURS: dict[str, tuple[int, int, int]] = {"red": (200, 30, 30), "green": (20, 120, 40), "blue": (30, 50, 200), "black": (25, 25, 25)}
TEMPLATES: tuple[str, ...] = (
    'an image that shows the word "{word}" in {colour}',
    'the word "{word}" written in {colour}',
    'a picture of the word "{word}" in {colour} letters',
)
# every word of the templates, the colours and WORDS: the tiny text encoder's vocabulary
VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(w for t in TEMPLATES for w in t.replace('"', " ").split() if not w.startswith("{")).keys()) + tuple(COLOURS) + WORDS
WIDTH_FRACTION = (0.78, 0.92)


def _cv2(what: str):
    try:
        import cv2
    except ImportError:
        raise MissingExtraError("opencv-python-headless", "image", what) from None
    return cv2


def fonts() -> tuple[int, ...]:
    """The OpenCV fonts the renderer draws with (Hershey triplex and complex)."""
    cv2 = _cv2("the text_render renderer")
    return (cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_COMPLEX)


def prompt_text(word: str, colour: str, template: int = 0) -> str:
    """The prompt of ``word`` in ``colour`` in paraphrase ``template`` of :data:`TEMPLATES`."""
    return TEMPLATES[template].format(word=word, colour=colour)


def record(word: str, colour: str, template: int) -> dict[str, Any]:
    """The JSONL record of a prompt, as the prompt sampler reads it (``metadata.text`` is the
    ``ocr`` reward's target)."""
    return {"prompt": prompt_text(word, colour, template), "metadata": {"text": word, "colour": colour, "category": colour, "template": template}}


def held_out_combinations(seed: int = 0) -> set[tuple[str, str]]:
    """The (word, colour) pairs never rendered in training: one colour per word, each colour
    held out for an equal share of the words (a seeded permutation of the words)."""
    rng = np.random.RandomState(seed)
    order = rng.permutation(len(WORDS))
    colours = list(COLOURS)
    return {(WORDS[i], colours[k % len(colours)]) for k, i in enumerate(order)}


def split_records(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) records: every template of each train combination; one seeded template
    of each held-out combination. Both in a seeded order."""
    held = held_out_combinations(seed)
    rng = np.random.RandomState(seed + 1)
    train, held_out = [], []
    for word in WORDS:
        for colour in COLOURS:
            if (word, colour) in held:
                held_out.append(record(word, colour, int(rng.randint(len(TEMPLATES)))))
            else:
                train.extend(record(word, colour, t) for t in range(len(TEMPLATES)))
    return [train[i] for i in rng.permutation(len(train))], [held_out[i] for i in rng.permutation(len(held_out))]


def write_prompt_sets(out_dir: str | Path, *, seed: int = 0) -> dict[str, int]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (:func:`split_records`) into ``out_dir``; returns
    the number of records of each."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, records in zip(("train", "eval"), split_records(seed)):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        counts[name] = len(records)
    return counts


def parse_prompt(prompt: str) -> tuple[str, str]:
    """(word, colour) of a prompt of this world: the text between its first double quotes and
    the colour named after it; ``ValueError`` for anything else."""
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].strip():
        raise ValueError(f"no quoted word in {prompt!r}")
    colours = [c for c in COLOURS if c in parts[2].replace(",", " ").split()]
    if len(colours) != 1:
        raise ValueError(f"expected one colour of {list(COLOURS)} after the word in {prompt!r}")
    return parts[1].strip(), colours[0]


def render_word(word: str, colour: str, size: int = 32, seed: int = 0) -> np.ndarray:
    """An RGB uint8 image [size, size, 3] of ``word`` in ``colour`` (:data:`COLOURS`, or an RGB
    triple) on a light background; font, scale, jitter and position are drawn from ``seed``."""
    cv2 = _cv2("the text_render renderer")
    rng = np.random.RandomState(seed)
    rgb = np.asarray(COLOURS[colour] if isinstance(colour, str) else colour, dtype=np.int64)
    background = rng.randint(185, 251, size=3)
    font = fonts()[rng.randint(len(fonts()))]
    target_width = rng.uniform(*WIDTH_FRACTION) * size
    # the largest scale (in steps of 0.02) whose width fits the target
    scale = 4.0
    while True:
        thickness = max(1, round(1.6 * scale))
        (width, height), baseline = cv2.getTextSize(word, font, scale, thickness)
        if width <= target_width or scale <= 0.1:
            break
        scale -= 0.02
    ink = np.clip(rgb + rng.randint(-20, 21, size=3), 0, 255)
    x_room = max(0, size - 2 - width)
    y_room = max(0, size - 2 - height - baseline)
    x = 1 + int(rng.randint(x_room + 1))
    y = 1 + height + int(rng.randint(y_room + 1))  # putText's origin is the baseline's left end
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = background.astype(np.uint8)
    # OpenCV draws in the array's channel order; the array is RGB
    cv2.putText(image, word, (x, y), font, scale, tuple(int(c) for c in ink), thickness, cv2.LINE_AA)
    return image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.text_render.world", description="Write the text-rendering world's train and held-out prompt sets (JSONL).")
    parser.add_argument("--out", required=True, help="output directory (train.jsonl, eval.jsonl)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the held-out templates and the record order")
    args = parser.parse_args(argv)
    counts = write_prompt_sets(args.out, seed=args.seed)
    print(f"wrote {counts['train']} train and {counts['eval']} held-out prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
