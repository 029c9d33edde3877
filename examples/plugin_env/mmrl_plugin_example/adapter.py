"""An mmrl env adapter: ``env: {type: plugin_reach, num_envs: 8, tolerance: 0.05}``.

An adapter is a function ``(config, seed) -> gymnasium.vector.VectorEnv`` registered under a
``type`` name with its config dataclass (a subclass of mmrl's ``EnvConfig``, whose fields
``num_envs``, ``vectorization``, ``max_episode_steps``, ``success_key`` and ``wrappers`` every
env section has; an adapter applies ``wrappers`` to each single env with
``mmrl.env_wrappers.apply_wrappers``, the sampler reads ``success_key`` itself). mmrl finds
this module through the ``mmrl.envs`` entry point in pyproject.toml, so the type resolves
in any run once the package is installed, with no import in the user's config or code.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium

from mmrl.config import option
from mmrl.env_wrappers import apply_wrappers, async_vector_env
from mmrl.errors import ConfigError
from mmrl.registry import ENVS
from mmrl.core.component_config import EnvConfig
from mmrl_plugin_example.env import PluginReachEnv


@dataclass
class PluginReachConfig(EnvConfig):
    """PluginReach with its own settings as config fields (checked when the config loads)."""

    type: str = option("plugin_reach", "registered name of this component (see `mmrl list`)")
    step_size: float = option(0.3, "how far one action of 1 moves the point", gt=0)
    tolerance: float = option(0.1, "success distance to the target", gt=0)

    def validate(self, path: str) -> None:
        if self.tolerance >= 1.0:
            raise ConfigError(f"{path}.tolerance" if path else "tolerance", self.tolerance, "must be < 1 (the line is [-1, 1])")


@ENVS.register("plugin_reach", config=PluginReachConfig)
def make_vector_env(cfg: PluginReachConfig, seed: int) -> gymnasium.vector.VectorEnv:
    """PluginReach copies in a gymnasium vector env."""

    def make_one() -> gymnasium.Env:
        env = PluginReachEnv(step_size=cfg.step_size, tolerance=cfg.tolerance, max_steps=cfg.max_episode_steps or 10)
        return apply_wrappers(env, cfg.wrappers)

    if cfg.vectorization == "async":  # workers that leave Ctrl-C and SIGTERM to the trainer
        env = async_vector_env(make_one, cfg.num_envs)
    else:
        env = gymnasium.vector.SyncVectorEnv([make_one] * cfg.num_envs)
    env.action_space.seed(seed)
    return env
