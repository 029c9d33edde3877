"""Aggregations: reduce a per-decision loss ``Tensor[B, T]`` and its mask to a scalar.

Every registered aggregation has the signature ::

    fn(loss: Tensor[B, T], mask: Tensor[B, T], *, num_tokens=None, num_seqs=None, max_len=None)
        -> Tensor[]

The normalisers default to the local batch (Σ mask, B, T). In distributed training pass
the global values (all-reduced token and sequence counts, divided by the world size as the
gradient all-reduce averages) so every rank divides by the same number. Every aggregation
accepts all three so a caller can pass them uniformly. ``mask`` may be bool or 0/1 float;
masked entries of ``loss`` must be finite (they are multiplied by 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.config import Component, option
from mmrl.registry import AGGREGATIONS


@dataclass
class AggregationConfig(Component):
    """``algo.aggregation``: how per-decision losses become one number (``type``)."""

    type: str = option("token_mean", "aggregation (mmrl list aggregations)")


@dataclass
class ConstNormConfig(AggregationConfig):
    type: str = option("const_norm", "aggregation (mmrl list aggregations)")
    max_len: int | None = option(None, "the fixed length L divided by, e.g. the generation budget (null = longest in the batch)", ge=1)


@AGGREGATIONS.register("token_mean", config=AggregationConfig)
def token_mean(
    loss: Tensor, mask: Tensor, *, num_tokens: float | None = None, num_seqs: float | None = None, max_len: int | None = None
) -> Tensor:
    """Token mean: Σ_{i,t} m·L / num_tokens (DAPO, Yu et al. 2025). Every valid decision
    weighs the same, whatever its sequence's length. A batch without valid decisions
    gives 0."""
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    return (loss * mask).sum() / num_tokens


@AGGREGATIONS.register("seq_mean_token_mean", config=AggregationConfig)
def seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, num_tokens: float | None = None, num_seqs: float | None = None, max_len: int | None = None
) -> Tensor:
    """Sequence mean of token means: Σ_i [Σ_t m·L / Σ_t m] / num_seqs (original GRPO,
    Shao et al. 2024). A row without valid decisions contributes 0 but still counts in
    the default ``num_seqs`` = B."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / (loss.shape[0] if num_seqs is None else num_seqs)


@AGGREGATIONS.register("seq_mean_token_sum", config=AggregationConfig)
def seq_mean_token_sum(
    loss: Tensor, mask: Tensor, *, num_tokens: float | None = None, num_seqs: float | None = None, max_len: int | None = None
) -> Tensor:
    """Sequence mean of token sums: Σ_{i,t} m·L / num_seqs (verl ``seq-mean-token-sum``)."""
    return (loss * mask).sum() / (loss.shape[0] if num_seqs is None else num_seqs)


@AGGREGATIONS.register("const_norm", config=ConstNormConfig)
def const_norm(
    loss: Tensor, mask: Tensor, *, num_tokens: float | None = None, num_seqs: float | None = None, max_len: int | None = None
) -> Tensor:
    """Constant normaliser: Σ_{i,t} m·L / (num_seqs · max_len) (Dr. GRPO, Liu et al. 2025
    "Understanding R1-Zero-Like Training"). No length bias; ``max_len`` defaults to T and
    should be the generation budget when batches are padded to different lengths."""
    num_seqs = loss.shape[0] if num_seqs is None else num_seqs
    max_len = loss.shape[1] if max_len is None else max_len
    return (loss * mask).sum() / (num_seqs * max_len)
