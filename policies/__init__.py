"""Policy families, one folder each (``<name>/config.py`` + ``<name>/model.py``).

A family registers itself (``@POLICIES.register``) in its own module; the registry imports
every module of this package on first lookup, so a new family is its folder alone.
"""
