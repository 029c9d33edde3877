"""The few collectives the loop needs, for processes that may hold different numbers of rows.

After group filters each process can keep a different number of samples, so every gather
here is variable-length (sizes first, then padded rows). With one process every function is
the identity, with no communication.

The global order of rows is rank-major: process 0's rows, then process 1's, and so on.
:func:`local_rows` turns a set of global row indices (a slice of a global permutation) into
the local indices of this process's rows, which is how N processes take exactly the
minibatches one process would.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Collectives:
    def __init__(self, accelerator=None):
        """``accelerator=None``: one process, no communication."""
        self.accelerator = accelerator
        self.world = accelerator.num_processes if accelerator is not None else 1
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.device = accelerator.device if accelerator is not None else torch.device("cpu")

    def sizes(self, n: int) -> list[int]:
        """Every process's ``n``, in rank order."""
        if self.world == 1:
            return [n]
        t = torch.tensor([n], device=self.device)
        return [int(v) for v in self.accelerator.gather(t).cpu()]

    def gather_rows(self, t: Tensor, sizes: list[int] | None = None) -> Tensor:
        """Concatenate every process's ``t`` along dim 0 (rank-major), whatever their lengths."""
        if self.world == 1:
            return t
        sizes = sizes if sizes is not None else self.sizes(t.shape[0])
        longest = max(sizes)
        padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.to(self.device)
        gathered = self.accelerator.gather(padded).cpu().view(self.world, longest, *t.shape[1:])
        return torch.cat([gathered[r, : sizes[r]] for r in range(self.world)])

    def sum(self, t: Tensor | float) -> Tensor:
        """Sum over processes (a float64 tensor on the CPU)."""
        t = torch.as_tensor(t, dtype=torch.float64)
        if self.world == 1:
            return t
        return self.accelerator.reduce(t.to(self.device), "sum").cpu()

    def max(self, value: int | float) -> int | float:
        """The largest ``value`` over processes (an int stays an int)."""
        if self.world == 1:
            return value
        t = torch.tensor(value, device=self.device, dtype=torch.float64 if isinstance(value, float) else torch.long)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return type(value)(t.item())

    def gather_objects(self, obj) -> list:
        """Every process's picklable ``obj``, in rank order (for checkpoints, not hot paths)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather_tree(self, tree: dict) -> dict:
        """:meth:`gather_rows` of every tensor of the nested dict ``tree`` (all with the same
        number of rows on a process): every process's rows, rank-major, on the CPU. A bool
        tensor travels as uint8 (not every backend reduces bools)."""
        if self.world == 1:
            return tree
        sizes = self.sizes(_row_count(tree))

        def gather(t: Tensor) -> Tensor:
            return self.gather_rows(t.to(torch.uint8), sizes).bool() if t.dtype == torch.bool else self.gather_rows(t, sizes)

        return _map_tree(tree, gather)

    def average_grads(self, params) -> None:
        """Average the gradients of ``params`` over processes, one all-reduce per dtype: the
        parameters the distributed wrapper does not hold (an off-policy loss's critics and
        temperature). A parameter without a gradient keeps none (alike in every process:
        which terms ran is decided by the step count)."""
        if self.world == 1:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)
            torch.distributed.all_reduce(flat)
            flat /= self.world
            at = 0
            for g in grads:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()

    def offset(self, sizes: list[int]) -> int:
        """Global index of this process's first row."""
        return sum(sizes[: self.rank])


def _row_count(tree: dict) -> int:
    first = next(iter(tree.values()))
    return _row_count(first) if isinstance(first, dict) else int(first.shape[0])


def _map_tree(tree: dict, fn) -> dict:
    return {k: _map_tree(v, fn) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def local_rows(global_rows: Tensor, start: int, count: int) -> Tensor:
    """The local indices of the rows among ``global_rows`` that live on the process holding
    global rows [start, start + count), in the order they appear in ``global_rows``."""
    mine = (global_rows >= start) & (global_rows < start + count)
    return global_rows[mine] - start


def normalizers(dist, mb, algo, targets=None) -> dict:
    """The normalizers of minibatch ``mb`` (this process's rows) under the ``algo`` section:
    the aggregation's token count, sequence count and length, over all processes. Each process
    divides by (global count / processes), so the distributed wrapper's gradient average
    equals one process's loss on the whole batch. With ``algo.advantage.normalize:
    minibatch`` and ``targets`` (``mb``'s), also ``adv_shift`` and ``adv_scale``: the mean
    and std (+ eps) of the advantages over the minibatch's valid decisions on all processes,
    float64, which the policy-gradient loss applies."""
    out = {
        # a minibatch without valid decisions (e.g. all truncated) gives loss 0, not 0/0
        "num_tokens": max(dist.sum(mb.mask.sum()).item(), 1.0) / dist.world,
        "num_seqs": dist.sum(mb.batch_size).item() / dist.world,
        "max_len": getattr(algo.aggregation, "max_len", None) or dist.max(mb.mask.shape[1]),
    }
    if targets is not None and getattr(algo.advantage, "normalize", None) == "minibatch":
        adv, valid = targets.adv.double(), (mb.mask > 0).double()
        adv = adv[:, None].expand_as(valid) if adv.dim() == 1 else adv
        count = max(dist.sum(valid.sum()).item(), 1.0)
        shift = dist.sum((adv * valid).sum()) / count
        out["adv_shift"] = shift
        out["adv_scale"] = (dist.sum(((adv - shift) * valid).square().sum()) / count).sqrt() + algo.advantage.eps
    return out
