"""Demonstrations of a MiniGrid level with text actions: the shortest walk to the goal, played
in ``mmrl/MiniGridText-v0`` itself, with each observation's image saved beside the file.

    python -m mmrl.tasks.minigrid_text.demos --out DIR --episodes 64 --seed 0 [--level MiniGrid-Empty-5x5-v0]

writes ``DIR/demos.jsonl``, one episode per line, ``{"turns": [[observation, action], ...]}``
with each observation ``{"text": ..., "image": "images/e<episode>_t<turn>.png"}`` (the
``conversations`` data source reads the PNG files relative to the .jsonl), and the images.
The actions are the words of :meth:`MiniGridTextEnv.shortest_actions`; the observations are
the env's own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def shortest_walk_episode(seed: int, level: str = "MiniGrid-Empty-5x5-v0", tile_size: int = 8) -> list[tuple[dict, str]]:
    """The (observation, action word) turns of one episode reset with ``seed``, walking the
    shortest path to the goal; raises if the walk does not reach it."""
    from mmrl.tasks.minigrid_text.env import MiniGridTextEnv

    env = MiniGridTextEnv(level=level, tile_size=tile_size)
    observation, _ = env.reset(seed=seed)
    turns = []
    for word in env.shortest_actions():
        turns.append((observation, word))
        observation, _, terminated, truncated, info = env.step(word)
        if terminated or truncated:
            break
    env.close()
    if not turns or not info.get("success"):
        raise RuntimeError(f"the shortest walk of {level} reset with seed {seed} does not reach the goal")
    return turns


def write_demos(out: Path, episodes: int, seed: int = 0, level: str = "MiniGrid-Empty-5x5-v0", tile_size: int = 8) -> Path:
    """``out/demos.jsonl`` and ``out/images/`` (module docstring); returns the .jsonl path."""
    import cv2

    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for e in range(episodes):
        turns = []
        for t, (observation, word) in enumerate(shortest_walk_episode(seed + e, level, tile_size)):
            name = f"images/e{e}_t{t}.png"
            cv2.imwrite(str(out / name), cv2.cvtColor(observation["image"], cv2.COLOR_RGB2BGR))
            turns.append([{"text": observation["text"], "image": name}, word])
        lines.append(json.dumps({"turns": turns}))
    path = out / "demos.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.minigrid_text.demos", description="write shortest-walk demonstrations of mmrl/MiniGridText-v0, images beside them")
    parser.add_argument("--out", required=True, help="the directory to write demos.jsonl and images/ into")
    parser.add_argument("--episodes", type=int, default=64, help="episodes, reset with seeds seed .. seed + episodes - 1")
    parser.add_argument("--seed", type=int, default=0, help="first reset seed")
    parser.add_argument("--level", default="MiniGrid-Empty-5x5-v0", help="the MiniGrid level")
    parser.add_argument("--tile-size", type=int, default=8, help="pixels per grid cell of the agent's view")
    args = parser.parse_args(argv)
    print(write_demos(Path(args.out), args.episodes, args.seed, args.level, args.tile_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
