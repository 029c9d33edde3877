"""``mmrl plot RUN_DIR``: PNG learning curves from ``metrics.jsonl``, laid out the way
TensorBoard / W&B reports are read.

``learning_curves.png`` starts with the headline row: the held-out evaluation (success rate,
accuracy …) with its 95% interval as a band and the evaluation before training marked, and
what the run trains on, smoothed, over its faint raw values (:func:`headline_training`): the
episode return as the advantages weight it (``trained_return``) for a run whose advantages add
the env's step rewards (GAE, step level), with the training success rate next; else the
combined reward (``reward/total``). Diagnostics follow (policy loss,
approximate KL, clip fraction, entropy, gradient norm, seconds per step split into sampling
and update), then per-category evaluations, every category a line of one panel.
``other_metrics.png`` holds every other metric that changes, a reward component the run's
``config.yaml`` gives weight 0 titled as logged with weight 0. A metric whose values are all
equal (a constant learning rate, the number of evaluation episodes) gets no panel; interval
bounds (``…_ci_low`` / ``…/ci_high``) and category counts (``…/n``) are never curves.

The x axis is the first counter the records carry (``env_steps``, ``samples``), else the
update step; a record without the counter (the evaluation after the last step) takes it
from the latest record at or before its step.

The pure helpers (:func:`x_values`, :func:`plan_panels`, :func:`ema` …) decide what is
drawn; :func:`plot_run` reads the run's files and only draws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmrl.errors import ConfigError
from mmrl.train.metrics import read_metrics

COUNTERS = ("env_steps", "samples")  # x axes in the order preferred, before the update step
EVAL_PREFIXES = ("eval/", "suite/")
# the held-out metric of the headline, first present wins; else the first other eval/ key
HEADLINE_EVAL = ("eval/success_rate", "eval/accuracy", "eval/pairwise_accuracy", "eval/reward_mean", "eval/return_mean")
# the training curve of the headline, first present wins (:func:`headline_training`):
# the return a step-reward run's advantages use, the combined reward of any other RL run,
# the env's return and success, a supervised run's loss
HEADLINE_TRAIN = {
    "trained_return": "training return (what the advantages use)",
    "reward/total": "training reward",
    "episode_return": "training episode return",
    "success_rate": "training success rate",
    "loss/sft": "training loss (SFT)",
}
RETURNS = ("trained_return", "episode_return")  # headlines that the training success rate follows
DIAGNOSTICS = (
    ("loss/policy", "policy loss"),
    ("loss/sft", "SFT loss"),
    ("approx_kl", "approx. KL to the sampling policy"),
    ("kl/ref", "KL to the reference"),
    ("objective/clipped", "clip fraction"),
    ("entropy", "entropy per decision"),
    ("grad_norm", "gradient norm (before clipping)"),
)
UPDATE_TIME = "time/update_s"  # derived: time/step_s − time/sample_s
BAND_SUFFIXES = (("_ci_low", "_ci_high"), ("/ci_low", "/ci_high"))
COUNT_SUFFIX = "/n"
MIN_POINTS_TO_SMOOTH = 10  # a handful of points is read as it is


@dataclass(frozen=True)
class Curve:
    key: str
    label: str
    band: tuple[str, str] | None = None  # keys of its 95% interval, drawn as a band
    smooth: bool = False  # a noisy per-step value: an EMA over the faint raw values
    start: bool = False  # mark the value of the evaluation before training


@dataclass(frozen=True)
class Panel:
    title: str
    curves: tuple[Curve, ...]
    rate: bool = False  # a fraction: drawn on the whole [0, 1] axis, so 0.8 → 1.0 does not look like 0 → 1


# ---------------------------------------------------------------------- what is drawn


def x_axis(records: list[dict[str, Any]]) -> str:
    """The counter of the x axis: the first of :data:`COUNTERS` that any record holds,
    else ``step`` (the update)."""
    return next((c for c in COUNTERS if any(_finite(r.get(c)) for r in records)), "step")


def x_values(records: list[dict[str, Any]], counter: str) -> list[float]:
    """Each record's x. A record without ``counter`` takes it from the latest record at or
    before its step, since counters only grow and a step's records share one count (the
    trainer writes the evaluation after the last step as a record of its own). One before
    any counted record is placed in proportion to its step, counters starting at 0 at step
    0, so the evaluation before training sits at 0."""
    known = sorted((r["step"], r[counter]) for r in records if _finite(r.get(counter)))
    out = []
    for r in records:
        if _finite(r.get(counter)):
            out.append(float(r[counter]))
            continue
        earlier = [c for s, c in known if s <= r["step"]]
        if earlier:
            out.append(float(earlier[-1]))
        elif known and known[0][0] > 0:
            out.append(known[0][1] * r["step"] / known[0][0])
        else:
            out.append(float(r["step"]))
    return out


def with_update_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with ``time/update_s`` where a step's total and sampling times are both
    logged: a step is sampling then the update, and which of the two dominates is what a
    slow run needs to know."""
    out = []
    for r in records:
        if _finite(r.get("time/step_s")) and _finite(r.get("time/sample_s")):
            r = {**r, UPDATE_TIME: r["time/step_s"] - r["time/sample_s"]}
        out.append(r)
    return out


def is_constant(records: list[dict[str, Any]], key: str) -> bool:
    """Whether every finite value of ``key`` is the same (or there is none)."""
    return len({r[key] for r in records if _finite(r.get(key))}) <= 1


def band_of(key: str, keys) -> tuple[str, str] | None:
    """The keys of ``key``'s 95% interval (``key_ci_low``/``_high`` or ``key/ci_low``/``/ci_high``)."""
    return next(((key + lo, key + hi) for lo, hi in BAND_SUFFIXES if key + lo in keys and key + hi in keys), None)


def is_auxiliary(key: str) -> bool:
    """Interval bounds and category counts: they belong to another curve."""
    return key.endswith(COUNT_SUFFIX) or any(key.endswith(s) for pair in BAND_SUFFIXES for s in pair)


def is_rate(key: str) -> bool:
    """A success rate or an accuracy (a fraction of episodes / samples)."""
    return key.rpartition("/")[2].endswith(("success_rate", "accuracy"))


def categories_of(aggregate: str, keys) -> dict[str, str]:
    """Category → key of the per-category values of ``aggregate``: ``P/M/<category>``
    (the prompt sampler's ``eval/accuracy/<category>``) or ``P/<category>/M`` (a suite's
    ``suite/<name>/<task>/success_rate`` under ``suite/<name>/success_rate``)."""
    prefix, _, name = aggregate.rpartition("/")
    out = {}
    for key in keys:
        if is_auxiliary(key):
            continue
        if key.startswith(aggregate + "/"):
            category = key[len(aggregate) + 1 :]
        elif aggregate.startswith("suite/") and key.startswith(prefix + "/") and key.endswith("/" + name) and len(key) > len(aggregate) + 1:
            category = key[len(prefix) + 1 : -len(name) - 1]
        else:
            continue
        if category and "/" not in category:
            out[category] = key
    return out


def headline_training(keys, weights: dict[str, float] | None = None) -> str | None:
    """The key of the headline's training curve: the first of :data:`HEADLINE_TRAIN` among
    ``keys``. ``weights`` (reward column name -> weight, from the run's config; None: unknown)
    rules out ``reward/total`` when every component has weight 0: then nothing of it is
    trained on (a run written before ``trained_return`` was logged that trained on the env's
    step rewards alone), and the env's return is the headline. A single reward component is
    never the headline."""
    skip = {"reward/total"} if weights and not any(weights.values()) else set()
    return next((k for k in HEADLINE_TRAIN if k in keys and k not in skip), None)


def reward_weights(config: dict[str, Any] | None) -> dict[str, float] | None:
    """Reward column name (``reward/<name>``) -> weight, from a run's resolved config as a
    dict (its ``config.yaml``); None without one."""
    if not config or not isinstance(config.get("rewards"), list):
        return None
    from mmrl.core.reward import reward_names

    rewards = [r for r in config["rewards"] if isinstance(r, dict) and "type" in r]
    return dict(zip(reward_names([r["type"] for r in rewards]), (float(r.get("weight", 1.0)) for r in rewards)))


def plan_panels(records: list[dict[str, Any]], weights: dict[str, float] | None = None) -> tuple[list[Panel], list[Panel]]:
    """(panels of ``learning_curves.png``, panels of ``other_metrics.png``). The first list
    opens with the headline — the held-out evaluation, then the training curve
    (:func:`headline_training`) — drawn even when flat (a success rate stuck at 0 is the
    result); a return headline is followed by the training success rate. Every other panel
    needs a metric that changes. ``weights`` (:func:`reward_weights`) marks the reward
    components logged with weight 0."""
    keys = _numeric_keys(records)
    changing = [k for k in keys if not is_constant(records, k)]
    used: set[str] = set()

    def eval_curve(key: str, label: str | None = None, start: bool = False) -> Curve:
        return Curve(key, label or key, band=band_of(key, keys), start=start)

    def train_curve(key: str, label: str | None = None) -> Curve:
        n = sum(_finite(r.get(key)) for r in records)
        return Curve(key, label or key, smooth=n >= MIN_POINTS_TO_SMOOTH)

    main: list[Panel] = []
    evals = [k for k in keys if k.startswith("eval/") and not is_auxiliary(k)]
    headline_eval = next((k for k in HEADLINE_EVAL if k in keys), next((k for k in evals if k in changing), None))
    if headline_eval is not None:
        title = f"held-out {headline_eval.removeprefix('eval/').replace('_', ' ')}"
        main.append(Panel(title, (eval_curve(headline_eval, start=True),), rate=is_rate(headline_eval)))
        used.add(headline_eval)
    headline_train = headline_training(keys, weights)
    if headline_train is not None:
        main.append(Panel(HEADLINE_TRAIN[headline_train], (train_curve(headline_train),), rate=is_rate(headline_train)))
        used.add(headline_train)
    if headline_train in RETURNS and "success_rate" in keys:  # success beside the return
        main.append(Panel(HEADLINE_TRAIN["success_rate"], (train_curve("success_rate"),), rate=True))
        used.add("success_rate")

    for key, title in DIAGNOSTICS:
        if key in changing and key not in used:
            main.append(Panel(title, (train_curve(key),)))
            used.add(key)
    if UPDATE_TIME in keys and ("time/sample_s" in changing or UPDATE_TIME in changing):
        timing = [train_curve("time/sample_s", "sampling"), train_curve(UPDATE_TIME, "update")]
    else:  # supervised steps have no sampling
        timing = [train_curve("time/step_s", "step")] if "time/step_s" in changing else []
    if timing:
        main.append(Panel("seconds per step", tuple(timing)))
        used.update(c.key for c in timing)
        used.add("time/step_s")

    for aggregate in keys:
        if is_auxiliary(aggregate) or not aggregate.startswith(EVAL_PREFIXES):
            continue
        categories = categories_of(aggregate, keys)
        if categories and any(k in changing for k in categories.values()):
            curves = tuple(eval_curve(k, category) for category, k in sorted(categories.items()))
            main.append(Panel(f"{aggregate} by category", curves, rate=is_rate(aggregate)))
            used.update(categories.values())

    other = []
    for key in changing:
        if key in used or is_auxiliary(key):
            continue
        curve = eval_curve(key) if key.startswith(EVAL_PREFIXES) else train_curve(key)
        unweighted = weights is not None and key.startswith("reward/") and weights.get(key.removeprefix("reward/"), 1.0) == 0
        other.append(Panel(f"{key} (logged, weight 0)" if unweighted else key, (curve,), rate=is_rate(key)))
    return main, other


def initial_evaluation(records: list[dict[str, Any]], key: str) -> int | None:
    """The index of the evaluation before training: the first record holding ``key`` at a
    step before every training record (one with a metric outside eval/ and suite/; the
    trainer writes those from step 1 on, so an evaluation at step 0 is one)."""
    trained = [r["step"] for r in records if any(k not in ("step", *COUNTERS) and not k.startswith(EVAL_PREFIXES) for k in r)]
    first_update = min(trained, default=math.inf)
    return next((i for i, r in enumerate(records) if _finite(r.get(key)) and r["step"] < first_update), None)


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased for its start at 0
    (so the first points are not pulled towards 0)."""
    out, last = [], 0.0
    for i, v in enumerate(values, 1):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**i))
    return out


def smoothing_weight(n: int) -> float:
    """The EMA weight for ``n`` points: its span (1 / (1 − w) points) is about 1/20 of the
    run, so a long run is smoothed as much as a short one looks; never less smoothing than
    TensorBoard's default, 0.6."""
    return max(0.6, 1 - 20 / max(n, 1))


# ---------------------------------------------------------------------- drawing


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError("run_dir", str(run_dir), "holds no metrics.jsonl (is it a directory written by `mmrl train`?)")
    records = with_update_time(read_metrics(run_dir))
    if not _numeric_keys(records):
        raise ConfigError("run_dir", str(run_dir), "metrics.jsonl holds no numeric metrics yet")
    main, other = plan_panels(records, reward_weights(_config(run_dir)))
    if not main and not other:
        raise ConfigError("run_dir", str(run_dir), "metrics.jsonl holds no metric that changes yet, so no curve to draw")
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    counter = x_axis(records)
    xs = x_values(records, counter)
    pad = 0.02 * (max(xs) - min(xs) or 1)
    xlim = (min(xs) - pad, max(xs) + pad)  # one range for every panel: evaluations line up with training
    written = []

    fig = plt.figure(figsize=(13, 3.9 + 2.9 * math.ceil(max(len(main) - 2, 0) / 3)), layout="constrained")
    for ax, panel in zip(_report_axes(fig, len(main)), main):
        _draw(ax, panel, records, xs, counter, xlim)
    fig.suptitle(run_dir.resolve().name, fontsize=11)
    written.append(out / "learning_curves.png")
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)

    if other:
        cols = 4
        rows = math.ceil(len(other) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.6 * rows), squeeze=False, layout="constrained")
        for ax, panel in zip(axes.flat, other):
            _draw(ax, panel, records, xs, counter, xlim, small=True)
        for ax in list(axes.flat)[len(other) :]:
            ax.axis("off")
        fig.suptitle(f"{run_dir.resolve().name}: other metrics", fontsize=11)
        written.append(out / "other_metrics.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written


def _report_axes(fig, n: int) -> list:
    """The headline row (two wide panels) over a grid of three per row."""
    rest = max(n - 2, 0)
    rows = 1 + math.ceil(rest / 3)
    grid = fig.add_gridspec(rows, 6, height_ratios=[1.35] + [1] * (rows - 1))
    axes = [fig.add_subplot(grid[0, 0:3]), fig.add_subplot(grid[0, 3:6])][: min(n, 2)]
    axes += [fig.add_subplot(grid[1 + i // 3, 2 * (i % 3) : 2 * (i % 3) + 2]) for i in range(rest)]
    return axes


def _draw(ax, panel: Panel, records, xs, counter: str, xlim: tuple[float, float], small: bool = False) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    many = len(panel.curves) > 1
    for i, curve in enumerate(panel.curves):
        points = [(x, r) for x, r in zip(xs, records) if _finite(r.get(curve.key))]
        if not points:
            continue
        x, ys = [p[0] for p in points], [p[1][curve.key] for p in points]
        color = palette[i % len(palette)]
        label = curve.label if many else None
        if curve.band is not None:
            lo, hi = curve.band
            bounded = [(xi, r[lo], r[hi]) for xi, (_, r) in zip(x, points) if _finite(r.get(lo)) and _finite(r.get(hi))]
            if bounded:
                bx, blo, bhi = zip(*bounded)
                ax.fill_between(bx, blo, bhi, color=color, alpha=0.12 if many else 0.2, linewidth=0, label=None if many else "95% interval")
        if curve.smooth:
            ax.plot(x, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(x, ema(ys, smoothing_weight(len(ys))), color=color, linewidth=1.6, label=label)
        else:
            ax.plot(x, ys, color=color, marker="o" if len(ys) < 40 else None, markersize=3.5, linewidth=1.4, label=label)
        if curve.start and (first := initial_evaluation(records, curve.key)) is not None:
            value = records[first][curve.key]
            ax.axhline(value, color="gray", linestyle=":", linewidth=1)
            ax.plot([xs[first]], [value], marker="D", color="black", markersize=6, linestyle="none", label=f"before training: {value:.3g}", zorder=5)
    ax.set_xlim(*xlim)
    if panel.rate:
        ax.set_ylim(-0.03, 1.03)
    ax.set_title(panel.title, fontsize=9 if small else 10)
    ax.set_xlabel({"env_steps": "env steps", "samples": "samples", "step": "update step"}[counter], fontsize=8)
    if counter != "step":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.tick_params(labelsize=7 if small else 8)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncols=2 if len(panel.curves) > 6 else 1, framealpha=0.7)


def _config(run_dir: Path) -> dict[str, Any] | None:
    """The run's resolved ``config.yaml`` as a dict; None when it is missing or unreadable
    (metrics.jsonl alone is enough to plot)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def _numeric_keys(records: list[dict[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", *COUNTERS) and _finite(v):
                keys.setdefault(k, None)
    return list(keys)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
