"""Registers ``mmrl/TextWorld-v0`` (mmrl/tasks/textworld): TextWorld text adventures for language
agents. ``textworld`` (the ``textworld`` extra) is imported only when the env is built."""

import gymnasium

gymnasium.register(id="mmrl/TextWorld-v0", entry_point="mmrl.tasks.textworld.env:TextWorldEnv", max_episode_steps=8)
