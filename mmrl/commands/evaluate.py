"""``mmrl eval``: a trained run (or a config's initial/pretrained policy) evaluated with the
run's sampler; success rate with a 95% Wilson interval, written as JSON, Markdown and CSV."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmrl import registry
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.sampler import build_sampler, sampler_context
from mmrl.core.statistics import wilson_interval
from mmrl.core.weights import build_policy, load_state
from mmrl.errors import ConfigError, fault_context, run_source
from mmrl.media import annotate_episode, write_media, write_video
from mmrl.core.weights import latest_checkpoint


def evaluate_run(cfg, run_dir: Path | None, episodes: int | None = None, checkpoint: str | None = None, out_dir: str | None = None, save_episodes: str | None = None) -> dict[str, Any]:
    """The run's sampler's evaluation and, for a supervised run whose data source holds out
    data of its own (``preferences``), that source's held-out metrics. ``save_episodes``: a
    new directory where the env sampler's evaluation episodes are written (LeRobotDataset
    v3's layout, :mod:`mmrl.episodes`; a language agent's as JSON lines of turns,
    :func:`mmrl.samplers.recording.write_text_episodes`)."""
    from mmrl.data.sources import DataSource

    torch.manual_seed(cfg.seed)
    if save_episodes is not None:
        from mmrl.episodes import check_new_directory

        if cfg.sampler.type != "env":
            raise ConfigError("--save-episodes", save_episodes, f"saves the episodes of an env sampler; this config's sampler.type is {cfg.sampler.type!r}")
        check_new_directory(save_episodes, "--save-episodes")
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
        keep = {"keep_episodes": True} if save_episodes is not None else {}
        phase = f"evaluation of {ckpt.name}" if ckpt is not None else "evaluation of the config's weights"
        with torch.no_grad(), fault_context(source=run_source(cfg), seed=cfg.seed, phase=phase):
            result = sampler.evaluate(policy, n, seed=cfg.seed + 1_000_003, rewards=rewards, **keep)
        if save_episodes is not None:
            from mmrl.samplers.recording import write_kept_episodes

            write_kept_episodes(save_episodes, result.pop("kept_episodes"), sampler.env, sampler.cameras, {"env": sampler.env_name, "weights": str(ckpt) if ckpt else "config", "seed": cfg.seed + 1_000_003})
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
            write_media(out / "samples", media)
    return result


# ---------------------------------------------------------------------- task suites


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
        sampler = registry.SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, sampler_context(task_cfg))
        successes: list[float] = []
        try:
            for i, seed in enumerate(suite.seeds):
                where = {"source": run_source(task_cfg), "task": str(task), "phase": f"evaluation on suite {suite.name!r}, suite seed {seed}"}
                with torch.no_grad(), fault_context(**where):
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
    sampler = registry.SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, sampler_context(cfg))
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
