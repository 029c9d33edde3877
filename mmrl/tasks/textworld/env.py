"""``mmrl/TextWorld-v0``: TextWorld text adventures (Microsoft's ``textworld``) as a gymnasium env.

A language agent's env (docs/agents.md) over a set of TextWorld games generated offline
(``python -m mmrl.tasks.textworld.games``). ``games`` is a directory (every ``*.json`` game
in it) or a list of game files (``.json``, or ``.z8`` with its ``.json`` beside it):

- ``reset(seed)`` picks one of the games from the seed (the env's ``np_random``, so the same
  seed gives the same game) and returns the game's opening text: its objective and the first
  room, without TextWorld's ASCII banner, the ``>`` prompt and the status line;
- ``step(command)`` types the first line of the turn into the game and returns the game's
  reply, cleaned the same way. The reward is the score the command gained (the game's own
  points: 1 for each quest completed, so ``max_score`` in all), the episode terminates when the
  game is won or lost, and ``info["success"]`` is True once it is won.

``info`` also holds ``score`` and ``max_score`` (the game's), ``moves`` (the game's move count)
and ``game`` (the game's file name without its extension). Observations are at most
``max_text`` characters (a longer one is cut with a marker, and the first cut is warned about
once, with its length: TextWorld's own ``house`` theme opens with more than the default 512) of
printable ASCII. The commands
that would leave the game (``quit``, ``restart``, ``restore``, ``save``, ``undo``, ``script``)
are not passed on: the reply says so and nothing changes.

**Held-out games.** The env sampler evaluates with reset seeds of 2**31 and above and trains
below (``mmrl/samplers/env.py``); with ``eval_games`` such a seed picks one of those games
instead, so a run trains on ``games`` and evaluates on ``eval_games``.

**Compiled games.** TextWorld plays a compiled story file (``.z8``, ~380 KB, mostly Inform 7's
library) and reads the game's ``.json`` (~20 KB) beside it. A ``.json`` game without its
``.z8`` is compiled once (about 0.5 s) into ``cache_dir`` (default ``$MMRL_TEXTWORLD_CACHE``,
else ``~/.cache/mmrl/textworld``), keyed by the file's content and TextWorld's version, so the
games shipped in ``examples/textworld`` are their ``.json`` files only.

The game stays open between resets that pick it again; picking another closes it and opens
that one (~15 ms). ``textworld`` is imported only when the env is built (``pip install
'mmrl[textworld]'``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import gymnasium
from gymnasium import spaces

from mmrl.errors import ConfigError, MissingExtraError

logger = logging.getLogger(__name__)

# printable ASCII: what the observations and the agent's turns may hold
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n"
# the env sampler's evaluation reset seeds are this and above (mmrl/samplers/env.py, _TRAIN_SEEDS)
EVAL_SEEDS = 2**31
# commands that would leave, restart or rewind the game: never typed into it
META_COMMANDS = frozenset({"quit", "q", "restart", "restore", "save", "undo", "script", "unscript", "transcript", "noscript"})
REFUSED = "That command is not available in this game."
_BANNER = frozenset(" _|\\/$<>")  # the characters of TextWorld's ASCII-art title
_PROMPT = re.compile(r">\s*(-=.*=-\s*\S*)?\s*$")  # the prompt and the status line after it
_DROPPED = ("Would you like to RESTART", "Please give one of the answers above")


def clean_text(text: str) -> str:
    """A game's reply without the ASCII banner, the ``>`` prompt, the status line and the
    replay question; lines stripped, blank lines and runs of spaces squeezed, printable ASCII."""
    lines = []
    for raw in str(text).splitlines():
        line = raw.strip()
        if not line or set(line) <= _BANNER:
            continue
        line = _PROMPT.sub("", line).strip()
        if not line or line.startswith(_DROPPED):
            continue
        line = "".join(c if " " <= c <= "~" else " " for c in line)
        lines.append(" ".join(line.split()))
    return "\n".join(lines)


def game_files(games, field: str = "env.kwargs.games") -> list[Path]:
    """The ``.json`` files of the games ``games`` names: a directory (every ``*.json`` in it,
    sorted) or a file, or a list of files (``.json``, or ``.z8`` with its ``.json`` beside it).
    A ConfigError naming ``field`` when there are none or one is missing."""
    allowed = "a directory of TextWorld games (*.json, from python -m mmrl.tasks.textworld.games) or a list of game files (.json or .z8)"
    if isinstance(games, (str, os.PathLike)):
        path = Path(games)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise ConfigError(field, str(games), f"the directory holds no TextWorld games (*.json); expected {allowed}")
            return found
        items = [path]
    elif isinstance(games, (list, tuple)) and games:
        items = [Path(g) for g in games]
    else:
        raise ConfigError(field, games, f"expected {allowed}")
    out = []
    for item in items:
        if item.suffix not in (".json", ".z8"):
            raise ConfigError(field, str(item), f"no such directory, nor a game file; expected {allowed}")
        json_file = item.with_suffix(".json")
        if not json_file.is_file():
            raise ConfigError(field, str(item), f"no such file {json_file}; expected {allowed}")
        out.append(json_file)
    return out


def default_cache_dir() -> Path:
    return Path(os.environ.get("MMRL_TEXTWORLD_CACHE") or Path.home() / ".cache" / "mmrl" / "textworld")


def story_file(game_json: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The compiled story (``.z8``) of a game: the one beside its ``.json``, else one compiled
    into ``cache_dir`` once (a directory per game content; concurrent compilations of the same
    game are safe, the first one to finish is kept)."""
    beside = game_json.with_suffix(".z8")
    if beside.is_file():
        return beside
    import textworld
    from textworld.generator import Game, compile_game

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(game_json.read_bytes() + textworld.__version__.encode()).hexdigest()[:24]
    story = root / key / "game.z8"
    if story.is_file():
        return story
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        scratch.chmod(0o755)
        options = textworld.GameOptions()
        options.path, options.force_recompile = str(scratch / "game.z8"), True
        try:
            game = Game.load(str(game_json))
        except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input
            raise ConfigError("env.kwargs.games", str(game_json), f"not a TextWorld game file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        compile_game(game, options)
        try:
            os.rename(scratch, root / key)
        except OSError:  # another process compiled it first
            if not story.is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return story


_warned_cut = False


def _warn_cut(length: int, limit: int, game: str, opening: bool) -> None:
    """Once per process: an observation is longer than ``max_text`` and loses its end."""
    global _warned_cut
    if not _warned_cut:
        _warned_cut = True
        what = "opening text (its objective and first room)" if opening else "reply"
        logger.warning(
            "mmrl/TextWorld-v0: game %s's %s is %d characters, more than env.kwargs.max_text=%d, and is cut; "
            "set max_text to at least %d to keep it whole", game, what, length, limit, length,
        )


def cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = f"\n[cut at {limit} characters]"
    return text[: limit - len(marker)] + marker


class TextWorldEnv(gymnasium.Env):
    """A TextWorld game picked by the reset seed; the agent's turn is a command, the reward
    the points it scored."""

    metadata = {"render_modes": []}

    def __init__(self, games=None, eval_games=None, max_text: int = 512, cache_dir: str | None = None):
        try:
            import textworld  # noqa: F401
        except ImportError:
            raise MissingExtraError("textworld", "textworld", "mmrl/TextWorld-v0") from None
        if int(max_text) < 64:
            raise ConfigError("env.kwargs.max_text", max_text, "at least 64 characters")
        self.games = game_files(games, "env.kwargs.games")
        self.eval_games = game_files(eval_games, "env.kwargs.eval_games") if eval_games is not None else None
        self.max_text = int(max_text)
        self.cache_dir = cache_dir
        self.observation_space = spaces.Text(max_length=self.max_text, charset=CHARSET)
        self.action_space = spaces.Text(max_length=self.max_text, charset=CHARSET)
        self._pool = self.games
        self._open_game: Path | None = None
        self._tw = None  # TextWorld's env of the open game
        self.game: Path | None = None
        self.score = self.max_score = self.moves = 0
        self.over = False

    def _open(self, game: Path):
        if self._open_game == game and self._tw is not None:
            return
        import textworld

        self._close_game()
        infos = textworld.EnvInfos(score=True, max_score=True, won=True, lost=True, moves=True)
        story = str(story_file(game, self.cache_dir))
        with warnings.catch_warnings():  # jericho's "not fully supported" (its own score tracking; TextWorld tracks the score)
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            self._tw = textworld.start(story, request_infos=infos)
        self._open_game = game

    def _close_game(self):
        if self._tw is not None:
            self._tw.close()
        self._tw, self._open_game = None, None

    def _info(self, won: bool = False) -> dict:
        return {"success": bool(won), "score": int(self.score), "max_score": int(self.max_score), "moves": int(self.moves), "game": self.game.stem}

    def _text(self, raw: str, opening: bool = False) -> str:
        text = clean_text(raw) or "..."
        if len(text) > self.max_text:
            _warn_cut(len(text), self.max_text, self.game.stem, opening)
        return cut(text, self.max_text)

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self._pool = self.eval_games if self.eval_games is not None and seed >= EVAL_SEEDS else self.games
        self.game = self._pool[int(self.np_random.integers(len(self._pool)))]
        self._open(self.game)
        state = self._tw.reset()
        self.score, self.max_score, self.moves, self.over = int(state["score"] or 0), int(state["max_score"] or 0), int(state["moves"] or 0), False
        return self._text(state.feedback, opening=True), self._info()

    def step(self, action: str):
        if self.over:
            return "The game is over.", 0.0, True, False, self._info(won=False)
        lines = [line.strip() for line in str(action).splitlines() if line.strip()]
        # printable ASCII but the backslash, which the interpreter (dumb frotz) reads as an escape
        command = "".join(c if " " <= c <= "~" and c != "\\" else " " for c in (lines[0] if lines else ""))[:200].strip()
        if command.split(" ", 1)[0].lower().rstrip(".!") in META_COMMANDS:
            return REFUSED, 0.0, False, False, self._info()
        state, score, done = self._tw.step(command)
        won, lost = bool(state["won"]), bool(state["lost"])
        reward = float(int(score) - self.score)
        self.score, self.moves = int(score), int(state["moves"] or 0)
        self.over = bool(done or won or lost)
        return self._text(state.feedback), reward, self.over, False, self._info(won=won)

    def close(self):
        self._close_game()
        super().close()
