"""Samplers: ``env`` (gymnasium vector envs) and ``prompt`` (prompts / conditions)."""

from mmrl.samplers import env, prompt  # noqa: F401  (registration)
