"""Gymnasium wrappers named in the config, applied to each single env before vectorization.

```yaml
env:
  type: gym
  id: Reacher-v5
  wrappers:
    - {type: ClipReward, kwargs: {min_reward: -0.5, max_reward: 0.5}}   # gymnasium.wrappers
    - {type: "my_package.wrappers:RenameInfo", kwargs: {old: succeed, new: success}}
```

``type`` names a callable ``(env, **kwargs) -> gymnasium.Env``, usually a wrapper class:
``"package.module:Name"`` or ``"package.module.Name"``, or a bare ``Name`` from
``gymnasium.wrappers``. ``kwargs`` are plain YAML values. Wrappers apply in list order, the
first one innermost. Vector-env wrappers (``gymnasium.wrappers.vector``) do not fit here:
every env adapter vectorizes after wrapping.

:func:`async_vector_env` is gymnasium's ``AsyncVectorEnv`` whose worker processes leave
SIGINT and SIGTERM to the trainer (every adapter's ``vectorization: async`` goes through it).

This module sits beside the config code rather than in ``mmrl.envs`` because ``EnvConfig``
types its ``wrappers`` field with :class:`WrapperConfig`, and ``mmrl.envs`` imports the configs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import signal
from dataclasses import dataclass
from typing import Any, Callable

from mmrl.config import option
from mmrl.errors import ConfigError

_GYMNASIUM_WRAPPERS = "gymnasium.wrappers"


@dataclass
class WrapperConfig:
    """One entry of ``env.wrappers``: a gymnasium wrapper and its keyword arguments."""

    type: str = option(doc="the wrapper: 'package.module:ClassName', 'package.module.ClassName', or a bare name from gymnasium.wrappers")
    kwargs: dict[str, Any] = option(factory=dict, doc="keyword arguments of the wrapper (after the env)")

    def validate(self, path: str) -> None:
        field = path or "wrapper"
        wrapper = resolve_wrapper(self.type, f"{field}.type")
        try:
            signature = inspect.signature(wrapper)
        except (TypeError, ValueError):  # no introspectable signature (a C extension): checked when applied
            return
        try:
            signature.bind(None, **self.kwargs)  # None stands for the env
        except TypeError as e:
            raise ConfigError(f"{field}.kwargs", self.kwargs, f"{self.type} takes {_parameters(signature)}: {e}") from None


def _parameters(signature: inspect.Signature) -> str:
    names = [p.name for p in list(signature.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"({', '.join(names)})" if names else "no arguments besides the env"


def resolve_wrapper(spec: str, field: str) -> Callable:
    """The callable that ``spec`` names (see the module doc); a ConfigError naming ``field``
    if it cannot be imported, is missing or is a vector-env wrapper."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(field, spec, "name a wrapper: 'package.module:ClassName' or a class of gymnasium.wrappers")
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        module_name, attr = _GYMNASIUM_WRAPPERS, spec
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(field, spec, f"could not import the module {module_name!r}: {e}") from None
    wrapper = module
    for part in attr.split("."):
        wrapper = getattr(wrapper, part, None)
        if wrapper is None:
            public = [n for n in dir(module) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, public, n=3, cutoff=0.6)
            hint = f"close matches: {', '.join(close)}" if close else "expected 'package.module:ClassName'"
            raise ConfigError(field, spec, f"the module {module_name!r} has no {attr!r}; {hint}")
    import gymnasium

    if isinstance(wrapper, type) and issubclass(wrapper, (gymnasium.vector.VectorEnv, gymnasium.vector.VectorWrapper)):
        raise ConfigError(field, spec, "is a vector-env wrapper; env.wrappers wraps each single env before vectorization")
    if not callable(wrapper):
        raise ConfigError(field, spec, f"is a {type(wrapper).__name__}, not a wrapper class or function")
    return wrapper


def apply_wrappers(env, wrappers: list[WrapperConfig], path: str = "env.wrappers"):
    """``env`` wrapped by each of ``wrappers`` in order (the first innermost). A wrapper that
    fails on this env, or returns something other than a gymnasium env, is a ConfigError
    naming its entry, ``env.wrappers[i]``."""
    import gymnasium

    for i, cfg in enumerate(wrappers):
        field = f"{path}[{i}]"
        wrapper = resolve_wrapper(cfg.type, f"{field}.type")
        try:
            wrapped = wrapper(env, **cfg.kwargs)
        except Exception as e:
            # A user's wrapper raises whatever it likes on arguments or spaces it cannot take;
            # the run cannot start either way, so say which entry failed and why.
            env.close()
            raise ConfigError(field, {"type": cfg.type, "kwargs": cfg.kwargs}, f"failed on {_env_name(env)}: {type(e).__name__}: {e}") from e
        if not isinstance(wrapped, gymnasium.Env):
            env.close()
            raise ConfigError(field, cfg.type, f"returned a {type(wrapped).__name__}, not a gymnasium env")
        env = wrapped
    return env


def _env_name(env) -> str:
    spec = getattr(env, "spec", None)
    return spec.id if spec is not None else type(env.unwrapped).__name__


class _SignalsToParent:
    """An env factory for a worker process that first ignores SIGINT and SIGTERM.

    Ctrl-C in a terminal, and ``timeout`` or a cluster scheduler, signal the whole process
    group. A worker killed by that signal would break the step the trainer is finishing before
    it writes its checkpoint; ignoring it leaves the shutdown to the trainer, which closes the
    workers itself. A worker whose parent dies still ends: its pipe closes.
    """

    def __init__(self, make_one: Callable[[], Any]):
        self.make_one = make_one

    def __call__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        return self.make_one()


def async_vector_env(make_one: Callable[[], Any], num_envs: int, **kwargs: Any):
    """``gymnasium.vector.AsyncVectorEnv`` of ``num_envs`` copies of ``make_one()``, with workers
    that leave SIGINT/SIGTERM to the trainer (kwargs: ``context``, ``shared_memory``, ...)."""
    import gymnasium

    return gymnasium.vector.AsyncVectorEnv([_SignalsToParent(make_one)] * num_envs, **kwargs)
