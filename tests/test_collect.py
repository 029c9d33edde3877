"""`mmrl collect` and task suites: expert demonstrations that replay, suites as data."""

import gymnasium
import numpy as np
import pytest
import yaml

from mmrl.cli import main
from mmrl.commands.collect import collect
from mmrl.demos import read_demos, read_index
from mmrl.envs.tabletop.tasks import TASKS, family_tasks
from mmrl.errors import ConfigError
from mmrl.suites import load_suite, list_suites


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_collected_demos_replay_to_the_same_observations_and_success(tmp_path):
    summary = collect(["spatial_top", "goal_blue_next_to_red"], 2, tmp_path, seed=40, env_kwargs={"image_size": 32})
    assert summary["written"] == 4 and summary["failed"] == 0
    episodes = read_demos(tmp_path)
    assert [(e.task, e.seed) for e in episodes] == [("spatial_top", 40), ("spatial_top", 41), ("goal_blue_next_to_red", 40), ("goal_blue_next_to_red", 41)]
    env = gymnasium.make("mmrl/Tabletop-v0", task=episodes[2].task, image_size=32)
    for episode in episodes[2:]:
        assert episode.success and episode.instruction == TASKS[episode.task].instruction
        assert episode.image.shape == (len(episode), 32, 32, 3) and episode.reward[-1] == 1.0
        obs, _ = env.reset(seed=episode.seed)
        for t, action in enumerate(episode.action):
            assert np.array_equal(obs["image"], episode.image[t]) and np.array_equal(obs["state"], episode.state[t])
            obs, reward, terminated, truncated, info = env.step(action)
        assert terminated and info["success"]
    env.close()
    index = read_index(tmp_path)
    assert index["env_kwargs"] == {"image_size": 32} and index["collections"][0]["seed"] == 40


def test_failures_are_counted_and_written_only_when_asked(tmp_path):
    summary = collect(["object_red"], 2, tmp_path / "a", max_episode_steps=2)
    assert summary["written"] == 0 and summary["failed"] == 2 and read_demos(tmp_path / "a") == []
    summary = collect(["object_red"], 2, tmp_path / "b", max_episode_steps=2, keep_failures=True)
    assert summary["written"] == 2 and [e.success for e in read_demos(tmp_path / "b")] == [False, False]


def test_noise_makes_demos_differ_reproducibly(tmp_path):
    collect(["goal_red_bottom_right"], 1, tmp_path / "a", seed=3)
    collect(["goal_red_bottom_right"], 1, tmp_path / "b", seed=3, noise=0.3)
    collect(["goal_red_bottom_right"], 1, tmp_path / "c", seed=3, noise=0.3)
    a, b, c = (read_demos(tmp_path / x)[0] for x in "abc")
    assert np.array_equal(b.action, c.action) and not np.array_equal(a.action[:3], b.action[:3])
    assert np.array_equal(a.image[0], b.image[0])


def test_cli_collects_a_family_and_appends(tmp_path, capsys):
    out = tmp_path / "demos"
    assert main(["collect", "--task", "object", "--episodes-per-task", "1", "--out", str(out), "--image-size", "16"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 4 episodes" in printed and "0 failed" in printed
    assert main(["collect", "--task", "goal_blue_top_left", "--episodes-per-task", "1", "--out", str(out), "--image-size", "16", "--append"]) == 0
    tasks = [e.task for e in read_demos(out)]
    assert tasks == [*family_tasks("object"), "goal_blue_top_left"]
    assert len(read_index(out)["collections"]) == 2


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--task", "spatial_lft"], ["--task", "spatial_lft", "spatial_left", "tabletop_spatial"]),
        (["--task", "spatial", "--seed", str(2**31 - 1), "--episodes-per-task", "2"], ["seed", "2**31"]),
        (["--task", "spatial", "--env-id", "Reacher-v5"], ["env_id", "Reacher-v5"]),
        (["--task", "spatial", "--episodes-per-task", "0"], ["--episodes-per-task", "positive integer"]),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, flags, expected):
    try:
        code = main(["collect", *flags, "--out", str(tmp_path / "d")])
    except SystemExit as e:  # refused by the argument parser itself
        code = e.code
    assert code == 2
    line = _error_line(capsys)
    for part in expected:
        assert part in line
    assert not (tmp_path / "d").exists()


def test_cli_refuses_a_directory_with_demos_and_appending_other_settings(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["collect", "--task", "goal_blue_top_left", "--episodes-per-task", "1", "--out", out, "--image-size", "16"]) == 0
    capsys.readouterr()
    assert main(["collect", "--task", "goal_blue_top_left", "--out", out]) == 2
    assert "already holds demonstrations" in _error_line(capsys)
    assert main(["collect", "--task", "goal_blue_top_left", "--out", out, "--append", "--image-size", "32"]) == 2
    assert "same env and kwargs" in _error_line(capsys)


# ------------------------------------------------------------------ suites


def test_builtin_suites_cover_the_families():
    assert {"tabletop_spatial", "tabletop_object", "tabletop_goal", "tabletop_all"} <= set(list_suites())
    for family in ("spatial", "object", "goal"):
        suite = load_suite(f"tabletop_{family}")
        assert suite.tasks == family_tasks(family) and suite.episodes_per_task >= 1 and suite.seeds
        assert suite.env_section()["kwargs"]["task"] == suite.tasks
    assert load_suite("tabletop_all").tasks == list(TASKS)
    for family in ("spatial", "object"):  # LIBERO-style initial states around one arrangement
        suite = load_suite(f"tabletop_{family}_nominal")
        assert suite.tasks == family_tasks(family)
        assert suite.env_section()["kwargs"]["layout"] == "nominal"


def test_a_user_written_suite_yaml_works_without_code(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "colours",
                "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "max_episode_steps": 40, "kwargs": {"image_size": 24, "cameras": ["top", "front"]}},
                "tasks": ["object_red", "object_purple"],
                "episodes_per_task": 1,
                "seeds": [5, 6],
            }
        )
    )
    suite = load_suite(path)
    assert suite.name == "colours" and suite.tasks == ["object_red", "object_purple"] and suite.seeds == [5, 6]
    env = gymnasium.make(suite.env["id"], **suite.env_section(["object_purple"])["kwargs"])
    obs, info = env.reset(seed=0)
    assert info["task"] == "object_purple" and obs["image"].shape == (2, 24, 24, 3)
    env.close()
    assert main(["collect", "--task", str(path), "--out", str(tmp_path / "d")]) == 0
    episodes = read_demos(tmp_path / "d")
    assert [e.task for e in episodes] == ["object_red", "object_purple"] and episodes[0].image.shape[1:] == (2, 24, 24, 3)
    assert read_index(tmp_path / "d")["max_episode_steps"] == 40


@pytest.mark.parametrize(
    "change, field",
    [
        ({"tasks": ["object_red", "fly"]}, "tasks"),
        ({"episodes_per_task": 0}, "episodes_per_task"),
        ({"seeds": []}, "seeds"),
        ({"colour": "red"}, "colour"),
        ({"env": {"type": "gym", "id": "NoSuchEnv-v9"}}, "env.id"),
        ({"env": {"type": "gym", "id": "mmrl/Tabletop-v0", "kwargs": {"task": "spatial"}}}, "tasks"),
    ],
)
def test_suite_errors_name_the_field(tmp_path, change, field):
    data = {"env": {"type": "gym", "id": "mmrl/Tabletop-v0"}, "tasks": ["object_red"], "episodes_per_task": 2, **change}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_suite(path)
    assert err.value.field == field


def test_an_unknown_suite_name_lists_the_builtin_ones():
    with pytest.raises(ConfigError, match="tabletop_spatial") as err:
        load_suite("tabletop_nothing")
    assert err.value.field == "suite"


def test_state_demos_train_a_state_policy_that_then_samples_the_env_with_a_critic(tmp_path, capsys):
    # obs_mode state end to end: demos without images -> SFT of a Gaussian MLP -> GAE with a
    # critic, on the same env; the SFT fits the demos (its loss falls) and RL takes a step.
    import math

    from mmrl.config import from_dict
    from mmrl.train.metrics import read_metrics
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    out = tmp_path / "demos"
    assert main(["collect", "--task", "object", "--episodes-per-task", "2", "--obs-mode", "state", "--out", str(out)]) == 0
    episodes = read_demos(out)
    assert len(episodes) == 8 and all(e.success and e.image.shape == (len(e), 0) and e.state.shape == (len(e), 26) for e in episodes)
    env = {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 4, "kwargs": {"task": "object", "obs_mode": "state", "reward_mode": "dense"}}
    base = {"env": env, "policy": {"type": "gaussian_mlp", "hidden_sizes": [32, 32], "obs_norm": True}, "sampler": {"type": "env"},
            "rewards": [{"type": "success"}], "eval": {"every": 1000, "episodes": 4, "at_start": False}, "checkpoint": {"every": 1000},
            "log": {"progress": False, "tensorboard": False}}
    sft = Trainer(from_dict(TrainConfig, {**base, "name": "sft", "total_steps": 60, "run_dir": str(tmp_path / "sft"), "optim": {"lr": 0.003},
                                          "algo": {"type": "sft"}, "data": {"path": str(out), "batch_size": 32}, "log": {**base["log"], "every": 1}}))
    sft.train()
    losses = [m["loss/sft"] for m in read_metrics(tmp_path / "sft") if "loss/sft" in m]
    assert losses[-1] < losses[0] - 0.5
    rl = Trainer(from_dict(TrainConfig, {**base, "name": "rl", "total_steps": 2, "run_dir": str(tmp_path / "rl"),
                                         "policy": {**base["policy"], "pretrained": str(tmp_path / "sft")},
                                         "critic": {"type": "mlp", "hidden_sizes": [32]},
                                         "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "kl": {"coef": 0.0},
                                                  "advantage": {"type": "gae", "gamma": 0.99, "lam": 0.95, "step_reward_weight": 1.0}}}))
    rl.train()
    rows = [m for m in read_metrics(tmp_path / "rl") if "loss/value" in m]
    assert len(rows) == 2 and all(math.isfinite(m["loss/value"]) and m["episode_length"] > 1 for m in rows)
