"""Parity tests: TRL's and verl's own code run on the same tensors as mmrl's functions.

They need the ``parity`` extra (``scripts/setup.sh`` installs it, verl without its
dependencies). Without it they are skipped, except where ``MMRL_REQUIRE_PARITY=1`` (set by
``.ci/run``): there a missing or different reference library fails the run.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import Tensor

# The versions docs/parity.md describes; another version may have moved on.
REFERENCE_VERSIONS = {"trl": "1.16.0", "verl": "0.9.1", "torchrl": "0.10.1"}
# docs/parity.md's "equal": two libraries' float32 losses over B x T = 48 decisions of size ~1,
# summed in each one's own order (measured: at most 1.2e-7 under ATEN_CPU_CAPABILITY default,
# avx2 and avx512, 10% of it)
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def reference(module: str):
    """Import ``module`` of a reference library, or skip (fail under MMRL_REQUIRE_PARITY=1)
    when it is missing or not the version the parity table is about."""
    distribution = module.split(".")[0]
    problem = None
    try:
        imported = importlib.import_module(module)
        version = importlib.metadata.version(distribution)
        if version != REFERENCE_VERSIONS[distribution]:
            problem = f"{distribution} {version} is installed; the parity tests are about {REFERENCE_VERSIONS[distribution]}"
    except ImportError as error:
        problem = f"{module} cannot be imported ({error})"
    if problem is None:
        return imported
    problem += "; scripts/setup.sh installs the parity extra"
    if os.environ.get("MMRL_REQUIRE_PARITY") == "1":
        pytest.fail(problem + " (MMRL_REQUIRE_PARITY=1)", pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="session")
def core_algos():
    """verl.trainer.ppo.core_algos: the narrowest verl module holding the functions compared.
    Importing it runs verl's package __init__, which needs ray, tensordict, omegaconf,
    codetiming and orjson (the parity extra), but no GPU and nothing of verl's training stack."""
    return reference("verl.trainer.ppo.core_algos")


@pytest.fixture(scope="session")
def grpo_trainer_module():
    return reference("trl.trainer.grpo_trainer")


@dataclass
class Batch:
    """One minibatch of B completions padded to T decisions, as both libraries see it."""

    logp: Tensor  # [B, T] current policy (leaf; gradients are taken w.r.t. it)
    old_logp: Tensor  # [B, T] sampling policy
    ref_logp: Tensor  # [B, T] reference policy
    adv: Tensor  # [B] one advantage per completion
    mask: Tensor  # [B, T] float 0/1, every row has at least one valid decision

    @property
    def token_adv(self) -> Tensor:
        """The advantage on every valid decision (verl's [B, T] form; 0 on padding)."""
        return self.adv[:, None] * self.mask


def random_batch(
    seed: int = 0,
    batch: int = 8,
    length: int = 6,
    log_ratio_scale: float = 0.4,
    ref_scale: float = 0.3,
    far_off: float = 0.0,
) -> Batch:
    """Random log-probs whose log-ratios to the old policy are ~N(0, log_ratio_scale²), so
    ratios land on both sides of the clip range; ``far_off`` > 0 moves a few decisions that
    far in log-ratio (CISPO's cap, dual clip). Lengths 1 … T."""
    gen = torch.Generator().manual_seed(seed)
    old_logp = -3 * torch.rand(batch, length, generator=gen)
    log_ratio = log_ratio_scale * torch.randn(batch, length, generator=gen)
    if far_off:
        log_ratio[::3, 0] = far_off
        log_ratio[1::3, 0] = -far_off
    logp = old_logp + log_ratio
    ref_logp = logp + ref_scale * torch.randn(batch, length, generator=gen)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    adv = torch.randn(batch, generator=gen)
    return Batch(logp.requires_grad_(), old_logp, ref_logp, adv, mask)


def value_and_grad(loss_fn: Callable[[Tensor], Tensor], logp: Tensor) -> tuple[Tensor, Tensor]:
    """A scalar loss of ``logp`` and its gradient w.r.t. ``logp``."""
    loss = loss_fn(logp)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def assert_same_value_and_grad(ours: Callable[[Tensor], Tensor], theirs: Callable[[Tensor], Tensor], logp: Tensor):
    """Both losses equal to 1e-6 in value and in gradient w.r.t. ``logp``; returns mmrl's
    gradient so a caller can check the batch exercised what it meant to."""
    our_value, our_grad = value_and_grad(ours, logp)
    their_value, their_grad = value_and_grad(theirs, logp)
    torch.testing.assert_close(our_value, their_value, **TOLERANCE)
    torch.testing.assert_close(our_grad, their_grad, **TOLERANCE)
    return our_grad
