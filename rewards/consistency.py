"""Consistency rewards for text: agreement of answers across paraphrases of one question
(``paraphrase_consistency``) and reasoning → answer consistency under a slowly updated
reference (``grpo_care``).

``paraphrase_consistency`` (after PS-GRPO's use of similarity across paraphrased queries):
prompt records that are paraphrases of one question share a metadata value (``key``, e.g.
``question_id``, which :mod:`mmrl.tasks.arithmetic.world` writes). For sample i, its *peers* are the
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

import copy
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.policy import overrides
from mmrl.core.reward import Reward, RewardContext
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.records import record_answers
from mmrl.rewards.text import _check_tag, decoded_completions, tagged_answer

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
    """Fraction of the other paraphrases' samples whose answer equals this sample's (PS-GRPO style)."""
    completions = decoded_completions(rollout, "paraphrase_consistency")
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


@dataclass
class GrpoCareConfig(RewardConfig):
    """GRPO-CARE's consistency bonus for correct samples whose reasoning makes their answer likely."""

    type: str = option("grpo_care", "registered name of this component (see `mmrl list`)")
    answer_tag: str = option("answer", "the answer is the last <tag>...</tag>; the reasoning is the text before it")
    bonus: float = option(0.5, "reward added to a correct sample whose consistency is at least its group's correct samples' mean", ge=0)
    ema_decay: float = option(0.995, "the reference is an exponential moving average of the policy: ref <- decay * ref + (1 - decay) * policy at every call", ge=0, lt=1)
    likelihood: Literal["mean", "sum"] = option("mean", "consistency = the mean (or summed) log-prob of the answer's tokens given the prompt and the reasoning, under the reference")
    ignore_case: bool = option(False, "compare answers case-insensitively")

    def validate(self, path: str) -> None:
        _check_tag(path, "answer_tag", self.answer_tag)


@REWARDS.register("grpo_care", config=GrpoCareConfig)
class GrpoCare(Reward):
    """GRPO-CARE (Chen et al. 2025, "GRPO-CARE: Consistency-Aware Reinforcement Learning for
    Multimodal Reasoning", arXiv:2506.16141): a bonus for reasoning → answer consistency.

    Sample i of a group is *correct* when its tagged answer equals the record's answer. Its
    *consistency* c_i is the likelihood of its answer given the prompt and its own reasoning
    (the completion before the answer tag) under a slowly updated reference: an exponential
    moving average of the policy's weights, kept by this component (started from the policy
    at the first call, moved toward it at every later call, saved in checkpoints). A correct
    sample whose c_i is at least the mean c of its group's correct samples gets ``bonus``;
    every other sample gets 0. Add it to a correctness reward (e.g. ``exact_match``); the
    paper uses it in place of the KL penalty. Needs a text policy
    (``continuation_log_prob``)."""

    needs_policy = True

    def __init__(self, cfg: GrpoCareConfig, context: RewardContext):
        super().__init__(cfg, context)
        self.reference = None
        self.calls = 0
        self._pending: dict[str, Any] | None = None

    @torch.no_grad()
    def _update_reference(self, policy) -> None:
        if not overrides(policy, "continuation_log_prob"):
            raise ConfigError("rewards", "grpo_care", f"scores answers given reasoning with a text policy (policy.type: text_lm), not {type(policy).__name__}")
        if self.reference is None:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
            if self._pending is None:
                return  # a new run: the reference starts as the policy
            self.reference.load_state_dict(self._pending)  # a resumed run: its saved average, then this call's step
            self._pending = None
        decay = self.config.ema_decay
        for ref, live in zip(self.reference.state_dict().values(), policy.state_dict().values()):
            if ref.dtype.is_floating_point:
                ref.mul_(decay).add_(live.to(ref.device, ref.dtype), alpha=1 - decay)

    @torch.no_grad()
    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        cfg = self.config
        if policy is None:
            raise ConfigError("rewards", "grpo_care", "needs the policy (the trainer passes it to components with needs_policy)")
        self._update_reference(policy)
        self.calls += 1
        completions = decoded_completions(rollout, "grpo_care")
        answers = record_answers(rollout, "grpo_care", str, "text")
        prompts = [str(p) for p in rollout.info["prompt"]]
        norm = (lambda t: " ".join(t.split()).casefold()) if cfg.ignore_case else (lambda t: " ".join(t.split()))
        correct, rows, prefixes, spans = [], [], [], []
        for i, (text, answer) in enumerate(zip(completions, answers)):
            split = _split_answer(text, cfg.answer_tag)
            ok = split is not None and norm(split[1]) == norm(answer)
            correct.append(ok)
            if ok:
                rows.append(i)
                prefixes.append(split[0])
                spans.append(split[1])
        out = torch.zeros(len(completions))
        if not rows:
            return out
        consistency = self.reference.continuation_log_prob([prompts[i] for i in rows], prefixes, spans, reduce=cfg.likelihood).float().cpu()
        groups = rollout.group_id.cpu()[rows]
        for g in groups.unique():
            members = groups == g
            mean = consistency[members].mean()
            for k in members.nonzero().flatten().tolist():
                if consistency[k] >= mean - 1e-6:
                    out[rows[k]] = cfg.bonus
        return out

    def state_dict(self) -> dict[str, Any]:
        ref = self.reference.state_dict() if self.reference is not None else self._pending
        return {"calls": self.calls, "reference": {k: v.detach().cpu().clone() for k, v in ref.items()} if ref is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))
        ref = state.get("reference")
        if ref is None:
            return
        if self.reference is not None:
            self.reference.load_state_dict(ref)
        else:
            self._pending = ref


def _split_answer(text: str, tag: str) -> tuple[str, str] | None:
    """(everything before the last <tag>…</tag> plus the opening tag, the inside of it)."""
    start = text.rfind(f"<{tag}>")
    end = text.find(f"</{tag}>", start + 1) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return text[: start + len(tag) + 2], text[start + len(tag) + 2 : end]
