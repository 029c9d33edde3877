"""Consistency rewards for text: agreement of answers across paraphrases of one question.

``paraphrase_consistency`` (after PS-GRPO's use of similarity across paraphrased queries):
prompt records that are paraphrases of one question share a metadata value (``key``, e.g.
``question_id``, which :mod:`mmrl.data.arithmetic` writes). For sample i, its *peers* are the
samples of the batch drawn from the *other* paraphrases of its question (not its own group:
those answered the same wording). Its reward is the fraction of peers whose extracted answer
equals its own:

    r_i = |{j ∈ peers(i) : ans_j = ans_i}| / |peers(i)|

so an answer that the question gets however it is worded scores 1, and one that depends on
the wording scores low — whether or not it is right (combine it with a correctness reward).
A sample with no peer in the batch, or with no extractable answer, gets ``no_peer_value``.
Peers meet only within one reward call (one collection round): set
``sampler.cluster_key: question_id`` so the paraphrases of a question are consecutive in the
prompt order, and ``algo.groups_per_step`` a multiple of the number of paraphrases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.config import RewardConfig
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.text import _check_tag, _completions, tagged_answer

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class ParaphraseConsistencyConfig(RewardConfig):
    """Agreement of a sample's answer with the answers to the other paraphrases of its question."""

    type: str = option("paraphrase_consistency", "registered name of this component (see `mmrl list`)")
    key: str = option("question_id", "metadata field shared by the paraphrases of one question")
    answer_tag: str | None = option("answer", "the answer is the inside of the last <tag>...</tag> (null: the last number of the completion)")
    no_peer_value: float = option(0.0, "reward of a sample with no paraphrase peer in the batch or no answer")

    def validate(self, path: str) -> None:
        _check_tag(path, "answer_tag", self.answer_tag)


def _answer(text: str, tag: str | None) -> str | None:
    if tag is not None:
        inside = tagged_answer(text, tag)
        return " ".join(inside.split()) if inside is not None and inside.strip() else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


@REWARDS.register("paraphrase_consistency", config=ParaphraseConsistencyConfig)
def paraphrase_consistency(rollout: Rollout, cfg: ParaphraseConsistencyConfig) -> Tensor:
    completions = _completions(rollout, "paraphrase_consistency")
    if "metadata" not in rollout.info or "record_id" not in rollout.info:
        raise ConfigError("rewards", "paraphrase_consistency", "reads prompt-record metadata; use it with sampler.type: prompt")
    answers = [_answer(c, cfg.answer_tag) for c in completions]
    records = [int(r) for r in rollout.info["record_id"]]
    questions = [m.get(cfg.key) for m in rollout.info["metadata"]]
    out = []
    for i, (answer, question) in enumerate(zip(answers, questions)):
        peers = [j for j, q in enumerate(questions) if question is not None and q == question and records[j] != records[i]]
        if answer is None or not peers:
            out.append(cfg.no_peer_value)
        else:
            out.append(sum(answers[j] == answer for j in peers) / len(peers))
    return torch.tensor(out, dtype=torch.float32)
