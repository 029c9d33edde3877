"""What rewards read from a prompt-sampler rollout: each sample's prompt-record answer."""

from __future__ import annotations

from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError


def record_answers(rollout: Rollout, reward: str, convert, what: str) -> list:
    """Each sample's prompt-record answer, converted; an error names the first record
    without one or with one that does not convert."""
    if "answer" not in rollout.info:
        raise ConfigError("rewards", reward, "reads each prompt record's answer; use it with sampler.type: prompt")
    out = []
    for i, answer in enumerate(rollout.info["answer"]):
        record = int(rollout.info["record_id"][i])
        if answer is None:
            raise ConfigError("rewards", reward, f"needs an answer for every prompt record; record {record} has none (see sampler.data.answer_field)")
        try:
            out.append(convert(answer))
        except (TypeError, ValueError):
            raise ConfigError("rewards", reward, f"record {record}'s answer {answer!r} is not {what}") from None
    return out
