"""Demonstrations of the calculator task: call the calculator with the expression, then answer
with its result, played through the tool env itself.

    python -m mmrl.tasks.long_arithmetic.demos --out demos.jsonl --episodes 64 --seed 0 --digits 6 --terms 2

writes one episode per line, ``{"turns": [[observation, action], ...]}`` (the
``conversations`` data source of ``algo.type: sft``): the first action is the JSON call
``{"tool": "calculator", "arguments": {"expression": "<the expression>"}}``, the second
``Answer: <the calculator's result>``. The observations are the tool env's own (without the
tool instructions: ``instructions: false``, the form the demonstrations teach), so SFT sees
exactly what sampling will; ``--instructions`` keeps them, for an env that gives them (a
pretrained model told the call form in its first message).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def calculator_episode(seed: int, digits: int = 6, terms: int = 2, operators: str = "+-*", instructions: bool = False) -> list[list[str]]:
    """The turns of one episode of ``mmrl/LongArithmetic-v0`` behind the tool env (calculator
    only), reset with ``seed`` and solved with one call; raises if the episode is not solved."""
    import gymnasium

    import mmrl.envs  # noqa: F401  (registers the ids)
    from mmrl.envs.tool_env import ToolEnv

    task = gymnasium.make("mmrl/LongArithmetic-v0", digits=digits, terms=terms, operators=operators)
    env = ToolEnv(task, ["calculator"], max_calls=2, call_format="json", instructions=instructions)
    observation, _ = env.reset(seed=seed)
    expression = task.unwrapped.expression
    call = json.dumps({"tool": "calculator", "arguments": {"expression": expression}})
    turns = [[observation, call]]
    observation, _, terminated, truncated, _ = env.step(call)
    if terminated or truncated:
        raise RuntimeError(f"the calculator call ended the episode: {observation!r}")
    result = observation.rsplit("\n", 1)[-1].strip()
    answer = f"Answer: {result}"
    turns.append([observation, answer])
    _, reward, terminated, _, info = env.step(answer)
    env.close()
    if not (terminated and info.get("success")):
        raise RuntimeError(f"the demonstrated answer {answer!r} was not accepted for {expression!r}")
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.long_arithmetic.demos", description="write calculator demonstrations of mmrl/LongArithmetic-v0 behind the tool env")
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    parser.add_argument("--episodes", type=int, default=64, help="episodes, reset with seeds seed .. seed + episodes - 1")
    parser.add_argument("--seed", type=int, default=0, help="first reset seed")
    parser.add_argument("--digits", type=int, default=6, help="digits of each number")
    parser.add_argument("--terms", type=int, default=2, help="numbers in the expression")
    parser.add_argument("--operators", default="+-*", help="operators drawn between the numbers")
    parser.add_argument("--instructions", action="store_true", help="keep the tool env's instructions in the first observation (for an env with instructions: true)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"turns": calculator_episode(args.seed + i, args.digits, args.terms, args.operators, args.instructions)}) for i in range(args.episodes)]
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
