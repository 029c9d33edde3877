"""``mmrl eval``: a trained run (or a config's initial/pretrained policy) evaluated with the
run's sampler; success rate with a 95% Wilson interval, written as JSON, Markdown and CSV."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mmrl import registry
from mmrl.core.policy import build_policy, load_state
from mmrl.errors import ConfigError
from mmrl.train.checkpoint import Checkpointer


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sound at 0 and 1, unlike ±1.96·SE)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def evaluate_run(cfg, run_dir: Path | None, episodes: int | None = None, checkpoint: str | None = None, out_dir: str | None = None) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    sampler = registry.SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, cfg)
    try:
        policy = build_policy(cfg.policy, sampler.policy_spec())
        source = "config"
        ckpt = Path(checkpoint) if checkpoint else (Checkpointer(run_dir).latest() if run_dir else None)
        if checkpoint and not Path(checkpoint).is_dir():
            raise ConfigError("--checkpoint", checkpoint, "no such checkpoint directory")
        if run_dir is not None and ckpt is None:
            raise ConfigError("run_dir", str(run_dir), "holds no checkpoint yet")
        if ckpt is not None:
            load_state(policy, ckpt, "--checkpoint")
            source = str(ckpt)
        policy.eval()
        n = episodes or cfg.eval.episodes
        with torch.no_grad():
            result = sampler.evaluate(policy, n, seed=cfg.seed + 1_000_003)
    finally:
        sampler.close()
    result = {"weights": source, **result}
    if "success_rate" in result:
        lo, hi = wilson_interval(result["success_rate"] * result["episodes"], result["episodes"])
        result["success_ci95"] = [lo, hi]
    out = Path(out_dir) if out_dir else (run_dir / "eval" if run_dir is not None else None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(result, indent=2))
        keys = [k for k, v in result.items() if isinstance(v, (int, float))]
        (out / "eval.csv").write_text(",".join(keys) + "\n" + ",".join(f"{result[k]}" for k in keys) + "\n")
        rows = [f"| {k} | {result[k]:.4g} |" if isinstance(result[k], float) else f"| {k} | {result[k]} |" for k in keys]
        if "success_ci95" in result:
            rows.append(f"| success 95% CI | [{result['success_ci95'][0]:.3f}, {result['success_ci95'][1]:.3f}] |")
        (out / "eval.md").write_text("| metric | value |\n|---|---|\n" + "\n".join(rows) + "\n")
    return result
