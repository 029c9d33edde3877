"""``mmrl plot RUN_DIR``: PNG learning curves from ``metrics.jsonl``."""

from __future__ import annotations

import math
from pathlib import Path

from mmrl.errors import ConfigError
from mmrl.train.metrics import read_metrics

# the curves people look at first, in this order; anything else numeric follows
_PREFERRED = ["success_rate", "eval/success_rate", "reward/total", "episode_return", "loss/policy", "approx_kl", "objective/clipped", "grad_norm"]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError("run_dir", str(run_dir), "holds no metrics.jsonl (is it a directory written by `mmrl train`?)")
    records = read_metrics(run_dir)
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if k not in ("step", "env_steps") and isinstance(v, (int, float)) and k not in keys:
                keys.append(k)
    keys = [k for k in _PREFERRED if k in keys] + sorted(k for k in keys if k not in _PREFERRED)
    if not keys:
        raise ConfigError("run_dir", str(run_dir), "metrics.jsonl holds no numeric metrics yet")
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    x_key = "env_steps" if any("env_steps" in r for r in records) else "step"
    cols = 3
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r.get(x_key, r["step"]), r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(x_key, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    path = out / "learning_curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
