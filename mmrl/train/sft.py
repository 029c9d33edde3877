"""Data sources for supervised fine-tuning (``algo.type: sft``).

A data source yields batches; the policy scores them with ``policy.sft_loss(batch)``. The
trainer knows nothing else about them. Batches are drawn with replacement, seeded by
(run seed, step), over all processes at once: each process takes its slice of the global
batch, so one process and N processes train on the same samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError

_SFT_STREAM = 1 << 40  # group index reserved for the draws of a step's SFT batch


class DemonstrationSource:
    """Recorded episodes (``mmrl collect``): every time step is one sample — its observation,
    the next C actions and their mask, C = the policy's action chunk."""

    def __init__(self, data_cfg, policy, seed: int, world: int, rank: int):
        from mmrl.demos import chunk_samples, read_demos

        if data_cfg.batch_size % world:
            raise ConfigError("data.batch_size", data_cfg.batch_size, f"must be divisible by the number of processes ({world})")
        self.batch_size, self.seed, self.world, self.rank = data_cfg.batch_size, seed, world, rank
        episodes = read_demos(data_cfg.path)
        if data_cfg.max_episodes_per_task is not None:
            per_task: dict[str, int] = {}
            kept = []
            for ep in episodes:
                per_task[ep.task] = per_task.get(ep.task, 0) + 1
                if per_task[ep.task] <= data_cfg.max_episodes_per_task:
                    kept.append(ep)
            episodes = kept
        if not episodes:
            raise ConfigError("data.path", data_cfg.path, "holds no demonstrations")
        chunk = int(getattr(policy.config, "action_chunk", 1) or 1)
        samples = chunk_samples(episodes, chunk)
        self.samples = {k: (v if isinstance(v, list) else torch.as_tensor(np.asarray(v))) for k, v in samples.items()}
        self.num_samples = len(next(iter(self.samples.values())))
        self.info = {"episodes": len(episodes), "samples": self.num_samples}

    def batch(self, step: int, device) -> dict[str, Any]:
        """This process's share of step ``step``'s batch of ``data.batch_size`` samples."""
        gen = torch.Generator().manual_seed(group_seed(self.seed, step, _SFT_STREAM))
        idx = torch.randint(self.num_samples, (self.batch_size,), generator=gen).chunk(self.world)[self.rank]
        return {k: ([v[i] for i in idx.tolist()] if isinstance(v, list) else v[idx].to(device)) for k, v in self.samples.items()}
