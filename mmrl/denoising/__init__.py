"""Shared denoising machinery: Gaussian transitions whose log-probs make a denoising chain an MDP.

One module for every denoising policy, whether it generates images (a diffusers UNet or
transformer) or robot action chunks (a diffusion policy, a flow-matching VLA's action
expert): the chain is the chain.

- :mod:`~mmrl.denoising.gaussian`: log-density (summed or averaged over latent elements)
  and entropy of a Gaussian step.
- :mod:`~mmrl.denoising.schedules`: DDPM betas → ᾱ, sampler timesteps, flow sigmas.
- :mod:`~mmrl.denoising.transitions`: (mean, std) of each step — DDPM, DDIM with η (DDPO),
  flow ODE, flow SDE (Flow-GRPO), CPS, Flow-Noise (πRL) — bound to K-step schedules.
- :mod:`~mmrl.denoising.chain`: run a chain with a chosen set of stochastic steps and
  recompute its per-step log-probs under current parameters.
- :mod:`~mmrl.denoising.time_embedding`: the sinusoidal time features denoisers take.
"""

from mmrl.denoising.chain import ChainSample, chain_log_probs, last_steps, random_step, run_chain, sde_window, transition_log_probs
from mmrl.denoising.gaussian import gaussian_entropy, gaussian_log_prob
from mmrl.denoising.schedules import alphas_cumprod, ddim_timesteps, ddpm_betas, flow_sigmas
from mmrl.denoising.time_embedding import sinusoidal_embedding
from mmrl.denoising.transitions import (
    DiffusionTransition,
    FlowTransition,
    Transition,
    ddim_step,
    ddpm_step,
    flow_cps_step,
    flow_noise_step,
    flow_ode_step,
    flow_sde_step,
    predicted_x0,
)

__all__ = [
    "ChainSample",
    "DiffusionTransition",
    "FlowTransition",
    "Transition",
    "alphas_cumprod",
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
    "predicted_x0",
    "random_step",
    "run_chain",
    "sde_window",
    "sinusoidal_embedding",
    "transition_log_probs",
]
