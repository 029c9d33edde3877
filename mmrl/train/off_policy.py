"""The learner's update of a loss that trains from the replay buffer (``trains_from_buffer``,
``algo.loss: sac``): the step's transitions join the buffer, and once it holds
``learning_starts`` each new transition buys ``utd`` optimizer steps, each on ``batch_size``
transitions drawn from it (fractions carry over to the next step). The buffer, its generator
and the steps owed are saved with the run (``replay_buffer``, ``owed_updates``)."""

from __future__ import annotations

from typing import Any

import torch

from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.train.optimization import optimizer_step
from mmrl.train.replay_buffer import ReplayBuffer, transitions

# the group index reserved for the seed of the buffer's draws
_BUFFER_STREAM = 1 << 44


class BufferUpdates:
    """The replay buffer of one learner process and the optimizer steps it feeds."""

    def __init__(self, cfg, device):
        self.cfg, self.options = cfg, cfg.algo.loss
        self.buffer = ReplayBuffer(self.options.buffer_size, device if self.options.buffer_device == "learner" else "cpu", group_seed(cfg.seed, 0, _BUFFER_STREAM))
        self.owed_updates = 0.0  # utd x new transitions not yet spent on optimizer steps

    def state_dict(self) -> dict[str, Any]:
        return {"replay_buffer": self.buffer.state_dict(), "owed_updates": self.owed_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["replay_buffer"])
        self.owed_updates = float(state["owed_updates"])

    def learn(self, learner, rollout: Rollout, step: int) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
        """Add ``rollout``'s transitions, take the optimizer steps they buy with ``learner``'s
        loss, model and optimizer. Returns the rollout, zero advantages (none are computed) and
        the steps' mean metrics."""
        o, loss = self.options, learner.loss
        added = self.buffer.add(transitions(rollout, o.gamma, o.n_step))
        steps = 0
        if len(self.buffer) >= o.learning_starts:
            self.owed_updates += o.utd * added
            steps = int(self.owed_updates)
            self.owed_updates -= steps
        loss.begin_update(step)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}  # a term some steps leave out (the actor's, between actor steps) averages over those that have it
        for _ in range(steps):
            batch = self.buffer.sample(o.batch_size, learner.accelerator.device)
            terms = {}

            def loss_of(piece):
                out = loss(learner.model, piece)
                terms.update(out.terms)
                return out.loss

            grad_norm = optimizer_step(learner.accelerator, learner.model, learner.optimizer, [batch], loss_of, f"loss ({o.type})", step, self.cfg.optim.max_grad_norm)
            loss.after_optimizer_step()
            if grad_norm is not None:
                terms["grad_norm"] = grad_norm
            for k, v in terms.items():
                sums[k], counts[k] = sums.get(k, 0.0) + float(v), counts.get(k, 0) + 1
        stats = {k: v / counts[k] for k, v in sums.items()}
        stats = {**stats, **loss.end_update(step), "buffer/size": float(len(self.buffer)), "buffer/added": float(added), "update/steps": float(steps)}
        return rollout, torch.zeros(rollout.batch_size, 1), stats
