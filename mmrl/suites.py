"""Task suites as data: a YAML file names an env, its tasks and how many episodes of each.

```yaml
name: tabletop_spatial
description: pick the block by where it lies
env: {type: gym, id: mmrl/Tabletop-v0, kwargs: {image_size: 64}}
tasks: [spatial_left, spatial_right, spatial_top, spatial_bottom]
episodes_per_task: 50
seeds: [0, 1, 2]
```

- ``env``: an mmrl env section (as in a training config), checked like one.
- ``tasks``: the suite's tasks. For ``mmrl/Tabletop-v0`` a family name (``spatial``) or
  ``all`` expands to its tasks; :meth:`Suite.env_section` sets ``kwargs.task``.
- ``episodes_per_task``: demonstrations collected per task (``mmrl collect``), and episodes
  per task and seed when the suite is evaluated.
- ``seeds``: evaluation seeds; one evaluation round per seed, so results come with a spread
  over seeds. Demonstrations use reset seeds below 2**31 and evaluation seeds at or above it
  (see ``mmrl/samplers/env.py``), so the two never share an initial state.

A bare name (``tabletop_spatial``) is a built-in suite in mmrl's ``configs/suites/``; any
other path is a user's YAML file, which needs no code.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.config import builtin_config_dir, load_yaml
from mmrl.errors import ConfigError

TABLETOP_ID = "mmrl/Tabletop-v0"
_KEYS = ("name", "description", "env", "tasks", "episodes_per_task", "seeds")


@dataclass
class Suite:
    """A named set of tasks of one env, with episode counts and evaluation seeds."""

    name: str
    env: dict[str, Any]
    tasks: list[str]
    episodes_per_task: int
    seeds: list[int] = field(default_factory=lambda: [0])
    description: str = ""

    def env_section(self, tasks: list[str] | None = None) -> dict[str, Any]:
        """The env section for some of the suite's tasks (default: all of them); for
        ``mmrl/Tabletop-v0`` with ``kwargs.task`` set to them."""
        section = copy.deepcopy(self.env)
        if section.get("id") == TABLETOP_ID:
            section["kwargs"] = {**section.get("kwargs", {}), "task": list(tasks if tasks is not None else self.tasks)}
        return section


def builtin_suite_dir() -> Path:
    return builtin_config_dir() / "suites"


def list_suites() -> list[str]:
    """Names of the built-in suites."""
    try:
        return sorted(p.stem for p in builtin_suite_dir().glob("*.yaml"))
    except FileNotFoundError:
        return []


def _suite_path(name_or_path: str | os.PathLike) -> Path:
    text = str(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or os.sep in text or path.is_file():
        if not path.is_file():
            raise ConfigError("suite", text, "no such file")
        return path
    builtin = builtin_suite_dir() / f"{text}.yaml"
    if not builtin.is_file():
        raise ConfigError("suite", text, f"not a built-in suite or a YAML file; built-in suites: {', '.join(list_suites()) or 'none'}")
    return builtin


def _int_list(value, key: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(key, value, "expected a non-empty list of integers")
    return value


def load_suite(name_or_path: str | os.PathLike) -> Suite:
    """Read and check a suite: a built-in name or a YAML path. Errors name the field."""
    path = _suite_path(name_or_path)
    data = load_yaml(path, "suite")
    for key in data:
        if key not in _KEYS:
            raise ConfigError(key, data[key], f"unknown key of a suite ({path}); allowed keys: {', '.join(_KEYS)}")
    for key in ("env", "tasks", "episodes_per_task"):
        if key not in data:
            raise ConfigError(key, None, f"required in a suite ({path})")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError("name", name, "expected a non-empty string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError("description", description, "expected a string")
    env = data["env"]
    if not isinstance(env, dict):
        raise ConfigError("env", env, "expected an env section, e.g. {type: gym, id: mmrl/Tabletop-v0}")
    _check_env(env)
    tasks = data["tasks"]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise ConfigError("tasks", tasks, "expected a non-empty list of task names")
    if env.get("id") == TABLETOP_ID:
        from mmrl.envs.tabletop.tasks import resolve_tasks

        tasks = resolve_tasks(tasks, "tasks")
        allowed = env.get("kwargs", {}).get("task")
        if allowed is not None:
            outside = [t for t in tasks if t not in resolve_tasks(allowed, "env.kwargs.task")]
            if outside:
                raise ConfigError("tasks", outside, f"not among the env's tasks (env.kwargs.task: {allowed!r})")
    episodes = data["episodes_per_task"]
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
        raise ConfigError("episodes_per_task", episodes, "expected a positive integer")
    seeds = _int_list(data.get("seeds", [0]), "seeds")
    return Suite(name=name, env=env, tasks=tasks, episodes_per_task=episodes, seeds=seeds, description=description)


def _check_env(env: dict) -> None:
    """Check an env section as a training config would (type, id, fields of the type)."""
    import mmrl.envs  # noqa: F401  (registers mmrl's gymnasium ids)
    from mmrl import registry
    from mmrl.config import from_dict

    if not env.get("type"):
        raise ConfigError("env.type", env.get("type"), f"required; known envs: {', '.join(registry.ENVS.names())}")
    from_dict(registry.ENVS.entry(env["type"], "env.type").config, env, "env")
