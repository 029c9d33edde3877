"""Registers ``mmrl/MiniGridText-v0`` (mmrl/tasks/minigrid_text): a MiniGrid level with text
actions and an image of the agent's view, for vision-language agents (needs the minigrid extra,
imported only when the env is built)."""

import gymnasium

gymnasium.register(id="mmrl/MiniGridText-v0", entry_point="mmrl.tasks.minigrid_text.env:MiniGridTextEnv", max_episode_steps=20)
