"""Samplers: ``env`` (gymnasium vector envs) and ``prompt`` (prompts / conditions); each
module registers itself and the registry imports them all on first lookup."""
