"""Registries: plain dicts filled by decorators at import time, plus third-party plugins.

Built-in components register when their module is imported; every lookup first imports
every module of the registry's built-in packages (walked, so a new folder needs no import
line anywhere) and the ``importlib.metadata`` entry points of its group, so a YAML run never
depends on someone having imported the right module.

What a kind of component is to the rest of mmrl is declared here or where each component
registers: a registry names the config section it fills (``section``), and an entry may
carry traits the core reads (an advantage's ``min_group_size``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from mmrl.errors import ConfigError


@dataclass
class Entry:
    name: str
    obj: Any
    config: type | None = None
    doc: str = ""
    traits: dict[str, Any] = field(default_factory=dict)


class Registry:
    """One kind of component. ``builtin_packages`` are imported with every module below them;
    ``section`` is the config section whose ``type:`` picks an entry (None: not a section)."""

    def __init__(self, kind: str, builtin_packages: tuple[str, ...] = (), entry_point_group: str | None = None, section: str | None = None):
        self.kind = kind
        self.section = section
        self._entries: dict[str, Entry] = {}
        self._builtin_packages = builtin_packages
        self._entry_point_group = entry_point_group
        self._loaded = False
        if section is not None:
            SECTIONS[section] = self

    def register(self, name: str, config: type | None = None, **traits: Any) -> Callable:
        """Decorator: register ``obj`` as ``name`` with its config dataclass and ``traits``."""

        def decorator(obj):
            if name in self._entries and self._entries[name].obj is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            doc = (obj.__doc__ or "").strip().splitlines()
            self._entries[name] = Entry(name, obj, config, doc[0] if doc else "", dict(traits))
            return obj

        return decorator

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for name in self._builtin_packages:
            import_all(name)
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


def import_all(package: str) -> None:
    """Import ``package`` and every module below it (each registers what it defines)."""
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix=package + "."):
        if info.name.rpartition(".")[2] != "__main__":
            importlib.import_module(info.name)


def for_section(section: str) -> Registry | None:
    """The registry whose entries a config section's ``type:`` picks (``policy``, ``rewards``, ...)."""
    return SECTIONS.get(section)


SECTIONS: dict[str, Registry] = {}

ENVS = Registry("envs", ("mmrl.envs", "mmrl.tasks"), "mmrl.envs", section="env")  # a task folder registers its gymnasium id
POLICIES = Registry("policies", ("mmrl.policies",), "mmrl.policies", section="policy")
REWARDS = Registry("rewards", ("mmrl.rewards", "mmrl.tasks"), "mmrl.rewards", section="rewards")
SAMPLERS = Registry("samplers", ("mmrl.samplers",), "mmrl.samplers", section="sampler")
DATA_SOURCES = Registry("data sources", ("mmrl.data", "mmrl.tasks"), section="data")

ADVANTAGES = Registry("advantages", ("mmrl.algo.advantage", "mmrl.algo.value"), section="advantage")
OBJECTIVES = Registry("objectives", ("mmrl.algo.objective",), section="objective")
AGGREGATIONS = Registry("aggregations", ("mmrl.algo.aggregation",), section="aggregation")
KL_ESTIMATORS = Registry("kl estimators", ("mmrl.algo.kl",))
FILTERS = Registry("filters", ("mmrl.algo.filters",), section="filters")
ENGINES = Registry("engines", ("mmrl.rollout",))  # rollout.engine: where rollout workers run
CORRECTIONS = Registry("corrections", ("mmrl.algo.correction",), section="correction")
LOSSES = Registry("losses", ("mmrl.algo.losses",), "mmrl.losses", section="loss")  # algo.loss: what one piece of a minibatch backpropagates


def import_callable(spec: str, field: str, what: str = "function"):
    """The callable a config names as ``package.module:Name`` (a user's function or class);
    a one-line ConfigError naming ``field`` if the module cannot be imported or has no such
    callable."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(field, spec, f"could not import the module {module_name!r}: {e}") from None
    value = getattr(module, attr, None) if attr else None
    if value is None or not callable(value):
        raise ConfigError(field, spec, f"the module {module_name!r} has no {what} {attr!r}; expected 'package.module:Name'")
    return value
