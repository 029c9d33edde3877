"""Verifiable rewards for text completions.

Each reads the completions the text policy decoded (``rollout.info["completions"]``); the
answer checks also read each sample's prompt-record answer (``rollout.info["answer"]``,
from the prompt sampler). All return 1.0 or 0.0 per sample.

- ``math_answer``: the completion's final answer equals the record's, as the ``math-verify``
  library decides it (``\\boxed{}`` first, then other LaTeX, then the last number or
  expression; ``1/2``, ``0.5`` and ``\\frac{1}{2}`` are the same answer).
- ``exact_match``: the completion (or the part of it inside an answer tag) equals the
  record's answer as text, up to surrounding and repeated whitespace.
- ``format``: the completion is exactly a sequence of tagged blocks, by default
  ``<think>…</think><answer>…</answer>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.registry import REWARDS
from mmrl.rewards.records import record_answers

_TAG_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def decoded_completions(rollout: Rollout, reward: str) -> list[str]:
    """The decoded completions of a text policy's rollout; a one-line error for any other."""
    if "completions" not in rollout.info:
        raise ConfigError("rewards", reward, f"reads the decoded completions info['completions'] (use it with policy.type: text_lm); the rollout info has {sorted(rollout.info)}")
    return list(rollout.info["completions"])


def _check_tag(path: str, field: str, tag: str | None) -> None:
    if tag is not None and not _TAG_NAME.fullmatch(tag):
        raise ConfigError(f"{path}.{field}" if path else field, tag, "expected a tag name such as answer (letters, digits, _, -, .), without angle brackets")


def tagged_answer(completion: str, tag: str | None) -> str | None:
    """The text inside the last ``<tag>…</tag>`` block of ``completion`` (None if it has
    none); the whole completion when ``tag`` is None."""
    if tag is None:
        return completion
    blocks = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else None


@dataclass
class MathAnswerConfig(RewardConfig):
    """1 when math-verify finds the completion's final answer equal to the record's answer."""

    type: str = option("math_answer", "registered name of this component (see `mmrl list`)")
    answer_tag: str | None = option(None, "read the answer only inside the last <tag>...</tag> of a completion (e.g. answer; none there scores 0); null = the whole completion")
    extraction: list[Literal["latex", "expr"]] = option(
        factory=lambda: ["latex", "expr"], doc="answer forms to look for: latex (\\boxed{} first, then $...$ and other LaTeX), expr (the last plain number or expression)"
    )
    float_rounding: int = option(6, "decimal places numbers are rounded to before they are compared", ge=0)
    timeout_seconds: int | None = option(5, "math-verify's time limit per parse and per comparison (SIGALRM: the main thread only); null = none", ge=1)

    def validate(self, path: str) -> None:
        _check_tag(path, "answer_tag", self.answer_tag)
        if not self.extraction:
            raise ConfigError(f"{path}.extraction" if path else "extraction", self.extraction, "name at least one answer form: latex, expr")


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise MissingExtraError("math-verify", "text", "the math_answer reward") from None
    return math_verify


@REWARDS.register("math_answer", config=MathAnswerConfig)
def math_answer(rollout: Rollout, cfg: MathAnswerConfig) -> Tensor:
    """1 if the completion's final answer equals the record's answer (math-verify), else 0.

    r_i = [verify(parse(answer_i), parse(completion_i))], with math-verify's ``parse`` (the
    configured answer forms) and ``verify`` (symbolic and numeric equality)."""
    mv = _math_verify()
    forms = {"latex": mv.LatexExtractionConfig(), "expr": mv.ExprExtractionConfig()}
    extraction = [forms[name] for name in cfg.extraction]
    completions = decoded_completions(rollout, "math_answer")
    golds: dict[str, list] = {}

    def gold_of(answer) -> list:
        text = str(answer).strip()
        if text not in golds:
            # the gold answer is read as the content of a \boxed{}: parsed as free text,
            # "1 + x^2" would give its first number
            parsed = mv.parse(text if "\\boxed" in text else f"\\boxed{{{text}}}", parsing_timeout=cfg.timeout_seconds)
            if not parsed:
                raise ValueError(text)
            golds[text] = parsed
        return golds[text]

    answers = record_answers(rollout, "math_answer", gold_of, "an answer math-verify can read")
    rewards = []
    for completion, gold in zip(completions, answers):
        text = tagged_answer(completion, cfg.answer_tag)
        predicted = mv.parse(text, extraction_config=extraction, parsing_timeout=cfg.timeout_seconds) if text is not None else []
        correct = bool(predicted) and mv.verify(gold, predicted, float_rounding=cfg.float_rounding, timeout_seconds=cfg.timeout_seconds)
        rewards.append(float(correct))
    return torch.tensor(rewards, dtype=torch.float32)


@dataclass
class ExactMatchConfig(RewardConfig):
    """1 when the completion's answer text equals the record's answer (whitespace-normalized)."""

    type: str = option("exact_match", "registered name of this component (see `mmrl list`)")
    answer_tag: str | None = option(None, "compare only the inside of the last <tag>...</tag> of a completion (e.g. answer; none there scores 0); null = the whole completion")
    ignore_case: bool = option(False, "compare case-insensitively")

    def validate(self, path: str) -> None:
        _check_tag(path, "answer_tag", self.answer_tag)


def _normalized(text: str, ignore_case: bool) -> str:
    text = " ".join(text.split())
    return text.casefold() if ignore_case else text


@REWARDS.register("exact_match", config=ExactMatchConfig)
def exact_match(rollout: Rollout, cfg: ExactMatchConfig) -> Tensor:
    """1 if the completion's answer text equals the record's answer, else 0.

    r_i = [norm(answer text of completion_i) = norm(answer_i)], norm = strip and collapse
    whitespace (and case-fold with ``ignore_case``)."""
    completions = decoded_completions(rollout, "exact_match")
    answers = record_answers(rollout, "exact_match", str, "text")
    rewards = []
    for completion, answer in zip(completions, answers):
        text = tagged_answer(completion, cfg.answer_tag)
        rewards.append(float(text is not None and _normalized(text, cfg.ignore_case) == _normalized(answer, cfg.ignore_case)))
    return torch.tensor(rewards, dtype=torch.float32)


@dataclass
class FormatConfig(RewardConfig):
    """1 when the completion is exactly the configured tagged blocks, in order."""

    type: str = option("format", "registered name of this component (see `mmrl list`)")
    tags: list[str] = option(factory=lambda: ["think", "answer"], doc="the blocks <tag>...</tag> a completion must consist of, in this order, each once (whitespace allowed between and around them)")

    def validate(self, path: str) -> None:
        if not self.tags:
            raise ConfigError(f"{path}.tags" if path else "tags", self.tags, "name at least one tag, e.g. [think, answer]")
        for i, tag in enumerate(self.tags):
            _check_tag(path, f"tags[{i}]", tag)


@REWARDS.register("format", config=FormatConfig)
def format_reward(rollout: Rollout, cfg: FormatConfig) -> Tensor:
    """1 if the completion consists of the configured tagged blocks, in order, else 0.

    r_i = [completion_i = ws <t_1>…</t_1> ws <t_2>…</t_2> ws … ws], each tag opened and
    closed exactly once (ws: optional whitespace)."""
    blocks = r"\s*".join(rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in cfg.tags)
    pattern = re.compile(rf"\s*{blocks}\s*", flags=re.DOTALL)
    rewards = []
    for completion in decoded_completions(rollout, "format"):
        once = all(completion.count(f"<{t}>") == 1 and completion.count(f"</{t}>") == 1 for t in cfg.tags)
        rewards.append(float(once and pattern.fullmatch(completion) is not None))
    return torch.tensor(rewards, dtype=torch.float32)
