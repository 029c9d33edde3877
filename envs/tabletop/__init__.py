"""mmrl's built-in language-conditioned MuJoCo tabletop task suite: ``mmrl/Tabletop-v0``.

Thirteen pushing tasks in three LIBERO-style families (spatial, object, goal), each an
instruction, an initial-state distribution drawn from the reset seed and a success
predicate (:mod:`~mmrl.envs.tabletop.tasks`); the env (:mod:`~mmrl.envs.tabletop.env`);
scripted experts that solve them from privileged state (:mod:`~mmrl.envs.tabletop.expert`).
Importing this package only registers the gymnasium id; MuJoCo is imported when an env is
built.
"""

import gymnasium

gymnasium.register(id="mmrl/Tabletop-v0", entry_point="mmrl.envs.tabletop.env:TabletopEnv", max_episode_steps=60)
