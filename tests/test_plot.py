"""``mmrl plot``: which panels a run's metrics get (headline, diagnostics, categories,
constants left out, interval bands), where records without the counter sit, smoothing, and
the PNGs written for the metric shapes of the robot, text and image demos."""

import json
import math
import random

import pytest

from mmrl.core.statistics import wilson_interval
from mmrl.errors import ConfigError
from mmrl.config import load_yaml
from mmrl.commands.plot import (
    HEADLINE_TRAIN,
    UPDATE_TIME,
    categories_of,
    ema,
    headline_training,
    initial_evaluation,
    plan_panels,
    plot_run,
    reward_weights,
    smoothing_weight,
    with_update_time,
    x_axis,
    x_values,
)
from tests.conftest import ROOT

EVAL_EPISODES = 50


def _rate_with_interval(key: str, rate: float, n: int) -> dict:
    hits = round(rate * n)
    low, high = wilson_interval(hits, n)
    return {key: hits / n, f"{key}_ci_low": low, f"{key}_ci_high": high}


def _training(step: int, rng: random.Random, progress: float) -> dict:
    """What every RL step logs (mmrl/train/trainer.py), noisy around a learning trend."""
    return {
        "adv/abs_mean": 0.8 + 0.05 * rng.random(),
        "decisions": 1200.0 - 800 * progress + 50 * rng.random(),
        "entropy": 1.8 - 1.2 * progress,
        "loss/policy": -0.01 + 0.01 * rng.random(),
        "grad_norm": 0.4 + 2 * progress + 0.3 * rng.random(),
        "approx_kl": 0.015 + 0.01 * rng.random(),
        "objective/ratio": 1.0 + 0.01 * (rng.random() - 0.5),
        "objective/clipped": 0.1 + 0.08 * rng.random(),
        "time/sample_s": 0.8 + 0.1 * rng.random(),
        "time/step_s": 1.3 + 0.2 * rng.random(),
        "optim/lr": 3e-4,
    }


def robot_records(steps: int = 60, every: int = 20) -> list[dict]:
    """An env run (PushCube-like): env_steps, an evaluation before training at step 0,
    evaluations with 95% intervals every ``every`` steps, and the evaluation after the last
    step as a record of its own, without env_steps."""
    rng = random.Random(0)

    def evaluation(rate: float) -> dict:
        return {**_rate_with_interval("eval/success_rate", rate, EVAL_EPISODES), "eval/return_mean": 10 * rate, "eval/length_mean": 50 - 20 * rate, "eval/episodes": EVAL_EPISODES}

    records = [{"step": 0, **evaluation(0.1)}]
    for step in range(1, steps + 1):
        progress = step / steps
        success = min(1.0, max(0.0, 0.1 + 0.8 * progress + 0.2 * (rng.random() - 0.5)))
        r = {"step": step, "success_rate": success, "episode_return": 10 * success, "episode_length": 50 - 20 * success}
        r |= {"reward/success": success, "reward/total": success, **_training(step, rng, progress), "env_steps": 512.0 * step}
        if step % every == 0 and step < steps:
            r |= evaluation(0.1 + 0.8 * progress)
        records.append(r)
    records.append({"step": steps, **evaluation(0.85)})
    return records


def text_records(steps: int = 50, every: int = 10) -> list[dict]:
    """A prompt run (text demo): no counter, accuracy per category with intervals and counts,
    a constant learning rate and number of evaluation samples, no evaluation at step 0."""
    rng = random.Random(1)

    def evaluation(acc: float) -> dict:
        out = {"eval/episodes": 200, "eval/reward_mean": acc, **_rate_with_interval("eval/accuracy", acc, 200), "eval/reward/exact_match": acc, "eval/reward/arithmetic_consistency": 0.9}
        for category, n, shift in (("carry", 120, -0.1), ("no_carry", 80, 0.1)):
            rate = min(1.0, acc + shift)
            low, high = wilson_interval(round(rate * n), n)
            out |= {f"eval/accuracy/{category}": rate, f"eval/accuracy/{category}/ci_low": low, f"eval/accuracy/{category}/ci_high": high, f"eval/accuracy/{category}/n": n}
        return out

    records = []
    for step in range(1, steps + 1):
        progress = step / steps
        exact = min(1.0, 0.4 + 0.5 * progress + 0.2 * (rng.random() - 0.5))
        r = {"step": step, "completion_length": 30 - 5 * progress, "truncated_rate": 0.05 * rng.random()}
        r |= {"reward/exact_match": exact, "reward/arithmetic_consistency": 0.9, "reward/total": exact, **_training(step, rng, progress)}
        if step % every == 0 and step < steps:
            r |= evaluation(0.4 + 0.5 * progress)
        records.append(r)
    records.append({"step": steps, **evaluation(0.9)})
    return records


def image_records(steps: int = 40, every: int = 10) -> list[dict]:
    """An image run (shapes demo): a cosine learning-rate schedule, no entropy, accuracy per
    category (single, count), the evaluation at step 0 of the pretrained model."""
    rng = random.Random(2)

    def evaluation(acc: float) -> dict:
        out = {"eval/episodes": 88, "eval/reward_mean": acc, **_rate_with_interval("eval/accuracy", acc, 88)}
        for category, n in (("count", 40), ("single", 48)):
            low, high = wilson_interval(round(acc * n), n)
            out |= {f"eval/accuracy/{category}": acc, f"eval/accuracy/{category}/ci_low": low, f"eval/accuracy/{category}/ci_high": high, f"eval/accuracy/{category}/n": n}
        return out

    records = [{"step": 0, **evaluation(0.6)}]
    for step in range(1, steps + 1):
        progress = step / steps
        reward = min(1.0, 0.6 + 0.35 * progress + 0.2 * (rng.random() - 0.5))
        r = {"step": step, "reward/total": reward, **_training(step, rng, progress)}
        del r["entropy"]
        r["optim/lr"] = 1e-4 * 0.5 * (1 + math.cos(math.pi * progress))
        if step % every == 0 and step < steps:
            r |= evaluation(0.6 + 0.35 * progress)
        records.append(r)
    records.append({"step": steps, **evaluation(0.95)})
    return records


def step_reward_records(trained_return: bool = True) -> list[dict]:
    """The env run of `make train` (configs/maniskill_pushcube_gae.yaml): GAE on the env's
    dense step reward, ``success`` logged with weight 0, so ``reward/total`` is 0 every step;
    ``trained_return`` (the env's return here) is what the advantages use. Without it: a run
    written before that metric was logged."""
    records = robot_records()
    for r in records:
        if "reward/total" in r:
            r["reward/total"] = 0.0
            if trained_return:
                r["trained_return"] = r["episode_return"]
    return records


DEMOS = {"robot": robot_records, "text": text_records, "image": image_records, "step_rewards": step_reward_records}


def _keys(panels) -> list[str]:
    return [c.key for p in panels for c in p.curves]


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


@pytest.mark.parametrize("demo", sorted(DEMOS))
def test_constant_metrics_get_no_panel(demo):
    main, other = plan_panels(with_update_time(DEMOS[demo]()))
    keys = _keys(main + other)
    assert "eval/episodes" not in keys
    assert ("optim/lr" in keys) == (demo == "image")  # only the cosine schedule changes
    assert not [k for k in keys if k.endswith("/n")]  # category counts are no curves either


def test_a_95_percent_interval_is_a_band_of_its_curve_not_panels_of_its_own():
    main, other = plan_panels(with_update_time(robot_records()))
    headline = main[0].curves[0]
    assert headline.band == ("eval/success_rate_ci_low", "eval/success_rate_ci_high")
    assert not [k for k in _keys(main + other) if "ci_" in k]


def test_the_report_opens_with_held_out_evaluation_then_smoothed_training_reward():
    main, _ = plan_panels(with_update_time(robot_records()))
    evaluation, training = main[0].curves[0], main[1].curves[0]
    assert (evaluation.key, evaluation.start, evaluation.smooth) == ("eval/success_rate", True, False)
    assert (training.key, training.smooth) == ("reward/total", True)
    assert main[0].rate and main[1].title == "training reward"
    text_main, _ = plan_panels(with_update_time(text_records()))
    assert text_main[0].curves[0].key == "eval/accuracy"


def test_diagnostics_follow_the_headline_each_only_when_logged():
    main, _ = plan_panels(with_update_time(robot_records()))
    titles = [p.title for p in main]
    assert titles[2:8] == ["policy loss", "approx. KL to the sampling policy", "clip fraction", "entropy per decision", "gradient norm (before clipping)", "seconds per step"]
    image_titles = [p.title for p in plan_panels(with_update_time(image_records()))[0]]
    assert "entropy per decision" not in image_titles and "policy loss" in image_titles


def test_seconds_per_step_are_split_into_sampling_and_update():
    records = with_update_time([{"step": 1, "time/sample_s": 0.5, "time/step_s": 2.0}, {"step": 2, "time/sample_s": 0.7, "time/step_s": 2.5}])
    assert [r[UPDATE_TIME] for r in records] == [1.5, 1.8]
    main, other = plan_panels(records)
    timing = next(p for p in main if p.title == "seconds per step")
    assert [(c.key, c.label) for c in timing.curves] == [("time/sample_s", "sampling"), (UPDATE_TIME, "update")]
    assert "time/step_s" not in _keys(other)  # the sum of the two lines


def test_a_supervised_run_headlines_its_loss_and_times_whole_steps():
    records = [{"step": s, "loss/sft": 1 / s, "grad_norm": s, "time/step_s": 0.1 * s, "optim/lr": 1e-3} for s in range(1, 6)]
    main, other = plan_panels(with_update_time(records))
    assert [p.title for p in main] == ["training loss (SFT)", "gradient norm (before clipping)", "seconds per step"]
    assert [c.label for c in main[2].curves] == ["step"] and other == []


def test_per_category_evaluation_is_one_panel_with_a_line_and_band_per_category():
    main, other = plan_panels(with_update_time(text_records()))
    panel = next(p for p in main if p.title == "eval/accuracy by category")
    assert [(c.key, c.label) for c in panel.curves] == [("eval/accuracy/carry", "carry"), ("eval/accuracy/no_carry", "no_carry")]
    assert panel.curves[0].band == ("eval/accuracy/carry/ci_low", "eval/accuracy/carry/ci_high")
    assert not [k for k in _keys(other) if k.startswith("eval/accuracy/")]


def test_suite_tasks_are_the_categories_of_the_suite_success_rate():
    keys = ["suite/sides/success_rate", "suite/sides/left/success_rate", "suite/sides/right/success_rate", "suite/other/left/success_rate"]
    assert categories_of("suite/sides/success_rate", keys) == {"left": "suite/sides/left/success_rate", "right": "suite/sides/right/success_rate"}
    # outside suites only eval/accuracy/<category> counts: eval/reward/accuracy is a reward, not a category
    assert categories_of("eval/accuracy", ["eval/accuracy/ci_low", "eval/accuracy/carry/n", "eval/reward/accuracy", "eval/accuracy/carry"]) == {"carry": "eval/accuracy/carry"}


def test_the_evaluation_after_the_last_step_sits_at_the_last_env_steps_not_zero():
    records = robot_records(steps=60)
    xs = x_values(records, x_axis(records))
    assert x_axis(records) == "env_steps"
    assert "env_steps" not in records[-1] and xs[-1] == 512.0 * 60
    assert xs[0] == 0.0  # the evaluation before training: nothing sampled yet
    assert xs == sorted(xs)  # no line runs back to the start


def test_a_record_before_any_counted_one_is_placed_in_proportion_to_its_step():
    records = [{"step": 2, "eval/success_rate": 0.5}, {"step": 4, "env_steps": 400.0}, {"step": 5, "eval/success_rate": 0.6}]
    assert x_values(records, "env_steps") == [200.0, 400.0, 400.0]


def test_without_a_counter_the_x_axis_is_the_update_step():
    records = text_records()
    assert x_axis(records) == "step" and x_values(records, "step") == [float(r["step"]) for r in records]


def test_the_evaluation_before_training_is_the_one_before_the_first_update():
    robot = robot_records()
    assert initial_evaluation(robot, "eval/success_rate") == 0
    assert initial_evaluation(text_records(), "eval/accuracy") is None  # its first evaluation follows an update


def test_smoothing_is_tensorboards_debiased_ema_spanning_a_twentieth_of_the_run():
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])
    assert smoothing_weight(20) == 0.6 and smoothing_weight(2000) == pytest.approx(0.99)


@pytest.mark.parametrize("demo", sorted(DEMOS))
def test_plot_run_writes_the_report_and_other_metrics_pngs(tmp_path, demo):
    run = _write(tmp_path / demo, DEMOS[demo]())
    paths = plot_run(run)
    assert [p.name for p in paths] == ["learning_curves.png", "other_metrics.png"]
    assert all(p.parent == run / "plots" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_plot_run_names_a_directory_without_metrics_or_curves(tmp_path):
    with pytest.raises(ConfigError, match="holds no metrics.jsonl"):
        plot_run(tmp_path)
    _write(tmp_path, [{"step": 7, "suite/sides/success_rate": 0.5, "suite/sides/left/success_rate": 0.0}])  # one suite evaluation
    with pytest.raises(ConfigError, match="no metric that changes"):
        plot_run(tmp_path)


def test_a_run_on_step_rewards_headlines_the_return_it_trains_on_with_success_beside_it():
    main, other = plan_panels(with_update_time(step_reward_records()), {"success": 0.0})
    assert [c.key for c in main[1].curves] == ["trained_return"] and main[1].title == HEADLINE_TRAIN["trained_return"]
    assert [c.key for c in main[2].curves] == ["success_rate"] and main[2].rate  # the training success rate next to it
    assert "training reward" not in [p.title for p in main + other] and "reward/total" not in _keys(main + other)
    # the weight-0 component keeps a panel of its own, said to be logged only
    assert [p.title for p in other if _keys([p]) == ["reward/success"]] == ["reward/success (logged, weight 0)"]


def test_a_component_with_weight_0_is_never_the_training_headline():
    keys = set().union(*step_reward_records(trained_return=False))
    # an older run of the same config: its combined reward is 0 by construction, the env's return is what trained
    assert headline_training(keys, {"success": 0.0}) == "episode_return"
    assert headline_training(keys - {"episode_return", "success_rate"}, {"success": 0.0}) is None  # never reward/success
    assert headline_training(keys, None) == "reward/total"  # no config.yaml: the weights are unknown


@pytest.mark.parametrize("demo", ["robot", "text", "image"])
def test_runs_on_reward_components_headline_their_combined_reward(demo):
    keys = set().union(*DEMOS[demo]())
    weights = {name.removeprefix("reward/"): 1.0 for name in keys if name.startswith("reward/") and name != "reward/total"}
    assert headline_training(keys, weights) == "reward/total"
    main, _ = plan_panels(with_update_time(DEMOS[demo]()), weights)
    assert main[1].title == "training reward" and "success_rate" not in _keys(main)


def test_the_weights_are_read_from_the_runs_config_by_the_components_metric_names(tmp_path, monkeypatch):
    config = load_yaml(ROOT / "configs" / "maniskill_pushcube_gae.yaml")
    assert reward_weights(config) == {"success": 0.0}
    assert reward_weights({"rewards": [{"type": "success", "weight": 1}, {"type": "success", "weight": 0}]}) == {"success": 1.0, "success_2": 0.0}
    assert reward_weights({}) is None
    run = _write(tmp_path / "run", step_reward_records())
    (run / "config.yaml").write_text((ROOT / "configs" / "maniskill_pushcube_gae.yaml").read_text())
    planned = []
    monkeypatch.setattr("mmrl.commands.plot.plan_panels", lambda records, weights=None: planned.append(weights) or plan_panels(records, weights))
    plot_run(run)
    assert planned == [{"success": 0.0}]
