"""Diffusion policy fine-tuned as in DPPO (Ren et al. 2024, "Diffusion Policy Policy Optimization").

The policy denoises an action chunk x ∈ R^{C×A} in the normalized action space
(env = center + half_range·x where the env's bounds are finite; a_n = ±1 are the bounds),
conditioned on an encoding of the observation:

- observation encoder: uint8 images [N, (K,) H, W, 3] → [−1, 1] → stride-2 3×3 convs
  (``vision_channels``, shared across the K cameras) → average-pooled to an
  ``image_grid``² map, or the coordinates of learned keypoints (spatial softmax) → linear;
  concatenated with the state and mixed by a 2-layer MLP into a conditioning vector
  c ∈ R^hidden (Diffusion Policy, Chi et al. 2023, in miniature);
- denoiser: ε̂θ(x_t, t, c), a residual MLP over [x_t, time features of t/T, c].

Behaviour cloning (``sft_loss``) is DDPM's noise-prediction loss (Ho et al. 2020) on
expert chunks x0: x_t = sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε, loss = ‖ε̂θ(x_t, t, c) − ε‖²,
averaged over the valid (unmasked) actions of the chunks.

Sampling runs K = ``denoising.num_inference_steps`` DDIM (or DDPM) steps from
x_K ~ N(0, I) with :mod:`mmrl.denoising` (``policy.denoising``: ``transition: ddim | ddpm``).
As in DPPO, by default only the last K' steps are stochastic and trained
(``stochastic_steps: last``, ``window_size: K'``): with ``logp_granularity: step`` the
policy's call makes K' decisions, step j's log-prob being
log N(x_{j+1}; μθ(x_j), max(σ_j, ``min_std``)²); the earlier steps are deterministic DDIM
(η = 0) and carry no log-prob (DPPO runs them with a frozen copy of the pretrained
network; here they share the fine-tuned weights). The environment sampler puts the
chunk's reward on the last of its decisions (a two-layer MDP). The action sent to the env
is the final latent clipped to [−1, 1]; the log-probs are those of the unclipped chain.
``deterministic=True`` runs every step as DDIM with η = 0 from x_K = 0, so the action
depends on the observation only (logp and entropy are then 0).

Replay per call: the observation (``image`` [N, 1, …], ``state`` [N, 1, D]) and the chain
in :mod:`mmrl.denoising`'s layout (``chain``: ``latents`` [N, 1, K' + 1, C, A],
``step_index`` / ``stochastic`` [N, 1, K']); all concatenate along dim 1 across calls.
``log_prob`` encodes each chunk's observation once and recomputes its steps in one
batched pass (or ``chunk_steps`` at a time).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmrl.denoising import alphas_cumprod, ddpm_betas, provisional_logp_why, sinusoidal_embedding
from mmrl.errors import ConfigError
from mmrl.policies.diffusion_policy.config import DiffusionPolicyConfig
from mmrl.policies.vla.action_chunk import ActionChunkPolicy
from mmrl.registry import POLICIES


def _conv_out(size: int) -> int:
    """Output size of a 3×3, stride-2, padding-1 convolution."""
    return (size - 1) // 2 + 1


class SpatialSoftmax(nn.Module):
    """Feature map [B, C, h, w] → the expected image coordinates of K learned keypoints,
    [B, 2K] in [−1, 1] (Levine et al. 2016, "End-to-End Training of Deep Visuomotor
    Policies"; the image pooling of robomimic and Diffusion Policy)."""

    def __init__(self, channels: int, keypoints: int, h: int, w: int):
        super().__init__()
        self.keypoints = nn.Conv2d(channels, keypoints, kernel_size=1)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
        self.register_buffer("grid", torch.stack([xs.flatten(), ys.flatten()], dim=1), persistent=False)  # [h*w, 2]

    def forward(self, features: Tensor) -> Tensor:
        attention = torch.softmax(self.keypoints(features).flatten(2), dim=-1)  # [B, K, h*w]
        return (attention @ self.grid).flatten(1)


class ObservationEncoder(nn.Module):
    """Images and/or state → a conditioning vector [N, hidden]."""

    def __init__(self, spec: dict, vision_channels: list[int], hidden: int, image_pooling: str = "grid", image_grid: int = 8, keypoints: int = 32):
        super().__init__()
        self.state_dim = int(spec.get("state_dim", spec.get("obs_dim", 0)) or 0)
        image_shape = spec.get("image_shape")
        self.num_cameras = 0
        features = self.state_dim
        if image_shape is not None:
            image_shape = [int(s) for s in image_shape]
            if len(image_shape) not in (3, 4) or image_shape[-1] != 3:
                raise ConfigError("env", image_shape, "expected RGB images of shape [H, W, 3] or [K, H, W, 3] (K cameras)")
            self.image_shape = tuple(image_shape[-3:])
            self.num_cameras = 1 if len(image_shape) == 3 else image_shape[0]
            layers: list[nn.Module] = []
            channels, h, w = 3, image_shape[-3], image_shape[-2]
            for c in vision_channels:
                layers += [nn.Conv2d(channels, c, kernel_size=3, stride=2, padding=1), nn.GELU()]
                channels, h, w = c, _conv_out(h), _conv_out(w)
            self.vision = nn.Sequential(*layers)
            if image_pooling == "spatial_softmax":
                self.grid = (h, w)
                self.pool = SpatialSoftmax(channels, keypoints, h, w)
                pooled = 2 * keypoints
            else:
                self.grid = (min(h, image_grid), min(w, image_grid))
                self.pool = nn.Flatten(1)
                pooled = channels * self.grid[0] * self.grid[1]
            self.image_proj = nn.Linear(pooled, hidden)
            features += self.num_cameras * hidden
        if features == 0:
            raise ConfigError("policy.type", "diffusion_policy", "needs image and/or state observations; the env gives neither")
        self.mlp = nn.Sequential(nn.Linear(features, hidden), nn.Mish(), nn.Linear(hidden, hidden))

    def forward(self, image: Tensor | None, state: Tensor | None) -> Tensor:
        parts = []
        if self.num_cameras:
            if image.dim() == 4:
                image = image.unsqueeze(1)
            n, k = image.shape[:2]
            if k != self.num_cameras or tuple(image.shape[2:]) != self.image_shape:
                raise ValueError(f"expected images [N, {self.num_cameras}, {', '.join(map(str, self.image_shape))}], got {list(image.shape)}")
            x = image.reshape(n * k, *self.image_shape).permute(0, 3, 1, 2).float() * (2 / 255.0) - 1.0
            features = self.vision(x)
            if tuple(features.shape[-2:]) != self.grid:
                features = nn.functional.adaptive_avg_pool2d(features, self.grid)
            parts.append(self.image_proj(self.pool(features)).view(n, -1))
        if self.state_dim:
            parts.append(state.reshape(state.shape[0], self.state_dim))
        return self.mlp(torch.cat(parts, dim=1))


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden))

    def forward(self, h: Tensor) -> Tensor:
        return h + self.net(h)


class NoisePredictor(nn.Module):
    """ε̂θ(x_t, t/T, c): a residual MLP over the flattened chunk, time features and conditioning."""

    def __init__(self, chunk_numel: int, hidden: int, num_layers: int):
        super().__init__()
        self.hidden = hidden
        self.time_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden))
        self.inp = nn.Linear(chunk_numel + 2 * hidden, hidden)
        self.blocks = nn.Sequential(*(ResidualBlock(hidden) for _ in range(num_layers)))
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, chunk_numel))

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        time = self.time_mlp(sinusoidal_embedding(t, self.hidden))
        h = self.inp(torch.cat([x.flatten(1), time, cond], dim=1))
        return self.out(self.blocks(h)).view_as(x)


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4, "kwargs": {"max_steps": 6, "min_steps": 3}},
        "sampler": {"type": "env"},
        "policy": {"type": "diffusion_policy", "hidden_size": 16, "num_layers": 1, "action_chunk": 2,
                   "denoising": {"num_train_timesteps": 20, "num_inference_steps": 3, "window_size": 2}},
        "rewards": [{"type": "success"}],
    },
    "ratio_atol": 1e-4,
    "ratio_why": provisional_logp_why("up to 9.5e-7 (log-probs up to 5.4) under MMRL_SHAPE_KERNELS=1 over seeds 0-2"),
}


@POLICIES.register("diffusion_policy", config=DiffusionPolicyConfig, contract=CONTRACT)
class DiffusionPolicy(ActionChunkPolicy):
    """DDPM/DDIM action-chunk denoiser on images + state; its last K' denoising steps are the decisions (DPPO)."""

    obs_keys = ("image", "state")

    def __init__(self, config: DiffusionPolicyConfig, spec: dict):
        super().__init__(config, spec)
        self.encoder = ObservationEncoder(spec, config.vision_channels, config.hidden_size, config.image_pooling, config.image_grid, config.keypoints)
        self.denoiser = NoisePredictor(self.chunk * self.action_dim, config.hidden_size, config.num_layers)
        schedule = alphas_cumprod(ddpm_betas(config.denoising.num_train_timesteps, config.denoising.beta_schedule, config.denoising.beta_start, config.denoising.beta_end))
        self.register_buffer("alphas_cumprod", schedule, persistent=False)  # float64, for sft_loss

    # ------------------------------------------------------------------ pieces

    def observation(self, inputs) -> dict[str, Tensor]:
        """The policy's observation tensors (uint8 image, float state) for a batch of inputs
        (a dict from the env sampler, or a flat observation tensor used as the state)."""
        device = self.action_center.device
        if isinstance(inputs, Tensor):
            inputs = {"state": inputs}
        obs: dict[str, Tensor] = {}
        if self.encoder.num_cameras:
            obs["image"] = inputs["image"].to(device)
        if self.encoder.state_dim:
            obs["state"] = inputs["state"].to(device, torch.float32)
        return obs

    def conditioning(self, obs: dict[str, Tensor]) -> Tensor:
        """The observations' encoding [N, hidden] that conditions the denoiser."""
        return self.encoder(obs.get("image"), obs.get("state"))

    @property
    def noise_feature_dim(self) -> int:
        return self.config.hidden_size

    def noise_conditioning(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The observations' encoding [N, hidden], which is both the denoiser's conditioning and the features."""
        cond = self.conditioning(obs)
        return cond, cond

    def _denoiser(self, cond: Tensor, compiled: bool = False):
        scale = 1.0 / self.denoising.num_train_timesteps
        network = self.compiled_step("denoiser", self.denoiser) if compiled else self.denoiser  # compile_denoiser

        def denoise(x: Tensor, t: Tensor, rows: Tensor) -> Tensor:
            return network(x, t * scale, cond[rows])

        return denoise

    def sft_errors(self, cond: Tensor, x0: Tensor) -> Tensor:
        """DDPM's noise-prediction error ‖ε̂θ(x_t, t, c) − ε‖² [B, C] of expert chunks x0
        [B, C, A] (normalized), x_t = sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε. Timesteps and noise
        come from torch's global generator."""
        b = x0.shape[0]
        num_train_timesteps = self.denoising.num_train_timesteps
        t = torch.randint(0, num_train_timesteps, (b,), device=x0.device)
        eps = torch.randn_like(x0)
        alpha_bar = self.alphas_cumprod[t].float().view(b, 1, 1)
        x_t = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * eps
        return (self.denoiser(x_t, t.float() / num_train_timesteps, cond) - eps).square().mean(-1)
