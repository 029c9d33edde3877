"""The ``Sampler`` interface: a policy plus a source of prompts/initial states → ``Rollout``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from torch import Tensor

from mmrl.core.component_config import EnvConfig, RewardConfig
from mmrl.core.policy import Policy
from mmrl.core.rollout import Rollout

if TYPE_CHECKING:
    from mmrl.core.reward import RewardSet


@dataclass(frozen=True)
class SamplerContext:
    """What of the run a sampler reads besides its own section. A sampler is built as
    ``cls(sampler_cfg, ctx)``: ``sampler_cfg`` its ``sampler`` section, ``ctx`` this, made
    from the run config in one place (:func:`sampler_context`). Samplers see no other part
    of the run config (algo, optim, rollout workers, checkpoints ...).

    - ``seed``: the run seed (the run config's ``seed``); reset seeds, the prompt order and
      the policy's noise derive from it (:func:`group_seed`).
    - ``env``: the ``env`` section, None without one; the env sampler builds its vector env
      from it and reads its success options (``success_key``, ``hide_success``,
      ``success_model``) and cameras (``kwargs.cameras``).
    - ``rewards``: the reward sections, in order; the env sampler checks that success is
      there to read when a ``success`` reward reads it.
    - ``policy_type``: the registered name of the run's policy (``policy.type``); the prompt
      sampler's ``shared_noise`` needs a policy that shares its initial noise.
    - ``gamma``: ``algo.advantage.gamma``, or the loss's own ``algo.loss.gamma`` where it has
      one (sac); the env sampler discounts each action chunk's rewards to its first step by it
      (``step_rewards``).
    - ``bootstrap_truncated``: ``algo.advantage.bootstrap_truncated`` (false for advantages
      without it), or true for a loss with the ``final_observations`` trait (sac); the env
      sampler then keeps the final observation of episodes a time limit cut
      (``info["final_replay"]``) for a critic to bootstrap from.
    - ``over_provision``: ``rollout.over_provision``; above 1, samplers keep groups in
      flight across steps (partial rollouts).
    - ``groups_per_step``: ``algo.groups_per_step``; the prompt sampler's record stream
      advances by it each step.
    - ``group_size``: ``algo.group_size``; a step draws ``groups_per_step × group_size``
      samples, which a prompt sampler with ``budget.type: knapsack`` shares unevenly.
    - ``state_keys``: whether the advantage groups decisions by the env state they were taken
      in (``algo.advantage.step_groups: state``, GiGPO); the env sampler then keys each
      decision's observation (``info["state_keys"]``).
    - ``log_probs``: whether the run's loss reads log-probs (its ``needs_log_probs`` trait;
      DiffusionNFT does not). Without, the samplers ask a policy that ``samples_final_only``
      for its final samples alone: no log-probs, no stored chain.

    For a plugin sampler: ``__init__(self, sampler_cfg, ctx: SamplerContext)``. Samplers used
    to take the whole run config (``train_cfg``); reading a section of it that the context
    does not carry (``ctx.algo``) raises an AttributeError naming the field to read instead.
    """

    seed: int = 0
    env: EnvConfig | None = None
    rewards: tuple[RewardConfig, ...] = ()
    policy_type: str = ""
    gamma: float = 1.0
    bootstrap_truncated: bool = False
    over_provision: float = 1.0
    groups_per_step: int = 8
    group_size: int = 8
    log_probs: bool = True
    state_keys: bool = False

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        moved = {"algo": "gamma, bootstrap_truncated, groups_per_step, group_size", "rollout": "over_provision", "policy": "policy_type"}.get(name)
        instead = f"; read ctx.{moved.replace(', ', ', ctx.')}" if moved else ""
        raise AttributeError(
            f"SamplerContext has no {name!r}: a sampler reads the run through its context ({', '.join(f.name for f in fields(self))}), "
            f"not the whole run config{instead} (mmrl/core/sampler.py)"
        )


def sampler_context(cfg) -> SamplerContext:
    """The :class:`SamplerContext` of a run config (a ``TrainConfig``)."""
    from mmrl import registry

    loss = getattr(cfg.algo, "loss", None)
    traits = {} if loss is None else registry.LOSSES.entry(loss.type, "algo.loss.type").traits
    return SamplerContext(
        seed=cfg.seed,
        env=cfg.env,
        rewards=tuple(cfg.rewards),
        policy_type=getattr(cfg.policy, "type", ""),  # no policy section: ""
        gamma=getattr(loss, "gamma", cfg.algo.advantage.gamma),  # a loss with a discount of its own (sac) discounts the chunks
        # a loss that bootstraps from every truncated episode (its ``final_observations`` trait) needs their final observations
        bootstrap_truncated=getattr(cfg.algo.advantage, "bootstrap_truncated", False) or traits.get("final_observations", False),
        over_provision=cfg.rollout.over_provision,
        groups_per_step=cfg.algo.groups_per_step,
        group_size=cfg.algo.group_size,
        log_probs=traits.get("needs_log_probs", True),
        state_keys=getattr(cfg.algo.advantage, "step_groups", "decision") == "state",
    )


class Sampler:
    """Collects groups of G samples that share a prompt / initial state.

    These are all the methods the trainer calls. ``group_offset`` is the global index of
    this process's first group, so that every process samples different groups and a group's
    randomness depends only on (seed, step, group index) — the same in one process or many.
    A sampler is built as ``cls(sampler_cfg, ctx)``: its own section and the
    :class:`SamplerContext` of the run.
    """

    # collect(..., keep_graph=True) asks a policy that ``keeps_sampling_graph`` to keep it
    # and carries its log-probs to ``Rollout.old.graph`` (algo.reuse_sampling_graph)
    keeps_sampling_graph: bool = False
    # observe() uses the rewards: they must be scored where this sampler samples, and every
    # sample of a step must reach it (one worker process at most)
    observes_rewards: bool = False
    # what the progress bar shows of a training step's and an evaluation's metrics (short name -> key)
    progress_metrics: dict[str, str] = {"success": "success_rate", "eval_success": "eval/success_rate"}

    def policy_spec(self) -> dict[str, Any]:
        """What the policy must know about inputs and outputs (observation and action sizes,
        number of prompts …); stored with the policy's weights."""
        return {}

    def collect(self, policy: Policy, num_groups: int, group_size: int, step: int, group_offset: int = 0, keep_graph: bool = False) -> Rollout:
        raise NotImplementedError

    def metrics(self, rollout: Rollout) -> dict[str, Tensor]:
        """Per-sample values of this sampler's training metrics for a collected rollout (e.g.
        episode success, return and length; accuracy). Each is a 1-D tensor over the rollout's
        samples; the trainer logs the mean over the samples of all processes."""
        return {}

    def observe(self, rollout: Rollout, reward: Tensor, gather=None) -> None:
        """The scored samples of a collection (all of them, before any filter) with their
        combined ``reward`` [B], for a sampler that adapts what it samples next to how its
        samples fared (``observes_rewards``: the prompt sampler's knapsack budgets).
        ``gather(t)`` concatenates a tensor's rows over the learner processes (rank-major),
        so that every process sees every sample; call it on every process alike."""

    def counters(self) -> dict[str, float]:
        """Running totals of this process (e.g. env steps); the trainer logs their sum over
        processes."""
        return {}

    def evaluate(self, policy: Policy, episodes: int, seed: int, rewards: RewardSet | None = None) -> dict[str, Any]:
        """Deterministic evaluation of ``episodes`` samples / episodes; returns metrics
        (``success_rate`` or ``accuracy`` where defined). ``rewards`` scores samples whose
        success is a reward (prompt samplers); env samplers read success from the env."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class NoRollouts(Sampler):
    """The sampler of a supervised run without a ``sampler`` section (a reward model on
    preference pairs): it collects nothing and its evaluation is empty, so the data
    source's held-out metrics are the evaluation."""

    def evaluate(self, policy: Policy, episodes: int, seed: int, rewards: RewardSet | None = None) -> dict[str, Any]:
        return {}


def build_sampler(cfg) -> Sampler:
    """The sampler named by ``cfg.sampler.type`` (a train config), or :class:`NoRollouts`
    when the type is empty."""
    from mmrl.registry import SAMPLERS

    return SAMPLERS.get(cfg.sampler.type, "sampler.type")(cfg.sampler, sampler_context(cfg)) if cfg.sampler.type else NoRollouts()


def group_seed(seed: int, step: int, group: int) -> int:
    """A 63-bit seed that depends only on (run seed, step, global group index)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + group * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    return x & ((1 << 63) - 1)
