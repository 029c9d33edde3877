"""``mmrl/TextWorld-v0`` (mmrl/tasks/textworld): games generated offline, their walkthroughs win
with the maximum score, a wrong command scores nothing, resets are deterministic by seed (the
evaluation seeds pick the held-out games), the demonstrations are the env's own observations
and read as SFT data, a tiny agent trains on the env by SFT and GRPO, bad ``games`` fail in one
line."""

import json
import sys

import gymnasium
import pytest

pytest.importorskip("textworld")
pytest.importorskip("transformers")

import mmrl.envs  # noqa: E402,F401  (registers mmrl/TextWorld-v0)
from mmrl.config import from_dict  # noqa: E402
from mmrl.errors import ConfigError, MissingExtraError  # noqa: E402
from mmrl.tasks.textworld.env import EVAL_SEEDS, REFUSED, TextWorldEnv, story_file  # noqa: E402
from mmrl.tasks.textworld.games import compile_beside, main, make_game  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """Two train games and one held-out game (json only, compiled into a cache of their own),
    with the demonstration of one more game."""
    root = tmp_path_factory.mktemp("textworld")
    cache = root / "cache"
    assert main(["--out", str(root / "games"), "--train", "2", "--eval", "1", "--seed", "3", "--world-size", "1", "--nb-objects", "2",
                 "--extra-demos", "1", "--json-only", "--cache-dir", str(cache)]) == 0
    return root / "games", cache


def make_env(games, **kwargs):
    out, cache = games
    return gymnasium.make("mmrl/TextWorld-v0", games=str(out / "train"), cache_dir=str(cache), **kwargs)


def test_generation_writes_the_games_their_demonstrations_and_their_settings(games):
    out, cache = games
    info = json.loads((out / "info.json").read_text())
    train, held_out = sorted((out / "train").glob("*.json")), sorted((out / "eval").glob("*.json"))
    assert [p.name for p in train] == [g["file"] for g in info["train"]] and len(train) == 2
    assert [p.name for p in held_out] == [g["file"] for g in info["eval"]] and len(held_out) == 1
    assert not list(out.rglob("*.z8"))  # --json-only: compiled on first use, into the cache
    # no path of the generating machine in the games (TextWorld saves its install directory)
    assert all(sys.prefix not in p.read_text() and json.loads(p.read_text())["KB"]["text_grammars_path"] == "" for p in train + held_out)
    assert len(list(cache.glob("*/game.z8"))) == 3
    assert {g["seed"] for g in info["train"]}.isdisjoint(g["seed"] for g in info["eval"])
    assert len((out / "demos.jsonl").read_text().splitlines()) == 3  # the train games' and the extra one's
    assert len(info["extra_demos"]) == 1 and info["extra_demos"][0]["seed"] > max(g["seed"] for g in info["train"] + info["eval"])
    # a game compiled beside its .json is played from there
    z8 = compile_beside(train[0])
    assert story_file(train[0], cache) == z8 and z8.stat().st_size > 100_000
    z8.unlink()
    assert make_game(3, world_size=1, nb_objects=2, quest_length=2).objective == make_game(3, world_size=1, nb_objects=2, quest_length=2).objective


def test_the_walkthrough_wins_with_the_max_score_and_a_wrong_command_scores_nothing(games):
    out, cache = games
    for game in json.loads((out / "info.json").read_text())["train"]:
        env = gymnasium.make("mmrl/TextWorld-v0", games=[str(out / "train" / game["file"])], cache_dir=str(cache), max_episode_steps=20)
        observation, info = env.reset(seed=0)
        assert "$$" not in observation and ">" not in observation and 0 < len(observation) <= 512 and info["success"] is False
        assert env.observation_space.contains(observation) and info["max_score"] == game["max_score"] >= 1
        for command in ("dance", "quit", "\\help", "", "restart\nlook"):  # not a verb; left out; an escape; empty; meta command
            text, reward, terminated, truncated, info = env.step(command)
            assert (reward, terminated, truncated, info["success"], info["score"]) == (0.0, False, False, False, 0)
            assert env.observation_space.contains(text)
        assert env.step("quit")[0] == REFUSED
        rewards = []
        for i, command in enumerate(game["walkthrough"]):
            text, reward, terminated, truncated, info = env.step(command)
            rewards.append(reward)
            assert terminated == (i == len(game["walkthrough"]) - 1) and not truncated
        assert info["success"] and info["score"] == info["max_score"] == sum(rewards) and info["game"] == game["file"][:-5]
        env.close()


def test_resets_are_deterministic_by_seed_and_evaluation_seeds_pick_the_held_out_games(games):
    from mmrl.samplers.env import _TRAIN_SEEDS

    out, _ = games
    assert EVAL_SEEDS == _TRAIN_SEEDS  # the sampler's evaluation seeds are the env's cue
    a, b = make_env(games), make_env(games)
    seeds = [0, 1, 2, 3, 5, 8, 2**31 + 7]
    first = [a.reset(seed=s) for s in seeds]
    assert first == [b.reset(seed=s) for s in seeds] == [a.reset(seed=s) for s in seeds]
    train = {p.stem for p in (out / "train").glob("*.json")}
    assert {info["game"] for _, info in first} == train  # both games come up
    held_out = make_env(games, eval_games=str(out / "eval"))
    assert held_out.reset(seed=0) == first[0]  # a training seed: the train games
    assert {held_out.reset(seed=EVAL_SEEDS + s)[1]["game"] for s in range(4)} == {p.stem for p in (out / "eval").glob("*.json")}
    for env in (a, b, held_out):
        env.close()


def test_the_demonstrations_are_the_envs_observations_and_read_as_sft_data(games):
    from mmrl.data.sources import Conversations, ConversationsConfig

    out, cache = games
    demos = [json.loads(line)["turns"] for line in (out / "demos.jsonl").read_text().splitlines()]
    for game, turns in zip(json.loads((out / "info.json").read_text())["train"], demos):
        env = TextWorldEnv(games=[str(out / "train" / game["file"])], cache_dir=str(cache))
        observation, _ = env.reset(seed=0)
        for (demo_observation, command), expected_command in zip(turns, game["walkthrough"]):
            assert (demo_observation, command) == (observation, expected_command)
            observation = env.step(command)[0]
        env.close()
    source = Conversations(ConversationsConfig(path=str(out / "demos.jsonl")), None, 0, 1, 0)
    assert source.samples["turns"] == [[tuple(t) for t in turns] for turns in demos]


def _config(games, **changes):
    out, cache = games
    cfg = {
        "name": "textworld", "seed": 0, "total_steps": 1, "device": "cpu",
        "env": {"type": "gym", "id": "mmrl/TextWorld-v0", "num_envs": 4, "max_episode_steps": 3,
                "kwargs": {"games": str(out / "train"), "eval_games": str(out / "eval"), "cache_dir": str(cache)}},
        "sampler": {"type": "env"},
        "policy": {"type": "text_agent", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "max_position_embeddings": 1024},
                   "generation": {"max_new_tokens": 12}, "max_context_tokens": 1024},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.0}},
        "eval": {"at_start": False, "at_end": True, "episodes": 4}, "log": {"progress": False, "tensorboard": False},
    }
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return from_dict(TrainConfig, cfg)


def test_a_tiny_agent_takes_an_sft_step_then_a_grpo_update_on_the_games(games, tmp_path):
    from mmrl.train.trainer import train

    out, _ = games
    sft = train(_config(games, algo={"type": "sft"}, data={"type": "conversations", "path": str(out / "demos.jsonl"), "batch_size": 2}), tmp_path / "sft")
    assert sft["step"] == 1 and (tmp_path / "sft" / "checkpoints" / "latest").is_file()
    grpo = train(_config(games, policy={"pretrained": str(tmp_path / "sft")}), tmp_path / "grpo")
    assert grpo["step"] == 1
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "episode_length" in r]
    assert trained and 1 <= trained[0]["episode_length"] <= 3
    assert any(r.get("eval/episodes") == 4 for r in rows)  # evaluated on the held-out game at the end


def test_bad_games_fail_in_one_line_naming_the_kwarg(games, tmp_path, monkeypatch):
    from mmrl.train.trainer import Trainer

    out, _ = games
    (tmp_path / "empty").mkdir()
    cases = [
        ({"games": str(tmp_path / "empty")}, "env.kwargs.games", "holds no TextWorld games"),
        ({"games": str(tmp_path / "missing")}, "env.kwargs.games", "no such directory, nor a game file"),
        ({"games": [str(out / "train" / "nope.z8")]}, "env.kwargs.games", "nope.json; expected"),
        ({"games": None}, "env.kwargs.games", "a directory of TextWorld games"),
        ({"games": str(out / "train"), "eval_games": []}, "env.kwargs.eval_games", "a directory of TextWorld games"),
    ]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^env.kwargs.games: got '.*bad.json'; not a TextWorld game file"):
        TextWorldEnv(games=[str(tmp_path / "bad.json")], cache_dir=str(tmp_path / "cache")).reset(seed=0)
    for kwargs, field, says in cases:
        with pytest.raises(ConfigError, match=field) as error:
            TextWorldEnv(**kwargs)
        assert says in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^env.kwargs.games: got '.*empty'; the directory holds no TextWorld games"):
        Trainer(_config(games, env={"kwargs": {"games": str(tmp_path / "empty")}}), tmp_path / "run")
    monkeypatch.setitem(__import__("sys").modules, "textworld", None)
    with pytest.raises(MissingExtraError, match=r"mmrl/TextWorld-v0 needs the 'textworld' package: pip install 'mmrl\[textworld\]'"):
        TextWorldEnv(games=str(out / "train"))


def test_a_game_whose_opening_is_longer_than_max_text_is_warned_about_once_with_its_length(games, tmp_path, monkeypatch, caplog):
    from mmrl.tasks.textworld import env as textworld_env
    from mmrl.tasks.textworld.games import save_game

    _, cache = games
    save_game(make_game(3, world_size=1, nb_objects=2, quest_length=2, theme="house"), tmp_path / "house.json")  # tw-make's default theme
    monkeypatch.setattr(textworld_env, "_warned_cut", False)
    whole = TextWorldEnv(games=[str(tmp_path / "house.json")], max_text=4096, cache_dir=str(cache))
    opening = whole.reset(seed=0)[0]
    assert len(opening) > 512 and not caplog.records  # what the default max_text cuts
    env = TextWorldEnv(games=[str(tmp_path / "house.json")], cache_dir=str(cache))
    with caplog.at_level("WARNING", logger="mmrl.tasks.textworld.env"):
        cut_opening = env.reset(seed=0)[0]
        env.reset(seed=1)
    assert len(cut_opening) == 512 and cut_opening.endswith("[cut at 512 characters]")
    assert [r.getMessage() for r in caplog.records] == [
        f"mmrl/TextWorld-v0: game house's opening text (its objective and first room) is {len(opening)} characters, more than env.kwargs.max_text=512, "
        f"and is cut; set max_text to at least {len(opening)} to keep it whole"
    ]
    for e in (whole, env):
        e.close()
