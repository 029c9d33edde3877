"""An example simulator package for mmrl: importing it registers ``PluginReach-v0`` with
gymnasium, so ``env: {type: gym, id: "mmrl_plugin_example:PluginReach-v0"}`` works with no
change to mmrl (gymnasium imports the module named before the colon)."""

import gymnasium

from mmrl_plugin_example.env import PluginReachEnv

__all__ = ["PluginReachEnv"]

if "PluginReach-v0" not in gymnasium.registry:
    gymnasium.register(id="PluginReach-v0", entry_point=PluginReachEnv)
