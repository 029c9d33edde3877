"""Guess the number (``mmrl/GuessNumber-v0``): a game with feedback over several turns, for language agents.
Importing this package registers the gymnasium id; the env is built from env.py."""

import gymnasium

gymnasium.register(id="mmrl/GuessNumber-v0", entry_point="mmrl.tasks.guess_number.env:GuessNumberEnv", max_episode_steps=6)
