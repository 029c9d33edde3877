"""Demonstrations of guess-the-number: binary search, played in the env itself.

    python -m mmrl.tasks.guess_number.demos --out demos.jsonl --episodes 64 --seed 0

writes one episode per line, ``{"turns": [[observation, action], ...]}`` (the
``conversations`` data source of ``algo.type: sft``). Each action is the midpoint of the range
left, written as ``"{guess}"``; the observations are the env's own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gymnasium


def binary_search_episode(seed: int, low: int = 1, high: int = 16, max_turns: int = 6) -> list[list[str]]:
    """The turns of one episode of ``mmrl/GuessNumber-v0`` reset with ``seed``, played by
    binary search (it always finds the number within ceil(log2(high − low + 1)) + 1 turns)."""
    import mmrl.envs  # noqa: F401  (registers the id)

    env = gymnasium.make("mmrl/GuessNumber-v0", low=low, high=high, max_episode_steps=max_turns)
    observation, _ = env.reset(seed=seed)
    lo, hi, turns = low, high, []
    for _ in range(max_turns):
        guess = (lo + hi) // 2
        turns.append([observation, str(guess)])
        observation, _, terminated, truncated, _ = env.step(str(guess))
        if terminated or truncated:
            break
        lo, hi = (guess + 1, hi) if observation == "Higher." else (lo, guess - 1)
    env.close()
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.guess_number.demos", description="write binary-search demonstrations of mmrl/GuessNumber-v0")
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    parser.add_argument("--episodes", type=int, default=64, help="episodes, reset with seeds seed .. seed + episodes - 1")
    parser.add_argument("--seed", type=int, default=0, help="first reset seed")
    parser.add_argument("--low", type=int, default=1, help="smallest number")
    parser.add_argument("--high", type=int, default=16, help="largest number")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"turns": binary_search_episode(args.seed + i, args.low, args.high)}) for i in range(args.episodes)]
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
