"""The options block of every denoising policy: ``policy.denoising`` in a config.

One dataclass says how a policy samples its denoising chain and scores it, whatever the
chain generates (an image latent, an action chunk, a toy vector):

- which Gaussian transition a stochastic step is (``transition`` with ``eta`` /
  ``noise_level`` / ``noise_std_range``) over how many steps (``num_inference_steps``) of
  which schedule (``num_train_timesteps`` and ``beta_schedule`` for diffusion,
  ``time_shift`` for flows);
- which steps are stochastic, i.e. are the RL decisions (``stochastic_steps`` with
  ``window_start`` / ``window_size``); the others take the deterministic update;
- how a step's log-prob is formed (``min_std``, ``logp_reduction``, ``logp_element_clamp``),
  what one decision is (``logp_granularity``) and how many steps one recomputation call
  batches (``chunk_steps``, checkpointed or not: ``checkpoint_chunks``), and where the
  old log-probs of the ratio come from (``old_logp``).

A policy embeds it as a nested section with its own defaults
(``denoising: DenoisingOptions = option(factory=lambda: DenoisingOptions(...))``); keys a
YAML file leaves out keep the policy's defaults. A policy whose denoiser predicts only
one kind of output (ε or v) checks ``transition`` against what it supports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.denoising.chain import random_step, sde_window
from mmrl.denoising.transitions import DIFFUSION_TRANSITIONS, DiffusionTransition, FlowTransition, Transition
from mmrl.errors import ConfigError

# Transitions whose last step has std 0 (DDIM/DDPM reach ᾱ = 1, CPS reaches σ = 0): a
# stochastic last step needs a std floor.
_ZERO_STD_LAST_STEP = ("ddim", "ddpm", "lcm", "flow_cps")


@dataclass
class DenoisingOptions:
    """How a denoising policy samples its chain and recomputes its log-probs."""

    transition: Literal["ddim", "ddpm", "lcm", "flow_sde", "flow_cps", "flow_noise", "flow_ode"] = option(
        "flow_sde",
        "Gaussian transition of a stochastic step: ddim (with eta), ddpm, or lcm (a multistep consistency sampler: RLCM) for noise-predicting (ε) models; flow_sde (Flow-GRPO), flow_cps (coefficient-preserving), flow_noise (learned std, πRL) or flow_ode (deterministic: no decisions) for velocity (flow-matching) models",
    )
    num_inference_steps: int = option(10, "denoising steps K of a sampled chain", ge=1)
    eval_num_inference_steps: int | None = option(
        None,
        "steps of a deterministic chain (evaluation) when they differ from num_inference_steps: Flow-GRPO trains with 10 and evaluates with 40; null = num_inference_steps",
        ge=1,
    )
    eta: float = option(1.0, "ddim: stochasticity of the stochastic steps (1: the DDPM posterior variance)", gt=0)
    noise_level: float = option(0.7, "flow_sde: noise level a, sigma_t = a sqrt(sigma / (1 - sigma)); flow_cps: std = sigma_next sin(a pi / 2), a <= 1", gt=0)
    sde_diffusion: Literal["flow_grpo", "constant"] = option(
        "flow_grpo",
        "flow_sde: the SDE's diffusion coefficient sigma_t: flow_grpo = noise_level sqrt(sigma / (1 - sigma)) (Flow-GRPO, piRL); constant = noise_level at every step (DanceGRPO's eta: std = eta sqrt(sigma - sigma_next))",
    )
    noise_std_range: list[float] = option(factory=lambda: [0.05, 0.3], doc="flow_noise: the learned std of every latent element lies in [lo, hi] (log-uniform squashing)")
    time_shift: float = option(1.0, "flow transitions: SD3 time shift of the sigma schedule (> 1 spends more steps at high noise)", gt=0)
    num_train_timesteps: int = option(1000, "ddim / ddpm: training timesteps T of the noise schedule the denoiser was trained on", ge=1)
    beta_schedule: Literal["cosine", "linear", "scaled_linear"] = option("linear", "ddim / ddpm: noise schedule the denoiser was trained on (cosine: Nichol & Dhariwal 2021)")
    lcm_original_steps: int = option(50, "lcm: steps of the schedule the consistency model was distilled on; the K steps are evenly spaced among them", ge=1)
    lcm_timestep_scaling: float = option(10.0, "lcm: timestep scaling of the boundary-condition coefficients c_skip, c_out", gt=0)
    beta_start: float = option(1e-4, "ddim / ddpm / lcm, linear and scaled_linear schedules: the first beta (DDPM 1e-4; Stable Diffusion and LCM 0.00085 with scaled_linear)", gt=0, lt=1)
    beta_end: float = option(0.02, "ddim / ddpm / lcm, linear and scaled_linear schedules: the last beta (DDPM 0.02; Stable Diffusion and LCM 0.012)", gt=0, lt=1)
    set_alpha_to_one: bool | None = option(None, "ddim / ddpm / lcm: the step after the last timestep goes to alpha_bar 1 (true) or to alpha_bar at t = 0 (false), as diffusers' DDIMScheduler; null = the pipeline's scheduler's (true without one)")
    clip_denoised: float | None = option(None, "ddim / ddpm: clip the predicted clean sample x0 to +-this inside each step; null: no clipping", gt=0)
    stochastic_steps: Literal["all", "last", "window", "random"] = option(
        "all",
        "which steps are stochastic (the decisions; the others deterministic): all; the last window_size (DPPO); window_size steps from window_start (MixGRPO, Flow-GRPO-Fast); or one per sample drawn uniformly from that window (πRL)",
    )
    window_start: int = option(0, "stochastic_steps window / random: first step of the window (0: the noisiest)", ge=0)
    window_size: int | None = option(None, "stochastic_steps last / window / random: steps in the window; null: through the last step", ge=1)
    train_fraction: float = option(
        1.0,
        "of each chain's stochastic steps, the fraction that are decisions, drawn at random per chain (DanceGRPO trains 0.6); the others still inject their noise but are neither decisions nor recomputed",
        gt=0,
        le=1,
    )
    min_std: float = option(0.0, "floor of the std of stochastic steps, when sampling and in log-probs (DPPO's minimum denoising std)", ge=0)
    logp_reduction: Literal["sum", "mean"] = option("sum", "a step's log-prob summed over the latent's elements, or averaged (DDPO, Flow-GRPO, DPPO; wants a much smaller clip range)")
    logp_element_clamp: list[float] | None = option(None, "clamp per-element log-densities to [lo, hi] before the reduction (DPPO uses [-5, 2]); null: no clamp")
    logp_granularity: Literal["step", "chain"] = option("step", "what one RL decision is: every stored denoising step (a ratio per step, as DDPO, Flow-GRPO, DPPO), or the whole chain (the joint log-likelihood of its stochastic steps; for a robot policy one per action chunk)")
    chunk_steps: int | None = option(None, "recompute log-probs with at most this many steps of each chain per denoiser call, checkpointed under grad (memory of one chunk when a step is a large network, for one more forward per chunk); null: all in one call", ge=1)
    old_logp: Literal["deferred", "sampler"] = option(
        "deferred",
        "where the old log-probs of the ratio come from: deferred = the trainer's log_prob at the sampling weights (the first minibatch's own forward, one no-grad pass over the other rows), so the first PPO step starts from ratios of exactly 1 on any CPU; sampler = the sampling pass's own numbers (no extra pass; a different batch shape sums floats in another order, which a clip range of 1e-4 can clip: the metric old_logp/sampler_gap_max shows by how much)",
    )
    checkpoint_chunks: bool = option(True, "with chunk_steps under grad: recompute each chunk's activations in backward (memory of one chunk); false keeps them all (the memory of one call, no extra forward) and only runs the denoiser on smaller batches, faster on a CPU once one call's activations outgrow the cache")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        k = self.num_inference_steps
        if self.transition in DIFFUSION_TRANSITIONS and k > self.num_train_timesteps:
            raise ConfigError(p + "num_inference_steps", k, f"must be <= num_train_timesteps ({self.num_train_timesteps})")
        if not self.beta_start < self.beta_end:
            raise ConfigError(p + "beta_end", self.beta_end, f"must be > beta_start ({self.beta_start})")
        k_eval = self.eval_num_inference_steps
        limit = "lcm_original_steps" if self.transition == "lcm" else "num_train_timesteps"
        if k_eval is not None and self.transition in DIFFUSION_TRANSITIONS and k_eval > getattr(self, limit):
            raise ConfigError(p + "eval_num_inference_steps", k_eval, f"must be <= {limit} ({getattr(self, limit)})")
        if self.transition == "lcm" and not k <= self.lcm_original_steps <= self.num_train_timesteps:
            raise ConfigError(p + "lcm_original_steps", self.lcm_original_steps, f"must lie in [num_inference_steps ({k}), num_train_timesteps ({self.num_train_timesteps})]")
        if self.sde_diffusion != "flow_grpo" and self.transition != "flow_sde":
            raise ConfigError(p + "sde_diffusion", self.sde_diffusion, f"only flow_sde has an SDE diffusion to choose (transition is {self.transition}); leave it at flow_grpo")
        if self.transition == "flow_cps" and self.noise_level > 1:
            raise ConfigError(p + "noise_level", self.noise_level, "flow_cps needs a noise level in (0, 1]")
        if self.time_shift == math.inf:
            raise ConfigError(p + "time_shift", self.time_shift, "must be a finite number > 0 (an infinite shift puts every sigma at 1)")
        lo_hi = self.noise_std_range
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] < math.inf:
            raise ConfigError(p + "noise_std_range", lo_hi, "expected [lo, hi] with 0 < lo <= hi, both finite")
        clamp = self.logp_element_clamp
        if clamp is not None and (len(clamp) != 2 or not clamp[0] < clamp[1]):
            raise ConfigError(p + "logp_element_clamp", clamp, "expected [lo, hi] with lo < hi, or null")
        if self.stochastic_steps in ("window", "random") and self.window_start >= k:
            raise ConfigError(p + "window_start", self.window_start, f"must be < num_inference_steps ({k})")
        start, stop = self.window
        if self.stochastic_steps != "all" and self.window_size is not None and stop - start != self.window_size:
            raise ConfigError(p + "window_size", self.window_size, f"the window must fit in the {k} steps (from step {start}: at most {k - start})")
        if self.transition in _ZERO_STD_LAST_STEP and stop == k and self.min_std == 0:
            raise ConfigError(p + "min_std", self.min_std, f"must be > 0: the last step of {self.transition} has std 0 and is stochastic here (or end the window before it)")

    def deterministic_options(self) -> "DenoisingOptions":
        """The options of a deterministic chain: ``eval_num_inference_steps`` steps when set
        (every step deterministic, the whole chain stored), else these options."""
        k_eval = self.eval_num_inference_steps
        if k_eval is None or k_eval == self.num_inference_steps:
            return self
        return dataclasses.replace(self, num_inference_steps=k_eval, eval_num_inference_steps=None, stochastic_steps="all", window_start=0, window_size=None)

    @property
    def window(self) -> tuple[int, int]:
        """[start, stop): the steps that may be stochastic (for ``all``: every step).
        Unchecked: :meth:`validate` says when ``window_size`` does not fit."""
        k = self.num_inference_steps
        if self.stochastic_steps == "all":
            return 0, k
        size = self.window_size
        if self.stochastic_steps == "last":
            return (0, k) if size is None else (max(k - size, 0), k)
        return self.window_start, k if size is None else min(self.window_start + size, k)

    @property
    def log_prob_options(self) -> dict:
        """Keyword arguments of :func:`~mmrl.denoising.chain.run_chain` and
        :func:`~mmrl.denoising.chain.chain_log_probs` for a step's log-prob."""
        clamp = tuple(self.logp_element_clamp) if self.logp_element_clamp is not None else None
        return {"min_std": self.min_std, "reduce": self.logp_reduction, "clamp": clamp}


def make_transition(options: DenoisingOptions, deterministic: bool = False, device=None) -> Transition:
    """The K-step :class:`~mmrl.denoising.transitions.Transition` of ``options``;
    ``deterministic`` gives the flow ODE for flows (a diffusion chain is made deterministic
    by its stochastic mask alone: its deterministic steps are DDIM with η = 0)."""
    k = options.num_inference_steps
    if options.transition in DIFFUSION_TRANSITIONS:
        return DiffusionTransition.from_config(
            options.num_train_timesteps, k, options.beta_schedule, options.transition, options.eta, options.clip_denoised, device=device,
            lcm_original_steps=options.lcm_original_steps, lcm_timestep_scaling=options.lcm_timestep_scaling,
            beta_start=options.beta_start, beta_end=options.beta_end, set_alpha_to_one=options.set_alpha_to_one is not False,
        )
    name = "flow_ode" if deterministic else options.transition
    return FlowTransition.from_config(k, name, options.noise_level, options.time_shift, device=device, diffusion=options.sde_diffusion)


def stochastic_mask(options: DenoisingOptions, n: int, generator: torch.Generator | None = None, device=None) -> Tensor:
    """[N, K] bool: the stochastic steps of N chains under ``options.stochastic_steps``
    (``random`` draws one step per chain from ``generator``, on the CPU); none for
    ``flow_ode``, whose every step is deterministic."""
    start, stop = options.window
    k = options.num_inference_steps
    if options.transition == "flow_ode":
        return torch.zeros(n, k, dtype=torch.bool, device=device)
    if options.stochastic_steps == "random":
        return random_step(n, k, generator, low=start, high=stop, device=device)
    return sde_window(n, k, start, stop - start, device=device)
