"""DSRL: steer a frozen flow or diffusion policy through its initial noise (Wagenmaker et al.,
CoRL 2025, "Steering Your Diffusion Policy with Latent Space Reinforcement Learning").

A pretrained policy π_dp that denoises an action chunk from an initial noise w ~ N(0, I)
stays frozen. A small policy π_w(w | o) chooses w instead; the env executes the chunk
a = π_dp(o, w) that π_dp's deterministic chain (a flow's ODE, DDIM with η = 0) decodes from
it. To the learner the noise is the action: replay keeps (o, w), the critic is Q(o, w), and
``algo.loss: sac`` trains π_w and Q unchanged (SAC in the noise space). Only π_w (and the
loss's critics) train; π_dp's parameters have no gradient and are not in the optimizer.

The noise policy is a tanh-Gaussian MLP, as SAC's actor:

    u ~ N(mu(o), diag(sigma(o)^2)),   w = noise_bound * tanh(u),
    log pi(u | o) = log N(u; mu, sigma^2) − sum_i log(1 − tanh(u_i)^2)

(the density of tanh(u) ∈ [−1, 1]^D, the action ``rsample`` and ``replayed_action`` give
the critic; w differs from it by the constant factor noise_bound). The replay keeps u, so
``log_prob`` recomputes the sampling log-prob exactly; the deterministic decision is
w = noise_bound * tanh(mu(o)).

What π_w and Q read (``inputs``): the frozen policy's pooled features of the observation
(a VLA's prefix states averaged, a diffusion policy's observation encoding), computed in
the same pass that decodes the chunk, and/or the env's state vector. Because π_dp is
frozen, its features are a fixed function of the observation: the replay stores them, and
SAC's updates never run π_dp (on a CPU the decoding pass is what costs; an update of a
few-hundred-unit MLP on stored features is cheap). An encoder of its own over the images
(as some DSRL agents have) would have to store the images and run in every update. With
``critic_privileged`` the critic also reads the env's privileged observation (a
simulator's state), which the noise policy never sees: SAC's actor learns through Q, so an
asymmetric critic (Pinto et al. 2017) needs nothing at acting time.

The frozen policy is any family that can act from a given noise
(``PolicyModule.sample_from_noise``); another is refused at build time. Where it loads
its weights from files (its ``pretrained`` or ``checkpoint``), they are left out of this
policy's saved weights (the files are their source, as they are for the run that made
them); a frozen policy built with random weights is saved with it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mmrl.core.critic import PRIVILEGED
from mmrl.core.policy import PolicyModule, Sample, overrides
from mmrl.core.weights import build_policy
from mmrl.errors import ConfigError
from mmrl.policies.dsrl.config import DSRLConfig
from mmrl.registry import POLICIES

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_BASE = "base."  # the frozen policy's prefix in this policy's state dict


def steerable_policies() -> list[str]:
    """The registered policy families DSRL can steer: those that act from a given initial noise."""
    return [entry.name for entry in POLICIES.entries() if overrides(entry.obj, "sample_from_noise")]


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4, "kwargs": {"max_steps": 6, "min_steps": 3}},
        "sampler": {"type": "env"},
        "policy": {"type": "dsrl", "hidden_sizes": [8],
                   "policy": {"type": "diffusion_policy", "hidden_size": 16, "num_layers": 1, "action_chunk": 2,
                              "denoising": {"num_train_timesteps": 20, "num_inference_steps": 3, "window_size": 2}}},
        "rewards": [{"type": "success"}],
    },
    "ratio_atol": 1e-5,
    "ratio_why": (
        "the log-density's elementwise exp and softplus run over one wave's rows when sampling and over every decision of the "
        "replay in log_prob, and torch's vectorized and scalar paths of a kernel differ by an ulp where the lengths split "
        "differently: 2.4e-7 measured on an AMD EPYC (log-probs up to 3.4), on one decision of 12"
    ),
}


@POLICIES.register("dsrl", config=DSRLConfig, contract=CONTRACT)
class DSRLPolicy(PolicyModule):
    """A tanh-Gaussian noise policy in front of a frozen flow or diffusion policy (DSRL)."""

    def __init__(self, config: DSRLConfig, spec: dict):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec)
        base = config.policy
        if not overrides(POLICIES.get(base.type, "policy.policy.type"), "sample_from_noise"):
            raise ConfigError("policy.policy.type", base.type, f"cannot act from a given initial noise, which DSRL steers; allowed: {', '.join(steerable_policies())}")
        self.base = build_policy(base, spec)
        self.base.requires_grad_(False).eval()
        self.base_noise_shape = tuple(self.base.noise_shape)
        self.noise_dim = math.prod(self.base_noise_shape)

        self.reads_features = config.inputs in ("features", "features_and_state")
        self.reads_state = config.inputs in ("state", "features_and_state")
        self.state_dim = int(spec.get("state_dim", spec.get("obs_dim")) or 0) if self.reads_state else 0
        if self.reads_state and not self.state_dim:
            raise ConfigError("policy.inputs", config.inputs, "this env gives no state vector: use features")
        self.input_dim = (int(self.base.noise_feature_dim) if self.reads_features else 0) + self.state_dim
        self.privileged_dim = int(spec.get("privileged_dim") or 0) if config.critic_privileged else 0
        if config.critic_privileged and not self.privileged_dim:
            raise ConfigError("policy.critic_privileged", True, "this env gives no privileged observation (mmrl/Tabletop-v0: env.kwargs.privileged_state: true)")

        layers: list[nn.Module] = []
        width = self.input_dim
        for hidden in config.hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        head = nn.Linear(width, 2 * self.noise_dim)
        self.net = nn.Sequential(*layers, head)
        # a near-zero head: the first noises are tanh of N(0, exp(init_log_std)^2) whatever the observation
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, gain=math.sqrt(2) if layer is not head else 0.01)
                nn.init.zeros_(layer.bias)
        with torch.no_grad():
            head.bias[self.noise_dim :] = config.init_log_std

        if base.pretrained or getattr(base, "checkpoint", None):
            self._register_state_dict_hook(_leave_out_the_base)
            self.register_load_state_dict_post_hook(_the_base_is_not_missing)

    def train(self, mode: bool = True) -> "DSRLPolicy":
        super().train(mode)
        self.base.eval()  # frozen: its dropout and augmentations stay off
        return self

    # ------------------------------------------------------------------ pieces

    def _actor_input(self, inputs, features: Tensor) -> Tensor:
        """What the noise policy reads of a batch of observations [N, input_dim]."""
        parts = [features.to(torch.float32)] if self.reads_features else []
        if self.reads_state:
            state = inputs["state"] if isinstance(inputs, dict) else inputs
            parts.append(torch.as_tensor(state).to(features.device, torch.float32).reshape(features.shape[0], -1))
        return torch.cat(parts, -1)

    def _mean_log_std(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_std = self.net(x).chunk(2, dim=-1)
        return mean, log_std.clamp(self.config.min_log_std, self.config.max_log_std)

    @staticmethod
    def _log_density(u: Tensor, mean: Tensor, log_std: Tensor) -> Tensor:
        """log N(u; mu, sigma^2) − sum log(1 − tanh(u)^2), summed over the last dim."""
        z = (u - mean) * torch.exp(-log_std)
        return (-0.5 * z.square() - log_std - _LOG_SQRT_2PI - _log_tanh_jacobian(u)).sum(-1)

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """Env actions [N, C, A]: the frozen policy's chunks decoded from the noises this
        policy draws on its features of ``inputs``; logp and entropy [N, 1] of the draws;
        replay {"obs": [N, 1, input_dim], "action": u [N, 1, D]}. ``deterministic``: u = mu."""
        drawn: dict[str, Tensor] = {}

        def choose(features: Tensor) -> Tensor:
            x = self._actor_input(inputs, features)
            mean, log_std = self._mean_log_std(x)
            if deterministic:
                u = mean
            else:
                eps = torch.randn(mean.shape, generator=generator, device=generator.device if generator is not None else mean.device)
                u = mean + torch.exp(log_std) * eps.to(mean.device)
            drawn.update(x=x, u=u, mean=mean, log_std=log_std)
            return (self.config.noise_bound * torch.tanh(u)).view(-1, *self.base_noise_shape)

        decoded = self.base.sample_from_noise(inputs, choose)
        x, u, mean, log_std = drawn["x"], drawn["u"], drawn["mean"], drawn["log_std"]
        logp = self._log_density(u, mean, log_std).unsqueeze(1)
        entropy = (log_std + _LOG_SQRT_2PI + 0.5).sum(-1).unsqueeze(1)
        replay = {"obs": x.unsqueeze(1), "action": u.unsqueeze(1)}
        return Sample(output=decoded.output, logp=logp, replay=replay, entropy=entropy, info={"noise": decoded.info["noise"]})

    def log_prob(self, replay: dict) -> Tensor:
        """Log-probs [B, T] of the replayed u [B, T, D] given the replayed inputs, under the current parameters."""
        x, u = replay["obs"], replay["action"]
        b, t = x.shape[:2]
        mean, log_std = self._mean_log_std(x.reshape(b * t, -1))
        return self._log_density(u.reshape(b * t, -1), mean, log_std).view(b, t)

    @property
    def critic_input_dim(self) -> int:
        return self.input_dim + self.privileged_dim

    def critic_inputs(self, replay: dict) -> Tensor:
        """What Q(o, w) reads [B, T, critic_input_dim]: the replayed inputs (features and/or
        state), and with ``critic_privileged`` the env's privileged observation after them."""
        if not self.privileged_dim:
            return replay["obs"]
        return torch.cat([replay["obs"], replay[PRIVILEGED].to(replay["obs"])], -1)

    @property
    def action_values(self) -> int:
        return self.noise_dim

    def rsample(self, replay: dict, noise: Tensor | None = None, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """tanh(u), u = mu(o) + sigma(o) * noise [B, T, D], and its log-prob [B, T], both with
        grad, for the replayed inputs (SAC's reparameterised actor in the noise space)."""
        x = replay["obs"]
        b, t = x.shape[:2]
        mean, log_std = self._mean_log_std(x.reshape(b * t, -1))
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=generator.device if generator is not None else mean.device)
        u = mean + torch.exp(log_std) * noise.reshape(mean.shape).to(mean)
        return torch.tanh(u).view(b, t, -1), self._log_density(u, mean, log_std).view(b, t)

    def replayed_action(self, replay: dict) -> Tensor:
        """tanh of the replayed u [B, T, D]: the executed noise over noise_bound."""
        return torch.tanh(replay["action"])


def _log_tanh_jacobian(u: Tensor) -> Tensor:
    """log(1 − tanh(u)^2) = 2 (log 2 − u − softplus(−2u)), elementwise, stable for large |u|."""
    return 2.0 * (math.log(2.0) - u - nn.functional.softplus(-2.0 * u))


def _leave_out_the_base(module, state_dict, prefix, local_metadata) -> None:
    """The frozen policy's weights come from its own files: not saved with the noise policy."""
    for key in [k for k in state_dict if k.startswith(prefix + _BASE)]:
        del state_dict[key]


def _the_base_is_not_missing(module, incompatible_keys) -> None:
    """Weights saved without the frozen policy load: it was built from its own files."""
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not k.startswith(_BASE) and f".{_BASE}" not in k]
