"""The learner's update of a loss that trains from the replay buffer (``trains_from_buffer``,
``algo.loss: sac``): the step's transitions join the buffer, and once it holds
``learning_starts`` each new transition buys ``utd`` optimizer steps, each on ``batch_size``
transitions drawn from it (fractions carry over to the next step). The buffer, its generator
and the steps owed are saved with the run (``replay_buffer``, ``owed_updates``).

With ``demos`` (RLPD, Ball et al., 2023), the demonstrations' transitions fill a second
buffer once, at the start, and ``demo_share`` of every batch is drawn from it (symmetric
sampling at 0.5), the rest from the online buffer; it is saved with the run too
(``demo_buffer``).

With an intervener (``sampler.intervener``, HIL-SERL), every transition carries
``intervened``, and the intervened ones (their action the intervener's) also join the
demonstrations' buffer, which then exists even without ``demos``: ``buffer_size`` rows of
a ring after the demonstrations from files, which stay. Until the first intervention every
batch comes from the online buffer. ``intervention/rate`` is the share of a step's new
transitions that an intervener took over.

In N learner processes, every process holds the whole buffer: each step's transitions (the
``intervened`` marks with them) are gathered from all processes, rank-major, before they
join the buffers, so every buffer, generator and draw is alike everywhere and is saved from
process 0 as from one. Each optimizer step's batch is drawn whole in every process; process
r computes the loss on its contiguous share, rows [r B/N, (r + 1) B/N) (``batch_size`` B
divisible by N), with the noise one process would give those rows, and the gradients are
averaged over the processes: the policy's by the distributed wrapper (the loss reads the
policy through it; a critic-only step between actor steps runs it without grad only, so
it has nothing to reduce), the loss's own critics' and temperature's (which it does not
hold) by one all-reduce before the step. The
mean over equal shares is the mean over the batch, so N processes take one process's steps
(to rounding) and the learner's compute is split N ways. Why not a buffer per process,
each drawing its share: the batch would be another one than one process draws, nothing to
test N = 1 against, and a checkpoint would have to gather N buffers; what the copies cost
is the buffer's memory in every process and one gather of the step's transitions."""

from __future__ import annotations

from typing import Any

import torch

from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError
from mmrl.train.optimization import optimizer_step
from mmrl.train.replay_buffer import ReplayBuffer, demo_transitions, transitions

# the group indices reserved for the seeds of the buffers' draws
_BUFFER_STREAM = 1 << 44
_DEMO_STREAM = (1 << 44) + 1


class BufferUpdates:
    """The replay buffer of one learner process and the optimizer steps it feeds."""

    def __init__(self, cfg, device, policy, dist):
        self.cfg, self.options, self.dist = cfg, cfg.algo.loss, dist
        if self.options.batch_size % dist.world:
            raise ConfigError("algo.loss.batch_size", self.options.batch_size, f"must divide by the number of learner processes ({dist.world}): each process trains on an equal share of every batch")
        where = device if self.options.buffer_device == "learner" else "cpu"
        self.buffer = ReplayBuffer(self.options.buffer_size, where, group_seed(cfg.seed, 0, _BUFFER_STREAM))
        self.owed_updates = 0.0  # utd x new transitions not yet spent on optimizer steps
        self.demos = None  # the demonstrations' buffer (RLPD), and the intervened transitions
        o = self.options
        intervener = getattr(cfg.sampler, "intervener", None)
        self.intervening = intervener is not None
        if o.demos is not None or self.intervening:
            from mmrl.core.policy import overrides

            if not overrides(policy, "demo_replay"):
                field, value = ("algo.loss.demos", o.demos) if o.demos is not None else ("sampler.intervener", intervener.type)
                raise ConfigError(field, value, f"policy {type(policy).__name__} cannot write demonstrations as its replay (demo_replay); gaussian_mlp can")
        if o.demos is not None:
            from mmrl.demos import read_demos

            try:
                episodes = read_demos(o.demos)
            except ConfigError as e:  # name the option, and how to write the directory
                raise ConfigError("algo.loss.demos", o.demos, f"{e.allowed}; `mmrl collect --config <this run config> --out {o.demos}` writes demonstrations of its env") from None
            batch = demo_transitions(episodes, policy, o.gamma, o.n_step)
            count = batch["reward"].shape[0]
            if self.intervening:
                batch["intervened"] = torch.zeros(count, dtype=torch.bool)
            self.demos = ReplayBuffer(count + (o.buffer_size if self.intervening else 0), where, group_seed(cfg.seed, 0, _DEMO_STREAM))
            self.demos.add(batch)
            if self.intervening:
                self.demos.pin()
        elif self.intervening:
            self.demos = ReplayBuffer(o.buffer_size, where, group_seed(cfg.seed, 0, _DEMO_STREAM))

    def state_dict(self) -> dict[str, Any]:
        state = {"replay_buffer": self.buffer.state_dict(), "owed_updates": self.owed_updates}
        if self.demos is not None:
            state["demo_buffer"] = self.demos.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["replay_buffer"])
        self.owed_updates = float(state["owed_updates"])
        if self.demos is not None:
            if "demo_buffer" not in state:
                if self.options.demos is None:
                    raise ConfigError("sampler.intervener", self.cfg.sampler.intervener.type, "the checkpoint was trained without interventions: resume with intervener null")
                raise ConfigError("algo.loss.demos", self.options.demos, "the checkpoint was trained without demonstrations: resume with demos null")
            self.demos = ReplayBuffer(int(state["demo_buffer"]["capacity"]), self.demos.device, 0)
            self.demos.load_state_dict(state["demo_buffer"])

    def draw(self, device) -> dict[str, Any]:
        """One batch: ``demo_share`` of ``batch_size`` from the demonstrations (rounded), the
        rest from the online buffer, concatenated in that order (online first)."""
        o = self.options
        if self.demos is None or len(self.demos) == 0:  # no demonstrations, or no intervention yet
            return self.buffer.sample(o.batch_size, device)
        from_demos = round(o.batch_size * o.demo_share)
        parts = [self.buffer.sample(o.batch_size - from_demos, device)] if from_demos < o.batch_size else []
        if from_demos:
            parts.append(self.demos.sample(from_demos, device))
        return _cat_trees(parts)

    def learn(self, learner, rollout: Rollout, step: int) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
        """Add ``rollout``'s transitions, take the optimizer steps they buy with ``learner``'s
        loss, model and optimizer. Returns the rollout, zero advantages (none are computed) and
        the steps' mean metrics."""
        o, loss, dist = self.options, learner.loss, self.dist
        new = transitions(rollout, o.gamma, o.n_step)
        if self.intervening:  # one mark per transition, in their order (valid decisions, row-major)
            new["intervened"] = rollout.info["intervened"][rollout.mask.bool()].to(new["reward"].device)
        new = dist.gather_tree(new)  # every process's transitions, rank-major: the buffers are alike everywhere
        if self.intervening and bool(new["intervened"].any()):
            self.demos.add(_take(new, new["intervened"]))
        added = self.buffer.add(new)
        steps = 0
        if len(self.buffer) >= o.learning_starts:
            self.owed_updates += o.utd * added
            steps = int(self.owed_updates)
            self.owed_updates -= steps
        loss.begin_update(step)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}  # a term some steps leave out (the actor's, between actor steps) averages over those that have it
        share = o.batch_size // dist.world
        rows = slice(dist.rank * share, (dist.rank + 1) * share) if dist.world > 1 else None  # this process's share of every batch
        own = [p for group in loss.parameter_groups() for p in group["params"]]  # outside the distributed wrapper

        def average_own_grads() -> bool:  # after the backward pass: the critics' and temperature's gradients, all processes
            dist.average_grads(own)
            return True

        for _ in range(steps):
            batch = self.draw(learner.accelerator.device)
            terms = {}

            def loss_of(piece):
                out = loss(learner.model, piece, rows=rows) if rows is not None else loss(learner.model, piece)
                terms.update(out.terms)
                return out.loss

            grad_norm = optimizer_step(learner.accelerator, learner.model, learner.optimizer, [batch], loss_of, f"loss ({o.type})", step, self.cfg.optim.max_grad_norm,
                                       proceed=average_own_grads if dist.world > 1 else None)
            loss.after_optimizer_step()
            if grad_norm is not None:
                terms["grad_norm"] = grad_norm
            for k, v in terms.items():
                sums[k], counts[k] = sums.get(k, 0.0) + float(v), counts.get(k, 0) + 1
        if dist.world > 1 and sums:  # each process's terms are means over its share: their mean is the batch's
            keys = sorted(sums)
            total = dist.sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64)) / dist.world
            sums = dict(zip(keys, total.tolist()))
        stats = {k: v / counts[k] for k, v in sums.items()}
        stats = {**stats, **loss.end_update(step), "buffer/size": float(len(self.buffer)), "buffer/added": float(added), "update/steps": float(steps)}
        if self.demos is not None:
            stats["buffer/demo_transitions"] = float(len(self.demos))
        if self.intervening:
            stats["intervention/rate"] = float(new["intervened"].float().mean()) if added else 0.0
        return rollout, torch.zeros(rollout.batch_size, 1), stats


def _take(tree: dict, rows: torch.Tensor) -> dict:
    return {k: _take(v, rows) if isinstance(v, dict) else v[rows.to(v.device)] for k, v in tree.items()}


def _cat_trees(trees: list[dict]) -> dict:
    first = trees[0]
    return {k: _cat_trees([t[k] for t in trees]) if isinstance(v, dict) else torch.cat([t[k] for t in trees]) for k, v in first.items()}
