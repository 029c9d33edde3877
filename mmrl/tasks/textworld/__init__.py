"""TextWorld games (``mmrl/TextWorld-v0``): text adventures generated offline, for language agents."""
