"""Synthetic multi-digit addition with checkable reasoning: prompt sets for text RL.

Each problem ``a + b`` (operands of ``digits`` digits) is a prompt record with its answer and
metadata; its SFT completion works the sum column by column, right to left, then states the
answer::

    prompt:      What is 47 + 38?
    completion:  <think>7+8=15 4+3+1=8</think><answer>85</answer>

Each step ``x+y[+c]=s`` adds one column's digits and the carry ``c`` from the step before
(written only when it is 1). The digits of the answer are the last digits of the step results,
read from the last step to the first, with the last step's carry in front. That makes
*reasoning → answer consistency* checkable: :func:`implied_answer` reads the number a
completion's reasoning computes (whether or not its arithmetic is right), and
:func:`is_consistent` says whether the stated answer equals it.

Train and held-out problems are disjoint operand pairs, split by a seeded permutation of all
pairs. Every problem has ``paraphrases`` wordings (``metadata.question_id`` links them, and
``metadata.paraphrase`` says which), so rewards can compare the answers to one question asked
several ways. ``metadata.category`` is ``carry`` or ``no_carry`` (whether any column carries),
the key ``mmrl eval`` breaks accuracy down by.

    python -m mmrl.tasks.arithmetic.world --out data/arithmetic [--digits 2 --train 2000 --held-out 200 --paraphrases 1 --seed 0]

writes ``train.jsonl`` and ``held_out.jsonl`` (prompt records: ``prompt``, ``answer``,
``completion`` and the metadata fields), the files ``configs/text_arithmetic_*.yaml`` read.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

TEMPLATES = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "{a} plus {b} equals what?",
    "Find the sum of {a} and {b}.",
)

_STEP = re.compile(r"(\d)\+(\d)(?:\+(\d))?=(\d+)")
_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def steps(a: int, b: int) -> list[str]:
    """The column additions of ``a + b``, right to left: ``x+y[+1]=s``."""
    out, carry = [], 0
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        s = x + y + carry
        out.append(f"{x}+{y}+{carry}={s}" if carry else f"{x}+{y}={s}")
        carry = s // 10
    return out


def completion(a: int, b: int) -> str:
    """The SFT target: the column steps, then the answer."""
    return f"<think>{' '.join(steps(a, b))}</think><answer>{a + b}</answer>"


def implied_answer(text: str) -> int | None:
    """The number the reasoning of ``text`` computes: the last digits of its step results,
    last step first, with the last result's tens in front; None without readable steps."""
    think = _THINK.search(text)
    found = _STEP.findall(think.group(1) if think else "")
    if not found:
        return None
    results = [int(s) for *_, s in found]
    digits = "".join(str(r % 10) for r in reversed(results))
    return int(f"{results[-1] // 10}{digits}")


def stated_answer(text: str) -> int | None:
    """The integer inside the last ``<answer>…</answer>`` of ``text``; None if there is none."""
    found = _ANSWER.findall(text)
    return int(found[-1]) if found else None


def is_consistent(text: str) -> bool:
    """Whether the answer ``text`` states is the number its reasoning computes."""
    implied, stated = implied_answer(text), stated_answer(text)
    return implied is not None and implied == stated


def has_carry(a: int, b: int) -> bool:
    """Whether some column of ``a + b`` carries into the next."""
    return any(int(step.split("=")[1]) >= 10 for step in steps(a, b))


def make_splits(digits: int, n_train: int, n_held_out: int, paraphrases: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Records of ``n_train`` and ``n_held_out`` disjoint problems, ``paraphrases`` wordings each."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not 1 <= paraphrases <= len(TEMPLATES):
        raise ValueError(f"paraphrases must lie in [1, {len(TEMPLATES)}], got {paraphrases}")
    low, high = (10 ** (digits - 1) if digits > 1 else 0), 10**digits
    pairs = [(a, b) for a in range(low, high) for b in range(low, high)]
    if n_train + n_held_out > len(pairs):
        raise ValueError(f"{digits}-digit operands give {len(pairs)} problems; asked for {n_train} + {n_held_out}")
    random.Random(seed).shuffle(pairs)

    def records(chosen, split):
        out = []
        for a, b in chosen:
            question_id = f"{a}+{b}"
            for k in range(paraphrases):
                out.append({
                    "prompt": TEMPLATES[k].format(a=a, b=b), "answer": str(a + b), "completion": completion(a, b),
                    "a": a, "b": b, "question_id": question_id, "paraphrase": k,
                    "category": "carry" if has_carry(a, b) else "no_carry", "split": split,
                })
        return out

    return records(pairs[:n_train], "train"), records(pairs[n_train:n_train + n_held_out], "held_out")


def write_splits(out: str | Path, **kwargs) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_splits(**kwargs)
    paths = out / "train.jsonl", out / "held_out.jsonl"
    for path, rows in zip(paths, (train, held_out)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.arithmetic.world", description="Write train / held-out JSONL prompt sets of multi-digit addition.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--train", type=int, default=2000, help="training problems")
    parser.add_argument("--held-out", type=int, default=200, help="held-out problems (disjoint operand pairs)")
    parser.add_argument("--paraphrases", type=int, default=1, help=f"wordings per problem (1..{len(TEMPLATES)})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        paths = write_splits(args.out, digits=args.digits, n_train=args.train, n_held_out=args.held_out, paraphrases=args.paraphrases, seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path} ({sum(1 for _ in path.open())} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
