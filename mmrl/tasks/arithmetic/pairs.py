"""A correct and an incorrect worked completion of each arithmetic prompt, the one with the
record's answer chosen (``python -m mmrl pairs arithmetic``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmrl.data.preferences import SPLITS, flip_labels, write_preferences
from mmrl.tasks.arithmetic.world import completion, stated_answer, steps


def wrong_completion(a: int, b: int, rng: np.random.RandomState) -> tuple[str, str]:
    """An incorrect worked completion of ``a + b`` and its mistake: the right steps and a
    wrong stated answer (``wrong answer``), one column's sum off by 1–3 with the answer
    following from the wrong steps (``wrong step``), or, when a column carries, the carry
    dropped (``dropped carry``)."""
    right = steps(a, b)
    kinds = ["wrong answer", "wrong step"] + (["dropped carry"] if any("+1=" in s for s in right) else [])
    kind = kinds[rng.randint(len(kinds))]
    if kind == "wrong answer":
        answer = a + b + int(rng.choice([-1, 1])) * int(rng.randint(1, 11))
        return f"<think>{' '.join(right)}</think><answer>{max(answer, 0) if answer != a + b else a + b + 1}</answer>", kind
    da, db = str(a)[::-1], str(b)[::-1]
    broken = int(rng.randint(len(right))) if kind == "wrong step" else None
    out, digits, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        c = 0 if kind == "dropped carry" else carry
        s = x + y + c
        if i == broken:
            s = max(0, s + int(rng.choice([-1, 1])) * int(rng.randint(1, 4)))
        out.append(f"{x}+{y}+{c}={s}" if c else f"{x}+{y}={s}")
        digits.append(str(s % 10))
        carry = s // 10
    answer = int(f"{carry}{''.join(reversed(digits))}")
    if answer == a + b:  # the error cancelled out: state a wrong answer instead
        answer += 1
    return f"<think>{' '.join(out)}</think><answer>{answer}</answer>", kind


def write_arithmetic_pairs(out: str | Path, prompts: str | Path, *, flip: float = 0.0, seed: int = 0) -> dict:
    """Write arithmetic preference pairs from the prompt sets in ``prompts`` (train.jsonl,
    held_out.jsonl of ``python -m mmrl.tasks.arithmetic.world``); returns ``info``."""
    if not 0 <= flip < 0.5:
        raise ValueError(f"flip must lie in [0, 0.5), not {flip}")
    rng = np.random.RandomState(seed)
    splits = {}
    for split in SPLITS:
        path = Path(prompts) / f"{split}.jsonl"
        if not path.is_file():
            raise ValueError(f"{path} does not exist (python -m mmrl.tasks.arithmetic.world --out {prompts})")
        rows = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            a, b, answer = int(record["a"]), int(record["b"]), str(record["answer"])
            (second, mistake), first = wrong_completion(a, b, rng), completion(a, b)
            correct = [str(stated_answer(t)) == answer for t in (first, second)]
            if correct[0] == correct[1]:
                continue  # exact match cannot tell them apart
            chosen, rejected = (first, second) if correct[0] else (second, first)
            rows.append({"prompt": record["prompt"], "chosen": chosen, "rejected": rejected, "metadata": {"category": record.get("category"), "question_id": record.get("question_id"), "mistake": mistake}})
        splits[split] = rows
    flip_labels(splits["train"], flip, np.random.RandomState(seed + 11))
    return write_preferences(out, "text", splits, source="arithmetic", prompts=str(prompts), flip=flip, seed=seed)
