"""Running a denoising chain as an MDP, storing it for replay, recomputing its log-probs.

A chain of K steps turns x_init (pure noise) into a sample: latents[:, 0] = x_init and
step k draws latents[:, k + 1] ~ N(mean_k, std_k²) from the transition's Gaussian
(:mod:`mmrl.denoising.transitions`). Each *stochastic* step is one decision whose
log-prob log N(x_{k+1}; mean_k, std_k²) the RL objective uses (DDPO, Black et al. 2023;
DPPO, Ren et al. 2024; Flow-GRPO, Liu et al. 2025); deterministic steps (ODE, DDIM η = 0)
carry no log-prob. Which steps are stochastic is a boolean mask [N, K]:

- all steps (DDPO, Flow-GRPO): ``torch.ones(n, K, dtype=bool)``;
- the last K' steps (DPPO fine-tunes only those): :func:`last_steps`;
- a window of consecutive steps, the rest ODE (MixGRPO, Li et al. 2025; Flow-GRPO-Fast):
  :func:`sde_window`;
- one random step per sample (πRL's Flow-SDE, Chen et al. 2025): :func:`random_step`.

**The replay layout.** Every denoising policy stores its chains for recomputation in one
structure, ``replay["chain"]`` (:meth:`ChainSample.replay`), from the first step that may
be stochastic (step s) to the end of the chain, W = K − s steps:

- ``"latents"`` [*, W + 1, …]: x_s, then the latent after each of the W steps (the last
  one is the chain's final sample);
- ``"step_index"`` [*, W] long: the chain step k of each stored transition (s … K − 1);
- ``"stochastic"`` [*, W] bool: which of them were stochastic (the decisions).

``*`` is [N] for one chain per sample (an image, a toy vector), or [N, calls] for a
policy that denoises one chain per env decision (an action chunk; the env sampler
concatenates its calls along dim 1). Latents may be any shape: image latents
[C, H, W], action chunks [C, A]. The sample's conditioning (prompt ids, text embeddings,
observations) sits beside ``"chain"`` in the replay under the policy's own keys. Steps
before s are deterministic and are not stored: a DPPO chain that trains its last 5 of 10
steps keeps 6 latents. A right-padded replay (zeros) has no stochastic step and
recomputes to 0.

The denoiser is any callable ``denoiser(x, t, rows)``: ``x`` [B, …] latents, ``t`` [B] the
transition's model time of each row (a training timestep or a flow σ), ``rows`` [B] long
— which of the chains each row belongs to (the index into the flattened ``*`` dims), so
the callable can pick that chain's conditioning (``cond[rows]``). It returns the model
output the transition expects (ε, v, or ``(v, std)`` for Flow-Noise). During sampling
``rows = arange(N)``; :func:`chain_log_probs` instead evaluates every stochastic (chain,
step) pair of a stored chain in one batched call, or in calls of at most ``chunk_steps``
steps of every chain.

``min_std`` floors the std of stochastic steps, when sampling and when recomputing, so
the log-prob stays the exact density of the drawn transition (DPPO's minimum denoising
std; it also keeps steps whose std vanishes, such as the last DDIM step, usable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mmrl.algo.kl import gaussian_kl
from mmrl.denoising.gaussian import gaussian_entropy, gaussian_log_prob
from mmrl.denoising.transitions import Transition

Denoiser = Callable[[Tensor, Tensor, Tensor], object]


@dataclass
class ChainSample:
    """A sampled chain of N samples and K steps."""

    latents: Tensor  # [N, K + 1, ...]: x_init, then the latent after each step
    log_probs: Tensor  # [N, K]: log-prob of each stochastic step, 0 on deterministic steps
    stochastic: Tensor  # [N, K] bool: which steps were stochastic
    entropies: Tensor  # [N, K]: differential entropy of each stochastic step's Gaussian, 0 elsewhere

    @property
    def final(self) -> Tensor:
        return self.latents[:, -1]

    def replay(self, first_step: int = 0) -> dict[str, Tensor]:
        """The replay layout (module docstring) of steps ``first_step`` … K − 1."""
        n, k_steps = self.stochastic.shape
        steps = torch.arange(first_step, k_steps, device=self.latents.device)
        return {
            "latents": self.latents[:, first_step:],
            "step_index": steps.expand(n, k_steps - first_step).clone(),
            "stochastic": self.stochastic[:, first_step:],
        }


def _floor(std: Tensor, min_std: float) -> Tensor:
    return std.clamp(min=min_std) if min_std > 0 else std


def _data(x: Tensor) -> Tensor:
    """``x`` detached from the autograd graph (itself where it has none: no operator)."""
    return x.detach() if x.requires_grad else x


def run_chain(
    denoiser: Denoiser,
    transition: Transition,
    x_init: Tensor,
    stochastic: Tensor,
    generator: torch.Generator | None = None,
    *,
    min_std: float = 0.0,
    reduce: str = "sum",
    clamp: tuple[float, float] | None = None,
    keep_graph: bool = False,
) -> ChainSample:
    """Run the K = ``transition.num_steps`` steps from ``x_init`` [N, …].

    ``stochastic`` [N, K] bool picks the stochastic steps per sample. Noise is drawn on the
    CPU from ``generator`` and moved to the latents' device, so a seed gives the same chain
    on every device. ``reduce`` / ``clamp`` are those of
    :func:`~mmrl.denoising.gaussian.gaussian_log_prob`. Raises ``ValueError`` if a
    stochastic step has std 0 (choose ``min_std > 0`` or make that step deterministic).

    Without grad, unless ``keep_graph``: then the denoiser runs with grad on the steps that
    are stochastic for some chain, and ``log_probs`` keep the autograd graph of its
    parameters. The latent handed to the next step (and stored) is detached, so step k's
    log-prob depends on the parameters only through its own mean (and std), exactly as
    :func:`chain_log_probs` recomputes it at the stored latents: at unchanged parameters
    both give the same log-probs and the same gradient, without a second forward.
    """
    n, k_steps = x_init.shape[0], transition.num_steps
    if stochastic.shape != (n, k_steps):
        raise ValueError(f"stochastic must be [N, K] = [{n}, {k_steps}], got {list(stochastic.shape)}")
    # No host sync inside the chain: which steps are stochastic is read from the host copy of the
    # mask (free when it is built on the CPU), the noise of every stochastic step is drawn before
    # the chain in the order the steps take it and moved to the device at once, and a zero std
    # is checked once after the last step.
    host = stochastic.to(dtype=torch.bool).cpu()
    stochastic = stochastic.to(device=x_init.device, dtype=torch.bool)
    any_rows, all_rows = host.any(0).tolist(), host.all(0).tolist()
    drawn = [torch.randn(x_init.shape, generator=generator, dtype=x_init.dtype) for k in range(k_steps) if any_rows[k]]
    noises = iter(torch.stack(drawn).to(x_init.device).unbind(0)) if drawn else iter(())
    rows = torch.arange(n, device=x_init.device)
    # A transition with a step table computes the coefficients of all K steps at once, for the
    # steps that every row takes alike (all stochastic or none): the same values, fewer operators.
    # A chain whose graph is kept (reused for the update) takes the per-step path that log_prob's
    # recompute takes, so that the two give the same gradients.
    table = transition.step_table(n, x_init.device, tuple(x_init.shape[1:])) if getattr(transition, "step_table", None) is not None and not keep_graph else None
    x = x_init.detach()
    latents = [x]
    log_probs, entropies, zero_std = [], [], []
    for k in range(k_steps):
        any_stochastic, all_stochastic = any_rows[k], all_rows[k]
        alike = table is not None and (all_stochastic or not any_stochastic)
        if not alike:
            step = torch.full((n,), k, dtype=torch.long, device=x.device)
            is_stochastic = stochastic[:, k]
        with torch.set_grad_enabled(keep_graph and any_stochastic):
            if alike:
                out = denoiser(x, table[k]["time"], rows)
                mean, std = transition.mean_std_at(table[k], x, out, all_stochastic)
            else:
                out = denoiser(x, transition.model_time(step), rows)
                mean, std = transition.mean_std(step, x, out, is_stochastic, all_stochastic=all_stochastic, any_stochastic=any_stochastic)
            if all_stochastic:  # the usual case: no masking needed
                from_table = alike and std is table[k].get("std")
                std = _floor(std, min_std)
                if not from_table:
                    zero_std.append((k, (std <= 0).any()))
                elif min_std <= 0:  # the table's std: the table checked it (a floor > 0 leaves no zero)
                    zero_std.append((k, table[k]["zero_std"]))
                noise = next(noises)
                # the drawn latent is data, not a function of the parameters (module docstring)
                x = _data(mean + std * noise)
                log_std = std.log()  # the log-prob's and the entropy's
                log_probs.append(gaussian_log_prob(x, mean, std, reduce, clamp=clamp, log_std=log_std))
                entropies.append(_data(gaussian_entropy(std, x, reduce, log_std=log_std)))
            elif any_stochastic:
                std = _floor(std, min_std)
                noisy = is_stochastic.view(n, *([1] * (x.ndim - 1))).expand_as(x)
                zero_std.append((k, ((std <= 0) & noisy).any()))
                noise = next(noises)
                x = torch.where(noisy, mean + std * noise, mean).detach()
                safe_std = torch.where(noisy, std, torch.ones_like(std))
                lp = gaussian_log_prob(x, mean, safe_std, reduce, clamp=clamp)
                log_probs.append(torch.where(is_stochastic, lp, torch.zeros_like(lp)))
                ent = gaussian_entropy(safe_std, x, reduce).detach()
                entropies.append(torch.where(is_stochastic, ent, torch.zeros_like(ent)))
            else:
                x = _data(mean)
                log_probs.append(x.new_zeros(n))
                entropies.append(x.new_zeros(n))
        latents.append(x)
    if zero_std:
        flags = torch.stack([flag for _, flag in zero_std]).tolist()  # the chain's one host sync
        if any(flags):
            k = zero_std[flags.index(True)][0]
            raise ValueError(f"denoising step {k} is stochastic but its std is 0; set a minimum std (min_std > 0) or make the step deterministic")
    with torch.set_grad_enabled(keep_graph):
        log_probs = torch.stack(log_probs, 1)
    return ChainSample(torch.stack(latents, 1), log_probs, stochastic, torch.stack(entropies, 1))


def _gaussian(denoiser: Denoiser, transition: Transition, x: Tensor, step: Tensor, rows: Tensor, min_std: float) -> tuple[Tensor, Tensor]:
    """(mean, floored std) of stochastic steps ``step`` [B] from latents ``x`` [B, …]."""
    out = denoiser(x, transition.model_time(step), rows)
    mean, std = transition.mean_std(step, x, out, torch.ones_like(step, dtype=torch.bool))
    return mean, _floor(std, min_std)


def _per_stochastic_step(chain: dict[str, Tensor], chunk_steps: int | None, evaluate: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], checkpoint_chunks: bool = True) -> Tensor:
    """``evaluate(x, x_next, step, rows) -> [B]`` on the stochastic transitions of a stored
    chain (the replay layout), at most ``chunk_steps`` steps of every chain per call (None:
    one call); [*, W], 0 on deterministic steps. With grad and ``checkpoint_chunks``, chunks
    are checkpointed: backward recomputes each chunk's activations instead of keeping them all."""
    stochastic = chain["stochastic"].to(torch.bool)
    lead, width = stochastic.shape[:-1], stochastic.shape[-1]
    latents, step_index = chain["latents"], chain["step_index"]
    if tuple(latents.shape[: len(lead) + 1]) != (*lead, width + 1) or step_index.shape != stochastic.shape:
        raise ValueError(
            f"a stored chain needs latents [*, W + 1, ...] and step_index [*, W] for stochastic [*, W] = {list(stochastic.shape)}; "
            f"got latents {list(latents.shape)} and step_index {list(step_index.shape)}"
        )
    stochastic = stochastic.reshape(-1, width)
    latents = latents.reshape(stochastic.shape[0], width + 1, *latents.shape[len(lead) + 1 :])
    step_index = step_index.reshape(-1, width)
    out = latents.new_zeros(stochastic.shape)
    chunk = chunk_steps or max(width, 1)
    for first in range(0, width, chunk):
        rows, cols = stochastic[:, first : first + chunk].nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        cols = cols + first
        inputs = (latents[rows, cols], latents[rows, cols + 1], step_index[rows, cols], rows)
        if chunk_steps is not None and checkpoint_chunks and torch.is_grad_enabled():
            values = checkpoint(evaluate, *inputs, use_reentrant=False)
        else:
            values = evaluate(*inputs)
        out = out.index_put((rows, cols), values)
    return out.view(*lead, width)


def chain_log_probs(
    denoiser: Denoiser,
    transition: Transition,
    chain: dict[str, Tensor],
    *,
    min_std: float = 0.0,
    reduce: str = "sum",
    clamp: tuple[float, float] | None = None,
    chunk_steps: int | None = None,
    checkpoint_chunks: bool = True,
) -> Tensor:
    """Recompute the per-step log-probs [*, W] of a stored chain (the replay layout)
    under current parameters, with grad; 0 on deterministic steps. Under unchanged
    parameters this equals :func:`run_chain`'s ``log_probs`` of the stored steps.

    The stochastic steps are evaluated in one denoiser call (none if no step is
    stochastic), or with ``chunk_steps`` in calls over at most that many steps of every
    chain: the same values with memory bounded by one chunk — without grad each chunk's
    activations are freed, with grad they are recomputed in backward (gradient
    checkpointing: one more forward per chunk). ``checkpoint_chunks=False`` keeps every
    chunk's activations instead: the memory of one call, no extra forward, the denoiser
    run on batches of one chunk (on a CPU a large network runs faster on those than on
    one batch of every step, whose activations outgrow the cache)."""

    def log_prob(x: Tensor, x_next: Tensor, step: Tensor, rows: Tensor) -> Tensor:
        mean, std = _gaussian(denoiser, transition, x, step, rows, min_std)
        return gaussian_log_prob(x_next, mean, std, reduce, clamp=clamp)

    return _per_stochastic_step(chain, chunk_steps, log_prob, checkpoint_chunks)


def chain_kl(
    denoiser: Denoiser,
    reference: Denoiser,
    transition: Transition,
    chain: dict[str, Tensor],
    *,
    min_std: float = 0.0,
    reduce: str = "sum",
    chunk_steps: int | None = None,
    checkpoint_chunks: bool = True,
) -> Tensor:
    """Exact KL(πθ(· | x_k) ‖ πref(· | x_k)) [*, W] of every stochastic step of a stored
    chain, at its stored latent x_k; 0 on deterministic steps.

    Both steps are Gaussians with the schedule's std σ_k (floored by ``min_std``), so the
    KL is ‖μθ − μref‖² / (2σ²) (Flow-GRPO, Liu et al. 2025), summed or averaged over the
    latent's elements like the log-probs (``reduce``; :func:`mmrl.algo.kl.gaussian_kl`).
    Flow-Noise learns its std, so there the KL of two diagonal Gaussians with different
    stds is used. The gradient flows into ``denoiser`` only: the reference is evaluated
    without grad. A DPPO ``clamp`` of the log-densities is not part of the KL."""
    learned_std = transition.name == "flow_noise"

    def kl(x: Tensor, x_next: Tensor, step: Tensor, rows: Tensor) -> Tensor:
        with torch.no_grad():
            ref_mean, ref_std = _gaussian(reference, transition, x, step, rows, min_std)
        mean, std = _gaussian(denoiser, transition, x, step, rows, min_std)
        return gaussian_kl(mean, ref_mean, std, reduce, ref_std=ref_std if learned_std else None)

    return _per_stochastic_step(chain, chunk_steps, kl, checkpoint_chunks)


# ------------------------------------------------------------------ which steps are stochastic


def sde_window(n: int, num_steps: int, start: int | Tensor, size: int, device=None) -> Tensor:
    """[N, K] bool: steps start … start + size − 1 stochastic, the rest ODE (MixGRPO's
    sliding window; Flow-GRPO-Fast). ``start`` is an int or a long tensor [N] (a window per
    sample); the window is cut at the chain's end."""
    steps = torch.arange(num_steps, device=device)
    start_t = torch.as_tensor(start, device=device).reshape(-1, 1)
    return ((steps >= start_t) & (steps < start_t + size)).expand(n, num_steps).clone()


def last_steps(n: int, num_steps: int, count: int, device=None) -> Tensor:
    """[N, K] bool: the last ``count`` steps stochastic (DPPO fine-tunes the last K' steps)."""
    return sde_window(n, num_steps, num_steps - count, count, device)


def random_subset(stochastic: Tensor, fraction: float, generator: torch.Generator | None = None) -> Tensor:
    """[N, K] bool: of each chain's stochastic steps, round(fraction x their number) (at
    least one where there is one), drawn uniformly without replacement on the CPU from
    ``generator`` (DanceGRPO's random subset of trained timesteps)."""
    counts = stochastic.sum(1)
    keep = (counts.float() * fraction).round().clamp(min=1).minimum(counts.float())
    scores = torch.rand(stochastic.shape, generator=generator).to(stochastic.device).masked_fill(~stochastic, 2.0)
    rank = scores.argsort(1).argsort(1)
    return stochastic & (rank < keep[:, None])


def random_step(n: int, num_steps: int, generator: torch.Generator | None = None, low: int = 0, high: int | None = None, device=None) -> Tensor:
    """[N, K] bool: one step per sample, uniform in [low, high) (default: any step), drawn
    on the CPU from ``generator`` (πRL's Flow-SDE: one stochastic step per action chunk)."""
    high = num_steps if high is None else high
    if not 0 <= low < high <= num_steps:
        raise ValueError(f"need 0 <= low < high <= {num_steps}, got low={low}, high={high}")
    chosen = torch.randint(low, high, (n,), generator=generator).to(device)
    return torch.nn.functional.one_hot(chosen, num_steps).bool()
