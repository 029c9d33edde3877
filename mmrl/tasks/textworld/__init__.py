"""TextWorld games (``mmrl/TextWorld-v0``): text adventures generated offline, for language agents.
Importing this package registers the gymnasium id; ``textworld`` (the ``textworld`` extra) is
imported only when the env is built."""

import gymnasium

gymnasium.register(id="mmrl/TextWorld-v0", entry_point="mmrl.tasks.textworld.env:TextWorldEnv", max_episode_steps=8)
