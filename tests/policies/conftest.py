"""Fixtures of the policy tests that compile sampling steps (``compile_denoiser``,
``compile_prefix``, ``compile_decoder``)."""

import os

import pytest
import torch


@pytest.fixture(scope="module")
def inductor_cache_per_kernel_set(tmp_path_factory):
    """A compile cache of this CPU kernel set's own: inductor's precompiled C++ header, built
    under one ATEN_CPU_CAPABILITY and reused under another (CI runs the numerics tests again
    under ``default``), leaves the vectorized kernels it writes without ``at::vec``."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / f"inductor_{capability}")
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.fixture
def one_thread():
    """One intra-op thread, so that compiled and eager kernels reduce in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
