"""``ocr``: how well a generated image spells the text its prompt asks for, read by a real OCR
model (PP-OCRv4 detection and recognition through ``rapidocr-onnxruntime``, ``mmrl[ocr]``).

Flow-GRPO's text-rendering reward (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models
via Online RL", arXiv:2505.05470; ``flow_grpo/ocr.py``, ``OcrScorer``, checked at
yifan123/flow_grpo commit ac4c86e), computed the same way:

1. the target t is the text the prompt asks for: the record's ``metadata[target_field]``
   (``text`` by default) when it has one, else the prompt's text between its first pair of
   double quotes (Flow-GRPO's ``prompt.split('"')[1]``: ``a sign that says "Hello World"`` →
   ``Hello World``);
2. the OCR model reads the image; the recognized text s is the concatenation of the lines it
   finds (top to bottom, left to right) whose confidence is at least ``min_confidence``;
3. both are normalized as Flow-GRPO does: spaces removed (the ``' '`` character only) and
   lower-cased — ``norm(x) = x.replace(" ", "").lower()``;
4. d = 0 if norm(t) occurs in norm(s) (text around the target is not penalized), else the
   Levenshtein distance between norm(s) and norm(t); d is capped at len(norm(t)) ("recognized
   many unrelated characters": at most the penalty of reading nothing);
5. r = 1 − d / len(norm(t)), in [0, 1]. An image where nothing is read scores 0 (d is then
   len(norm(t))); the exact text, or any text containing it, scores 1.

What differs from Flow-GRPO: the engine is ``rapidocr-onnxruntime``'s ONNX export of PP-OCRv4
(Chinese + English recognition dictionary) rather than PaddleOCR 2.9's English PP-OCRv4 model,
run on the CPU through onnxruntime; images are handed to it as BGR, the order it reads arrays
in (Flow-GRPO gave PaddleOCR its RGB arrays unconverted); and an OCR failure is an error here
rather than a reward of 0. The options default to what Flow-GRPO's PaddleOCR did: no angle
classifier (``use_angle_cls=False``), lines below confidence 0.5 dropped (PaddleOCR's
``drop_score``; Flow-GRPO's own filter keeps confidence > 0 on top of it), detection at the
image's own size up to 960 pixels on its longer side (PaddleOCR's ``det_limit_side_len`` /
``det_limit_type: max``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import Reward, RewardContext
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import REWARDS
from mmrl.rewards.images import rollout_images


def rapidocr(what: str):
    """The ``RapidOCR`` engine class, or an error that names the ``ocr`` extra."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise MissingExtraError("rapidocr-onnxruntime", "ocr", what) from None
    return RapidOCR


def normalize_text(text: str) -> str:
    """Flow-GRPO's normalization of both texts: spaces (``' '``) removed, then lower-cased."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """The edit distance between ``a`` and ``b``: the fewest single-character insertions,
    deletions and substitutions that turn one into the other ("kitten" → "sitting": 3).
    Dynamic programming over one row at a time, O(len(a) · len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_text_score(recognized: str, target: str, contains: bool = True) -> float:
    """r = 1 − min(d, len(t)) / len(t) for t = norm(target), s = norm(recognized) (see the
    module docstring); d = 0 when ``contains`` and t occurs in s, else levenshtein(s, t). A
    target that is empty after normalization is a ``ValueError`` (the score has no scale)."""
    s, t = normalize_text(recognized), normalize_text(target)
    if not t:
        raise ValueError(f"the OCR target {target!r} is empty once spaces are removed")
    d = 0 if contains and t in s else levenshtein(s, t)
    return 1.0 - min(d, len(t)) / len(t)


def quoted_text(prompt: str) -> str | None:
    """The prompt's text after its first double quote, up to the next one (Flow-GRPO's
    ``prompt.split('"')[1]``), or None when the prompt has no double quote."""
    parts = prompt.split('"')
    return parts[1] if len(parts) > 1 else None


@dataclass
class OCRRewardConfig(RewardConfig):
    """How closely the text an OCR model (PP-OCRv4) reads in each image matches the text its
    prompt asks for: 1 − edit distance / target length, in [0, 1] (Flow-GRPO's OCR reward)."""

    type: str = option("ocr", "registered name of this component (see `mmrl list`)")
    target_field: str | None = option("text", "metadata field of the prompt record holding the text to render; a record without it (or null) uses the prompt's text between double quotes")
    min_confidence: float = option(0.5, "recognized lines of lower confidence are dropped (PaddleOCR's drop_score, 0.5, which Flow-GRPO ran with); lines of confidence 0 always are", ge=0, le=1)
    contains: bool = option(True, "a recognized text that contains the target scores 1, whatever surrounds it (Flow-GRPO); false: the plain edit distance")
    use_cls: bool = option(False, "run the text-angle classifier (turns 180°-rotated lines upright) before recognition; Flow-GRPO ran without it")
    det_limit_side_len: int = option(960, "detection size limit in pixels, see det_limit_type (PaddleOCR's default 960)", ge=32)
    det_limit_type: Literal["max", "min"] = option("max", "max: an image whose longer side exceeds the limit is scaled down to it for detection, smaller ones are detected at their own size (PaddleOCR); min: an image whose shorter side is below the limit is scaled up to it (rapidocr's default, with 736)")
    threads: int = option(0, "onnxruntime threads of the OCR engine (0: torch's thread count where the engine is built, so a rollout worker uses its own share)", ge=0)


@REWARDS.register("ocr", config=OCRRewardConfig)
class OCRReward(Reward):
    """Flow-GRPO's OCR reward with PP-OCRv4 (``rapidocr-onnxruntime``) on the CPU; the formula
    is in this module's docstring (:func:`ocr_text_score`).

    The package is checked when the reward is built (``MissingExtraError`` naming the ``ocr``
    extra); the engine itself is built on the first call and kept. It runs on the CPU whatever
    ``device`` says. In a rollout worker process the reward is rebuilt from its config, and a
    pickled copy leaves the engine behind and builds its own on its first call."""

    # rebuilt from the config in each rollout worker; the engine is built there on first use
    runs_in_worker = True

    def __init__(self, cfg: OCRRewardConfig, context: RewardContext):
        super().__init__(cfg, context)
        rapidocr("the ocr reward")
        self._engine: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_engine"] = None  # onnxruntime sessions do not pickle; the copy builds its own
        return state

    @property
    def engine(self):
        """The RapidOCR engine (PP-OCRv4 detection and recognition, onnxruntime on the CPU),
        built on first use with the config's options."""
        if self._engine is None:
            cfg = self.config
            threads = cfg.threads or torch.get_num_threads()
            self._engine = rapidocr("the ocr reward")(
                text_score=0.0,  # every line comes back; min_confidence filters below
                use_cls=cfg.use_cls,
                det_limit_side_len=cfg.det_limit_side_len,
                det_limit_type=cfg.det_limit_type,
                intra_op_num_threads=threads,
                inter_op_num_threads=1,
            )
        return self._engine

    def read(self, images: np.ndarray) -> list[str]:
        """The recognized text of each RGB uint8 image [B, H, W, 3]: the lines the engine finds,
        in its reading order (top to bottom, left to right), of confidence at least
        ``min_confidence`` (and above 0), concatenated without separator; "" when none."""
        engine, floor = self.engine, self.config.min_confidence
        texts = []
        for image in images:
            lines, _ = engine(np.ascontiguousarray(image[..., ::-1]))  # the engine reads arrays as BGR
            texts.append("".join(str(text) for _, text, conf in (lines or []) if float(conf) > 0 and float(conf) >= floor))
        return texts

    def targets(self, rollout: Rollout) -> list[str]:
        """Each sample's target text: ``metadata[target_field]`` when the record has it, else
        the prompt's text between double quotes; an error names the first record with neither."""
        if "prompt" not in rollout.info:
            raise ConfigError("rewards", "ocr", f"reads the text each prompt asks for from its prompt record; use it with sampler.type: prompt (the rollout info has {sorted(rollout.info)})")
        prompts = [str(p) for p in rollout.info["prompt"]]
        metadata = rollout.info.get("metadata") or [None] * len(prompts)
        records = rollout.info.get("record_id", range(len(prompts)))
        field = self.config.target_field
        out = []
        for prompt, meta, record in zip(prompts, metadata, records):
            value = (meta or {}).get(field) if field else None
            target = str(value) if value is not None else quoted_text(prompt)
            if target is None or not normalize_text(target):
                where = f"no metadata[{field!r}] and " if field else ""
                raise ConfigError("rewards", "ocr", f"needs the text to render for every sample; record {int(record)} has {where}no text between double quotes in its prompt {prompt!r}")
            out.append(target)
        return out

    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        images = rollout_images(rollout, "ocr")
        targets = self.targets(rollout)
        recognized = self.read(images)
        contains = self.config.contains
        return torch.tensor([ocr_text_score(s, t, contains) for s, t in zip(recognized, targets)], dtype=torch.float32)
