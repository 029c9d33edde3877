"""``mmrl eval``: a trained run (or a config's initial/pretrained policy) evaluated with the
run's sampler; success rate with a 95% Wilson interval, written as JSON, Markdown and CSV."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mmrl import registry
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.statistics import wilson_interval
from mmrl.core.weights import build_policy, load_state
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.core.weights import latest_checkpoint


def evaluate_run(cfg, run_dir: Path | None, episodes: int | None = None, checkpoint: str | None = None, out_dir: str | None = None) -> dict[str, Any]:
    """The run's sampler's evaluation and, for a supervised run whose data source holds out
    data of its own (``preferences``), that source's held-out metrics."""
    from mmrl.core.sampler import build_sampler
    from mmrl.train.sft import DataSource

    torch.manual_seed(cfg.seed)
    sampler = build_sampler(cfg)
    try:
        policy = build_policy(cfg.policy, sampler.policy_spec())
        source = "config"
        ckpt = Path(checkpoint) if checkpoint else (latest_checkpoint(run_dir) if run_dir else None)
        if checkpoint and not Path(checkpoint).is_dir():
            raise ConfigError("--checkpoint", checkpoint, "no such checkpoint directory")
        if run_dir is not None and ckpt is None:
            raise ConfigError("run_dir", str(run_dir), "holds no checkpoint yet")
        if ckpt is not None:
            load_state(policy, ckpt, "--checkpoint")
            source = str(ckpt)
        policy.eval()
        n = episodes or cfg.eval.episodes
        rewards = RewardSet(cfg.rewards, cfg.algo.reward_aggregation, RewardContext(run_dir=run_dir, seed=cfg.seed), cfg.algo.log_tamed_threshold)
        with torch.no_grad():
            result = sampler.evaluate(policy, n, seed=cfg.seed + 1_000_003, rewards=rewards)
        source_cls = registry.DATA_SOURCES.get(cfg.data.type, "data.type") if cfg.algo.type == "sft" else None
        if source_cls is not None and source_cls.evaluate is not DataSource.evaluate:
            result.update(source_cls(cfg.data, policy, cfg.seed, 1, 0).evaluate(policy))
    finally:
        sampler.close()
    media = result.pop("media", None)
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
        if media:
            from mmrl.media import write_media

            write_media(out / "samples", media)
    return result


# ---------------------------------------------------------------------- task suites


def write_video(path: Path, frames, fps: int = 10, scale: int = 4) -> Path:
    """Write uint8 frames [T, H, W, 3] as an H.264 mp4 (imageio-ffmpeg), each pixel
    enlarged ``scale`` times (nearest neighbour, so 64×64 observations stay sharp)."""
    import numpy as np

    frames = np.asarray(frames, dtype=np.uint8)
    if scale > 1:
        frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        import imageio.v2 as imageio

        imageio.mimwrite(tmp, list(frames), fps=fps, macro_block_size=1)
    except ImportError:  # OpenCV only: MPEG-4 part 2 instead of H.264
        import cv2

        writer = cv2.VideoWriter(str(tmp), cv2.VideoWriter_fourcc(*"mp4v"), fps, (frames.shape[2], frames.shape[1]))
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
    tmp.replace(path)
    return path


# RGB; the outcome is read by its colour before its word
OUTCOME_COLOURS = {True: (40, 220, 40), False: (235, 40, 40)}


def annotate_episode(frames, instruction: str | None, success: bool, min_width: int = 256, max_lines: int = 2):
    """The frames [T, H, W, 3] (uint8) of one evaluation episode with its instruction on a
    dark band at the top (wrapped to ``max_lines`` lines, the rest cut to "...") and its
    outcome, "success" in green or "failure" in red, on a dark band at the bottom, as
    evaluation videos of ManiSkill and LeRobot let a reader see at a glance which episode
    failed at what. The outcome is known when the video is written and is on every frame,
    so any frame of a paused video says it. Frames narrower than ``min_width`` are first
    enlarged by a whole factor (nearest neighbour: 64×64 observations stay sharp and the
    text gets enough pixels to be read). Returns new frames [T, H·k, W·k, 3]."""
    try:
        import cv2
    except ImportError:
        raise MissingExtraError("opencv-python", "vla", "evaluation videos with their instruction and outcome") from None
    import numpy as np

    frames = np.asarray(frames, dtype=np.uint8)
    k = max(1, math.ceil(min_width / frames.shape[2]))
    frames = frames.repeat(k, axis=1).repeat(k, axis=2)
    height, width = frames.shape[1:3]
    font, font_scale, thickness = cv2.FONT_HERSHEY_SIMPLEX, width / 560, max(1, round(width / 400))
    (_, text_height), baseline = cv2.getTextSize("Ag", font, font_scale, thickness)
    pad = max(2, text_height // 3)
    line_height = text_height + baseline + pad

    def fits(text: str) -> bool:
        return cv2.getTextSize(text, font, font_scale, thickness)[0][0] <= width - 2 * pad

    # the text is drawn once, as coverage (anti-aliased, 0..255) and colour, then blended
    # into every frame over the darkened bands
    coverage = np.zeros((height, width), np.uint8)
    colour = np.zeros((height, width, 3), np.uint8)
    bands = np.zeros(height, bool)
    lines = _wrap(instruction, fits, max_lines) if instruction else []
    for i, line in enumerate(lines):
        cv2.putText(coverage, line, (pad, pad + text_height + i * line_height), font, font_scale, 255, thickness, cv2.LINE_AA)
    top = len(lines) * line_height + pad if lines else 0
    bands[:top] = True
    colour[:top] = 255
    bottom = height - line_height - pad
    # bold: the outcome is what a reader scans a grid of videos for
    cv2.putText(coverage, "success" if success else "failure", (pad, height - pad - baseline), font, font_scale, 255, thickness + 1, cv2.LINE_AA)
    bands[bottom:] = True
    colour[bottom:] = OUTCOME_COLOURS[bool(success)]

    alpha = coverage[bands, :, None].astype(np.float32) / 255
    backed = frames[:, bands].astype(np.float32) * 0.25  # the dark backing of both bands
    frames[:, bands] = (backed * (1 - alpha) + colour[bands] * alpha).round().astype(np.uint8)
    return frames


def _wrap(text: str, fits, max_lines: int) -> list[str]:
    """Greedy word wrap of ``text`` into at most ``max_lines`` lines that ``fits``; a line
    that does not fit (the words left over, a word too long) is cut and ends in "..." (the
    video fonts are ASCII only)."""
    lines: list[str] = []
    words = text.split()
    while words and len(lines) < max_lines:
        line = words.pop(0)
        while words and fits(f"{line} {words[0]}"):
            line = f"{line} {words.pop(0)}"
        lines.append(line)
    if words:  # what is left goes on the last line, to be cut
        lines[-1] = f"{lines[-1]} {' '.join(words)}"
    return [line if fits(line) else _cut(line, fits) for line in lines]


def _cut(line: str, fits) -> str:
    while line and not fits(line + "..."):
        line = line[:-1]
    return line.rstrip() + "..."


def _task_env_config(env_section: dict, task, field: str):
    """The suite's env section with the task filled in: the env type's ``task`` field if it
    has one, otherwise ``kwargs.task`` (gymnasium ids that take the task as a make argument)."""
    import dataclasses

    from mmrl.config import from_dict

    data = dict(env_section)
    if "type" not in data:
        raise ConfigError(f"{field}.type", None, "the suite's env section needs a type (see `mmrl list envs`)")
    entry = registry.ENVS.entry(data["type"], f"{field}.type")
    names = {f.name for f in dataclasses.fields(entry.config)}
    if "task" in names:
        data["task"] = task
    elif "kwargs" in names:
        data["kwargs"] = {**(data.get("kwargs") or {}), "task": task}
    else:
        raise ConfigError(f"{field}.type", data["type"], "this env type takes no task (no `task` or `kwargs` field)")
    return from_dict(entry.config, data, field)


def evaluate_suite(
    cfg,
    run_dir: Path | None,
    suite,
    checkpoint: str | None = None,
    out_dir: str | None = None,
    episodes_per_task: int | None = None,
    videos: int = 1,
) -> dict[str, Any]:
    """Evaluate one policy on every task of ``suite``: ``episodes_per_task`` episodes for
    each of the suite's seeds, success with a 95% Wilson interval per task and overall,
    written as Markdown, CSV and JSON with mp4 videos of the first ``videos`` episodes of
    each task; the numbers also go to the run's metrics.jsonl (``suite/<name>/...``)."""
    import dataclasses

    torch.manual_seed(cfg.seed)
    policy, source, step = _policy_for(cfg, run_dir, checkpoint)
    policy.eval()
    n_per_seed = episodes_per_task or suite.episodes_per_task
    out = Path(out_dir) if out_dir else ((run_dir / "eval" / suite.name) if run_dir is not None else Path("eval") / suite.name)
    rows = []
    all_successes: list[float] = []
    for task in suite.tasks:
        task_cfg = dataclasses.replace(cfg, env=_task_env_config(suite.env, task, "suite.env"))
        sampler = registry.SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, task_cfg)
        successes: list[float] = []
        try:
            for i, seed in enumerate(suite.seeds):
                with torch.no_grad():
                    result = sampler.evaluate(policy, n_per_seed, seed=int(seed), videos=videos if i == 0 else 0)
                successes += result["successes"]
                recorded = result.get("frames", [])
                instructions = result.get("instructions") or [None] * len(recorded)
                for k, (frames, instruction) in enumerate(zip(recorded, instructions)):
                    success = bool(result["successes"][k])
                    video = annotate_episode(frames, instruction or str(task), success)  # without language, the task's name
                    write_video(out / "videos" / f"{_slug(task)}_{k}_{'success' if success else 'failure'}.mp4", video, scale=1)
        finally:
            sampler.close()
        lo, hi = wilson_interval(sum(successes), len(successes))
        rows.append({"task": str(task), "episodes": len(successes), "successes": int(sum(successes)), "success_rate": sum(successes) / len(successes), "ci95_low": lo, "ci95_high": hi})
        all_successes += successes
    lo, hi = wilson_interval(sum(all_successes), len(all_successes))
    overall = {"task": "overall", "episodes": len(all_successes), "successes": int(sum(all_successes)), "success_rate": sum(all_successes) / len(all_successes), "ci95_low": lo, "ci95_high": hi}
    summary = {"suite": suite.name, "weights": source, "step": step, "seeds": list(suite.seeds), "episodes_per_seed": n_per_seed, "tasks": rows, "overall": overall}

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    cols = ["task", "episodes", "successes", "success_rate", "ci95_low", "ci95_high"]
    (out / "results.csv").write_text(",".join(cols) + "\n" + "".join(",".join(str(r[c]) for c in cols) + "\n" for r in [*rows, overall]))
    md = [f"Suite `{suite.name}` — weights `{source}`, {n_per_seed} episodes × {len(suite.seeds)} seeds per task", "", "| task | episodes | success | 95% CI |", "|---|---|---|---|"]
    md += [f"| {r['task']} | {r['episodes']} | {r['success_rate']:.3f} | {r['ci95_low']:.3f}–{r['ci95_high']:.3f} |" for r in rows]
    md.append(f"| **overall** | {overall['episodes']} | **{overall['success_rate']:.3f}** | {overall['ci95_low']:.3f}–{overall['ci95_high']:.3f} |")
    (out / "results.md").write_text("\n".join(md) + "\n")
    if run_dir is not None:
        from mmrl.train.metrics import MetricsWriter

        writer = MetricsWriter(run_dir, tensorboard=False)
        record = {f"suite/{suite.name}/success_rate": overall["success_rate"]}
        record.update({f"suite/{suite.name}/{r['task']}/success_rate": r["success_rate"] for r in rows})
        writer.write(step, record)
        writer.close()
    summary["out_dir"] = str(out)
    return summary


def _slug(task) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in str(task))


def _policy_for(cfg, run_dir: Path | None, checkpoint: str | None):
    """The policy of a run (latest or given checkpoint) or of a config (initial/pretrained
    weights), built with the spec of the config's own env; returns (policy, source, step)."""
    sampler = registry.SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, cfg)
    try:
        policy = build_policy(cfg.policy, sampler.policy_spec())
    finally:
        sampler.close()
    if checkpoint and not Path(checkpoint).is_dir():
        raise ConfigError("--checkpoint", checkpoint, "no such checkpoint directory")
    ckpt = Path(checkpoint) if checkpoint else (latest_checkpoint(run_dir) if run_dir else None)
    if run_dir is not None and ckpt is None:
        raise ConfigError("run_dir", str(run_dir), "holds no checkpoint yet")
    if ckpt is None:
        return policy, "config", 0
    load_state(policy, ckpt, "--checkpoint")
    state_path = ckpt / "state.pt"
    step = int(torch.load(state_path, weights_only=True)["step"]) if state_path.is_file() else 0
    return policy, str(ckpt), step
