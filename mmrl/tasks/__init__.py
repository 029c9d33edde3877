"""Demo worlds, each in one folder beside what only it uses: its generator or renderer, its
verifier or rewards, its data-making command (``python -m mmrl.tasks.<task>.world``).

Nothing in ``mmrl/core``, ``mmrl/algo`` or ``mmrl/train`` imports a task; the registries
find their rewards and data sources by walking this package."""
