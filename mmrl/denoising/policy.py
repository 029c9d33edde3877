"""``DenoisingPolicy``: the base of policies whose decisions are denoising steps.

A subclass holds ``config.denoising`` (:class:`~mmrl.denoising.options.DenoisingOptions`),
samples with :meth:`DenoisingPolicy.sample_chain` from its own denoiser, stores the
returned ``chain`` (the replay layout of :mod:`mmrl.denoising.chain`) as
``replay["chain"]`` beside its conditioning, and implements :meth:`chain_denoiser`. It
then inherits ``log_prob`` (the stored chains' log-probs, recomputed) and ``exact_kl``
(the closed-form KL of every stochastic step to a reference).

Decisions (``logp_granularity``): ``step`` makes every stored step a decision — [N, W]
per chain, [N, calls·W] for a policy with one chain per env decision — and masks the
deterministic ones; ``chain`` makes each chain one decision whose log-prob is the sum
over its stochastic steps ([N, 1] or [N, calls]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.core.policy import PolicyModule
from mmrl.denoising.chain import Denoiser, chain_kl, chain_log_probs, random_subset, run_chain
from mmrl.denoising.options import DenoisingOptions, make_transition, stochastic_mask
from mmrl.denoising.transitions import FLOW_TRANSITIONS


def provisional_logp_why(measured: str) -> str:
    """A denoising policy's contract ``ratio_why`` when its old log-probs are deferred: the
    sampling pass runs the chain over one wave of observations, ``log_prob`` over the whole
    replay, so their matrix products have other row counts. ``measured`` gives the gaps seen."""
    return (
        "the old log-probs are deferred (the trainer's first ratio is exactly 1: two passes over one replay agree to the bit); the "
        "sampling pass's provisional numbers come from GEMMs over one wave of rows, log_prob's from GEMMs over every decision of the "
        "replay at once, and some BLAS kernels (MKL on AVX512 Intel Xeons) sum a row in an order chosen from the row count, a few "
        f"ulps of each log-prob apart (0 on AMD EPYC; tests/kernel_emulation reproduces it anywhere). Measured: {measured}"
    )


@dataclass
class ChainDecisions:
    """What :meth:`DenoisingPolicy.sample_chain` returns for N chains."""

    final: Tensor  # [N, ...] the chains' final samples
    chain: dict[str, Tensor]  # the replay layout, leading dim N
    logp: Tensor  # [N, T] per decision
    entropy: Tensor  # [N, T] per decision
    mask: Tensor | None  # [N, T] the stochastic steps (step granularity), else None
    # ``logp`` is provisional: the trainer's log_prob at the sampling weights replaces it
    # (``denoising.old_logp: deferred``; the policy passes it on as ``Sample.logp_deferred``)
    deferred: bool = False


class DenoisingPolicy(PolicyModule):
    """A policy whose RL decisions are the stochastic steps of denoising chains."""

    @property
    def denoising(self) -> DenoisingOptions:
        return self.config.denoising

    def chain_denoiser(self, replay: dict[str, Any]) -> Denoiser:
        """The denoiser ``(x, t, rows) -> output`` conditioned on the replay's conditioning;
        ``rows`` index the chains of ``replay["chain"]`` with its leading dims flattened."""
        raise NotImplementedError(f"{type(self).__name__} must say how its denoiser is conditioned on a replay (chain_denoiser)")

    def step_activation_bytes(self) -> int | None:
        """Bytes of the widest feature map one denoiser evaluation computes per latent (a
        UNet's first level: channels x height x width x element size; a transformer's
        tokens x width x element size), for :meth:`activation_bytes`; ``None`` (the
        default): no estimate."""
        return None

    def activation_bytes(self, replay: dict[str, Any]) -> float | None:
        """Per sample of ``replay`` (the mean): :meth:`step_activation_bytes` x the steps of
        its chains that one recomputation call evaluates (its stochastic steps, at most
        ``chunk_steps`` per chain)."""
        per_step = self.step_activation_bytes()
        stochastic = replay["chain"]["stochastic"]
        n, width = stochastic.shape[0], stochastic.shape[-1]
        if per_step is None or n == 0:
            return None
        steps = stochastic.reshape(n, -1, width).to(torch.bool).sum(-1)  # [N, chains per sample]
        if self.denoising.chunk_steps is not None:
            steps = steps.clamp(max=self.denoising.chunk_steps)
        return float(per_step * steps.sum(-1).float().mean())

    def decisions(self, per_step: Tensor) -> Tensor:
        """Per-step values [N, (calls,) W] of stored chains → per-decision values [N, T]."""
        n = per_step.shape[0]
        if self.denoising.logp_granularity == "chain":
            return per_step.sum(-1).reshape(n, -1)
        return per_step.reshape(n, -1)

    def per_decision(self, values: Tensor, chain: dict[str, Tensor]) -> Tensor:
        """Values [N, calls, …] of each stored chain (its observation, its final sample) →
        one row per decision [N·T, …], in the order of :meth:`decisions` (a chain's value
        repeated for each of its W steps with ``logp_granularity: step``)."""
        if self.denoising.logp_granularity == "step":
            values = values.repeat_interleave(chain["stochastic"].shape[-1], dim=1)
        return values.flatten(0, 1)

    def initial_noise(self, shape: tuple[int, ...], generator: torch.Generator | None = None, group_size: int | None = None) -> Tensor:
        """Starting noise [N, …] of N chains from ``generator``, on the CPU. ``group_size`` G:
        each run of G consecutive chains starts from one draw (DanceGRPO's noise shared by a
        group, ``shares_initial_noise``); their steps still draw their own noises."""
        n = shape[0]
        if not group_size or group_size == 1:
            return torch.randn(shape, generator=generator)
        if n % group_size:
            raise ValueError(f"{n} samples are not whole groups of {group_size}")
        return torch.randn((n // group_size, *shape[1:]), generator=generator).repeat_interleave(group_size, dim=0)

    def sample_chain(
        self, denoiser: Denoiser, x_init: Tensor, generator: torch.Generator | None = None, deterministic: bool = False, keep_graph: bool = False,
        final_only: bool = False,
    ) -> ChainDecisions:
        """Run N chains from ``x_init`` [N, …] under ``config.denoising``; ``deterministic``
        makes every step deterministic (no decision has a log-prob), over
        ``eval_num_inference_steps`` steps when set. ``keep_graph``: the
        log-probs keep the autograd graph of the stochastic steps' denoiser calls, latents
        detached between steps (:func:`~mmrl.denoising.chain.run_chain`), so they are the
        log-probs ``log_prob`` would recompute, with its gradient. ``final_only``: the stored
        chain is the final latent alone (no steps), one decision per chain with log-prob 0 —
        for a loss that reads final samples, not log-probs (``samples_final_only``)."""
        if final_only:
            options = self.denoising.deterministic_options() if deterministic else self.denoising
            n, device = x_init.shape[0], x_init.device
            # the mask on the CPU: run_chain reads it there and moves it (no host sync in the chain)
            stochastic = torch.zeros(n, options.num_inference_steps, dtype=torch.bool) if deterministic else stochastic_mask(options, n, generator)
            chain = run_chain(denoiser, self.transition(options, deterministic, device), x_init, stochastic, generator, **options.log_prob_options)
            stored = {
                "latents": chain.final.detach().unsqueeze(1),
                "step_index": torch.zeros(n, 0, dtype=torch.long, device=device),
                "stochastic": torch.zeros(n, 0, dtype=torch.bool, device=device),
            }
            zeros = torch.zeros(n, 1, device=device)
            return ChainDecisions(chain.final, stored, zeros, zeros.clone(), None, False)
        options = self.denoising.deterministic_options() if deterministic else self.denoising
        n, device = x_init.shape[0], x_init.device
        transition = self.transition(options, deterministic, device)
        if deterministic:  # the mask on the CPU: run_chain reads it there and moves it (no host sync in the chain)
            stochastic = torch.zeros(n, options.num_inference_steps, dtype=torch.bool)
        else:
            stochastic = stochastic_mask(options, n, generator)
        chain = run_chain(denoiser, transition, x_init, stochastic, generator, **options.log_prob_options, keep_graph=keep_graph)
        first = options.window[0]
        stored = chain.replay(first)
        log_probs, entropies = chain.log_probs, chain.entropies
        with torch.set_grad_enabled(keep_graph):
            if not deterministic and options.train_fraction < 1:
                # the untrained stochastic steps are stored as deterministic: no decision, no recompute
                trained = random_subset(chain.stochastic, options.train_fraction, generator)
                stored["stochastic"] = trained[:, first:]
                log_probs, entropies = log_probs * trained, entropies * trained
            logp = self.decisions(log_probs[:, first:])
        mask = stored["stochastic"].float() if options.logp_granularity == "step" else None
        deferred = not deterministic and options.old_logp == "deferred"
        return ChainDecisions(chain.final, stored, logp, self.decisions(entropies[:, first:]), mask, deferred)

    def transition(self, options: DenoisingOptions, deterministic: bool = False, device=None):
        """The K-step transition that sampling, ``log_prob`` and ``exact_kl`` run under
        ``options``: :func:`~mmrl.denoising.options.make_transition` (mmrl's own σ / β grid).
        A policy whose pipeline has a grid of its own (a diffusers scheduler's sigmas)
        overrides this one method."""
        return make_transition(options, deterministic, device)

    def flow_sigmas(self) -> Tensor:
        """σ_0 = 1 … σ_K = 0 [K + 1] of the sampler's steps (a flow transition only)."""
        transition = self.transition(self.denoising)
        if not hasattr(transition, "sigmas"):
            raise NotImplementedError(f"{type(self).__name__} with transition {self.denoising.transition!r} is not a flow")
        return transition.sigmas

    def velocity(self, replay: dict[str, Any], x: Tensor, sigma: Tensor, rows: Tensor) -> Tensor:
        """v(x, σ | c) of the flow denoiser, conditioned as the replay's chains ``rows``
        (:meth:`PolicyModule.velocity`); a flow transition only (its denoiser returns v)."""
        if self.denoising.transition not in FLOW_TRANSITIONS:
            raise NotImplementedError(f"{type(self).__name__} with transition {self.denoising.transition!r} predicts no velocity (a flow transition does)")
        out = self.chain_denoiser(replay)(x, sigma, rows)
        return out[0] if isinstance(out, tuple) else out  # a learned noise head's std is not the velocity

    def final_samples(self, replay: dict[str, Any]) -> Tensor:
        """The chains' final latents, one row per chain [N·calls, ...] (the stored chain's
        last latent; one chain per sample, or one per env decision of an action-chunk
        policy), in the order of ``chain_denoiser``'s rows."""
        chain = replay["chain"]
        step_dim = chain["stochastic"].dim() - 1  # latents [*, W + 1, ...]
        return chain["latents"].select(step_dim, -1).flatten(0, step_dim - 1)

    def log_prob(self, replay: dict[str, Any]) -> Tensor:
        """Log-probs [N, T] of the replayed decisions under the current parameters."""
        options = self.denoising
        chain = replay["chain"]
        per_step = chain_log_probs(
            self.chain_denoiser(replay), self.transition(options, device=chain["latents"].device), chain, **options.log_prob_options,
            chunk_steps=options.chunk_steps, checkpoint_chunks=options.checkpoint_chunks,
        )
        return self.decisions(per_step)

    def exact_kl(self, replay: dict[str, Any], reference: "DenoisingPolicy") -> Tensor:
        """KL(πθ ‖ πref) [N, T] of each replayed decision in closed form: per stochastic
        step ‖μθ − μref‖² / (2σ²) at the stored latent (:func:`~mmrl.denoising.chain.chain_kl`),
        reduced over the latent like the log-probs, summed over a chain's steps for
        ``logp_granularity: chain``; 0 on deterministic steps. Gradient w.r.t. this
        policy's parameters only."""
        if not hasattr(reference, "chain_denoiser"):  # a denoising policy, or one that stands in for it
            raise TypeError(f"the exact KL of a denoising policy needs a denoising reference policy, got {type(reference).__name__}")
        options = self.denoising
        chain = replay["chain"]
        with torch.no_grad():
            reference_denoiser = reference.chain_denoiser(replay)
        kl = chain_kl(
            self.chain_denoiser(replay),
            reference_denoiser,
            self.transition(options, device=chain["latents"].device),
            chain,
            min_std=options.min_std,
            reduce=options.logp_reduction,
            chunk_steps=options.chunk_steps,
            checkpoint_chunks=options.checkpoint_chunks,
        )
        return self.decisions(kl)
