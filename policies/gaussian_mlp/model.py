"""Gaussian MLP policy for continuous actions.

One decision = one action chunk of C actions of A dimensions. Its log-prob is that of a
diagonal Gaussian over the chunk's C x A dimensions:

    a_n ~ N(mu(o), diag(sigma^2)),   log pi(a_n | o) = sum_i log N(a_n,i; mu_i, sigma_i^2)

The Gaussian lives in a normalized action space: where the env's bounds [low, high] are
finite, the env action is ``center + half_range * a_n`` (so a_n = ±1 are the bounds);
unbounded dimensions are used as they are. Log-probs are densities of ``a_n``; they differ
from densities of env actions by the constant sum(log half_range), which cancels in
importance ratios and KL terms. The samples are not clipped here: the env sampler clips
what it executes, and the log-prob is that of the unclipped sample.

With ``squash: tanh`` the normalized action is a_n = tanh(u), u ~ N(mu(o), diag(sigma^2)),
and log pi(a_n | o) = log N(u; mu, sigma^2) − sum_i log(1 − tanh(u_i)^2) (the change of
variables of SAC's squashed Gaussian). Env actions then lie within their bounds, so nothing
is clipped: an unsquashed Gaussian whose samples the env clips gives the same env action to
every sample past a bound, so the policy gradient cannot tell them apart and the mean and the
std can drift past the bounds unchecked. Replay keeps u, so the recompute is exact; the
deterministic action is tanh(mu); the logged entropy is that of u's Gaussian. Demonstrations
(``sft_loss``) are read through atanh, their normalized actions held 1e-4 inside ±1.

Exploration noise can be annealed (``final_log_std``): the log std in use is
min(learned log std, cap), the cap going linearly from ``init_log_std`` to ``final_log_std``
over the first ``log_std_anneal_decisions`` decisions this policy samples stochastically in
training mode, over all processes (a counter saved with the weights, so a resumed run
continues the schedule; evaluation, in eval mode, does not move it). Like the observation
statistics it moves once per training step, when the trainer commits the step's samples
(``mmrl/core/statistics.py``), so one and N processes follow the same schedule. The learned
log std below the cap keeps its gradient. Why: a Gaussian policy trained with a fixed or
slowly-learned std optimizes the return *of the noisy policy*, and its mean can come to rely
on the noise (on ManiSkill PushCube the mean learned to press the gripper down and push
timidly, leaving the noise to break contact and friction: 0.53 success with the mean action
against 0.79 sampled). Shrinking the noise during training makes the mean carry the task,
so that deterministic evaluation matches what training optimized. Each decision's cap is
kept in its replay, so ``log_prob`` recomputes the sampling log-prob exactly even though the
cap moves between rollouts.

Replay holds the network's inputs (normalized observations) and the normalized actions,
so ``log_prob(replay)`` recomputes exactly what ``sample`` computed, whatever the running
observation statistics did in between.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mmrl.core.policy import PolicyModule, Sample
from mmrl.core.statistics import RunningCount, RunningMoments
from mmrl.errors import ConfigError
from mmrl.policies.gaussian_mlp.config import GaussianMLPConfig
from mmrl.registry import POLICIES

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# Observations further than this many running stds from the running mean are clipped
# (as in Stable-Baselines3's VecNormalize), so one outlier cannot blow up the MLP input.
_OBS_CLIP = 10.0
# Demo actions at a bound are read as tanh(u) at this distance inside it (atanh(±1) is infinite).
_SQUASH_EDGE = 1e-4


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, samples a rollout, recomputes its log-probs and round-trips its weights.
CONTRACT = {
    "train": {
        "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4, "kwargs": {"max_steps": 6, "min_steps": 3}},
        "sampler": {"type": "env"},
        # with the running observation statistics and the annealed std cap (state saved with the weights, a cap in the replay)
        "policy": {"type": "gaussian_mlp", "hidden_sizes": [8], "obs_norm": True, "final_log_std": -1.0, "log_std_anneal_decisions": 100},
        "rewards": [{"type": "success"}],
    },
}


@POLICIES.register("gaussian_mlp", config=GaussianMLPConfig, contract=CONTRACT)
class GaussianMLPPolicy(PolicyModule):
    """Diagonal Gaussian over action chunks, mean from an MLP; for state-based control."""

    def __init__(self, config: GaussianMLPConfig, spec: dict):
        super().__init__()
        self.config, self.spec = config, spec
        self.obs_dim = int(spec["obs_dim"])
        self.action_dim = int(spec["action_dim"])
        self.chunk = config.action_chunk
        out = self.chunk * self.action_dim

        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[config.activation]
        layers: list[nn.Module] = []
        width = self.obs_dim
        for hidden in config.hidden_sizes:
            layers += [nn.Linear(width, hidden), act()]
            width = hidden
        head = nn.Linear(width, out * (2 if config.state_dependent_std else 1))
        self.net = nn.Sequential(*layers, head)
        # PPO-style init: orthogonal hidden layers, a near-zero head so the initial mean is
        # the centre of the action range and the initial std is exp(init_log_std).
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, gain=math.sqrt(2) if layer is not head else 0.01)
                nn.init.zeros_(layer.bias)
        if config.state_dependent_std:
            with torch.no_grad():
                head.bias[out:] = config.init_log_std
        else:
            self.log_std = nn.Parameter(torch.full((out,), float(config.init_log_std)))

        low = torch.as_tensor(spec.get("action_low", [-math.inf] * self.action_dim), dtype=torch.float32)
        high = torch.as_tensor(spec.get("action_high", [math.inf] * self.action_dim), dtype=torch.float32)
        finite = torch.isfinite(low) & torch.isfinite(high)
        if config.squash == "tanh" and not bool(finite.all()):
            raise ConfigError("policy.squash", "tanh", "needs an env whose action bounds are all finite (tanh maps onto [low, high])")
        # Derived from the spec, not learned: kept out of the saved weights.
        self.register_buffer("action_center", torch.where(finite, (low + high) / 2, 0.0), persistent=False)
        self.register_buffer("action_half_range", torch.where(finite, (high - low) / 2, 1.0), persistent=False)

        if config.final_log_std is not None:
            # Stochastically sampled training decisions so far (over all processes): the
            # clock of the log std cap.
            self.sampled_decisions = RunningCount()
        if config.obs_norm:
            # Running observation statistics, committed once per training step over all
            # processes (mmrl/core/statistics.py).
            self.obs_stats = RunningMoments(self.obs_dim)
        self._register_load_state_dict_pre_hook(_rename_legacy_statistics)
        self._register_load_state_dict_pre_hook(_start_the_annealing_clock, with_module=True)

    # ------------------------------------------------------------------ helpers

    @property
    def updates_obs_stats(self) -> bool:
        """Whether observations go into the running statistics (``obs_norm_update``). A
        pretrained policy keeps its loaded ones under ``auto``: its network was fitted to
        them, and statistics that drift with the new run's states change what it computes
        (fine-tuning a behaviour-cloned policy, they cut its success from 0.25 to 0.06 within
        20 updates, benchmarks/results/robots_tabletop.md)."""
        mode = self.config.obs_norm_update
        return self.config.obs_norm and (mode == "always" or (mode == "auto" and not self.config.pretrained))

    def _normalize(self, obs: Tensor) -> Tensor:
        if not self.config.obs_norm:
            return obs
        return self.obs_stats.normalize(obs, _OBS_CLIP)

    def log_std_cap(self) -> float | None:
        """The current cap of the log std (None without ``final_log_std``)."""
        cfg = self.config
        if cfg.final_log_std is None:
            return None
        progress = min(1.0, self.sampled_decisions.value.item() / cfg.log_std_anneal_decisions)
        return cfg.init_log_std + (cfg.final_log_std - cfg.init_log_std) * progress

    def _mean_log_std(self, obs_n: Tensor, cap: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Mean and log std of the normalized chunk, both [N, C*A]; ``cap`` [N, 1] (or a
        scalar tensor) caps the log std."""
        out = self.net(obs_n)
        if self.config.state_dependent_std:
            mean, log_std = out.chunk(2, dim=-1)
        else:
            mean, log_std = out, self.log_std.expand_as(out)
        if cap is not None:
            log_std = torch.minimum(log_std, cap.to(log_std))
        return mean, log_std.clamp(self.config.min_log_std, self.config.max_log_std)

    def _log_density(self, x: Tensor, mean: Tensor, log_std: Tensor) -> Tensor:
        """Log-density of the pre-squash sample ``x`` (the normalized action without
        ``squash``) summed over the last dim: the diagonal Gaussian's, less
        sum log(1 − tanh(x)^2) with ``squash: tanh``."""
        z = (x - mean) * torch.exp(-log_std)
        logp = (-0.5 * z.square() - log_std - _LOG_SQRT_2PI).sum(-1)
        if self.config.squash == "tanh":
            logp = logp - _log_tanh_jacobian(x).sum(-1)
        return logp

    def _squash(self, u: Tensor) -> Tensor:
        """The normalized action of a pre-squash sample."""
        return torch.tanh(u) if self.config.squash == "tanh" else u

    # ------------------------------------------------------------------ protocol

    @torch.no_grad()
    def sample(self, inputs: Tensor, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        """``inputs``: observations [N, obs_dim], or a structured env's dict whose "state"
        [N, obs_dim] is read (other keys, e.g. an instruction, are not). Returns env actions
        [N, C, A], logp [N, 1], replay {"obs": [N, 1, obs_dim] normalized, "action": [N, 1, C,
        A] normalized, and with ``final_log_std`` "log_std_cap": [N, 1]}. Stochastic sampling
        in training mode adds the observations to the statistics (see ``obs_norm_update``)
        and the decisions to the annealing clock, both used from the next commit on;
        ``deterministic`` returns the mean."""
        if isinstance(inputs, dict):  # a structured env (e.g. the tabletop's obs_mode: state): its state vector
            inputs = inputs["state"]
        obs = inputs.to(self.action_center.device, torch.float32)
        learning = self.training and not deterministic
        if self.updates_obs_stats and learning:
            self.obs_stats.observe(obs)
        obs_n = self._normalize(obs)
        n = obs.shape[0]
        cap_value = self.log_std_cap()
        cap = None if cap_value is None else torch.full((n, 1), cap_value, device=obs.device)
        mean, log_std = self._mean_log_std(obs_n, cap)
        if cap is not None and learning:  # not in (sampled) evaluation
            self.sampled_decisions.add(n)
        if deterministic:
            action_n = mean
        else:
            noise = torch.randn(mean.shape, generator=generator, device=generator.device if generator is not None else mean.device)
            action_n = mean + torch.exp(log_std) * noise.to(mean.device)
        logp = self._log_density(action_n, mean, log_std).unsqueeze(1)
        entropy = (log_std + _LOG_SQRT_2PI + 0.5).sum(-1).unsqueeze(1)
        chunk = action_n.view(n, self.chunk, self.action_dim)
        replay = {"obs": obs_n.unsqueeze(1), "action": chunk.unsqueeze(1)}
        if cap is not None:
            replay["log_std_cap"] = cap  # [N, 1]: one cap per decision
        return Sample(
            output=self.action_center + self.action_half_range * self._squash(chunk),
            logp=logp,
            replay=replay,
            entropy=entropy,
        )

    @property
    def critic_input_dim(self) -> int:
        return self.obs_dim

    @property
    def value_feature_dim(self) -> int:
        return self.config.hidden_sizes[-1] if self.config.hidden_sizes else self.obs_dim

    def critic_inputs(self, replay: dict) -> Tensor:
        """The replayed normalized observations [B, T, obs_dim] (a separate critic's input)."""
        return replay["obs"]

    def value_features(self, replay: dict) -> Tensor:
        """The mean MLP's last hidden layer [B, T, F] on the replayed observations (a value
        head's input; its gradient reaches the shared layers)."""
        return self.net[:-1](replay["obs"])

    def log_prob(self, replay: dict) -> Tensor:
        """Log-probs [B, T] of replayed normalized actions [B, T, C, A] given the replayed
        normalized observations [B, T, obs_dim], under the current parameters."""
        obs_n, action_n = replay["obs"], replay["action"]
        b, t = obs_n.shape[:2]
        cap = replay.get("log_std_cap")
        mean, log_std = self._mean_log_std(obs_n.reshape(b * t, -1), None if cap is None else cap.reshape(b * t, 1))
        return self._log_density(action_n.reshape(b * t, -1), mean, log_std).view(b, t)

    @property
    def action_values(self) -> int:
        return self.chunk * self.action_dim

    def rsample(self, replay: dict, noise: Tensor | None = None, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """tanh(u), u = mu(o) + sigma(o) * noise, and log pi = log N(u; mu, sigma^2) −
        sum log(1 − tanh(u)^2), both with grad, for the replayed normalized observations
        [B, T, obs_dim] (SAC's reparameterised tanh-Gaussian; no log std cap)."""
        obs_n = replay["obs"]
        b, t = obs_n.shape[:2]
        mean, log_std = self._mean_log_std(obs_n.reshape(b * t, -1))
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=generator.device if generator is not None else mean.device)
        u = mean + torch.exp(log_std) * noise.reshape(mean.shape).to(mean)
        return torch.tanh(u).view(b, t, -1), self._log_density(u, mean, log_std).view(b, t)

    def replayed_action(self, replay: dict) -> Tensor:
        """The executed normalized chunk [B, T, C*A] (tanh of the replayed u)."""
        action = replay["action"]
        return self._squash(action.reshape(*action.shape[:2], -1))

    def demo_replay(self, inputs, actions: Tensor | None) -> dict:
        """{"obs": [N, 1, obs_dim] normalized, "action": [N, 1, C, A]}: the demonstrated env
        actions clipped to the bounds and normalized, pre-squash (atanh, within 1e-4 of the
        edge) with ``squash: tanh``; "action" left out when ``actions`` is None."""
        if isinstance(inputs, dict):
            inputs = inputs["state"]
        obs = inputs.to(self.action_center.device, torch.float32).reshape(inputs.shape[0], -1)
        replay = {"obs": self._normalize(obs).unsqueeze(1)}
        if actions is not None:
            action_n = ((actions.to(obs) - self.action_center) / self.action_half_range).clamp(-1, 1)
            if self.config.squash == "tanh":
                action_n = torch.atanh(action_n.clamp(-1 + _SQUASH_EDGE, 1 - _SQUASH_EDGE))
            replay["action"] = action_n.reshape(obs.shape[0], 1, self.chunk, self.action_dim)
        return replay

    def rsample_refusal(self) -> Exception | None:
        cfg = self.config
        if cfg.squash != "tanh":
            return ConfigError("policy.squash", cfg.squash, "an off-policy actor-critic loss trains a bounded reparameterised action: use tanh")
        if cfg.obs_norm:
            return ConfigError("policy.obs_norm", True, "the replay buffer keeps normalized observations, which moving statistics would leave stale: use false")
        if cfg.final_log_std is not None:
            return ConfigError("policy.final_log_std", cfg.final_log_std, "an off-policy actor-critic loss learns its exploration (the entropy temperature): use null")
        return None

    def sft_loss(self, batch: dict) -> Tensor:
        """Behaviour cloning: the masked mean negative log-likelihood of the demonstrated
        chunks, -log N(a_n; mu(o), sigma^2) per action, with a_n the demo actions in the
        normalized space (clipped to the env bounds first). Observations come as "obs" (flat)
        or "state"; with ``obs_norm`` the batch is added to the running statistics (unless
        ``obs_norm_update`` keeps them as loaded)."""
        obs = batch["obs"] if "obs" in batch else batch["state"]
        obs = obs.to(self.action_center.device, torch.float32).reshape(obs.shape[0], -1)
        if self.updates_obs_stats:
            self.obs_stats.observe(obs)
        actions = batch["actions"].to(obs.device, torch.float32)  # [B, C, A] env units
        b = actions.shape[0]
        action_n = ((actions - self.action_center) / self.action_half_range).clamp(-1, 1)
        if self.config.squash == "tanh":  # the pre-squash value of the demo action
            action_n = torch.atanh(action_n.clamp(-1 + _SQUASH_EDGE, 1 - _SQUASH_EDGE))
        cap_value = self.log_std_cap()
        mean, log_std = self._mean_log_std(self._normalize(obs), None if cap_value is None else torch.tensor(cap_value))
        z = (action_n.reshape(b, -1) - mean) / torch.exp(log_std)
        nll = 0.5 * z.square() + log_std + _LOG_SQRT_2PI
        if self.config.squash == "tanh":
            nll = nll + _log_tanh_jacobian(action_n.reshape(b, -1))
        nll = nll.view(b, self.chunk, self.action_dim).sum(-1)  # [B, C]
        mask = batch.get("action_mask")
        mask = torch.ones_like(nll) if mask is None else mask.to(nll)
        return (nll * mask).sum() / mask.sum().clamp_min(1)


def _log_tanh_jacobian(u: Tensor) -> Tensor:
    """log(1 − tanh(u)^2) = 2 (log 2 − u − softplus(−2u)), elementwise, stable for large |u|."""
    return 2.0 * (math.log(2.0) - u - nn.functional.softplus(-2.0 * u))


def _rename_legacy_statistics(state_dict, prefix, *args) -> None:
    """Weights saved before the statistics became modules: obs_mean/obs_var/obs_count and the
    sampled_decisions buffer move to obs_stats.* and sampled_decisions.value."""
    for old, new in (("obs_mean", "obs_stats.mean"), ("obs_var", "obs_stats.var"), ("obs_count", "obs_stats.count")):
        if prefix + old in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
    legacy = state_dict.get(prefix + "sampled_decisions")
    if legacy is not None:
        state_dict[prefix + "sampled_decisions.value"] = state_dict.pop(prefix + "sampled_decisions")


def _start_the_annealing_clock(module, state_dict, prefix, *args) -> None:
    """Weights saved without annealing (e.g. a behaviour-cloned policy) load into a policy
    with ``final_log_std``: its clock starts at 0 decisions instead of refusing the load."""
    if getattr(module, "sampled_decisions", None) is not None and prefix + "sampled_decisions.value" not in state_dict:
        state_dict[prefix + "sampled_decisions.value"] = torch.zeros((), dtype=torch.float64)
