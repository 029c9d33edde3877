"""``mmrl collect``: run the scripted experts of ``mmrl/Tabletop-v0`` and write demonstrations.

Episode j of every task resets with seed ``seed + j`` (and the task forced through
``reset(options={"task": ...})``), so a task's demonstrations are reproducible and equal to
those of an env holding that task alone. Demonstration seeds must stay below 2**31: mmrl
evaluates with reset seeds at or above 2**31 (``mmrl/samplers/env.py``), so no evaluation
episode starts from a demonstrated initial state.

Only successful episodes are written unless ``keep_failures``; the summary says how many
failed. Episodes are written task by task (see :mod:`mmrl.demos` for the format), or, with
``layout="lerobot"``, all at once at the end in LeRobotDataset v3's layout
(:mod:`mmrl.episodes`; not appendable).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mmrl.demos import INDEX, Episode, read_index, write_demos
from mmrl.errors import ConfigError, call_user_code, fault_context

TABLETOP_ID = "mmrl/Tabletop-v0"
DEMO_SEED_LIMIT = 2**31  # evaluation reset seeds start here


def collect(
    tasks: list[str],
    episodes_per_task: int,
    out: str | os.PathLike,
    *,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    max_episode_steps: int | None = None,
    noise: float = 0.0,
    keep_failures: bool = False,
    append: bool = False,
    env_id: str = TABLETOP_ID,
    report: Callable[[str], None] | None = None,
    layout: str = "mmrl-demos",
) -> dict[str, Any]:
    """Collect ``episodes_per_task`` expert episodes of each task into ``out``.

    ``env_kwargs`` go to ``gymnasium.make`` (``image_size``, ``cameras`` ...; ``task`` is set
    here); ``noise`` is the standard deviation of Gaussian noise added to the expert's
    actions (seeded per episode); ``report`` receives one line per task. Returns a summary:
    ``{"out", "written", "failed", "steps", "tasks": {task: {"succeeded", "failed"}}}``."""
    import gymnasium

    import mmrl.envs  # noqa: F401  (registers mmrl/Tabletop-v0)
    from mmrl.envs.tabletop.expert import expert_action
    from mmrl.envs.tabletop.tasks import resolve_tasks

    if env_id != TABLETOP_ID:
        raise ConfigError("env_id", env_id, f"scripted experts exist for {TABLETOP_ID} only")
    tasks = resolve_tasks(tasks, "task")
    _check_collection("episodes_per_task", episodes_per_task, seed, noise)
    if layout not in ("mmrl-demos", "lerobot"):
        raise ConfigError("format", layout, "mmrl-demos or lerobot")
    if layout == "lerobot":
        from mmrl.episodes import check_new_directory, write_episodes

        if append:
            raise ConfigError("append", append, "the lerobot layout is written once; append to an mmrl-demos directory, or collect into a new directory")
        check_new_directory(out, "out")
    everything: list[Episode] = []
    kwargs = {k: v for k, v in (env_kwargs or {}).items() if k != "task"}
    out = Path(out)
    previous: list = []
    if (out / INDEX).exists():
        index = read_index(out)
        if not append:
            raise ConfigError("out", str(out), "already holds demonstrations; choose another directory or append to it")
        if (index.get("env_id"), index.get("env_kwargs")) != (env_id, kwargs):
            raise ConfigError("out", str(out), f"holds demonstrations of {index.get('env_id')} with env kwargs {index.get('env_kwargs')}; append only with the same env and kwargs ({kwargs})")
        previous = index.get("collections", [])

    env = gymnasium.make(env_id, max_episode_steps=max_episode_steps, task=tasks, **kwargs)
    summary: dict[str, Any] = {"out": str(out), "written": 0, "failed": 0, "steps": 0, "tasks": {}}
    try:
        for task_index, task in enumerate(tasks):
            episodes, failed = [], 0
            for j in range(episodes_per_task):
                with fault_context(source=f"env {env_id!r}"):  # a simulator's fault names the env, the task and the episode's seed
                    episode = run_expert_episode(env, expert_action, task, seed + j, noise, np.random.default_rng([seed + j, task_index]))
                summary["steps"] += len(episode)
                if episode.success or keep_failures:
                    episodes.append(episode)
                failed += not episode.success
            summary["tasks"][task] = {"succeeded": episodes_per_task - failed, "failed": failed}
            summary["written"] += len(episodes)
            summary["failed"] += failed
            if layout == "lerobot":
                everything += episodes
                if report is not None:
                    report(f"{task}: {episodes_per_task - failed}/{episodes_per_task} succeeded")
                continue
            run = {"tasks": tasks[: task_index + 1], "episodes_per_task": episodes_per_task, "seed": seed, "noise": noise, "keep_failures": keep_failures}
            metadata = {
                "env_id": env_id,
                "env_kwargs": kwargs,
                "max_episode_steps": env.spec.max_episode_steps if env.spec else None,
                "collections": previous + [run],
            }
            write_demos(out, episodes, metadata=metadata, append=append or task_index > 0)
            if report is not None:
                report(f"{task}: {episodes_per_task - failed}/{episodes_per_task} succeeded")
        if layout == "lerobot":
            cameras = kwargs.get("cameras", "top")
            metadata = {"env_id": env_id, "env_kwargs": kwargs, "max_episode_steps": env.spec.max_episode_steps if env.spec else None,
                        "collections": [{"tasks": tasks, "episodes_per_task": episodes_per_task, "seed": seed, "noise": noise, "keep_failures": keep_failures}]}
            if not everything:
                raise ConfigError("out", str(out), "no episode to write: every episode failed (pass keep_failures to write failures)")
            write_episodes(out, everything, fps=int(env.metadata.get("render_fps", 10)), cameras=[cameras] if isinstance(cameras, str) else list(cameras), metadata=metadata)
    finally:
        env.close()
    return summary


def _check_collection(count_field: str, count, seed, noise: float) -> None:
    """The episode count, seeds and action noise of a collection, refused naming the field."""
    if not isinstance(count, int) or count < 1:
        raise ConfigError(count_field, count, "expected a positive integer")
    if not isinstance(seed, int) or seed < 0 or seed + count > DEMO_SEED_LIMIT:
        raise ConfigError("seed", seed, f"demonstration seeds seed .. seed + {count_field} - 1 must lie in [0, 2**31) (evaluation uses seeds >= 2**31)")
    if noise < 0:
        raise ConfigError("noise", noise, "expected a standard deviation >= 0")


def run_expert_episode(env, expert_action, task: str, seed: int, noise: float = 0.0, rng: np.random.Generator | None = None) -> Episode:
    """One episode of ``expert_action`` on ``task`` from reset seed ``seed`` (observations,
    actions, rewards and success as written by ``mmrl collect``). What the env's ``reset`` or
    ``step`` raises comes out as a :class:`~mmrl.errors.UserCodeError` naming the task and
    the seed."""
    where = {"task": task, "reset_seed": seed}
    obs, _ = call_user_code("env.reset", env.reset, where=where, seed=seed, options={"task": task})
    images, states, actions, rewards, flags = [], [], [], [], []
    info: dict = {"success": False}
    done = False
    while not done:
        action = expert_action(env, noise=noise, rng=rng)
        images.append(obs["image"] if "image" in obs else np.zeros(0, np.uint8))  # a state-only env: no image
        states.append(obs["state"])
        actions.append(action)
        obs, reward, terminated, truncated, info = call_user_code("env.step", env.step, action, where=where)
        rewards.append(reward)
        flags.append(bool(info.get("success", False)))
        done = terminated or truncated
    return Episode(
        image=np.stack(images).astype(np.uint8),
        state=np.stack(states).astype(np.float32),
        action=np.stack(actions).astype(np.float32),
        reward=np.asarray(rewards, dtype=np.float32),
        success=bool(info["success"]),
        instruction=str(obs["instruction"]),
        task=task,
        seed=seed,
        costs={name: float(value) for name, value in info.get("costs", {}).items()},
        step_success=np.asarray(flags, dtype=bool),
        final_state=np.asarray(obs["state"], dtype=np.float32),
        terminated=bool(terminated),
    )


def collect_from_config(cfg, episodes: int, out: str | os.PathLike, *, seed: int = 0, noise: float = 0.0, keep_failures: bool = False,
                        report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Collect ``episodes`` episodes of the scripted expert of a run config's env (its env
    type's ``scripted_expert`` trait: one env built from the config's env section, as the run
    steps it, and its expert) into ``out``, for an off-policy loss's ``demos``. Episode j
    resets with seed ``seed + j``; ``noise``: std of Gaussian noise on the normalized actions,
    clipped to [-1, 1]. Returns the summary of :func:`collect` (``steps``: the env steps the
    demonstrations took, which count in a run's budget)."""
    from mmrl import registry
    from mmrl.config import to_dict

    entry = registry.ENVS.entry(cfg.env.type)
    make = entry.traits.get("scripted_expert")
    if make is None:
        with_one = sorted(name for name in registry.ENVS.names() if registry.ENVS.entry(name).traits.get("scripted_expert"))
        raise ConfigError("env.type", cfg.env.type, f"has no scripted expert; env types with one: {', '.join(with_one)} (and {TABLETOP_ID} through `mmrl collect --task`)")
    _check_collection("episodes", episodes, seed, noise)
    out = Path(out)
    if (out / INDEX).exists():
        raise ConfigError("out", str(out), "already holds demonstrations; choose another directory")
    env, act = make(cfg.env)
    summary: dict[str, Any] = {"out": str(out), "written": 0, "failed": 0, "steps": 0, "tasks": {}}
    kept = []
    try:
        for j in range(episodes):
            rng = np.random.default_rng([seed + j])
            where = {"reset_seed": seed + j}
            with fault_context(source=f"env {cfg.env.type!r}"):
                obs, _ = call_user_code("env.reset", env.reset, where=where, seed=seed + j)
                states, actions, rewards, flags = [], [], [], []
                terminated = truncated = False
                info: dict = {}
                while not (terminated or truncated):
                    action = act(env)
                    if noise:
                        action = np.clip(action + rng.normal(0.0, noise, action.shape), -1, 1).astype(np.float32)
                    states.append(np.asarray(obs, dtype=np.float32).reshape(-1))
                    actions.append(action)
                    obs, reward, terminated, truncated, info = call_user_code("env.step", env.step, action, where=where)
                    rewards.append(float(reward))
                    flags.append(bool(info.get("success", False)))
            summary["steps"] += len(actions)
            success = bool(flags[-1])
            summary["failed"] += not success
            if success or keep_failures:
                kept.append(Episode(
                    image=np.zeros((len(actions), 0), np.uint8), state=np.stack(states), action=np.stack(actions).astype(np.float32),
                    reward=np.asarray(rewards, np.float32), success=success, instruction="", task=str(getattr(cfg.env, "id", cfg.env.type)),
                    seed=seed + j, step_success=np.asarray(flags, bool), final_state=np.asarray(obs, np.float32).reshape(-1), terminated=bool(terminated),
                ))
    finally:
        env.close()
    task = str(getattr(cfg.env, "id", cfg.env.type))
    summary["tasks"][task] = {"succeeded": episodes - summary["failed"], "failed": summary["failed"]}
    if not kept:
        raise ConfigError("out", str(out), "no episode to write: every episode failed (pass keep_failures to write failures)")
    write_demos(out, kept, metadata={"env": to_dict(cfg.env), "collections": [{"episodes": episodes, "seed": seed, "noise": noise, "keep_failures": keep_failures}]})
    summary["written"] = len(kept)
    if report is not None:
        report(f"{task}: {episodes - summary['failed']}/{episodes} succeeded, {summary['steps']} env steps")
    return summary
