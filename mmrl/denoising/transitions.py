"""Denoising transitions: the Gaussian N(mean, std²) of x_next given x and the model output.

Each pure function maps (x, model output, schedule values) to ``(mean, std)``; a sampler
draws x_next = mean + std·z and the log-prob of the step is log N(x_next; mean, std²)
(:func:`mmrl.denoising.gaussian.gaussian_log_prob`). ``std`` is 0 for deterministic
steps (ODE, DDIM with η = 0). Schedule values may be Python floats or tensors that
broadcast against ``x`` (e.g. per-sample ``[B, 1, …]``).

:class:`DiffusionTransition` and :class:`FlowTransition` bind these functions to a K-step
schedule for :func:`mmrl.denoising.chain.run_chain`: step k ∈ [0, K) goes from latent k to
latent k + 1, and a step that is not stochastic takes the deterministic update (DDIM η = 0
or the flow ODE) so that a chain can mix SDE and ODE steps (an SDE window).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from mmrl.denoising.schedules import alphas_cumprod, ddim_timesteps, ddpm_betas, flow_sigmas, lcm_timesteps

# ------------------------------------------------------------------ diffusion (ε-prediction)


def predicted_x0(x: Tensor, eps: Tensor, alpha_bar, clip_denoised: float | None = None) -> tuple[Tensor, Tensor]:
    """x̂0 = (x − sqrt(1 − ᾱ)·ε̂) / sqrt(ᾱ), optionally clipped to ±``clip_denoised``; when
    clipped, ε̂ is recomputed from the clipped x̂0 so both stay consistent with x (as DPPO
    and diffusers do). Returns (x̂0, ε̂)."""
    sqrt_ab = _sqrt(alpha_bar)
    sqrt_1m = _sqrt(1 - alpha_bar)
    x0 = (x - sqrt_1m * eps) / sqrt_ab
    if clip_denoised is not None:
        x0 = x0.clamp(-clip_denoised, clip_denoised)
        eps = (x - sqrt_ab * x0) / sqrt_1m
    return x0, eps


def ddpm_step(x: Tensor, eps: Tensor, alpha_bar, alpha_bar_prev, clip_denoised: float | None = None) -> tuple[Tensor, Tensor]:
    """Ancestral DDPM step: the posterior q(x_prev | x_t, x̂0) (Ho et al. 2020, eq. 6–7),
    valid for strided timesteps with α = ᾱ_t/ᾱ_prev, β = 1 − α:

        mean = sqrt(ᾱ_prev)·β/(1 − ᾱ_t)·x̂0 + sqrt(α)·(1 − ᾱ_prev)/(1 − ᾱ_t)·x_t
        std  = sqrt((1 − ᾱ_prev)/(1 − ᾱ_t)·β)
    """
    x0, _ = predicted_x0(x, eps, alpha_bar, clip_denoised)
    alpha = alpha_bar / alpha_bar_prev
    beta = 1 - alpha
    mean = _sqrt(alpha_bar_prev) * beta / (1 - alpha_bar) * x0 + _sqrt(alpha) * (1 - alpha_bar_prev) / (1 - alpha_bar) * x
    std = _sqrt((1 - alpha_bar_prev) / (1 - alpha_bar) * beta)
    return mean, _like(std, x)


def ddim_step(x: Tensor, eps: Tensor, alpha_bar, alpha_bar_prev, eta: float, clip_denoised: float | None = None) -> tuple[Tensor, Tensor]:
    """DDIM step with stochasticity η (Song et al. 2021, eq. 12; DDPO's η = 1 sampler,
    Black et al. 2023):

        σ    = η·sqrt((1 − ᾱ_prev)/(1 − ᾱ_t))·sqrt(1 − ᾱ_t/ᾱ_prev)
        mean = sqrt(ᾱ_prev)·x̂0 + sqrt(1 − ᾱ_prev − σ²)·ε̂,    std = σ

    η = 0 is the deterministic DDIM (probability-flow) step; η = 1 has the DDPM posterior
    variance (and, given the true ε, the DDPM posterior mean).
    """
    x0, eps = predicted_x0(x, eps, alpha_bar, clip_denoised)
    std = eta * _sqrt((1 - alpha_bar_prev) / (1 - alpha_bar) * (1 - alpha_bar / alpha_bar_prev))
    direction = _sqrt(_clamp_min0(1 - alpha_bar_prev - std**2))
    mean = _sqrt(alpha_bar_prev) * x0 + direction * eps
    return mean, _like(std, x)


# ------------------------------------------------------------------ flow matching (v-prediction)


def lcm_boundary_scalings(timestep, timestep_scaling: float = 10.0, sigma_data: float = 0.5):
    """(c_skip, c_out) of a consistency model at training timestep t: with s = t·scaling,
    c_skip = σ_d² / (s² + σ_d²), c_out = s / sqrt(s² + σ_d²) (Luo et al. 2023, LCM)."""
    s = timestep * timestep_scaling
    return sigma_data**2 / (s**2 + sigma_data**2), s / (s**2 + sigma_data**2) ** 0.5


def lcm_step(x: Tensor, eps: Tensor, alpha_bar, alpha_bar_prev, c_skip, c_out, last, clip_denoised: float | None = None) -> tuple[Tensor, Tensor]:
    """One multistep consistency-sampler step, the Gaussian RLCM treats as the decision
    (Oertell et al. 2024, "RL for Consistency Models"): the consistency function
    f = c_skip·x + c_out·x̂0, then x_prev ~ N(sqrt(ᾱ_prev)·f, (1 − ᾱ_prev)·I); the ``last``
    step returns f itself (std 0)."""
    x0, _ = predicted_x0(x, eps, alpha_bar, clip_denoised)
    f = c_skip * x + c_out * x0
    mean = torch.where(last, f, _sqrt(alpha_bar_prev) * f)
    std = torch.where(last, torch.zeros_like(_like(alpha_bar_prev, x)), _like(_sqrt(1 - alpha_bar_prev), x))
    return mean, std


def flow_ode_step(x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor]:
    """Euler step of the flow ODE dx = v dσ: mean = x + v·(σ_next − σ), std = 0."""
    return x + v * (sigma_next - sigma), torch.zeros_like(x)


def flow_sde_step(x: Tensor, v: Tensor, sigma, sigma_next, noise_level: float, sigma_max=None, diffusion: str = "flow_grpo") -> tuple[Tensor, Tensor]:
    """Euler–Maruyama step of the marginal-preserving SDE of a rectified flow with noise
    level a (Flow-GRPO, Liu et al. 2025; πRL's Flow-SDE, Chen et al. 2025):

        σ_t  = a·sqrt(σ / (1 − σ)),   dt = σ_next − σ < 0
        mean = x + [v + σ_t²/(2σ)·(x + (1 − σ)·v)]·dt,    std = σ_t·sqrt(−dt)

    (x + (1 − σ)·v is the predicted noise, so the drift's correction is −σ_t²/2 times the
    score.) At σ = 1 the ratio σ/(1 − σ) is infinite; as Flow-GRPO, the denominator then
    uses ``sigma_max`` (the schedule's largest σ below 1) instead of σ.

    ``diffusion="constant"`` takes σ_t = a at every step, the SDE of DanceGRPO (Xue et al.
    2025; its η): std = a·sqrt(σ − σ_next), the same drift correction with that σ_t.
    """
    if diffusion == "constant":
        sigma_t = noise_level
    else:
        sigma_den = sigma if sigma_max is None else _where_one(sigma, sigma_max)
        sigma_t = noise_level * _sqrt(sigma / (1 - sigma_den))
    dt = sigma_next - sigma
    mean = x + (v + sigma_t**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    std = sigma_t * _sqrt(-dt)
    return mean, _like(std, x)


def flow_cps_step(x: Tensor, v: Tensor, sigma, sigma_next, noise_level: float) -> tuple[Tensor, Tensor]:
    """Coefficient-preserving sampling (CPS; Wang & Yu 2025, "Coefficients-Preserving
    Sampling for Reinforcement Learning with Flow Matching"): with x̂0 = x − σ·v and
    x̂1 = x + (1 − σ)·v (the predicted data and noise),

        std  = σ_next·sin(aπ/2)
        mean = (1 − σ_next)·x̂0 + sqrt(σ_next² − std²)·x̂1

    so the noise coefficient of x_next stays exactly σ_next. a = 0 is the ODE step; the
    last step (σ_next = 0) is always deterministic. Unlike the SDE's, its per-step noise does
    not shrink with the step size: with x̂0 = E[x0 | x] (even the exact one) every step
    loses a little of the data's variance, more as a grows (Gaussian data of std 0.30
    ends at ~0.28 for a = 0.3 and ~0.25 for a = 0.7, at 100 or 1000 steps).
    """
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    mean = (1 - sigma_next) * x0 + _sqrt(_clamp_min0(sigma_next**2 - std**2)) * x1
    return mean, _like(std, x)


def flow_noise_step(x: Tensor, v: Tensor, sigma, sigma_next, std: Tensor) -> tuple[Tensor, Tensor]:
    """Flow-Noise (πRL, Chen et al. 2025): the ODE step's mean x + v·(σ_next − σ) with a
    std predicted by a learned noise head, so every step has an exact Gaussian log-likelihood."""
    mean, _ = flow_ode_step(x, v, sigma, sigma_next)
    return mean, std.expand_as(x)


def learned_noise_std(raw: Tensor, std_range: tuple[float, float] | list[float]) -> Tensor:
    """Flow-Noise's std from a noise head's raw output, squashed log-uniformly into
    [lo, hi]: std = exp(log lo + (log hi − log lo)·sigmoid(raw)), so it stays positive and
    bounded whatever the head outputs."""
    log_lo, log_hi = math.log(std_range[0]), math.log(std_range[1])
    return torch.exp(log_lo + (log_hi - log_lo) * torch.sigmoid(raw))


# ------------------------------------------------------------------ schedules bound to K steps


class Transition(Protocol):
    """A K-step schedule: what the denoiser is told the time is, and each step's Gaussian."""

    name: str  # one of TRANSITIONS
    num_steps: int

    def model_time(self, step: Tensor) -> Tensor:
        """Time fed to the denoiser for step indices ``step`` (long [B]) → float [B]."""
        ...

    def mean_std(self, step: Tensor, x: Tensor, model_output, stochastic: Tensor, all_stochastic: bool | None = None, any_stochastic: bool | None = None) -> tuple[Tensor, Tensor]:
        """(mean, std) of x_next for steps ``step`` [B] from latents ``x`` [B, …]; rows with
        ``stochastic`` [B] false take the deterministic update (std 0). ``all_stochastic`` /
        ``any_stochastic``: what the caller knows on the host of the mask (None: read it from the
        mask, a device sync where the mask is on a GPU)."""
        ...


# The names of the transitions, shared by these classes and the ``transition`` option of
# :class:`mmrl.denoising.options.DenoisingOptions`.
DIFFUSION_TRANSITIONS = ("ddim", "ddpm", "lcm")
FLOW_TRANSITIONS = ("flow_sde", "flow_cps", "flow_noise", "flow_ode")
# flow_sde's diffusion coefficient σ_t: Flow-GRPO's a·sqrt(σ/(1 − σ)) or DanceGRPO's constant a
SDE_DIFFUSIONS = ("flow_grpo", "constant")
TRANSITIONS = DIFFUSION_TRANSITIONS + FLOW_TRANSITIONS


class DiffusionTransition:
    """K steps of an ε-prediction diffusion model over training timesteps ``timesteps``
    (noisiest first). ``name="ddim"``: :func:`ddim_step` with ``eta``; ``"ddpm"``:
    :func:`ddpm_step`; ``"lcm"``: :func:`lcm_step` over LCM's timesteps (a multistep
    consistency sampler, RLCM). Deterministic steps use DDIM with η = 0 (for lcm, with the
    consistency estimate as the clean sample). The step after the last
    timestep goes to ᾱ = ``final_alpha_cumprod`` (1.0: the clean sample; diffusers'
    ``DDIMScheduler`` with ``set_alpha_to_one`` false stops at ᾱ_0 = 1 − β_0).

    The denoiser is given the training timestep t_k (as a float) as its time.
    """

    def __init__(
        self,
        alphas_cumprod: Tensor,
        timesteps: Tensor,
        name: str = "ddim",
        eta: float = 1.0,
        clip_denoised: float | None = None,
        final_alpha_cumprod: float = 1.0,
        lcm_timestep_scaling: float = 10.0,
    ):
        if name not in DIFFUSION_TRANSITIONS:
            raise ValueError(f"name must be one of {DIFFUSION_TRANSITIONS}, got {name!r}")
        self.name, self.eta, self.clip_denoised = name, float(eta), clip_denoised
        self.timesteps = timesteps.long()
        self.num_steps = int(timesteps.shape[0])
        ab = alphas_cumprod.to(torch.float64)[self.timesteps.to(alphas_cumprod.device)]
        # Schedules are computed in float64 and used in float32, the latents' precision.
        self.alpha_bar = ab.float()
        self.alpha_bar_prev = torch.cat([ab[1:], ab.new_tensor([final_alpha_cumprod])]).float()
        c_skip, c_out = lcm_boundary_scalings(self.timesteps.to(torch.float64), lcm_timestep_scaling)
        self.c_skip, self.c_out = c_skip.float(), c_out.float()

    @classmethod
    def from_config(
        cls,
        num_train_timesteps: int,
        num_steps: int,
        beta_schedule: str = "cosine",
        name: str = "ddim",
        eta: float = 1.0,
        clip_denoised: float | None = None,
        spacing: str = "trailing",
        device=None,
        lcm_original_steps: int = 50,
        lcm_timestep_scaling: float = 10.0,
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        set_alpha_to_one: bool = True,
    ) -> "DiffusionTransition":
        ab = alphas_cumprod(ddpm_betas(num_train_timesteps, beta_schedule, beta_start, beta_end)).to(device)
        final_alpha_cumprod = 1.0 if set_alpha_to_one else float(ab[0])
        if name == "lcm":
            timesteps = lcm_timesteps(num_train_timesteps, num_steps, lcm_original_steps)
        else:
            timesteps = ddim_timesteps(num_train_timesteps, num_steps, spacing)
        return cls(ab, timesteps.to(device), name, eta, clip_denoised, final_alpha_cumprod, lcm_timestep_scaling)

    def model_time(self, step: Tensor) -> Tensor:
        return self.timesteps.to(step.device)[step].float()

    def mean_std(self, step: Tensor, x: Tensor, model_output: Tensor, stochastic: Tensor, all_stochastic: bool | None = None, any_stochastic: bool | None = None) -> tuple[Tensor, Tensor]:
        ab = _per_sample(self.alpha_bar.to(x.device)[step], x)
        ab_prev = _per_sample(self.alpha_bar_prev.to(x.device)[step], x)
        if self.name == "lcm":
            # deterministic steps: DDIM (η = 0) with the consistency estimate f as the clean sample
            c_skip, c_out = _per_sample(self.c_skip.to(x.device)[step], x), _per_sample(self.c_out.to(x.device)[step], x)
            last = _per_sample(step == self.num_steps - 1, x)
            mean, std = lcm_step(x, model_output, ab, ab_prev, c_skip, c_out, last, self.clip_denoised)
            f = torch.where(last, mean, mean / _sqrt(ab_prev))
            eps_f = (x - _sqrt(ab) * f) / _sqrt(1 - ab)
            det_mean = torch.where(last, f, _sqrt(ab_prev) * f + _sqrt(_clamp_min0(1 - ab_prev)) * eps_f)
            keep = _per_sample(stochastic, x)
            return torch.where(keep, mean, det_mean), torch.where(keep, std, torch.zeros_like(std))
        if self.name == "ddim":
            mean, std = ddim_step(x, model_output, ab, ab_prev, self.eta, self.clip_denoised)
        else:
            mean, std = ddpm_step(x, model_output, ab, ab_prev, self.clip_denoised)
        if _all(stochastic, all_stochastic):  # no row takes the deterministic update: skip computing it
            return mean, std
        det_mean, _ = ddim_step(x, model_output, ab, ab_prev, 0.0, self.clip_denoised)
        keep = _per_sample(stochastic, x)
        return torch.where(keep, mean, det_mean), torch.where(keep, std, torch.zeros_like(std))


class FlowTransition:
    """K Euler steps of a rectified flow over ``sigmas`` (σ_0 = 1 … σ_K = 0, [K + 1]).

    ``name``: ``"flow_sde"`` (:func:`flow_sde_step`, noise level a, ``diffusion``
    ``"flow_grpo"`` or ``"constant"``), ``"flow_cps"``
    (:func:`flow_cps_step`), ``"flow_noise"`` (:func:`flow_noise_step`), ``"flow_ode"``
    (every step deterministic). Deterministic steps take the ODE step. The denoiser is
    given σ_k as its time and returns v, or ``(v, std)`` from a learned noise head:
    ``flow_noise`` needs the std, the others ignore it.
    """

    def __init__(self, sigmas: Tensor, name: str = "flow_sde", noise_level: float = 0.7, diffusion: str = "flow_grpo"):
        if name not in FLOW_TRANSITIONS:
            raise ValueError(f"name must be one of {FLOW_TRANSITIONS}, got {name!r}")
        if diffusion not in SDE_DIFFUSIONS:
            raise ValueError(f"diffusion must be one of {SDE_DIFFUSIONS}, got {diffusion!r}")
        self.name, self.noise_level, self.diffusion = name, float(noise_level), diffusion
        self.sigmas = sigmas.float()
        self.num_steps = int(sigmas.shape[0]) - 1
        # Flow-GRPO's stand-in for σ = 1 in σ/(1 − σ): the largest σ below 1 (read on the CPU:
        # building a transition for a chain on a GPU costs no host sync)
        host = self.sigmas.detach().cpu()
        below_one = host[host < 1]
        self.sigma_max = float(below_one.max()) if below_one.numel() else 0.0

    @classmethod
    def from_config(
        cls, num_steps: int, name: str = "flow_sde", noise_level: float = 0.7, shift: float = 1.0, device=None, diffusion: str = "flow_grpo"
    ) -> "FlowTransition":
        sigmas = flow_sigmas(num_steps, shift)
        transition = cls(sigmas, name, noise_level, diffusion)  # σ_max read from the CPU copy
        transition.sigmas = transition.sigmas.to(device)
        return transition

    def model_time(self, step: Tensor) -> Tensor:
        return self.sigmas.to(step.device)[step]

    def step_table(self, n: int, device=None, shape: tuple[int, ...] | None = None) -> list[dict[str, Tensor]]:
        """What :meth:`mean_std_at` needs of each of the K steps when all N rows take the same
        step (a sampling chain), computed once for the chain with the operators and float32
        values :meth:`mean_std` computes per step: ``time`` [N] (the model time), the update's
        coefficients (0-dim) and, for flow_sde and flow_cps, ``std`` (the schedule's std) and
        ``zero_std`` (0-dim bool: whether some row's std is 0). ``std`` is [N], or with ``shape``
        (one latent's) the [N, *shape] view of it that :meth:`mean_std` makes per step (the same
        strides), which :meth:`mean_std_at` then hands back as it is."""
        sigmas = self.sigmas.to(device)
        sigma, sigma_next = sigmas[:-1], sigmas[1:]
        columns: dict[str, Tensor] = {"time": sigma, "dt": sigma_next - sigma}
        std = None
        if self.name == "flow_sde":
            if self.diffusion == "constant":
                sigma_t = self.noise_level
            else:
                sigma_t = self.noise_level * _sqrt(sigma / (1 - _where_one(sigma, self.sigma_max)))
            columns["drift"] = sigma_t**2 / (2 * sigma)
            columns["keep"] = 1 - sigma
            std = sigma_t * _sqrt(-columns["dt"])
        elif self.name == "flow_cps":
            std = sigma_next * math.sin(self.noise_level * math.pi / 2)
            columns.update(sigma=sigma, keep=1 - sigma, clean=1 - sigma_next, noisy=_sqrt(_clamp_min0(sigma_next**2 - std**2)))
        rows = {"time": columns.pop("time").unsqueeze(1).expand(-1, n).contiguous().unbind(0)}
        if std is not None:  # [N, 1] rows as mean_std's per-sample std (its layout, so entropies sum alike)
            table = std.to(sigmas.dtype).unsqueeze(1).expand(-1, n).contiguous()  # [K, N]
            rows["zero_std"] = (table <= 0).any(1).unbind(0)
            if shape is not None:  # row k viewed [N, 1, ...] and expanded, as mean_std_at would per step
                table = table.view(*table.shape, *([1] * len(shape))).expand(*table.shape, *shape)
            rows["std"] = table.unbind(0)
        scalars = {key: value.unbind(0) for key, value in columns.items()}
        return [{**{key: value[k] for key, value in rows.items()}, **{key: value[k] for key, value in scalars.items()}} for k in range(self.num_steps)]

    def mean_std_at(self, entry: dict[str, Tensor], x: Tensor, model_output, stochastic: bool) -> tuple[Tensor, Tensor | None]:
        """:meth:`mean_std` of a step that every row takes (``entry`` from :meth:`step_table`),
        stochastic for all rows or for none: the same values, the coefficients not recomputed.
        The std is None on a deterministic step."""
        v, learned_std = model_output if isinstance(model_output, tuple) else (model_output, None)
        if not stochastic or self.name == "flow_ode":
            return x + v * entry["dt"], None
        per_sample = (x.shape[0], *([1] * (x.ndim - 1)))
        if self.name == "flow_sde":
            mean = x + (v + entry["drift"] * (x + entry["keep"] * v)) * entry["dt"]
        elif self.name == "flow_cps":
            mean = entry["clean"] * (x - entry["sigma"] * v) + entry["noisy"] * (x + entry["keep"] * v)
        else:
            if learned_std is None:
                raise ValueError("flow_noise needs a denoiser that returns (v, std) from a learned noise head")
            return x + v * entry["dt"], learned_std.expand_as(x)
        std = entry["std"]
        return mean, std if std.shape == x.shape else std.view(per_sample).expand_as(x)

    def mean_std(self, step: Tensor, x: Tensor, model_output, stochastic: Tensor, all_stochastic: bool | None = None, any_stochastic: bool | None = None) -> tuple[Tensor, Tensor]:
        v, learned_std = model_output if isinstance(model_output, tuple) else (model_output, None)
        sigmas = self.sigmas.to(x.device)
        sigma, sigma_next = _per_sample(sigmas[step], x), _per_sample(sigmas[step + 1], x)
        if self.name == "flow_ode":
            return flow_ode_step(x, v, sigma, sigma_next)
        if self.name == "flow_sde":
            mean, std = flow_sde_step(x, v, sigma, sigma_next, self.noise_level, self.sigma_max, self.diffusion)
        elif self.name == "flow_cps":
            mean, std = flow_cps_step(x, v, sigma, sigma_next, self.noise_level)
        else:
            if learned_std is None:
                raise ValueError("flow_noise needs a denoiser that returns (v, std) from a learned noise head")
            mean, std = flow_noise_step(x, v, sigma, sigma_next, learned_std)
        if _all(stochastic, all_stochastic):  # no row takes the ODE step: skip computing it
            return mean, std
        det_mean, zero = flow_ode_step(x, v, sigma, sigma_next)
        keep = _per_sample(stochastic, x)
        return torch.where(keep, mean, det_mean), torch.where(keep, std, zero)


# ------------------------------------------------------------------ helpers


def _all(stochastic: Tensor, hint: bool | None) -> bool:
    """Whether every row is stochastic: the caller's host-side ``hint`` where it gives one (no
    device sync), else read from the mask."""
    return bool(stochastic.all()) if hint is None else hint


def _per_sample(values: Tensor, x: Tensor) -> Tensor:
    """[B] → [B, 1, …] broadcasting against x [B, …]."""
    return values.reshape(values.shape[0], *([1] * (x.ndim - 1)))


def _sqrt(value):
    return value.sqrt() if isinstance(value, Tensor) else math.sqrt(value)


def _clamp_min0(value):
    return value.clamp(min=0) if isinstance(value, Tensor) else max(value, 0.0)


def _where_one(sigma, replacement):
    if isinstance(sigma, Tensor):
        return torch.where(sigma >= 1, torch.as_tensor(replacement, dtype=sigma.dtype, device=sigma.device), sigma)
    return replacement if sigma >= 1 else sigma


def _like(std, x: Tensor) -> Tensor:
    """std as a tensor broadcast to x's shape."""
    std = std if isinstance(std, Tensor) else x.new_tensor(float(std))
    return std.to(x.dtype).expand_as(x)
