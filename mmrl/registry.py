"""Registries: plain dicts filled by decorators at import time, plus third-party plugins.

Built-in components register when their package is imported; every lookup first imports
the registry's built-in modules and the ``importlib.metadata`` entry points of its group,
so a YAML run never depends on someone having imported the right module.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable

from mmrl.errors import ConfigError


@dataclass
class Entry:
    name: str
    obj: Any
    config: type | None = None
    doc: str = ""


class Registry:
    def __init__(self, kind: str, builtin_modules: tuple[str, ...] = (), entry_point_group: str | None = None):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._builtin_modules = builtin_modules
        self._entry_point_group = entry_point_group
        self._loaded = False

    def register(self, name: str, config: type | None = None) -> Callable:
        def decorator(obj):
            if name in self._entries and self._entries[name].obj is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            doc = (obj.__doc__ or "").strip().splitlines()
            self._entries[name] = Entry(name, obj, config, doc[0] if doc else "")
            return obj

        return decorator

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._builtin_modules:
            importlib.import_module(module)
        if self._entry_point_group:
            for ep in importlib.metadata.entry_points(group=self._entry_point_group):
                ep.load()  # the plugin module registers itself on import

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        self._load()
        return [self._entries[n] for n in sorted(self._entries)]

    def entry(self, name: str, field: str | None = None) -> Entry:
        self._load()
        if name not in self._entries:
            raise ConfigError(field or f"{self.kind}.type", name, f"known {self.kind}: {', '.join(self.names())}")
        return self._entries[name]

    def get(self, name: str, field: str | None = None) -> Any:
        return self.entry(name, field).obj

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries


ENVS = Registry("envs", ("mmrl.envs",), "mmrl.envs")
POLICIES = Registry("policies", ("mmrl.policies",), "mmrl.policies")
REWARDS = Registry("rewards", ("mmrl.rewards",), "mmrl.rewards")
SAMPLERS = Registry("samplers", ("mmrl.samplers",), "mmrl.samplers")
DATA_SOURCES = Registry("data sources", ("mmrl.train.sft",))

ADVANTAGES = Registry("advantages", ("mmrl.algo.advantage",))
OBJECTIVES = Registry("objectives", ("mmrl.algo.objective",))
AGGREGATIONS = Registry("aggregations", ("mmrl.algo.aggregation",))
KL_ESTIMATORS = Registry("kl estimators", ("mmrl.algo.kl",))
FILTERS = Registry("filters", ("mmrl.algo.filters",))
