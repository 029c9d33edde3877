"""Registers ``mmrl/GuessNumber-v0`` (mmrl/tasks/guess_number): a text game for language agents."""

import gymnasium

gymnasium.register(id="mmrl/GuessNumber-v0", entry_point="mmrl.tasks.guess_number.env:GuessNumberEnv", max_episode_steps=6)
