"""Interventions (HIL-SERL, Luo et al., 2024): someone else's action replaces the policy's.

In training, at every decision of the env sampler, an intervener sees the envs'
observations and the action chunks the policy proposes, and may take over some env rows:
those rows execute its actions instead. Each such decision is marked ``intervened`` in the
rollout (``info["intervened"]``), its replay is rewritten as the policy would have written
the executed action (``Policy.demo_replay``), and the off-policy learner adds it to the
demonstrations' buffer besides the online one (mmrl/train/off_policy.py). Evaluation never
intervenes.

```yaml
sampler:
  type: env
  intervener: {type: scripted, kwargs: {expert: "mmrl.envs.point_reach:reach_goal", fraction: 0.2, decay_steps: 4}}
  # or your device's:  {type: "my_package.teleop:SpaceMouse", kwargs: {scale: 0.5}}
```

``type`` is ``scripted`` (:class:`ScriptedIntervener`, for tests and benchmarks) or a class
``package.module:Class`` that implements :class:`Intervener`, built with ``kwargs`` (and
``seed``, derived from the run's, if its constructor takes one).
``examples/keyboard_intervener.py`` is one for a keyboard.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.registry import import_callable


@runtime_checkable
class Intervener(Protocol):
    """What a device (a teleop arm, a spacemouse, a keyboard, a scripted expert) implements.

    ``intervene`` is called once per decision of every training wave, with:

    - ``observations``: the vector env's observations as it returned them ([N, ...] NumPy
      arrays, a dict of them, or a simulator's torch tensors), N = ``env.num_envs``;
    - ``proposed``: the action chunks the policy proposes, a tensor [N, C, A] in env units;
    - ``step``: the training step (a schedule's clock);
    - ``env``: the vector env, for an intervener that reads the simulator's state.

    It returns None (no takeover) or ``(rows, actions)``: ``rows`` [N] bool, the envs it takes
    over, and ``actions`` [N, C, A] or [N, A] (one action for the whole chunk) in env units,
    read at those rows only. Both may be NumPy arrays or tensors.

    Optional: ``state_dict()`` / ``load_state_dict(state)`` (saved with the run, so a resumed
    run intervenes as the unbroken one would) and ``close()`` (called when the sampler closes).
    """

    def intervene(self, observations: Any, proposed: Tensor, step: int, env: Any) -> tuple[Any, Any] | None: ...


@dataclass
class IntervenerConfig:
    """``sampler.intervener``: who takes over decisions in training (mmrl/interventions.py)."""

    type: str = option(doc="'scripted' (an expert function on a decaying share of decisions) or 'package.module:Class' (your device's)")
    kwargs: dict[str, Any] = option(factory=dict, doc="keyword arguments of the intervener (scripted: expert, fraction, decay_steps)")

    def validate(self, path: str) -> None:
        field = path or "intervener"
        cls = resolve_intervener(self.type, f"{field}.type")
        try:
            inspect.signature(cls).bind(**_with_seed(cls, self.kwargs, 0))
        except TypeError as e:
            raise ConfigError(f"{field}.kwargs", self.kwargs, f"{self.type} takes {_parameters(cls)}: {e}") from None
        if cls is ScriptedIntervener:
            import_callable(self.kwargs["expert"], f"{field}.kwargs.expert", "function")


class ScriptedIntervener:
    """An expert that takes over each env at each decision with probability

        p(step) = fraction · max(0, 1 − step / decay_steps)        (decay_steps null: fraction)

    drawn from a generator of its own (seeded, saved with the run). ``expert`` names a
    function ``package.module:function`` of the observations that returns the actions [N, A]
    or chunks [N, C, A] in env units (``mmrl.envs.point_reach:reach_goal``: straight at the
    goal)."""

    def __init__(self, expert: str, fraction: float = 0.2, decay_steps: int | None = None, seed: int = 0):
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        if decay_steps is not None and decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1 (or null: no decay), got {decay_steps}")
        self.expert = import_callable(expert, "expert", "function")
        self.fraction, self.decay_steps = fraction, decay_steps
        self.generator = torch.Generator().manual_seed(seed)

    def rate(self, step: int) -> float:
        """p(step), the share of decisions taken over at ``step``."""
        if self.decay_steps is None:
            return self.fraction
        return self.fraction * max(0.0, 1.0 - step / self.decay_steps)

    def intervene(self, observations, proposed: Tensor, step: int, env) -> tuple[Tensor, Any] | None:
        p = self.rate(step)
        if p <= 0:
            return None
        rows = torch.rand(proposed.shape[0], generator=self.generator) < p
        return rows, self.expert(observations)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


_BUILT_IN = {"scripted": ScriptedIntervener}


def resolve_intervener(spec: str, field: str) -> type:
    """The class ``spec`` names (``scripted`` or ``package.module:Class``); a ConfigError
    naming ``field`` if it cannot be found."""
    if spec in _BUILT_IN:
        return _BUILT_IN[spec]
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(field, spec, f"expected {', '.join(_BUILT_IN)} or 'package.module:Class' (a class with intervene(observations, proposed, step, env))")
    cls = import_callable(spec, field, "class")
    if not callable(getattr(cls, "intervene", None)):
        raise ConfigError(field, spec, "has no intervene(observations, proposed, step, env) method (mmrl.interventions.Intervener)")
    return cls


def build_intervener(cfg: IntervenerConfig, seed: int, field: str = "sampler.intervener") -> Intervener:
    """The intervener of ``cfg``: its class built with ``kwargs``, and ``seed`` where the
    constructor takes one. What the constructor refuses is a ConfigError naming the kwargs."""
    cls = resolve_intervener(cfg.type, f"{field}.type")
    try:
        return cls(**_with_seed(cls, cfg.kwargs, seed))
    except ConfigError as e:  # one of its kwargs (the scripted expert's import path)
        raise ConfigError(f"{field}.kwargs.{e.field}", e.value, e.allowed) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{field}.kwargs", cfg.kwargs, str(e)) from None


def _with_seed(cls, kwargs: dict, seed: int) -> dict:
    parameters = inspect.signature(cls).parameters
    takes_seed = "seed" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return {**kwargs, "seed": seed} if takes_seed and "seed" not in kwargs else dict(kwargs)


def as_takeover(taken, proposed: Tensor) -> tuple[Tensor, Tensor]:
    """An intervener's ``(rows, actions)`` as a bool tensor [N] and actions [N, C, A] on
    ``proposed``'s device and dtype (one action [N, A] repeated over the chunk)."""
    rows, actions = taken
    rows = torch.as_tensor(np.asarray(rows) if not isinstance(rows, Tensor) else rows).to(proposed.device, torch.bool).reshape(-1)
    actions = torch.as_tensor(np.asarray(actions) if not isinstance(actions, Tensor) else actions).to(proposed.device, proposed.dtype)
    n, c, a = proposed.shape
    if rows.shape[0] != n:
        raise ValueError(f"the intervener's rows cover {rows.shape[0]} envs; the vector env has {n}")
    if actions.dim() == 2:
        actions = actions.unsqueeze(1).expand(n, c, a)
    if tuple(actions.shape) != (n, c, a):
        raise ValueError(f"the intervener's actions have shape {tuple(actions.shape)}; expected [{n}, {c}, {a}] or [{n}, {a}] (env units)")
    return rows, actions


def _parameters(cls) -> str:
    names = [name for name, p in inspect.signature(cls).parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"({', '.join(names)})" if names else "no arguments"
