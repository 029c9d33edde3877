"""Adapter for any gymnasium id: ``env: {type: gym, id: Reacher-v5, num_envs: 8}``.

An external simulator plugs in by its gymnasium id, with no change to mmrl, as long as its
package registers the id with gymnasium when it is imported:

- ``"package:Env-v0"`` imports ``package`` first (gymnasium's own convention);
- a namespaced id ``"package/Env-v0"`` that is not registered yet imports the module named
  by its namespace, ``package``, and is then made as ``"package:package/Env-v0"`` (so that
  async workers import it too). A package whose namespace is not its module name (ALE's
  ``ALE/Pong-v5`` comes from ``ale_py``) is named explicitly: ``"ale_py:ALE/Pong-v5"``.

``env.wrappers`` wrap each env after ``gymnasium.make`` (so outside its time limit and
gymnasium's checkers), before vectorization.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import gymnasium

from mmrl.config import option
from mmrl.env_wrappers import WrapperConfig, apply_wrappers, async_vector_env
from mmrl.errors import ConfigError
from mmrl.registry import ENVS
from mmrl.core.component_config import EnvConfig


@dataclass
class GymEnvConfig(EnvConfig):
    """Any gymnasium id, vectorized with gymnasium's SyncVectorEnv or AsyncVectorEnv."""

    type: str = option("gym", "registered name of this component (see `mmrl list`)")
    kwargs: dict[str, Any] = option(factory=dict, doc="extra keyword arguments of gymnasium.make for every env")
    context: str | None = option(
        "spawn", "start method of async workers (spawn is safe with GL/simulator state in the parent; fork starts faster for light envs; null = the platform default)",
        choices=("fork", "spawn", "forkserver"),
    )

    def validate(self, path: str) -> None:
        resolve_gym_id(self.id, f"{path}.id" if path else "id")


def resolve_gym_id(env_id: str, field: str) -> str:
    """The id to make ``env_id`` with: ``env_id`` itself, or ``"namespace:namespace/Env-v0"``
    when importing the namespace's module registered it. A ConfigError naming ``field``
    unless it is (or becomes) a registered gymnasium id."""
    name = env_id
    if ":" in env_id:
        module, name = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(field, env_id, f"could not import the module {module!r} before the id: {e}") from None
    if name in gymnasium.registry:
        return env_id
    namespace, _, _ = name.rpartition("/")
    tried = ""
    if ":" not in env_id and namespace:
        try:
            importlib.import_module(namespace)
        except ImportError as e:
            tried = f"; importing its namespace {namespace!r} as a module failed ({e})"
        else:
            if name in gymnasium.registry:
                return f"{namespace}:{name}"
            tried = f"; importing the module {namespace!r} did not register it"
    # the same env name in another namespace (or none) is the likeliest meaning
    same_name = [i for i in gymnasium.registry if i.rpartition("/")[2] == name.rpartition("/")[2]]
    close = list(dict.fromkeys(same_name + difflib.get_close_matches(name, list(gymnasium.registry), n=5, cutoff=0.6)))[:5]
    hint = f"close matches: {', '.join(close)}" if close else "e.g. mmrl/PointReach-v0, Reacher-v5, CartPole-v1"
    if namespace and ":" not in env_id:
        hint += f"; if a package registers it when imported, name the package first: 'package:{name}'"
    raise ConfigError(field, env_id, f"not a registered gymnasium id{tried}; {hint}")


def _make_env(env_id: str, max_episode_steps: int | None, kwargs: dict, wrappers: list[WrapperConfig]) -> gymnasium.Env:
    # A module-level function pickles by reference: an async worker started with spawn
    # imports mmrl.envs to unpickle it, which registers mmrl's own ids there too.
    return apply_wrappers(gymnasium.make(env_id, max_episode_steps=max_episode_steps, **kwargs), wrappers)


def _has_text(make_one) -> bool:
    """Whether the env's observations hold a Text space (e.g. an instruction).

    gymnasium's shared-memory buffers read Text observations only once, at start-up (later
    ones come back blank or stale), so such envs send observations through pipes instead.
    """
    probe = make_one()
    try:
        return _contains_text(probe.observation_space)
    finally:
        probe.close()


def _contains_text(space: gymnasium.Space) -> bool:
    if isinstance(space, gymnasium.spaces.Text):
        return True
    if isinstance(space, gymnasium.spaces.Dict):
        return any(_contains_text(s) for s in space.spaces.values())
    if isinstance(space, gymnasium.spaces.Tuple):
        return any(_contains_text(s) for s in space.spaces)
    return False


@ENVS.register("gym", config=GymEnvConfig)
def make_vector_env(cfg: GymEnvConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """Any gymnasium id (MuJoCo, classic control, mmrl/PointReach-v0, plugins) as a vector env.

    ``seed`` seeds the action space's sampler; episodes are seeded by the sampler at every
    reset. Auto-reset is gymnasium's default (next step).
    """
    env_id = resolve_gym_id(cfg.id, "env.id")
    for i, wrapper in enumerate(cfg.wrappers):
        wrapper.validate(f"env.wrappers[{i}]")
    make_one = partial(_make_env, env_id, cfg.max_episode_steps, dict(cfg.kwargs), list(cfg.wrappers))
    if cfg.vectorization == "async":
        env = async_vector_env(make_one, cfg.num_envs, context=cfg.context, shared_memory=not _has_text(make_one))
    else:
        env = gymnasium.vector.SyncVectorEnv([make_one] * cfg.num_envs)
    env.action_space.seed(seed)
    return env
