"""What the LeRobot flow-matching policies (``smolvla``, ``pi0``, ``pi05``) share.

Each is an :class:`~mmrl.policies.vla.action_chunk.ActionChunkPolicy` over a LeRobot policy
directory (:mod:`mmrl.policies.vla.lerobot_format`). A family builds its own model and says
what differs (:class:`LeRobotFlowPolicy`'s hooks); this base does the rest the same way for
all of them:

- the processors: normalizer and unnormalizer statistics, tokenizer settings, renames;
- the checkpoint's weights loaded under their own names, and written back by
  :meth:`LeRobotFlowPolicy.lerobot_state_dict` (LoRA merged) and :func:`save_lerobot_policy`;
- the chain: the checkpoint's padded chunk [chunk_size, max_action_dim] as the latent,
  LeRobot's Euler grid (:class:`EulerGridTransition`), the first ``n_action_steps`` actions
  of the un-normalized chunk executed;
- replays of uint8 frames, the raw state and the prompt's tokens; the prefix computed once per
  chunk (``conditioning``); LeRobot's flow-matching SFT loss; a value head on the pooled prefix;
- LoRA on the expert and/or the VLM with the adapter-free policy as the KL reference.
- pieces of the models themselves: the prefix-LM attention mask and the sine-cosine time
  features.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import FlowTransition, learned_noise_std
from mmrl.errors import ConfigError, MissingExtraError
from mmrl.policies.lora import adapters_disabled
from mmrl.policies.vla.action_chunk import ActionChunkPolicy
from mmrl.policies.vla.backbone import pooled_prefix_state
from mmrl.policies.vla.lerobot_format import LeRobotPolicyDir, write_lerobot_policy

STATE_KEY = "observation.state"
ACTION_KEY = "action"


# ------------------------------------------------------------------ pieces of the LeRobot models


def attention_mask_2d(pad: Tensor, blocks: Tensor) -> Tensor:
    """[B, L, L] bool: token i attends token j iff both are real (``pad``) and j's block
    index (the cumulative sum of ``blocks``, 1 where a new causal block starts) is ≤ i's
    (big_vision's prefix-LM masks)."""
    block = torch.cumsum(blocks, dim=1)
    return (block[:, None, :] <= block[:, :, None]) & (pad[:, None, :] & pad[:, :, None])


def time_features(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """Sine-cosine features [B, dim] of times t [B] with periods from ``min_period`` to
    ``max_period`` (geometric), computed in float64."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


# ------------------------------------------------------------------ the chain and the policy


class EulerGridTransition(FlowTransition):
    """LeRobot's K-step Euler grid: t_k = 1 + k·dt (float32 of the double), dt = −1/K,
    deterministic update x + dt·v; stochastic steps are the flow transition's on that grid."""

    step_table = None  # its deterministic update is its own: every step goes through mean_std

    def __init__(self, num_steps: int, name: str, noise_level: float, diffusion: str, device=None):
        self.dt = -1.0 / num_steps
        times = [1.0 + k * self.dt for k in range(num_steps)] + [0.0]
        super().__init__(torch.tensor(times, dtype=torch.float32), name, noise_level, diffusion)  # σ_max read on the CPU
        self.sigmas = self.sigmas.to(device)

    def mean_std(self, step: Tensor, x: Tensor, model_output, stochastic: Tensor, all_stochastic: bool | None = None, any_stochastic: bool | None = None) -> tuple[Tensor, Tensor]:
        v = model_output[0] if isinstance(model_output, tuple) else model_output
        euler = x + self.dt * v
        if self.name == "flow_ode" or not (bool(stochastic.any()) if any_stochastic is None else any_stochastic):
            return euler, torch.zeros_like(x)
        mean, std = super().mean_std(step, x, model_output, torch.ones_like(stochastic), all_stochastic=True)
        if all_stochastic:
            return mean, std
        keep = stochastic.view(-1, *([1] * (x.ndim - 1)))
        return torch.where(keep, mean, euler), torch.where(keep, std, torch.zeros_like(std))


class LeRobotFlowPolicy(ActionChunkPolicy):
    """A LeRobot flow-matching policy directory as an mmrl policy. A subclass's ``__init__``
    sets ``files``, ``arch`` (``chunk_size``, ``max_action_dim``, ``max_state_dim``),
    ``n_action_steps``, ``_denoising``, the processors (:meth:`_read_processors`),
    ``image_keys``, ``cameras``, ``state_dim``, ``lerobot_action_dim``, ``tokenizer``,
    ``model``, ``lerobot_keys`` and ``lora``; it says what differs through
    :meth:`prompts`, :meth:`lerobot_prefix`, ``_denoiser``, :attr:`prefix_width` and
    :meth:`_lora_targets`."""

    obs_keys = ("image", "state", "instruction_ids", "instruction_mask")

    # ------------------------------------------------------------------ what a family says

    def prompts(self, tasks: list[str], state: Tensor | None) -> list[str]:
        """The texts the pre-processor tokenizes for these tasks (and the raw state [N, D])."""
        raise NotImplementedError

    def lerobot_prefix(self, images: dict[str, Tensor], state: Tensor, ids: Tensor, id_mask: Tensor) -> dict:
        """The chunk conditioning from LeRobot's raw inputs (images {feature key: float
        [N, 3, H, W] in [0, 1]}, the raw state [N, D], token ids and mask [N, L]); holds the
        prefix's ``pad`` mask and ``hidden`` states besides what the denoiser reads."""
        raise NotImplementedError

    @property
    def prefix_width(self) -> int:
        """Width of the VLM's prefix states (what :meth:`value_features` pools)."""
        raise NotImplementedError

    def _lora_targets(self) -> dict[str, list[nn.Module]]:
        """The transformers ``lora_on`` names: {"expert": [...], "vlm": [...]}."""
        raise NotImplementedError

    # ------------------------------------------------------------------ construction pieces

    def _read_processors(self, files: LeRobotPolicyDir, tokenizer_max_length: int) -> None:
        """The pre/post-processors' normalization statistics, tokenizer settings and renames."""
        self.normalizer = files.normalizer("preprocessor", "normalizer_processor")
        self.unnormalizer = files.normalizer("postprocessor", "unnormalizer_processor")
        tokenizer_step = files.step("preprocessor", "tokenizer_processor") or {}
        self.tokenizer_settings = {"max_length": tokenizer_max_length, "padding": "max_length", "padding_side": "right", "truncation": True, **tokenizer_step.get("config", {})}
        self.rename_map = dict((files.step("preprocessor", "rename_observations_processor") or {}).get("config", {}).get("rename_map", {}))

    def _add_noise_head(self) -> None:
        """Flow-Noise (πRL): a noise head on the expert's action-token states, std =
        learned_noise_std(head(h)) in ``denoising.noise_std_range``; mmrl's own (not in the
        checkpoint, not exported: LeRobot's inference is the ODE). None for other transitions."""
        self.noise_head = None
        if self.config.denoising.transition != "flow_noise":
            return
        out = self.model.action_out_proj
        head = nn.Sequential(nn.Linear(out.in_features, out.in_features), nn.Tanh(), nn.Linear(out.in_features, out.out_features))
        self.noise_head = head.to(out.weight.device)

    def _velocity(self, velocity) -> "Tensor | tuple[Tensor, Tensor]":
        """``velocity(with_hidden)`` of the expert → v, or (v, std) with the noise head."""
        if self.noise_head is None:
            return velocity(False)
        v, hidden = velocity(True)
        return v, learned_noise_std(self.noise_head(hidden), self.denoising.noise_std_range)

    def _load_lerobot_weights(self, state: dict[str, Tensor]) -> None:
        missing, unexpected = self.load_state_dict(state, strict=False)
        names: dict[int, list[str]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        aliases = {name: group for group in names.values() for name in group}
        missing = [k for k in missing if not any(other in state for other in aliases.get(k, ()))]  # loaded under its other name
        if missing or unexpected:
            raise ConfigError(f"{self.files.path / 'model.safetensors'}", f"missing {missing[:3]}, unexpected {unexpected[:3]}", "the weights do not fit the architecture config.json describes")

    def _add_lora(self, config) -> None:
        try:
            import peft
        except ImportError:
            raise MissingExtraError("peft", "text", "LoRA adapters (policy.lora.r > 0)") from None
        lora = config.lora
        targets = self._lora_targets()
        modules = targets.get(config.lora_on) or targets["expert"] + targets["vlm"]
        for module in modules:
            module.requires_grad_(False)
            adapter = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none")
            try:
                peft.inject_adapter_in_model(adapter, module)
            except ValueError as e:
                raise ConfigError("policy.lora.target_modules", lora.target_modules, f"must name linear layers of the {config.lora_on} transformer: {e}") from None
            for name, param in module.named_parameters():
                if "lora_" in name:
                    param.requires_grad_(True)

    # ------------------------------------------------------------------ the chain

    @property
    def denoising(self) -> DenoisingOptions:
        """``config.denoising`` with the checkpoint's number of steps filled in."""
        return self._denoising

    def transition(self, options: DenoisingOptions, deterministic: bool = False, device=None):
        """LeRobot's Euler grid (:class:`EulerGridTransition`) for K = ``options.num_inference_steps``."""
        name = "flow_ode" if deterministic else options.transition
        return EulerGridTransition(options.num_inference_steps, name, options.noise_level, options.sde_diffusion, device)

    @property
    def latent_shape(self) -> tuple[int, int]:
        return (self.arch.chunk_size, self.arch.max_action_dim)

    # ------------------------------------------------------------------ observations → prefix

    def tokenize(self, tasks: list[str], state: Tensor | None = None, padding: str | None = None) -> tuple[Tensor, Tensor]:
        """Task strings (and the raw state [N, D], for a prompt that holds it) → token ids and
        mask [N, L] as LeRobot's pre-processor makes them; ``padding`` overrides the setting
        (mmrl's replays pad to max_length, so every call has the same width)."""
        settings = dict(self.tokenizer_settings)
        if padding is not None:
            settings["padding"] = padding
        out = self.tokenizer(
            self.prompts(list(tasks), state), max_length=settings["max_length"], truncation=settings["truncation"], padding=settings["padding"], padding_side=settings["padding_side"], return_tensors="pt"
        )
        return out["input_ids"], out["attention_mask"].to(torch.bool)

    def observation(self, inputs) -> dict[str, Tensor]:
        """Env inputs → what the replay keeps: uint8 frames, the raw state, the prompt's tokens."""
        if "instruction_ids" in inputs:
            return {key: inputs[key].to(self.action_center.device) for key in self.obs_keys if key in inputs}
        device = self.action_center.device
        state = inputs["state"].to(device, torch.float32)
        tasks = inputs.get("instruction") or [""] * state.shape[0]
        ids, mask = self.tokenize(list(tasks), state, padding="max_length")
        return {"image": inputs["image"].to(device), "state": state, "instruction_ids": ids.to(device), "instruction_mask": mask.to(device)}

    def conditioning(self, obs: dict[str, Tensor]) -> dict:
        """The VLM's pass over each chunk's prefix (once per chunk, reused by every denoising step)."""
        frames = obs["image"]
        if frames.dim() == 4:  # one camera: [N, H, W, 3]
            frames = frames.unsqueeze(1)
        images = {key: frames[:, k].permute(0, 3, 1, 2).to(torch.float32) / 255 for k, key in enumerate(self.cameras)}
        return self.lerobot_prefix(images, obs["state"].to(torch.float32), obs["instruction_ids"], obs["instruction_mask"].to(torch.bool))

    @property
    def noise_feature_dim(self) -> int:
        return int(self.prefix_width)

    def noise_conditioning(self, obs: dict[str, Tensor]) -> tuple[dict, Tensor]:
        """:meth:`conditioning` and the VLM's pooled prefix state [N, width] (float32) of the same pass."""
        cond = self.conditioning(obs)
        return cond, pooled_prefix_state(cond["hidden"].to(torch.float32), cond["pad"])

    # ------------------------------------------------------------------ actions

    def actions_to_latents(self, actions: Tensor) -> Tensor:
        """Env-unit chunks [B, C, A] → normalized chunks [B, C, max_action_dim] (padded with 0)."""
        x = self.normalizer.normalize(ACTION_KEY, actions.to(self.action_center.device, torch.float32))
        return F.pad(x, (0, self.arch.max_action_dim - x.shape[-1]))

    def latents_to_actions(self, latents: Tensor) -> Tensor:
        """Normalized chunks [..., C, max_action_dim] → env-unit chunks [..., C, A] (the
        post-processor's un-normalization of the action dims)."""
        return self.unnormalizer.unnormalize(ACTION_KEY, latents[..., : self.lerobot_action_dim])

    def env_actions(self, latents: Tensor) -> Tensor:
        """The first ``n_action_steps`` actions of each chunk, in env units (not clipped)."""
        return self.latents_to_actions(latents)[..., : self.n_action_steps, :]

    def sft_errors(self, cond: dict, x0: Tensor) -> Tensor:
        """LeRobot's flow-matching error ‖vθ(x_t, t) − (ε − x0)‖² [B, C], averaged over all
        max_action_dim dims, t = 0.001 + 0.999·Beta(1.5, 1), ε and t from torch's global generator."""
        b = x0.shape[0]
        eps = torch.randn_like(x0)
        t = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0)).sample((b,)).to(x0.device) * 0.999 + 0.001
        x_t = t[:, None, None] * eps + (1 - t[:, None, None]) * x0
        v = self._denoiser(cond)(x_t, t, torch.arange(b, device=x0.device))
        return F.mse_loss(v, eps - x0, reduction="none").mean(-1)

    @torch.no_grad()
    def lerobot_chunk(self, observation: dict, noise: Tensor) -> Tensor:
        """What LeRobot's pre-processor → ``predict_action_chunk(batch, noise=noise)`` →
        post-processor returns for an observation in its raw keys: the un-normalized
        chunk [B, chunk_size, action_dim], by mmrl's deterministic chain from ``noise``
        (a checkpoint without a state feature gets zeros)."""
        observation = {self.rename_map.get(k, k): v for k, v in observation.items()}
        device = self.action_center.device
        images = {key: observation[key].to(device, torch.float32) for key in self.image_keys if key in observation}
        state = observation[STATE_KEY].to(device, torch.float32) if STATE_KEY in observation else torch.zeros(noise.shape[0], self.state_dim, device=device)
        tasks = observation["task"]
        ids, mask = self.tokenize([tasks] if isinstance(tasks, str) else list(tasks), state)
        cond = self.lerobot_prefix(images, state, ids.to(device), mask.to(device))
        out = self.sample_chain(self._denoiser(cond), noise.to(device, torch.float32), deterministic=True)
        return self.latents_to_actions(out.final)

    # ------------------------------------------------------------------ critic, reference, export

    @property
    def value_feature_dim(self) -> int:
        """Width of :meth:`value_features` (a ``critic.type: value_head`` reads them)."""
        if self.denoising.logp_granularity != "chain":
            raise ConfigError("policy.denoising.logp_granularity", self.denoising.logp_granularity, "a value head gives one value per action chunk: use chain with critic.type value_head")
        return int(self.prefix_width)

    def value_features(self, replay: dict) -> Tensor:
        """The VLM's pooled prefix state [N, T, width] of each replayed observation (float32)."""
        obs = {key: replay[key] for key in self.obs_keys if key in replay}
        n, t = next(iter(obs.values())).shape[:2]
        cond = self.conditioning({k: v.reshape(n * t, *v.shape[2:]) for k, v in obs.items()})
        return pooled_prefix_state(cond["hidden"].to(torch.float32), cond["pad"]).view(n, t, -1)

    def reference(self):
        """With LoRA, this policy with its adapters disabled (the KL reference); else None."""
        return AdapterFreeLeRobotFlow(self) if self.lora else None

    export_layouts = {"lerobot": "a LeRobot policy directory: the checkpoint's config.json and processors with their statistics, model.safetensors with the trained weights under LeRobot's names (LoRA merged)"}

    def export(self, fmt: str, out) -> None:
        save_lerobot_policy(self, out)

    @contextmanager
    def adapters_disabled(self):
        with adapters_disabled(self.model):
            yield

    def lerobot_state_dict(self) -> dict[str, Tensor]:
        """The weights under LeRobot's names (the file's), LoRA adapters merged into their
        layers, in the dtype the policy holds them."""
        state = {**dict(self.named_buffers(remove_duplicate=False)), **dict(self.named_parameters(remove_duplicate=False))}
        state = {k: v for k, v in state.items() if not k.startswith("noise_head.")}  # mmrl's Flow-Noise head
        if self.lora:
            from peft.tuners.lora import LoraLayer

            for name, module in self.named_modules():
                if isinstance(module, LoraLayer):
                    base = module.get_base_layer()
                    state[f"{name}.weight"] = base.weight + module.get_delta_weight("default").to(base.weight.dtype)
                    if base.bias is not None:
                        state[f"{name}.bias"] = base.bias
        return {key: state[key].detach() for key in self.lerobot_keys}


class AdapterFreeLeRobotFlow(nn.Module):
    """The KL reference of a LeRobot flow policy with LoRA adapters: the policy itself with its
    adapters disabled, sharing its weights without registering them."""

    def __init__(self, policy: LeRobotFlowPolicy):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    @torch.no_grad()
    def log_prob(self, replay: dict) -> Tensor:
        with self.policy.adapters_disabled():
            return self.policy.log_prob(replay)

    @torch.no_grad()
    def chain_denoiser(self, replay: dict):
        """The reference's denoiser: prefix and expert steps all with the adapters off."""
        with self.policy.adapters_disabled():
            denoise = self.policy.chain_denoiser(replay)

        def without_adapters(x: Tensor, t: Tensor, rows: Tensor):
            with self.policy.adapters_disabled():
                return denoise(x, t, rows)

        return without_adapters

    def forward(self, replay: dict) -> Tensor:
        return self.log_prob(replay)


def save_lerobot_policy(policy: LeRobotFlowPolicy, out) -> Path:
    """Write ``policy`` as a LeRobot policy directory: the checkpoint's config.json and
    processors as read, ``model.safetensors`` with its current weights under LeRobot's names."""
    return write_lerobot_policy(policy.files, policy.lerobot_state_dict(), out)
