"""The commands ``mmrl`` runs besides training (``mmrl/cli.py`` parses the command line and
dispatches here): ``collect``, ``eval`` (evaluate), ``export``, ``serve-reward``, ``doctor``,
``plot`` and ``pairs``. Each module is a command's work; none is imported by the library below
it (``mmrl/core``, ``mmrl/algo``, ``mmrl/train``, ``mmrl/data``)."""
