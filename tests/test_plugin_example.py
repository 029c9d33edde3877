"""examples/plugin_env: a simulator outside mmrl plugs in by gymnasium id or by entry point."""

import json
import os

import yaml

from .conftest import ROOT, run_mmrl

EXAMPLE = ROOT / "examples" / "plugin_env"
TINY = ["total_steps=2", "env.num_envs=4", "algo.group_size=2", "algo.groups_per_step=2", "eval.episodes=4", "log.progress=false", "log.tensorboard=false"]


def _pythonpath(*dirs) -> dict:
    return {"PYTHONPATH": os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mmrl_trains_on_the_example_env_by_its_gymnasium_id(tmp_path):
    config = EXAMPLE / "configs" / "plugin_reach_gym_id.yaml"
    assert yaml.safe_load(config.read_text())["env"] == {"type": "gym", "id": "mmrl_plugin_example:PluginReach-v0", "num_envs": 16}
    proc = run_mmrl("train", config, *TINY, "--run-dir", tmp_path / "run", env=_pythonpath(EXAMPLE))
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = _metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if "success_rate" in m] == [1, 2]
    assert metrics[-1]["eval/episodes"] == 4


def _fake_install(site) -> None:
    """What `pip install` leaves for the entry point: a dist-info with entry_points.txt
    (importlib.metadata reads it from any sys.path entry)."""
    info = site / "mmrl_plugin_example-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mmrl-plugin-example\nVersion: 0.1.0\n")
    entry_points = (EXAMPLE / "pyproject.toml").read_text().split('[project.entry-points."mmrl.envs"]')[1].split("[")[0].strip()
    assert entry_points == 'plugin_reach = "mmrl_plugin_example.adapter"'
    (info / "entry_points.txt").write_text(f"[mmrl.envs]\n{entry_points.replace(chr(34), '')}\n")


def test_an_mmrl_envs_entry_point_makes_the_plugin_env_type_resolve(tmp_path):
    _fake_install(tmp_path / "site")
    env = _pythonpath(tmp_path / "site", EXAMPLE)
    listed = run_mmrl("list", "envs", env=env)
    assert listed.returncode == 0 and "plugin_reach" in listed.stdout
    config = EXAMPLE / "configs" / "plugin_reach_entry_point.yaml"
    assert yaml.safe_load(config.read_text())["env"]["type"] == "plugin_reach"
    proc = run_mmrl("train", config, *TINY, "--run-dir", tmp_path / "run", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [m["step"] for m in _metrics(tmp_path / "run") if "success_rate" in m] == [1, 2]
    # the plugin's own config fields are checked like mmrl's
    bad = run_mmrl("train", config, "env.tolerance=1.5", "--run-dir", tmp_path / "bad", env=env)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("env.tolerance: got 1.5; must be < 1 (the line is [-1, 1])")


def test_without_the_entry_point_the_plugin_type_is_unknown(tmp_path):
    proc = run_mmrl("train", EXAMPLE / "configs" / "plugin_reach_entry_point.yaml", "--run-dir", tmp_path / "run", env=_pythonpath(EXAMPLE))
    assert proc.returncode == 2 and "env.type: got 'plugin_reach'; known envs:" in proc.stderr
