"""GEMMs whose summation order follows the shape, as some BLAS libraries' do on some CPUs.

Two computations are bit for bit equal on every machine only where both run the same
operators on the same shapes. MKL on an AVX512 Intel Xeon picks its GEMM kernel by the
matrix sizes, so a row of ``x @ W`` can come out in another order of sums when the batch
around it has another number of rows (sampling a wave of 4 env observations, recomputing
a replay of 8). On an AMD EPYC the same build happens to agree, so an exact-equality test
between two such computations passes here and fails there.

This module makes that visible on any machine: under :class:`ShapeDependentGemm`, every
float matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``, and the
CPU flash-attention kernel) splits its reduction at a point chosen from the number of rows
``M``. The same shapes give the same bits (the mode is deterministic), other row counts give
other roundings. A test that asserts ``torch.equal`` between computations of different batch
layouts fails under it, as it would on the Xeon.

Run the suite (or a part) under it with ``MMRL_SHAPE_KERNELS=1``: ``tests/conftest.py``
enters the mode for the test process, and puts this folder's ``sitecustomize`` on
``PYTHONPATH`` so that spawned workers run under it too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _split(k: int, m: int) -> int:
    """Where a reduction of length ``k`` over a matrix of ``m`` rows is cut (1 ≤ s < k)."""
    return 1 + (m * 7919 + 13) % (k - 1)


def _mm(a, b, m: int):
    k = a.shape[-1]
    if k < 2:
        return None
    s = _split(k, m)
    return torch.matmul(a[..., :s], b[..., :s, :]) + torch.matmul(a[..., s:], b[..., s:, :])


def _mv(a, x, m: int):
    k = a.shape[-1]
    if k < 2:
        return None
    s = _split(k, m)
    return torch.mv(a[:, :s], x[:s]) + torch.mv(a[:, s:], x[s:])


class ShapeDependentGemm(TorchDispatchMode):
    """Float GEMMs whose rounding depends on their row count (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # inside this handler the mode is off: the products below are the plain kernels
        kwargs = kwargs or {}
        out = None
        if func in (aten.mm.default, aten.bmm.default) and not kwargs and args[0].dtype in _FLOATS:
            out = _mm(args[0], args[1], args[0].shape[-2])
        elif func in (aten.addmm.default, aten.baddbmm.default) and args[1].dtype in _FLOATS:
            out = _affine(args[0], _mm(args[1], args[2], args[1].shape[-2]), kwargs)
        elif func is aten.mv.default and args[0].dtype in _FLOATS:
            out = _mv(args[0], args[1], args[0].shape[0])
        elif func is aten.addmv.default and args[1].dtype in _FLOATS:
            out = _affine(args[0], _mv(args[1], args[2], args[1].shape[0]), kwargs)
        elif func is aten._scaled_dot_product_flash_attention_for_cpu.default and args[0].shape[-2] % 2:
            # the fused kernel blocks queries and keys by their lengths; the math form stands
            # in for "another kernel" when the query length is odd
            return _math_attention(func, args, kwargs)
        if out is None:
            return func(*args, **kwargs)
        return out


def _affine(bias, prod, kwargs):
    """beta·bias + alpha·prod, as addmm computes it (None where the product was not split)."""
    if prod is None:
        return None
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    prod = prod if alpha == 1 else prod * alpha
    return prod if beta == 0 else prod + (bias if beta == 1 else bias * beta)


def _math_attention(func, args, kwargs):
    out = func(*args, **kwargs)
    q, k, v = args[:3]
    dropout = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    if dropout:
        return out
    causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    math = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, kwargs.get("attn_mask"), 0.0, causal, scale=kwargs.get("scale"))[0]
    return (math.to(out[0].dtype), *out[1:])


_MODE: ShapeDependentGemm | None = None


def enable() -> None:
    """Enter the mode for the rest of this process (idempotent)."""
    global _MODE
    if _MODE is None:
        _MODE = ShapeDependentGemm()
        _MODE.__enter__()


@contextmanager
def sampling_layout(policy):
    """A denoising policy whose ``log_prob`` calls the denoiser once per chain step, as its
    sampling pass does (``denoising.chunk_steps`` 1). Where every chain is stochastic at the same
    steps, those calls have the sampling pass's row counts: the same operators on the same
    shapes, so a recompute equals the sampling pass's log-probs to the bit on every CPU. Without
    it the recompute runs every step in one call, other row counts (a bound, not equality)."""
    options = policy.denoising
    before = options.chunk_steps
    options.chunk_steps = 1
    try:
        yield policy
    finally:
        options.chunk_steps = before


def check_recompute(policy, sample, atol: float) -> None:
    """``policy.log_prob(sample.replay)`` against the sampling pass's log-probs: to the bit under
    :func:`sampling_layout` where every chain is stochastic at the same steps (the sampling pass's
    row counts); within ``atol`` where a chain's own random steps make the recompute evaluate
    fewer rows a call, and for the default all-steps-in-one-call recompute."""
    stochastic = sample.replay["chain"]["stochastic"]
    with sampling_layout(policy):
        stepwise = policy.log_prob(sample.replay)
    if bool((stochastic == stochastic[:1]).all()):
        assert torch.equal(stepwise, sample.logp), f"recompute at the sampling layout differs by {(stepwise - sample.logp).abs().max():.3g}"
    else:
        torch.testing.assert_close(stepwise.detach(), sample.logp, atol=atol, rtol=0)
    torch.testing.assert_close(policy.log_prob(sample.replay).detach(), sample.logp, atol=atol, rtol=0)
