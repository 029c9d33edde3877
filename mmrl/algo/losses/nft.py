"""``nft``: DiffusionNFT (Zheng et al., 2025, arXiv 2509.16117), a supervised, negative-aware
loss on the final samples of a flow policy: no log-probs, any ODE sampler.

With r ∈ [0, 1] the optimality probability of a sample (from its group-normalized reward),
the implicit positive and negative policies are π⁺ ∝ r·π_old and π⁻ ∝ (1 − r)·π_old, whose
velocities are

    v⁺ = β·v_θ + (1 − β)·v_old,        v⁻ = (1 + β)·v_old − β·v_θ,

and the loss fits v⁺ to the sample where it was good and v⁻ where it was bad, in x0 space:
at a noise level σ of the sampler's schedule, x_σ = (1 − σ)·x0 + σ·ε with fresh noise,
x̂0^± = x_σ − σ·v^±, and

    L = C · mean over samples and levels of [ r·‖x̂0⁺ − x0‖²/w⁺ + (1 − r)·‖x̂0⁻ − x0‖²/w⁻ ] / β
        + λ_ref · mean ‖v_θ − v_ref‖²,

with ‖·‖² the mean over a latent's elements, the adaptive weights w^± = sg(mean|x̂0^± − x0|)
floored at 1e-5, and C = ``adv_clip`` (the reference multiplies by its advantage bound).
At θ = θ_old and r = ½ the two terms' gradients cancel exactly; r > ½ moves v_θ toward the
velocity that reaches the sample. The old policy is an EMA of the trained weights, updated
after each update with decay d(step) = 0 before ``old_delay`` steps, then
min(``old_rate``·(step − ``old_delay``), ``old_max``): the reference's schedule 1 is
rate 0.001, max 0.5, delay 0; its schedule 2 (OCR) rate 0.0075, max 0.999, delay 75.

Where mmrl follows the reference and where not:
- r = clamp(clip(A, ±C)/C/2 + ½, 0, 1) from the run's advantage; the reference's advantage is
  (R − group mean)/(batch std + 1e-4): ``algo.advantage: {type: grpo, std: batch, eps: 1e-4}``.
- The levels are the sampler's first int(``timestep_fraction``·K) σ's (0.99 of 10: σ_0 … σ_8),
  all of them in one step (the reference accumulates the same gradient over them one by one).
- The samples come from the policy's ODE (``policy.denoising.transition: flow_ode``) at the
  current weights; the reference samples with its old (EMA) adapter. At the start of either
  schedule (d ≈ 0) the two coincide.
- Flow VLAs (RLinf's "π-StepNFT" for π0): one row per env decision, the action chunk its
  chain reached with the ODE, r from that decision's advantage (a step-level group
  advantage or GAE). mmrl follows RLinf's ODE branch (x0 target space, adaptive weights,
  the MSE form); not its SDE-consistent ``xnext`` target, its 1/σ² weights, its DPO-form
  loss or its bound on ‖Δv‖/‖v_old‖. RLinf's embodied config also drops groups whose mean
  reward is outside [0.1, 0.9]: ``algo.filters: [{type: accuracy_band, lo: 0.1, hi: 0.9}]``.
- The fresh noise of a decision is drawn from a generator seeded by (run seed, step, global
  group index), so N processes train as one process does, and a resumed run as an unbroken
  one (the EMA is in the checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl import registry
from mmrl.algo.losses import Loss, LossConfig, LossOutput, Requirement, Targets
from mmrl.config import option
from mmrl.core.policy import overrides
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError

_NFT_NOISE_STREAM = 1 << 42  # group index offset reserved for the fresh noise of the loss


@dataclass
class NFTConfig(LossConfig):
    type: str = option("nft", "the loss module (mmrl list losses)")
    beta: float = option(1.0, "β: the step between the implicit policies (smaller trains faster and less stably; the reference uses 1, 0.1 for OCR and several rewards)", gt=0)
    adv_clip: float = option(5.0, "C: advantages are clipped to ±C and mapped to r = A/C/2 + 1/2; the loss is scaled by C", gt=0)
    timestep_fraction: float = option(0.99, "train on the sampler's first int(fraction x steps) noise levels, each sample at all of them", gt=0, le=1)
    ref_coef: float = option(1e-4, "λ_ref: weight of mean ||v_θ − v_ref||² to the reference (the initial weights, or the policy with its adapters off)", ge=0)
    old_rate: float = option(0.001, "EMA of the old policy: decay grows by this per step after the delay", ge=0)
    old_max: float = option(0.5, "EMA of the old policy: the largest decay", ge=0, lt=1)
    old_delay: int = option(0, "EMA of the old policy: steps of decay 0 (the old policy is the trained one) at the start", ge=0)


def optimality(adv: Tensor, clip: float) -> Tensor:
    """r = clamp(clip(A, ±C)/C/2 + 1/2, 0, 1)."""
    return (adv.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)


def ema_decay(step: int, rate: float, maximum: float, delay: int) -> float:
    """The old policy's decay after update ``step`` (0-based)."""
    return 0.0 if step < delay else min(rate * (step - delay), maximum)


def nft_terms(v: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, sigma: Tensor, r: Tensor, beta: float) -> Tensor:
    """Per row of ``v`` [M, ...]: r·‖x̂0⁺ − x0‖²/w⁺ + (1 − r)·‖x̂0⁻ − x0‖²/w⁻, over β (module
    docstring); ``sigma`` and ``r`` are [M]."""
    dims = tuple(range(1, v.dim()))
    s = sigma.reshape(-1, *[1] * (v.dim() - 1)).to(v)
    positive = beta * v + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v
    x0_pos, x0_neg = x_t - s * positive, x_t - s * negative
    with torch.no_grad():  # the adaptive weights, in double as the reference computes them
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dims, keepdim=True).clamp_min(1e-5).to(v)
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dims, keepdim=True).clamp_min(1e-5).to(v)
    pos = ((x0_pos - x0) ** 2 / w_pos).mean(dims)
    neg = ((x0_neg - x0) ** 2 / w_neg).mean(dims)
    return (r * pos + (1 - r) * neg) / beta


@registry.LOSSES.register("nft", NFTConfig, needs_log_probs=False)
class NFT(Loss):
    """DiffusionNFT: the negative-aware fit of final samples (no log-probs, any ODE sampler)."""

    requires = (
        Requirement("policy.denoising.transition", "flow_ode", "it samples with the ODE and keeps no log-probs"),
        Requirement("policy.denoising.logp_granularity", "chain", "it trains one loss per sample, its chain"),
        Requirement("algo.kl.coef", 0.0, "it has no log-probs for a KL term; its pull toward the reference is algo.loss.ref_coef"),
    )

    def __init__(self, algo, options: NFTConfig, policy, *, reference=None, seed: int = 0, **_):
        denoising = getattr(getattr(policy, "config", None), "denoising", None)
        if not overrides(policy, "flow_sigmas") or denoising is None:
            raise ConfigError("algo.loss.type", "nft", f"needs a flow policy with a denoising chain (image_diffusion, video_diffusion); {type(policy).__name__} has none")
        self.options, self.policy, self.reference, self.seed = options, policy, reference, seed
        sigmas = policy.flow_sigmas()
        count = int(options.timestep_fraction * (sigmas.numel() - 1))
        if count < 1:
            raise ConfigError("algo.loss.timestep_fraction", options.timestep_fraction, f"leaves none of the sampler's {sigmas.numel() - 1} steps: raise it")
        self.sigmas = sigmas[:count]
        # the old policy: an EMA of the trained parameters, kept beside them (a LoRA adapter's only)
        self.old = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        self.step, self.epoch = 0, 0

    @classmethod
    def wants_reference(cls, algo, options) -> bool:
        return options.ref_coef > 0

    def activation_bytes(self, replay) -> float | None:
        """Per sample: one denoiser evaluation's widest feature map at each trained level
        (the pieces of ``algo.micro_batches: null``)."""
        per_level = self.policy.step_activation_bytes()
        return None if per_level is None else float(per_level * len(self.sigmas))

    def begin_update(self, step: int) -> None:
        self.step, self.epoch = step, 0

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _noise(self, index: Tensor | None, x0: Tensor, per_sample: int) -> Tensor:
        """Fresh noise [L·M, ...] (level-major) for the levels of each of the M final samples
        (``per_sample`` consecutive rows per rollout sample: its decisions), drawn from (run
        seed, step, epoch, the sample's place in the step's batch, the decision): the same for
        a decision whichever process or piece holds it. Rows without a place (the spare) get
        zeros."""
        noise = torch.zeros(len(self.sigmas), *x0.shape, dtype=x0.dtype)
        for sample, i in enumerate(index.tolist() if index is not None else []):
            for t in range(per_sample):
                key = _NFT_NOISE_STREAM + (self.epoch << 36) + (int(i) << 16) + t
                gen = torch.Generator().manual_seed(group_seed(self.seed, self.step, key))
                noise[:, sample * per_sample + t] = torch.randn(len(self.sigmas), *x0.shape[1:], generator=gen, dtype=x0.dtype)
        return noise.flatten(0, 1).to(x0.device)

    @torch.no_grad()
    def _old_velocity(self, replay, x_t, sigma, rows) -> Tensor:
        return torch.func.functional_call(self.policy, self.old, (replay,), {"mode": "velocity", "x": x_t, "sigma": sigma, "rows": rows})

    def __call__(self, model, batch, targets: Targets, norm: dict, at_sampling_weights: bool = False) -> LossOutput:
        o = self.options
        replay = batch.replay
        x0 = self.policy.final_samples(replay).detach()  # [M, ...]: a row per chain (per decision)
        n, levels = x0.shape[0], len(self.sigmas)
        per_sample = n // batch.batch_size
        sigma = self.sigmas.to(x0.device).repeat_interleave(n)  # [L·N], level-major
        rows = torch.arange(n, device=x0.device).repeat(levels)
        x0_rep = x0.repeat(levels, *[1] * (x0.dim() - 1))
        s = sigma.reshape(-1, *[1] * (x0.dim() - 1)).to(x0)
        x_t = (1 - s) * x0_rep + s * self._noise(targets.index, x0, per_sample)
        v = model(replay, mode="velocity", x=x_t, sigma=sigma, rows=rows)
        v_old = self._old_velocity(replay, x_t, sigma, rows)
        # per decision: a sequence advantage [B, 1] broadcasts over a sample's decisions
        adv = targets.adv.expand(batch.batch_size, per_sample) if targets.adv.shape[1] == 1 else targets.adv
        r = optimality(adv.reshape(n).to(v), o.adv_clip).repeat(levels)
        per_row = nft_terms(v, v_old, x_t, x0_rep, sigma, r, o.beta) * o.adv_clip
        valid = batch.mask.reshape(n).to(v).repeat(levels)  # padding and a spare sample's rows count 0
        policy_loss = (per_row * valid).sum() / levels / norm["num_tokens"]
        loss, terms = policy_loss, {"loss/policy": policy_loss.detach()}
        if self.reference is not None and o.ref_coef > 0:
            with torch.no_grad():
                v_ref = self.reference.velocity(replay, x_t, sigma, rows)
            dims = tuple(range(1, v.dim()))
            ref = (((v - v_ref) ** 2).mean(dims) * valid).sum() / levels / norm["num_tokens"]
            loss = loss + o.ref_coef * ref
            terms["nft/ref_mse"] = ref.detach()
        with torch.no_grad():
            drift = ((v - v_old) ** 2).mean(tuple(range(1, v.dim()))).reshape(levels, n).mean(0)
        stats = {"nft/r": r.reshape(levels, n)[0].reshape(batch.batch_size, per_sample), "nft/velocity_drift": drift.reshape(batch.batch_size, per_sample)}
        return LossOutput(loss, terms, stats)

    @torch.no_grad()
    def end_update(self, step: int) -> dict[str, float]:
        """θ_old ← d·θ_old + (1 − d)·θ."""
        d = ema_decay(step, self.options.old_rate, self.options.old_max, self.options.old_delay)
        params = dict(self.policy.named_parameters())
        for name, old in self.old.items():
            old.mul_(d).add_(params[name].detach().to(old), alpha=1 - d)
        return {"nft/old_decay": d}

    def state_dict(self) -> dict:
        return {"old": {n: t.detach().cpu() for n, t in self.old.items()}}

    def load_state_dict(self, state: dict) -> None:
        for name, t in state["old"].items():
            self.old[name].copy_(t)
