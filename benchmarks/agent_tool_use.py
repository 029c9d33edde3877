"""What a calculator agent's tool use looks like in saved evaluation episodes.

    mmrl eval RUN --episodes 64 --save-episodes DIR
    python benchmarks/agent_tool_use.py DIR [DIR ...]

For each directory's ``episodes.jsonl`` (mmrl/LongArithmetic-v0 behind the tool env) it prints,
per episode on average: turns, tool calls, readable calls, correct calls (a calculator call
whose expression has the task's value), and the share of episodes whose answer equals the
result of their last correct call — and the success rate. So a rise in success can be read as
better calls, better copying of the result, or both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmrl.tasks.long_arithmetic.env import _evaluate, stated_answer  # noqa: E402
from mmrl.tools.calls import parse_turn  # noqa: E402

_TASK = re.compile(r"Compute (.+?) exactly\.")


def _value(expression: str) -> int | None:
    parts = expression.split()
    if len(parts) % 2 == 0 or not all(p.lstrip("-").isdigit() for p in parts[::2]) or not all(p in "+-*" for p in parts[1::2]):
        return None
    return _evaluate(parts)


def tool_use(path: Path) -> dict[str, float]:
    """The per-episode means of ``path``'s episodes (module docstring)."""
    rows = [json.loads(line) for line in (path / "episodes.jsonl").read_text().splitlines() if line.strip()]
    totals = {"episodes": len(rows), "success": 0.0, "turns": 0.0, "calls": 0.0, "readable_calls": 0.0, "correct_calls": 0.0, "answer_copies_result": 0.0}
    for row in rows:
        turns = row["turns"]
        target = _value(_TASK.search(turns[0][0]).group(1))
        totals["success"] += float(row["success"])
        totals["turns"] += len(turns)
        result = None
        for j, (_, reply) in enumerate(turns):
            turn = parse_turn(reply)
            totals["calls"] += len(turn.calls) + len(turn.errors)
            for call in turn.calls:
                totals["readable_calls"] += 1
                expression = str(call.arguments.get("expression", ""))
                if _value(expression) == target:
                    totals["correct_calls"] += 1
                    if j + 1 < len(turns):  # the result the agent read next
                        result = stated_answer(turns[j + 1][0])
            if not turn.calls and not turn.errors and result is not None:
                totals["answer_copies_result"] += float(stated_answer(turn.answer or reply) == result)
    n = max(1, len(rows))
    return {k: (v if k == "episodes" else v / n) for k, v in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="directories holding episodes.jsonl (mmrl eval --save-episodes)")
    args = parser.parse_args(argv)
    keys = ["episodes", "success", "turns", "calls", "readable_calls", "correct_calls", "answer_copies_result"]
    print("| episodes dir | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for d in args.dirs:
        stats = tool_use(d)
        print(f"| {d} | " + " | ".join(f"{stats[k]:.3f}" if k != "episodes" else str(int(stats[k])) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
