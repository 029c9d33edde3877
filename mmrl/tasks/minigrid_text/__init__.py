"""MiniGrid with text actions and an image of the agent's view (``mmrl/MiniGridText-v0``): an env
for vision-language agents. Importing this package registers the gymnasium id; ``minigrid``
(the ``minigrid`` extra) is imported only when the env is built."""

import gymnasium

gymnasium.register(id="mmrl/MiniGridText-v0", entry_point="mmrl.tasks.minigrid_text.env:MiniGridTextEnv", max_episode_steps=20)
