"""`mmrl train-reward`: a pairwise reward model through the training loop, from the command line."""

import json

import pytest

from mmrl.cli import main
from tests.conftest import run_mmrl

pytest.importorskip("cv2")

TINY = {"type": "bt_image", "image_size": 16, "channels": [8, 16], "hidden": 16, "prompt": {"dim": 8, "buckets": 64}}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from mmrl.data.preferences import write_preferences
    from mmrl.tasks.shapes.world import ObjectGroup, Scene, render_scene

    root = tmp_path_factory.mktemp("pairs")
    images, rows = [], {"train": [], "held_out": []}
    for i, (colour, other) in enumerate([("red", "blue"), ("blue", "green"), ("green", "red"), ("yellow", "cyan")] * 3):
        images += [render_scene(Scene((ObjectGroup(1, colour, "square"),)), 16, 2 * i), render_scene(Scene((ObjectGroup(1, other, "square"),)), 16, 2 * i + 1)]
        rows["train" if i < 8 else "held_out"].append({"prompt": f"a {colour} square", "chosen": 2 * i, "rejected": 2 * i + 1, "metadata": {"category": colour}})
    write_preferences(root, "image", rows, images)
    return root


def _config(pairs, **changes):
    cfg = {"name": "rm", "seed": 0, "total_steps": 2, "policy": dict(TINY), "algo": {"type": "sft"},
           "data": {"type": "preferences", "path": str(pairs), "batch_size": 4}, "eval": {"every": 1},
           "checkpoint": {"every": 1}, "log": {"progress": False, "tensorboard": False}}
    cfg.update(changes)
    return cfg


def test_train_reward_runs_resumes_and_evaluates_through_the_command_line(tmp_path, pairs, write_config):
    path = write_config(_config(pairs))
    run = tmp_path / "run"
    first = run_mmrl("train-reward", path, "--run-dir", run)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "held-out pairwise accuracy" in first.stdout and "over 4 pairs" in first.stdout
    resumed = run_mmrl("train-reward", run, "total_steps=4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss/sft" in r] == [1, 2, 3, 4]
    evals = [r for r in records if "eval/pairwise_accuracy" in r]
    assert evals and all(0 <= r["eval/pairwise_accuracy_ci_low"] <= r["eval/pairwise_accuracy"] <= r["eval/pairwise_accuracy_ci_high"] <= 1 for r in evals)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    evaluated = run_mmrl("eval", run)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    result = json.loads(evaluated.stdout)
    assert result["pairs"] == 4 and result["pairwise_accuracy"] == evals[-1]["eval/pairwise_accuracy"]
    assert [result[f"pairwise_accuracy/{c}/n"] for c in ("blue", "green", "red", "yellow")] == [1, 1, 1, 1]  # per metadata category


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"policy": {"type": "gaussian_mlp"}}, ["policy.type", "gaussian_mlp", "bt_image"]),
        ({"algo": {"type": "rl"}}, ["algo.type", "rl", "sft"]),
        ({"data": {"type": "completions", "path": "x.jsonl"}}, ["data.type", "completions", "preferences"]),
        ({"policy": {"type": "bt_image_set", "image_size": 16}}, ["data.path", "image pairs", "image_set"]),
        ({"data": {"type": "preferences", "path": "/no/such/dir"}}, ["data.path", "/no/such/dir", "info.json"]),
        ({"policy": {**TINY, "channels": []}}, ["policy.channels", "[]"]),
    ],
)
def test_bad_train_reward_input_exits_2_with_one_line(tmp_path, pairs, write_config, capsys, changes, expected):
    path = write_config(_config(pairs, **changes))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    for part in expected:
        assert part in line, line


def test_train_reward_help_documents_the_reward_model_fields(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-reward", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for text in ("policy with type: bt_image", "policy with type: bt_text", "data with type: preferences", "rewards[i] with type: pairwise_preference", "policy.prompt"):
        assert text in out
