"""Configs: YAML → nested dataclasses, ``type:``-selected components, dotted overrides.

- Every field is declared with :func:`option`, whose ``doc`` is shown by ``mmrl train --help``.
- A component section (``env``, ``policy``, ``sampler``, each reward) names its ``type``; the
  registry entry of that type supplies the dataclass of the rest of the section.
- ``defaults:`` pulls in presets (``presets/grpo``); the file's own keys win, and command-line
  overrides (``algo.objective.eps_high=0.28``) win over both.
- A config class may declare ``moved_keys``: keys of an earlier mmrl's config that now live
  elsewhere, so an old config is told where to write each instead of "unknown key".
- Every error is a :class:`~mmrl.errors.ConfigError` naming the dotted field, the value and
  what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from mmrl.errors import ConfigError


def option(default=MISSING, doc: str = "", *, factory=None, choices=None, ge=None, gt=None, le=None, lt=None):
    """A config field with a one-line doc and optional range/choice constraints."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class MovedKey:
    """Where a key of an earlier mmrl's config lives now, declared in the ``moved_keys`` class
    attribute of the config class that used to hold it.

    ``to`` is dotted from that class's section (``kl.coef``; ``filters[i].lo`` for an item of a
    list); ``since`` names the change that moved it; ``section_type`` is the ``type`` of the
    section that has the option, where its default type does not; ``note`` says what else the
    move changed (renamed values)."""

    to: str
    since: str
    section_type: str | None = None
    note: str = ""

    def message(self, prefix: str) -> str:
        place = prefix + self.to
        of_type = f", an option of {place.rsplit('.', 1)[0]} type {self.section_type}" if self.section_type else ""
        why = "; ".join(filter(None, (self.since, self.note)))
        return f"moved to {place}{of_type} ({why}); write it there"


@dataclass
class Component:
    """Base of component configs selected by ``type:`` from a registry."""

    type: str = option("", "registered name of this component (see `mmrl list`)")


def own_options(cfg, base: type) -> dict[str, Any]:
    """The fields of ``cfg`` that its class adds to ``base``: the options a registered
    function of one algorithm axis takes as keyword arguments. Only the method's own config
    reaches it, so one method's default can never replace another's."""
    inherited = {f.name for f in fields(base)}
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in inherited}


# ---------------------------------------------------------------- parsing and checking


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value, tp, path: str, resolve_component):
    """Convert a YAML value to the annotated type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:
            return _coerce(value, others[0], path, resolve_component)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, resolve_component)
            except ConfigError:
                continue
        raise ConfigError(path, value, f"expected {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, value, f"allowed: {', '.join(map(str, allowed))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, value, f"expected {_type_name(tp)}")
        (item_tp,) = typing.get_args(tp)[:1] or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]", resolve_component) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, value, "expected a mapping")
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and issubclass(tp, Component):  # `objective: cispo` names the type alone
            value = {"type": value}
        if not isinstance(value, dict):
            raise ConfigError(path, value, "expected a mapping")
        if issubclass(tp, Component):
            tp = resolve_component(path, value)
        return from_dict(tp, value, path, resolve_component)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(path, value, "expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, value, "expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, value, "expected a string")
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def _check_constraints(f: dataclasses.Field, value, path: str) -> None:
    m = f.metadata
    if value is None:
        return
    if m.get("choices") is not None and value not in m["choices"]:
        raise ConfigError(path, value, f"allowed: {', '.join(map(str, m['choices']))}")
    bounds = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"), ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))
    for key, ok, sym in bounds:
        bound = m.get(key)
        if bound is not None and isinstance(value, (int, float)) and not ok(value, bound):
            ranges = [f"{s} {m[k]}" for k, _, s in bounds if m.get(k) is not None]
            raise ConfigError(path, value, f"must be {' and '.join(ranges)}")


def from_dict(cls, data: dict, path: str = "", resolve_component=None):
    """Build dataclass ``cls`` from ``data``; unknown keys, wrong types and out-of-range
    values raise ConfigError with the dotted path."""
    resolve_component = resolve_component or _resolve_component
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    moved = getattr(cls, "moved_keys", {})
    for key in data:
        if key not in known:
            if key in moved:
                raise ConfigError(f"{prefix}{key}", data[key], moved[key].message(prefix))
            raise ConfigError(f"{prefix}{key}", data[key], f"unknown key; allowed keys of {path or 'the config'}: {', '.join(known)}")
    kwargs = {}
    for name, f in known.items():
        if name in data:
            raw = data[name]
            if raw == {"type": ""} and f.default_factory is not MISSING and getattr(f.default_factory(), "type", None) == "":
                # a section left out, as a resolved config writes it back (sft runs without a sampler)
                kwargs[name] = f.default_factory()
                continue
            if isinstance(raw, dict) and "type" not in raw and f.default_factory is not MISSING:
                # a component section without a type keeps the type of the field's default
                default_type = getattr(f.default_factory(), "type", None)
                if isinstance(default_type, str) and default_type:
                    raw = {"type": default_type, **raw}
            section_default = _section_default(f, hints[name])
            if section_default is not None and isinstance(raw, dict):
                # keys the file leaves out keep this field's own default (a policy's
                # defaults for its ``denoising`` section), not the section class's
                raw = deep_merge(to_dict(section_default), raw)
            value = _coerce(raw, hints[name], prefix + name, resolve_component)
            _check_constraints(f, value, prefix + name)
            kwargs[name] = value
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(prefix + name, None, f"required: {f.metadata.get('doc', '')}")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check(path)
    return obj


def _section_default(f: dataclasses.Field, tp):
    """The default instance of a nested (non-component) section field, or None."""
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)) or issubclass(tp, Component):
        return None
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _resolve_component(path: str, value: dict) -> type:
    """Find the config dataclass of a ``type:``-selected section from its registry."""
    from mmrl import registry

    section = path.split(".")[-1].split("[")[0]
    reg = registry.for_section(section)
    if reg is None:
        raise TypeError(f"no registry for component section {path!r}")
    name = value.get("type")
    if not name:
        raise ConfigError(f"{path}.type", name, f"required; known {reg.kind}: {', '.join(reg.names())}")
    entry = reg.entry(name, f"{path}.type")
    if entry.config is None:
        raise TypeError(f"{reg.kind} {name!r} registered without a config class")
    return entry.config


def to_dict(obj) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------- YAML, presets, overrides


def builtin_config_dir() -> Path:
    """``configs/`` of a checkout or the ``mmrl/configs`` of an installed wheel."""
    import mmrl

    for path in mmrl.__path__:
        for candidate in (Path(path) / "configs",):
            if (candidate / "presets").is_dir():
                return candidate
    raise FileNotFoundError("mmrl's built-in configs directory is missing from this installation")


def load_yaml(path: str | os.PathLike, field_name: str = "config") -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(field_name, str(path), "no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(field_name, str(path), f"not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(field_name, str(path), "the file must hold a mapping of config keys")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and v.get("type", out[k].get("type")) == out[k].get("type"):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _find_preset(name: str, relative_to: Path | None) -> Path:
    candidates = []
    stem = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    if relative_to is not None:
        candidates.append(relative_to / stem)
    try:
        builtin = builtin_config_dir()
        candidates += [builtin / stem, builtin / "presets" / stem]
    except FileNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    known = ", ".join(list_presets()) if candidates else "none"
    raise ConfigError("defaults", name, f"no such preset or file; known presets: {known}")


def list_presets() -> list[str]:
    try:
        return sorted(p.stem for p in (builtin_config_dir() / "presets").glob("*.yaml"))
    except FileNotFoundError:
        return []


def resolve_defaults(data: dict, relative_to: Path | None, _seen: tuple = ()) -> dict:
    defaults = data.pop("defaults", None)
    if defaults is None:
        return data
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError("defaults", defaults, "expected a preset name or a list of them")
    merged: dict = {}
    for name in defaults:
        path = _find_preset(name, relative_to)
        if path in _seen:
            raise ConfigError("defaults", name, "presets include each other in a cycle")
        merged = deep_merge(merged, resolve_defaults(load_yaml(path, "defaults"), path.parent, _seen + (path,)))
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError("override", text, "expected key=value, e.g. algo.objective.eps_high=0.28")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError("override", text, "expected a dotted key before '=', e.g. algo.objective.eps_high=0.28")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Dotted ``key=value`` overrides merged over ``data`` as :func:`deep_merge` merges a file
    over its presets: an override that changes a section's ``type`` replaces the section, so
    the options of the previous type (e.g. PPO's clip range) never leak into the new one."""
    data = dict(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):  # check the path before merging
            child = node.get(k) if isinstance(node, dict) else None
            if isinstance(child, str) and i == len(keys) - 2:
                child = {"type": child}  # `objective: cispo` is the section {type: cispo}
            if child is not None and not isinstance(child, dict):
                raise ConfigError(".".join(keys[: i + 1]), child, "is not a section; cannot set a key inside it")
            node = child or {}
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        data = _merge_override(data, nested)
    return data


def _merge_override(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        current = out.get(k)
        if isinstance(current, str) and isinstance(v, dict) and "type" not in v:
            current = {"type": current}
        if isinstance(v, dict) and isinstance(current, dict):
            if "type" in v and v["type"] != current.get("type"):
                out[k] = dict(v)  # a new type: the section starts from that type's defaults
            else:
                out[k] = _merge_override(current, v)
        else:
            out[k] = v
    return out


def load_config(cls, path: str | os.PathLike | None, overrides: list[str] = ()):
    """YAML file (+ presets) + dotted overrides → validated ``cls`` instance."""
    data = load_yaml(path) if path is not None else {}
    # `defaults=...` on the command line replaces the file's presets (before they are merged);
    # every other override wins over the merged result
    preset = [o for o in overrides if o.split("=", 1)[0] == "defaults"]
    data = apply_overrides(data, preset)
    data = resolve_defaults(data, Path(path).parent if path is not None else None)
    return from_dict(cls, apply_overrides(data, [o for o in overrides if o not in preset]))


def describe(cls, prefix: str = "", defaults=None) -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) for every field, recursing into sections; a
    section's defaults are those of the field's default instance (``defaults``)."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        name = prefix + f.name
        if defaults is not None:
            default = getattr(defaults, f.name)
        else:
            default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING else "required")
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and not issubclass(tp, Component):
            rows.append((name, "section", "", f.metadata.get("doc", "")))
            rows += describe(tp, name + ".", default if dataclasses.is_dataclass(default) else None)
            continue
        if dataclasses.is_dataclass(default):
            default = to_dict(default)
        rows.append((name, _type_name(tp), repr(default), f.metadata.get("doc", "")))
        inner = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else []
        if len(inner) == 1 and isinstance(inner[0], type) and dataclasses.is_dataclass(inner[0]) and not issubclass(inner[0], Component):
            rows += describe(inner[0], name + ".")  # an optional section (null by default): its options when given
    return rows
