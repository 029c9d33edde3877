"""``ActionChunkPolicy``: the base of the denoising policies over robot action chunks
(``diffusion_policy``, ``flow_vla``).

Such a policy denoises a chunk x ∈ R^{C×A} (``config.action_chunk`` actions of the env's
``action_dim``) in the normalized action space: env = center + half_range·x where the
env's bounds are finite (x = ±1 are the bounds), env = x on unbounded dimensions. The
action sent to the env is the chain's final latent clipped to [−1, 1]; the log-probs are
those of the unclipped chain. ``deterministic=True`` runs the chain from x = 0 without
noise, so the action depends on the observation only.

A subclass says what of an observation it keeps (:meth:`~ActionChunkPolicy.observation`,
whose keys ``obs_keys`` lists), what every denoising step of a chunk reuses
(:meth:`~ActionChunkPolicy.conditioning`), its denoiser given that (``_denoiser``), and
its supervised error per action (:meth:`~ActionChunkPolicy.sft_errors`). This base
samples (the replay: each observation tensor and the chain, with a call dim 1),
recomputes a replay's chains (``chain_denoiser``), behaviour-clones (``sft_loss``) and
turns a replay into a ``sft_loss`` batch (``imitation_batch``).

``compile_denoiser`` (a subclass's config field; off by default): sampling without grad runs
the network of a denoising step through ``torch.compile`` (:meth:`compiled_step`), which a
subclass's ``_denoiser(cond, compiled=True)`` calls. ``log_prob``'s recompute and the update
run the eager network at the stored latents, so the trainer's deferred old log-probs (its own
eager pass) give ratios of exactly 1; the sampling pass's own log-probs round otherwise. A
subclass may compile what sampling conditions on too (:meth:`_sampling_conditioning`: the flow
VLA's ``compile_prefix``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from mmrl.core.policy import Sample
from mmrl.denoising import DenoisingPolicy
from mmrl.denoising.chain import Denoiser


class CompiledSteps(dict):
    """A policy's compiled step networks, keyed by (name, device type): a cache, not state (a
    copy or a pickle of the policy starts empty and compiles its own)."""

    def __deepcopy__(self, memo):
        return CompiledSteps()

    def __reduce__(self):
        return (CompiledSteps, ())


def compiled_callable(cache: dict, name: str, fn: Callable, device: torch.device) -> Callable:
    """``fn`` (a module or function of tensors) under ``torch.compile(dynamic=False,
    fullgraph=False)``, kept in ``cache`` under (``name``, device type) and compiled once per
    batch shape: mode ``reduce-overhead`` (CUDA graphs) on CUDA, the default mode elsewhere. On
    CUDA each call starts a new graph step and returns copies of the outputs, which the next
    replay would overwrite."""
    key = (name, device.type)
    step = cache.get(key)
    if step is None:
        cuda = device.type == "cuda"
        compiled = torch.compile(fn, dynamic=False, fullgraph=False, mode="reduce-overhead" if cuda else None)
        if cuda:

            def step(*args, **kwargs):
                torch.compiler.cudagraph_mark_step_begin()
                return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, compiled(*args, **kwargs))

        else:
            step = compiled
        cache[key] = step
    return step


class ActionChunkPolicy(DenoisingPolicy):
    """A denoising policy whose samples are action chunks [N, C, A] in env units."""

    samples_final_only = True  # sample(..., final_only=True): the final chunk's latent, no chain

    obs_keys: tuple[str, ...] = ()  # the keys :meth:`observation` may return (what replay stores)

    def __init__(self, config: Any, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        self.action_dim = int(spec["action_dim"])
        self.chunk = config.action_chunk
        low = torch.as_tensor(spec.get("action_low", [-math.inf] * self.action_dim), dtype=torch.float32)
        high = torch.as_tensor(spec.get("action_high", [math.inf] * self.action_dim), dtype=torch.float32)
        finite = torch.isfinite(low) & torch.isfinite(high)
        # Derived from the spec and config, not learned: kept out of the saved weights.
        self.register_buffer("action_center", torch.where(finite, (low + high) / 2, 0.0), persistent=False)
        self.register_buffer("action_half_range", torch.where(finite, (high - low) / 2, 1.0), persistent=False)
        self._compiled_steps = CompiledSteps()

    # ------------------------------------------------------------------ what a subclass says

    def observation(self, inputs) -> dict[str, Tensor]:
        """The policy's observation tensors [N, …] for a batch of inputs (what replay stores,
        without the call dim)."""
        raise NotImplementedError

    def conditioning(self, obs: dict[str, Tensor]) -> Any:
        """What every denoising step of a chunk reuses, computed once per chunk from ``obs``."""
        raise NotImplementedError

    def _denoiser(self, cond: Any) -> Denoiser:
        """The denoiser ``(x, t, rows) -> output`` of the chunks whose conditioning is ``cond``;
        a subclass with ``compile_denoiser`` also takes ``compiled=True`` (:meth:`compiled_step`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ compiled sampling

    @property
    def compiles_denoiser(self) -> bool:
        """Whether no-grad sampling runs the compiled step network (``config.compile_denoiser``)."""
        return bool(getattr(self.config, "compile_denoiser", False))

    def _sampling_conditioning(self, obs: dict[str, Tensor]) -> Any:
        """The conditioning :meth:`sample` computes (no grad): :meth:`conditioning`, unless a
        subclass compiles part of it for sampling."""
        return self.conditioning(obs)

    def _sampling_denoiser(self, cond: Any) -> Denoiser:
        """The denoiser of :meth:`sample` and :meth:`sample_from_noise` (no grad): the compiled
        one under ``compile_denoiser``, else the eager one that ``log_prob`` runs."""
        return self._denoiser(cond, compiled=True) if self.compiles_denoiser else self._denoiser(cond)

    def compiled_step(self, name: str, module: nn.Module) -> Callable:
        """``module`` (a network that sampling runs: a denoising step's, a subclass's prefix pass)
        compiled for sampling, once per batch shape (:func:`compiled_callable`)."""
        return compiled_callable(self._compiled_steps, name, module, self.action_center.device)

    def sft_errors(self, cond: Any, x0: Tensor) -> Tensor:
        """The supervised error [B, C] of each action of the expert chunks ``x0`` [B, C, A]
        (normalized) given their conditioning ``cond``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ actions

    def normalize_actions(self, actions: Tensor) -> Tensor:
        """Env-unit actions [..., A] → normalized actions (not clipped)."""
        return (actions.to(self.action_center.device, torch.float32) - self.action_center) / self.action_half_range

    def env_actions(self, latents: Tensor) -> Tensor:
        """Final latents [..., C, A] → the env-unit chunks they execute (clipped to [−1, 1] first)."""
        return self.action_center + self.action_half_range * latents.clamp(-1.0, 1.0)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one chain's latent: [C, A] here; a policy that denoises more than the env
        executes (a checkpoint's padded action dims) says so."""
        return (self.chunk, self.action_dim)

    def actions_to_latents(self, actions: Tensor) -> Tensor:
        """Expert chunks [B, C, A] in env units → the latents ``sft_loss`` trains towards
        (normalized and clipped to [−1, 1])."""
        return self.normalize_actions(actions).clamp(-1.0, 1.0)

    def latents_to_actions(self, latents: Tensor) -> Tensor:
        """Final latents → the env-unit chunks ``imitation_batch`` hands to ``sft_loss``."""
        return self.env_actions(latents)

    # ------------------------------------------------------------------ protocol

    def chain_denoiser(self, replay: dict):
        """The denoiser conditioned on the replayed observations: one conditioning per chunk (call)."""
        obs = {key: replay[key].flatten(0, 1) for key in self.obs_keys if key in replay}
        return self._denoiser(self.conditioning(obs))

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False, final_only: bool = False) -> Sample:
        """Actions [N, C, A] (env units); logp / entropy per decision of the chunk's chain:
        [N, 1] with ``logp_granularity: chain`` (the chain's joint log-likelihood and the
        summed entropy of its stochastic steps), [N, W] with ``step`` (one per stored
        denoising step, with a mask of the stochastic ones)."""
        obs = self.observation(inputs)
        cond = self._sampling_conditioning(obs)
        device = self.action_center.device
        shape = (next(iter(obs.values())).shape[0], *self.latent_shape)
        x_init = torch.zeros(shape, device=device) if deterministic else torch.randn(shape, generator=generator).to(device)
        out = self.sample_chain(self._sampling_denoiser(cond), x_init, generator, deterministic, final_only=final_only)
        replay = {key: value.unsqueeze(1) for key, value in obs.items()}
        replay["chain"] = {key: value.unsqueeze(1) for key, value in out.chain.items()}
        return Sample(output=self.env_actions(out.final), logp=out.logp, replay=replay, mask=out.mask, entropy=out.entropy, logp_deferred=out.deferred)

    # ------------------------------------------------------------------ acting from a given noise (DSRL)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        """The initial noise of one chunk's chain: its latent's shape."""
        return tuple(self.latent_shape)

    def noise_conditioning(self, obs: dict[str, Tensor]) -> tuple[Any, Tensor]:
        """:meth:`conditioning` of ``obs`` and, from the same pass, the observations' features
        [N, noise_feature_dim] that ``sample_from_noise`` hands a noise-choosing function."""
        raise NotImplementedError(f"{type(self).__name__} gives no observation features (noise_conditioning)")

    @torch.no_grad()
    def sample_from_noise(self, inputs, noise) -> Sample:
        """The chunk the deterministic chain (the ODE of a flow, DDIM with η = 0) denoises from
        the given initial noise [N, *noise_shape] (or ``noise(features)``), in env units; the
        replay of ``final_only`` sampling (:meth:`PolicyModule.sample_from_noise`)."""
        obs = self.observation(inputs)
        cond, features = self.noise_conditioning(obs)
        x_init = (noise(features) if callable(noise) else noise).to(self.action_center.device, torch.float32)
        n = x_init.shape[0]
        if tuple(x_init.shape[1:]) != self.noise_shape:
            raise ValueError(f"expected initial noise [N, {', '.join(map(str, self.noise_shape))}], got {list(x_init.shape)}")
        out = self.sample_chain(self._sampling_denoiser(cond), x_init, deterministic=True, final_only=True)
        replay = {key: value.unsqueeze(1) for key, value in obs.items()}
        replay["chain"] = {key: value.unsqueeze(1) for key, value in out.chain.items()}
        zeros = torch.zeros(n, 1, device=x_init.device)
        return Sample(output=self.env_actions(out.final), logp=zeros, replay=replay, entropy=zeros.clone(), info={"features": features, "noise": x_init})

    def sft_loss(self, batch: dict) -> Tensor:
        """Behaviour cloning on expert chunks ``batch["actions"]`` [B, C, A] (env units;
        :meth:`actions_to_latents`): :meth:`sft_errors` averaged over the valid
        actions of ``batch["action_mask"]`` [B, C] (all valid if absent)."""
        cond = self.conditioning(self.observation(batch))
        x0 = self.actions_to_latents(batch["actions"])
        if tuple(x0.shape[1:]) != tuple(self.latent_shape):
            raise ValueError(f"expected actions [B, {self.chunk}, {self.action_dim}], got {list(batch['actions'].shape)}")
        mask = batch.get("action_mask")
        mask = torch.ones(x0.shape[0], self.chunk, device=x0.device) if mask is None else mask.to(x0.device, torch.float32)
        return (self.sft_errors(cond, x0) * mask).sum() / mask.sum().clamp(min=1.0)

    def imitation_batch(self, replay: dict) -> dict:
        """The N·T replayed decisions as a ``sft_loss`` batch: each one's observations and
        the chunk its chain executed (:meth:`latents_to_actions` of the final latent), so a chunk
        is imitated with the supervised loss rather than through its chain's likelihood."""
        chain = replay["chain"]
        flat = {key: self.per_decision(replay[key], chain) for key in self.obs_keys if key in replay}
        final = self.per_decision(chain["latents"][:, :, -1], chain).to(self.action_center.device)
        flat["actions"] = self.latents_to_actions(final)
        return flat
