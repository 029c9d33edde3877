"""The image benchmark scripts run at a tiny size and print their ratios (no timing is asserted)."""

import re
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("cv2")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run(script: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    return capsys.readouterr().out


def ratios(name: str, out: str) -> list[float]:
    return [float(r) for r in re.findall(rf"^{name} \S+ \S+: (\d+\.\d+)x", out, re.MULTILINE)]


def test_denoising_overhead_prints_a_ratio_per_size_and_transition(monkeypatch, capsys):
    out = run("denoising_overhead.py", ["--sizes", "8", "--batch", "2", "--steps", "2", "--repeats", "1"], monkeypatch, capsys)
    found = ratios("denoising_overhead", out)
    assert len(found) == 2 and all(r > 0 for r in found), out


def test_image_rl_throughput_prints_a_ratio_per_size_and_transition(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    # one transition: each (size, transition) spawns a process per side
    out = run("image_rl_throughput.py", ["--sizes", "8", "--transitions", "flow_sde", "--groups", "2", "--group-size", "2", "--steps", "2", "--repeats", "1"], monkeypatch, capsys)
    found = ratios("image_rl_throughput", out)
    assert len(found) == 1 and found[0] > 0 and "by CPU time" in out, out


def test_image_rl_throughput_reports_the_peak_rss_of_a_training_run(monkeypatch, capsys):
    args = ["--rss", str(CONFIGS / "image_ddpo_jpeg.yaml"), "total_steps=1", "eval.episodes=2", "policy.tiny.resolution=8"]
    out = run("image_rl_throughput.py", args, monkeypatch, capsys)
    match = re.search(r"peak RSS: (\d+\.\d+) GB", out)
    assert match and float(match.group(1)) > 0.05, out  # at least the Python + torch process


def test_shapes_failure_modes_reads_every_held_out_image_and_its_per_prompt_counts_add_up(monkeypatch, capsys):
    monkeypatch.chdir(CONFIGS.parent)  # the config's asset path is relative to the repository
    out = run("shapes_failure_modes.py", [str(CONFIGS / "image_shapes_ddpo.yaml"), "--per-prompt", "2", "policy.denoising.num_inference_steps=2", "policy.denoising.window_size=1"], monkeypatch, capsys)
    match = re.search(r"accuracy (\d\.\d+) \((\d+) of (\d+)\); wrong number of objects in (\d+) images; (\d+) objects", out)
    assert match, out
    per_prompt = re.findall(r"^  .+: (\d+) of 2 \((.+)\)$", out, re.MULTILINE)
    assert len(per_prompt) == 11 and int(match[3]) == 22 and sum(int(hits) for hits, _ in per_prompt) == int(match[2]), out
    # each prompt's images, counted by how many objects they show, are its 2 images
    assert all(sum(int(n) for n in re.findall(r"objects in (\d+)", shown)) == 2 for _, shown in per_prompt), out
    assert int(match[4]) <= 22, out


def test_image_shapes_curves_tabulates_each_seed_and_the_mean_and_draws_the_rl_panels(monkeypatch, capsys, tmp_path):
    import json

    for seed, (final, step_s) in enumerate([(0.75, 2.0), (0.5, 4.0)]):
        run_dir = tmp_path / f"flow_s{seed}"
        run_dir.mkdir()
        rows = [{"step": s, "reward/total": 0.5 + 0.01 * s, "time/step_s": step_s} for s in range(1, 31)]
        rows += [{"step": 30, "eval/accuracy": final, "eval/accuracy_ci_low": final - 0.1, "eval/accuracy_ci_high": final + 0.1}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_png = tmp_path / "curves.png"
    with pytest.raises(SystemExit) as exit_:  # the script exits with main()'s status
        run("image_shapes_curves.py", ["--variant", f"F={tmp_path / 'flow_s'}", "--start", "F=0.25,0.5", "--out", str(out_png)], monkeypatch, capsys)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "| F | 0 | 0.250 | 0.750 [0.65, 0.85] | +0.500 | 30 | 1 min |" in out, out
    assert "| F | 1 | 0.500 | 0.500 [0.40, 0.60] | +0.000 | 30 | 2 min |" in out, out
    assert "| F | mean of 2 | 0.375 | 0.625 | +0.250 | | |" in out, out
    assert out_png.stat().st_size > 1000
