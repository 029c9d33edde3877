"""A rollout worker: a copy of the policy at a published version, a sampler and the rewards.
It returns whole groups, scored and filtered (DAPO refill rounds included), each sample
tagged with the ``policy_version`` whose weights sampled it.

In ``rollout.mode: sync`` with ``engine: local`` the worker samples in the learner's process
with the learner's own policy object (no copy): the run is the single-process loop, bit for
bit. Imports nothing of the loop or the learner: it receives a policy and weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mmrl.algo.advantage import trained_returns, trains_on_step_rewards
from mmrl.algo.filters import FilterConfig, apply_filters
from mmrl.config import own_options
from mmrl.core.rollout import Rollout
from mmrl.errors import fault_context


@dataclass
class Collected:
    """A step's kept samples, plus sums over everything collected (for the metrics)."""

    rollout: Rollout
    spare: Rollout  # one collected sample with an empty mask: a no-op forward for DDP
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # metric -> [sum, count]
    num_collected: int = 0
    # from worker processes: the pending sums of the policy copy's running statistics (for
    # the learner's policy to commit), the samples dropped as too stale, seconds per role
    statistics: list[torch.Tensor] = field(default_factory=list)
    dropped: int = 0
    times: dict[str, float] = field(default_factory=dict)


class OneProcess:
    """The collectives of a worker that decides alone (a worker process): no communication."""

    world, rank = 1, 0

    def sizes(self, n: int) -> list[int]:
        return [n]

    def offset(self, sizes: list[int]) -> int:
        return 0

    def gather_rows(self, t: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        return t


def add_metric(sums: dict[str, torch.Tensor], name: str, values: torch.Tensor) -> None:
    """Add ``values`` to the float64 [sum, count] pair of metric ``name``."""
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1).cpu()
    pair = torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=torch.float64)])
    sums[name] = sums[name] + pair if name in sums else pair


class RolloutWorker:
    """Collects this process's whole groups with ``policy`` (at ``version``) and ``sampler``;
    ``rewards`` score them (with the ``reference``'s log-probs where ``algo.kl`` is estimated
    from sampled log-probs);
    ``algo`` gives the group size, the groups per step, the filters and their refill rounds;
    ``dist`` the collectives across learner processes (the refill decision is global);
    ``groups`` (first global group index, count) this worker's share of a step's groups (by
    default this learner process's)."""

    def __init__(self, sampler, policy, rewards, algo, dist, *, reference=None, device=None, keep_graph: bool = False, groups: tuple[int, int] | None = None):
        self.sampler, self.policy, self.rewards, self.algo, self.dist = sampler, policy, rewards, algo, dist
        self.reference = reference
        self.device = device if device is not None else torch.device("cpu")
        self.reuse_graph = keep_graph
        local = algo.groups_per_step // dist.world
        self.first_group, self.local_groups = groups if groups is not None else (dist.rank * local, local)
        self.filters = [(f.type, own_options(f, FilterConfig)) for f in algo.filters]
        # the env's step rewards join the combined reward in the advantages (GAE, step level)
        self.step_reward_weight = algo.advantage.step_reward_weight if trains_on_step_rewards(algo.advantage) else 0.0
        self.step_reward_gate = algo.advantage.step_reward_gate
        self.version = 0

    def load_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        """Take the learner's published weights (None: the policy object is the learner's own)."""
        if state is not None:
            self.policy.load_state_dict(state)
        self.version = version

    def collect(self, step: int, score: bool = True) -> Collected:
        """Whole groups for this process, scored and filtered. With ``resample_rounds``
        (DAPO dynamic sampling) more groups are collected until the processes together keep
        ``groups_per_step`` groups; the kept samples are the first ones in (round, process)
        order, which is the order one process would collect them in. ``score=False``
        (``rollout.score_on: learner``): the sampled groups as they are, for the learner's
        side to score, measure and filter (:meth:`finish`)."""
        cfg = self.algo
        target = cfg.groups_per_step * cfg.group_size
        sums: dict[str, torch.Tensor] = {}
        kept_parts: list[Rollout] = []
        kept_total, num_collected, spare = 0, 0, None
        with torch.no_grad():
            for round_ in range(cfg.resample_rounds + 1 if self.filters and score else 1):
                part = self._sample(step, round_)
                if spare is None:
                    spare = part[:1].with_(mask=torch.zeros_like(part.mask[:1]))
                if not score:
                    return Collected(part, spare)
                part = self.score(part, step)
                self._learn_rewards(part, step, sums)
                num_collected += part.batch_size
                combined = self._measure(part, sums)
                self.sampler.observe(part, combined, self.dist.gather_rows)
                if not self.filters:
                    kept_parts.append(part)
                    break
                kept = part[self._keep(combined, part.group_id)]
                sizes = self.dist.sizes(kept.batch_size)
                room = max(0, target - kept_total - self.dist.offset(sizes))
                kept_parts.append(kept[: _group_end(kept.group_id, room)])
                kept_total += sum(sizes)
                if kept_total >= target:
                    break
        return Collected(Rollout.cat(kept_parts), spare, sums, num_collected)

    def finish(self, collected: Collected, step: int) -> Collected:
        """Score, measure and filter samples a worker process returned unscored
        (``rollout.score_on: learner``: e.g. a reward model on the learner's GPU); the rest of
        ``collected`` is kept as it is."""
        with torch.no_grad():
            part = self.score(collected.rollout, step)
            sums: dict[str, torch.Tensor] = {}
        self._learn_rewards(part, step, sums)
        with torch.no_grad():
            combined = self._measure(part, sums)
            self.sampler.observe(part, combined, self.dist.gather_rows)
            kept = part[self._keep(combined, part.group_id)] if self.filters else part
        return replace(collected, rollout=kept, sums=sums, num_collected=part.batch_size)

    def _sample(self, step: int, round_: int) -> Rollout:
        """Round ``round_``'s groups of ``step``, tagged with this worker's version."""
        # refill groups get indices past the step's batch: every process count draws the same groups
        offset = round_ * self.algo.groups_per_step + self.first_group
        options = {"keep_graph": True} if self.reuse_graph else {}  # only samplers that keep it take the argument
        if getattr(self.sampler, "over_provision", 1) > 1:  # partial rollouts tag each decision with its version
            options["version"] = self.version
        with _fault_at(step, range(offset, offset + self.local_groups)):  # a simulator's fault names the update and the groups
            part = self.sampler.collect(self.policy, self.local_groups, self.algo.group_size, step, offset, **options)
        if part.policy_version is not None:  # a partial rollout's oldest decision
            return part
        return part.with_(policy_version=torch.full((part.batch_size,), self.version, dtype=torch.long))

    def _learn_rewards(self, part: Rollout, step: int, sums: dict[str, torch.Tensor]) -> None:
        """Rewards that learn during RL learn from the scored samples (outside ``no_grad``:
        they take gradient steps); their metrics join the step's."""
        if self.rewards.learns:
            with torch.enable_grad(), _fault_at(step, part.group_id):
                for name, value in self.rewards.update(part, part.rewards, step=step, dist=self.dist).items():
                    add_metric(sums, name, torch.tensor([value]))

    def _measure(self, part: Rollout, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        """Add the sampler's metrics and the rewards of scored ``part`` to ``sums``; returns
        the combined reward per sample. Each component's column is logged unweighted
        (``reward/<name>``), the combined reward as ``reward/total``; a run whose advantages
        add the env's step rewards also logs ``trained_return``: the combined reward plus
        the weighted step rewards of each episode, what those advantages are computed from."""
        for name, values in self.sampler.metrics(part).items():
            add_metric(sums, name, values)
        combined = part.reward
        for k, name in enumerate(self.rewards.names):
            add_metric(sums, f"reward/{name}", part.rewards[:, k])
        add_metric(sums, "reward/total", combined)
        if self.step_reward_weight > 0 and part.step_rewards is not None:
            add_metric(sums, "trained_return", trained_returns(combined, part.mask.cpu(), part.step_rewards.cpu(), self.step_reward_weight, self.step_reward_gate))
        return combined

    def score(self, rollout: Rollout, step: int) -> Rollout:
        """Reward columns [B, K], the combined reward [B] that filters and advantages read
        (combined here, once; ``log_tamed``'s batch statistics over the rows every process
        scores in this call) and, for a sampled-log-prob KL, the reference's log-probs."""
        with _fault_at(step, rollout.group_id):
            rewards = self.rewards.score(rollout, policy=self.policy, reference=self.reference, step=step)
        combined = self.rewards.combine(rewards, rollout.group_id.cpu(), self.dist.gather_rows)
        rollout = rollout.with_(rewards=rewards, reward_names=list(self.rewards.names), reward=combined)
        if self.reference is not None and self.algo.kl.needs_reference_logp:
            ref_logp = self.reference.log_prob(rollout.to(self.device).replay).detach().cpu()
            rollout = rollout.with_(ref_logp=ref_logp)
        return rollout

    def _keep(self, reward: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
        return apply_filters(self.filters, reward, group_id).cpu()


def _group_end(group_id: torch.Tensor, room: int) -> int:
    """The rows of the groups that start before row ``room``: a group that crosses the
    target is kept whole (groups are contiguous runs of ``group_id``; with groups of one
    size and a target that is a multiple of it, that is the first ``room`` rows)."""
    if room >= len(group_id):
        return len(group_id)
    if room == 0:
        return 0
    gid = group_id.cpu()
    later = (gid[room:] != gid[room - 1]).nonzero()
    return room + int(later[0]) if len(later) else len(gid)


def _fault_at(step: int, groups: range | torch.Tensor):
    """Names update ``step + 1`` (as checkpoints and metrics count) and the span of
    ``groups`` (global group indices) in a user-code fault (:class:`~mmrl.errors.UserCodeError`)
    raised inside the block."""
    if len(groups) == 0:
        return fault_context(update=step + 1)
    first, last = (groups[0], groups[-1]) if isinstance(groups, range) else (int(groups.min()), int(groups.max()))
    return fault_context(update=step + 1, groups=f"{first}-{last}")
