"""Shared denoising machinery: Gaussian transitions whose log-probs make a denoising chain an MDP.

One module for every denoising policy, whether it generates images (a diffusers UNet or
transformer) or robot action chunks (a diffusion policy, a flow-matching VLA's action
expert): the chain is the chain.

- :mod:`~mmrl.denoising.gaussian`: log-density (summed or averaged over latent elements)
  and entropy of a Gaussian step.
- :mod:`~mmrl.denoising.schedules`: DDPM betas → ᾱ, sampler timesteps, flow sigmas.
- :mod:`~mmrl.denoising.transitions`: (mean, std) of each step — DDPM, DDIM with η (DDPO),
  flow ODE, flow SDE (Flow-GRPO), CPS, Flow-Noise (πRL) — bound to K-step schedules.
- :mod:`~mmrl.denoising.chain`: run a chain with a chosen set of stochastic steps, the
  replay layout every denoising policy stores, and the per-step log-probs (and exact KL
  to a reference) recomputed from it under current parameters.
- :mod:`~mmrl.denoising.options`: ``DenoisingOptions``, the ``policy.denoising`` section
  every denoising policy embeds (transition, steps, stochastic steps, log-prob options).
- :mod:`~mmrl.denoising.policy`: ``DenoisingPolicy``, the base class that turns those
  into ``sample`` pieces, ``log_prob`` and ``exact_kl``.
- :mod:`~mmrl.denoising.time_embedding`: the sinusoidal time features denoisers take.
"""

from mmrl.denoising.chain import ChainSample, chain_kl, chain_log_probs, last_steps, random_step, run_chain, sde_window
from mmrl.denoising.gaussian import gaussian_entropy, gaussian_log_prob
from mmrl.denoising.options import DenoisingOptions, make_transition, stochastic_mask
from mmrl.denoising.policy import ChainDecisions, DenoisingPolicy, provisional_logp_why
from mmrl.denoising.schedules import alphas_cumprod, ddim_timesteps, ddpm_betas, flow_sigmas, resolution_shift, terminal_stretch
from mmrl.denoising.time_embedding import sinusoidal_embedding, sinusoidal_periods
from mmrl.denoising.transitions import (
    DIFFUSION_TRANSITIONS,
    FLOW_TRANSITIONS,
    TRANSITIONS,
    DiffusionTransition,
    FlowTransition,
    Transition,
    ddim_step,
    ddpm_step,
    flow_cps_step,
    flow_noise_step,
    flow_ode_step,
    flow_sde_step,
    learned_noise_std,
    predicted_x0,
)

__all__ = [
    "DIFFUSION_TRANSITIONS",
    "FLOW_TRANSITIONS",
    "TRANSITIONS",
    "ChainDecisions",
    "ChainSample",
    "DenoisingOptions",
    "DenoisingPolicy",
    "DiffusionTransition",
    "FlowTransition",
    "Transition",
    "alphas_cumprod",
    "chain_kl",
    "chain_log_probs",
    "ddim_step",
    "ddim_timesteps",
    "ddpm_betas",
    "ddpm_step",
    "flow_cps_step",
    "flow_noise_step",
    "flow_ode_step",
    "flow_sde_step",
    "flow_sigmas",
    "gaussian_entropy",
    "gaussian_log_prob",
    "last_steps",
    "learned_noise_std",
    "make_transition",
    "predicted_x0",
    "random_step",
    "resolution_shift",
    "terminal_stretch",
    "run_chain",
    "sde_window",
    "sinusoidal_embedding",
    "sinusoidal_periods",
    "stochastic_mask",
]
