"""The ``Sampler`` interface: a policy plus a source of prompts/initial states → ``Rollout``."""

from __future__ import annotations

from typing import Any

from mmrl.core.policy import Policy
from mmrl.core.rollout import Rollout


class Sampler:
    """Collects groups of G samples that share a prompt / initial state.

    ``group_offset`` is the global index of this process's first group, so that every
    process samples different groups and a group's randomness depends only on
    (seed, step, group index) — the same in one process or many.
    """

    def collect(self, policy: Policy, num_groups: int, group_size: int, step: int, group_offset: int = 0) -> Rollout:
        raise NotImplementedError

    def evaluate(self, policy: Policy, episodes: int, seed: int) -> dict[str, Any]:
        """Deterministic evaluation; returns metrics (``success_rate`` when defined)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def group_seed(seed: int, step: int, group: int) -> int:
    """A 63-bit seed that depends only on (run seed, step, global group index)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + group * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    return x & ((1 << 63) - 1)
