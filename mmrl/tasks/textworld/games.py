"""TextWorld games and their walkthroughs, generated offline.

    python -m mmrl.tasks.textworld.games --out DIR --train 32 --eval 16 --seed 0

writes ``DIR/train/*.json`` and ``DIR/eval/*.json`` (TextWorld's game files; with each its
compiled ``.z8`` unless ``--json-only``), ``DIR/demos.jsonl`` (one episode per train game, its
walkthrough played through :class:`~mmrl.tasks.textworld.env.TextWorldEnv`, so the
observations are the env's own: the ``conversations`` data source of ``algo.type: sft``,
``{"turns": [[observation, command], ...]}``) and ``DIR/info.json`` (the settings, each game's
seed and walkthrough). ``--extra-demos K`` appends the walkthroughs of K more games (made,
played and thrown away): SFT data beyond the train games, since a tiny model that sees only a
few dozen games memorizes them.

Games are made with TextWorld's generator (``textworld.generator.make_game``, Inform 7 ships in
the wheel) from seeds ``seed, seed + 1, ...``: the first ``--train`` distinct games are the
train set, the next ``--eval`` the held-out set (other seeds, and never a copy of a train
game), the next ``--extra-demos`` the extra demonstrations' games. A seed whose quest cannot
be generated, a game equal to an earlier one, or one whose walkthrough does not win it with
its maximum score is skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from mmrl.errors import MissingExtraError


def make_game(seed: int, world_size: int = 2, nb_objects: int = 3, quest_length: int = 2, theme: str = "basic"):
    """TextWorld's ``Game`` from ``seed`` (rooms, objects, quest and text all seeded), or None
    when no quest of that length can be made."""
    try:
        import textworld
        from textworld.generator import make_game as tw_make_game
        from textworld.generator.chaining import QuestGenerationError
    except ImportError:
        raise MissingExtraError("textworld", "textworld", "python -m mmrl.tasks.textworld.games") from None
    options = textworld.GameOptions()
    options.seeds = int(seed)
    options.nb_rooms, options.nb_objects = int(world_size), int(nb_objects)
    options.chaining.min_length = options.chaining.max_length = options.chaining.max_depth = int(quest_length)
    options.grammar.theme = theme
    try:
        return tw_make_game(options)
    except QuestGenerationError:
        return None


def _identity(game) -> str:
    """What makes two games the same game: the initial state, the quests and the text."""
    facts = sorted(str(f) for f in game.world.facts)
    return json.dumps([facts, game.objective, [q.commands for q in game.quests]])


def save_game(game, path: Path) -> None:
    """``game.save(path)`` without the one machine-specific field TextWorld writes: its
    knowledge base's ``text_grammars_path`` (the generating machine's install directory),
    which loading, compiling and playing the game never read."""
    game.save(str(path))
    data = json.loads(path.read_text())
    data["KB"]["text_grammars_path"] = ""
    path.write_text(json.dumps(data))


def compile_beside(game_json: Path) -> Path:
    """Compile the game of ``game_json`` into the ``.z8`` beside it."""
    import textworld
    from textworld.generator import Game, compile_game

    options = textworld.GameOptions()
    options.path, options.force_recompile = str(game_json.with_suffix(".z8")), True
    compile_game(Game.load(str(game_json)), options)
    game_json.with_suffix(".ni").unlink(missing_ok=True)  # the Inform 7 source
    return game_json.with_suffix(".z8")


def play_walkthrough(game_json: Path, commands: list[str], cache_dir=None, max_text: int = 512) -> tuple[list[list[str]], bool, int, int]:
    """The turns ``[[observation, command], ...]`` of ``commands`` played in
    :class:`TextWorldEnv` on this one game, whether the game was won, its score and max score."""
    from mmrl.tasks.textworld.env import TextWorldEnv

    env = TextWorldEnv(games=[str(game_json)], max_text=max_text, cache_dir=cache_dir)
    try:
        observation, info = env.reset(seed=0)
        turns, won = [], False
        for command in commands:
            turns.append([observation, command])
            observation, _, terminated, _, info = env.step(command)
            won = won or info["success"]
            if terminated:
                break
        return turns, won, info["score"], info["max_score"]
    finally:
        env.close()


def write_games(out, num_train: int, num_eval: int, seed: int = 0, world_size: int = 2, nb_objects: int = 3, quest_length: int = 2,
                theme: str = "basic", json_only: bool = False, cache_dir=None, max_text: int = 512, extra_demos: int = 0, log=print) -> dict:
    """Generate the train and held-out games into ``out`` with the demonstrations of the train
    games, and of ``extra_demos`` more games (distinct from both sets, not kept); returns what
    ``out/info.json`` holds."""
    out = Path(out)
    dirs = {"train": out / "train", "eval": out / "eval"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    settings = {"world_size": world_size, "nb_objects": nb_objects, "quest_length": quest_length, "theme": theme}
    seen, demos, made = set(), [], {"train": [], "eval": [], "extra_demos": []}
    seeds, skipped, start = itertools.count(int(seed)), 0, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmrl_textworld_") as scratch:
        # the extra demonstrations' games live (and are compiled) in a scratch directory only
        dirs["extra_demos"] = Path(scratch) / "games"
        dirs["extra_demos"].mkdir()
        for split, wanted in (("train", num_train), ("eval", num_eval), ("extra_demos", extra_demos)):
            while len(made[split]) < wanted:
                if skipped > 100 + 10 * (num_train + num_eval + extra_demos):
                    raise RuntimeError(f"only {len(made['train'])} train, {len(made['eval'])} held-out and {len(made['extra_demos'])} extra games after "
                                       f"{skipped} seeds skipped: no more distinct winnable games of {settings}; try larger sizes or fewer games")
                game_seed = next(seeds)
                game = make_game(game_seed, **settings)
                if game is None or _identity(game) in seen:
                    skipped += 1
                    continue
                path = dirs[split] / f"game_{game_seed:05d}.json"
                save_game(game, path)
                kept = split != "extra_demos"
                if kept and not json_only:
                    compile_beside(path)
                turns, won, score, max_score = play_walkthrough(path, list(game.walkthrough or []), cache_dir if kept else Path(scratch) / "cache", max_text)
                if not won or score != max_score:
                    for suffix in (".json", ".z8"):
                        path.with_suffix(suffix).unlink(missing_ok=True)
                    skipped += 1
                    continue
                seen.add(_identity(game))
                made[split].append({"file": path.name, "seed": game_seed, "walkthrough": list(game.walkthrough), "max_score": max_score})
                if split != "eval":
                    demos.append(turns)
    seconds = time.perf_counter() - start
    (out / "demos.jsonl").write_text("".join(json.dumps({"turns": turns}) + "\n" for turns in demos))
    made["extra_demos"] = [{"seed": g["seed"], "walkthrough": g["walkthrough"]} for g in made["extra_demos"]]
    info = {**settings, "seed": seed, "json_only": json_only, "max_text": max_text, "skipped_seeds": skipped,
            "seconds_per_game": round(seconds / max(1, num_train + num_eval + extra_demos), 3), **made}
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"wrote {num_train} train and {num_eval} held-out games to {out} ({info['seconds_per_game']} s per game, {skipped} seeds skipped), "
        f"and {len(demos)} demonstrations ({extra_demos} of other games) to {out / 'demos.jsonl'}")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.textworld.games", description="generate TextWorld games (train and held-out) and walkthrough demonstrations")
    parser.add_argument("--out", required=True, help="directory to write train/, eval/, demos.jsonl and info.json into")
    parser.add_argument("--train", type=int, default=32, help="train games (each with one demonstration)")
    parser.add_argument("--eval", type=int, default=16, help="held-out games")
    parser.add_argument("--extra-demos", type=int, default=0, help="demonstrations of this many more games (distinct from the train and held-out ones, not kept): SFT data beyond the train games")
    parser.add_argument("--seed", type=int, default=0, help="first generation seed (the games take the next distinct ones)")
    parser.add_argument("--world-size", type=int, default=2, help="rooms per game")
    parser.add_argument("--nb-objects", type=int, default=3, help="objects per game")
    parser.add_argument("--quest-length", type=int, default=2, help="commands the quest takes")
    parser.add_argument("--theme", default="basic", help="TextWorld's text grammar: basic (short, plain sentences) or house (longer, chatty)")
    parser.add_argument("--json-only", action="store_true", help="write each game's .json only (~20 KB; the env compiles the ~380 KB .z8 into its cache on first use)")
    parser.add_argument("--cache-dir", default=None, help="where games without a .z8 are compiled (default $MMRL_TEXTWORLD_CACHE or ~/.cache/mmrl/textworld)")
    parser.add_argument("--max-text", type=int, default=512, help="the env's max_text for the demonstrations' observations")
    args = parser.parse_args(argv)
    if args.train < 1 or args.eval < 0 or args.extra_demos < 0:
        parser.error("--train must be >= 1, --eval and --extra-demos >= 0")
    write_games(args.out, args.train, args.eval, args.seed, args.world_size, args.nb_objects, args.quest_length, args.theme,
                args.json_only, args.cache_dir, args.max_text, args.extra_demos)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
