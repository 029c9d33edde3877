"""``sac``: Soft Actor-Critic (Haarnoja et al., 2018) on transitions from the replay buffer,
with a critic ensemble (twin Q, or REDQ's N critics and a random subset of M for the
target; Chen et al., 2021) and LayerNorm critics as RLPD uses them (Ball et al., 2023).

On a batch of transitions (s, a, r, d, s', terminated) (``mmrl/train/replay_buffer.py``:
``d`` is gamma to the env steps up to s', so chunks and n-step returns need nothing more):

    y        = r + d (1 − terminated) (min_{j in M} Q̄_j(s', a') − α log π(a'|s')),  a' ~ π(·|s')
    L_critic = sum_i mean_batch (Q_i(s, a) − y)²
    L_actor  = mean_batch (α log π(ã|s) − Q(s, ã)),   ã = tanh(μ + σ ε) reparameterised,
               Q = min over the ensemble (SAC) or its mean (``actor_q: mean``, REDQ)
    L_alpha  = mean_batch (−log α (log π(ã|s) + H̄)),   H̄ = −(action values per decision) by default

The three are summed into one scalar (TorchRL's ``SACLoss`` form) whose gradients do not
cross: the actor's term reads the critics through detached parameters, the critics' target
is computed without grad, α enters the critic and actor terms detached and the temperature
term reads log π detached. So the learner's one optimizer trains the policy (the actor), the
critics and log α, each parameter from its own term. The critics update every optimizer
step; the actor and the temperature every ``actor_every``-th; the targets
Q̄ ← τ Q + (1 − τ) Q̄ after every ``target_every``-th.

Where mmrl follows TorchRL's ``SACLoss`` (0.10, ``loss_function: l2``; tests/parity): the
squared error without a ½, summed over critics and averaged over the batch; the temperature
loss in log α (CleanRL and ManiSkill take α·(…) instead: the same fixed point, a gradient
scaled by α). The noise ε of a' and ã, and the target's subset, come from a generator of
the loss's own, seeded by the run and saved with it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from mmrl import registry
from mmrl.algo.losses import Loss, LossOutput, OffPolicyConfig, Requirement
from mmrl.config import option
from mmrl.core.policy import overrides
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError

_SAC_STREAM = 1 << 43  # group index reserved for the loss's noise and target subsets


@dataclass
class SACConfig(OffPolicyConfig):
    type: str = option("sac", "the loss module (mmrl list losses)")
    num_critics: int = option(2, "N: Q networks in the ensemble (2: SAC's twin Q; 10: REDQ)", ge=1)
    target_critics: int | None = option(None, "M: the target takes the min over a random subset of M critics, drawn per step (REDQ: 2); null = all N", ge=1)
    actor_q: Literal["min", "mean"] = option("min", "what the actor maximises of the ensemble: its min (SAC) or its mean (REDQ)")
    critic_hidden_sizes: list[int] = option(factory=lambda: [256, 256], doc="widths of each critic's hidden layers (ReLU)")
    critic_layer_norm: bool = option(False, "LayerNorm after each hidden layer of the critics (RLPD)")
    critic_lr: float | None = option(None, "the critics' learning rate (null: optim.lr)", gt=0)
    tau: float = option(0.005, "Polyak rate of the target critics: Q̄ ← τ Q + (1 − τ) Q̄", gt=0, le=1)
    target_every: int = option(1, "critic updates between target updates", ge=1)
    actor_every: int = option(1, "critic updates between actor (and temperature) updates", ge=1)
    init_alpha: float = option(1.0, "the entropy temperature α at the start", gt=0)
    learn_alpha: bool = option(True, "learn α so that the policy's entropy tracks target_entropy (false: α stays init_alpha)")
    target_entropy: float | None = option(None, "H̄, the entropy α steers toward (null: minus the action values per decision)")
    alpha_lr: float | None = option(None, "the temperature's learning rate (null: optim.lr)", gt=0)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.target_critics is not None and self.target_critics > self.num_critics:
            raise ConfigError(p + "target_critics", self.target_critics, f"must be <= num_critics ({self.num_critics}): the target's subset is drawn from the ensemble")


def soft_q_target(reward: Tensor, discount: Tensor, terminated: Tensor, next_q: Tensor, next_logp: Tensor, alpha: Tensor) -> Tensor:
    """y = r + d (1 − terminated) (min_j Q̄_j(s', a') − α log π(a'|s')); ``next_q`` [M, N]."""
    return reward + discount * (~terminated).to(reward) * (next_q.min(0).values - alpha * next_logp)


def critic_loss(q: Tensor, target: Tensor) -> Tensor:
    """sum_i mean_batch (Q_i − y)², ``q`` [N critics, B]."""
    return (q - target).square().mean(1).sum()


def actor_loss(q: Tensor, logp: Tensor, alpha: Tensor, reduce: str = "min") -> Tensor:
    """mean_batch (α log π − Q), Q the ensemble's min or mean of ``q`` [N, B]."""
    value = q.min(0).values if reduce == "min" else q.mean(0)
    return (alpha * logp - value).mean()


def temperature_loss(log_alpha: Tensor, logp: Tensor, target_entropy: float) -> Tensor:
    """mean_batch (−log α (log π + H̄)), log π detached."""
    return (-log_alpha * (logp.detach() + target_entropy)).mean()


class CriticEnsemble(nn.Module):
    """N MLPs Q_i(s, a) of the concatenated observation and action; forward gives [N, B]."""

    def __init__(self, num: int, input_dim: int, hidden: list[int], layer_norm: bool):
        super().__init__()

        def mlp() -> nn.Sequential:
            layers: list[nn.Module] = []
            width = input_dim
            for size in hidden:
                layers += [nn.Linear(width, size), *([nn.LayerNorm(size)] if layer_norm else []), nn.ReLU()]
                width = size
            return nn.Sequential(*layers, nn.Linear(width, 1))

        self.members = nn.ModuleList(mlp() for _ in range(num))

    def forward(self, obs: Tensor, action: Tensor, members: list[int] | None = None) -> Tensor:
        x = torch.cat([obs, action], -1)
        chosen = self.members if members is None else [self.members[i] for i in members]
        return torch.stack([m(x).squeeze(-1) for m in chosen])


@registry.LOSSES.register("sac", SACConfig, trains_from_buffer=True, final_observations=True)
class SAC(Loss):
    """Soft Actor-Critic on the replay buffer: a critic ensemble, its targets, a temperature."""

    trains_from_buffer = True
    requires = (Requirement("algo.kl.coef", 0.0, "it has no KL term to a reference"),)

    def __init__(self, algo, options: SACConfig, policy, *, seed: int = 0, device=None, **_):
        if not overrides(policy, "rsample") or not policy.action_values or policy.critic_input_dim is None:
            raise ConfigError("algo.loss.type", "sac", f"trains a reparameterised continuous action against a critic of the observation: policy {type(policy).__name__} gives none (gaussian_mlp with squash: tanh does; dsrl steers a flow or diffusion policy through its noise)")
        refusal = policy.rsample_refusal()
        if refusal is not None:
            raise refusal
        self.options, self.policy = options, policy
        device = device if device is not None else next(policy.parameters()).device
        self.action_dim = int(policy.action_values)
        self.critics = CriticEnsemble(options.num_critics, policy.critic_input_dim + self.action_dim, options.critic_hidden_sizes, options.critic_layer_norm).to(device)
        self.targets = copy.deepcopy(self.critics).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(options.init_alpha), device=device), requires_grad=options.learn_alpha)
        self.target_entropy = options.target_entropy if options.target_entropy is not None else -float(self.action_dim)
        self.generator = torch.Generator().manual_seed(group_seed(seed, 0, _SAC_STREAM))
        self.updates = 0  # optimizer steps taken: the clock of actor_every and target_every

    def parameter_groups(self) -> list[dict]:
        o = self.options
        groups = [{"params": list(self.critics.parameters()), "base_lr": o.critic_lr}]
        if o.learn_alpha:
            groups.append({"params": [self.log_alpha], "base_lr": o.alpha_lr})
        return groups

    def terms(self, model, batch: dict, actor_noise: Tensor, next_noise: Tensor, subset: list[int] | None = None, actor_step: bool = True) -> LossOutput:
        """The summed loss of one batch given the noise of ã ([B, 1, D]) and of a' and the
        target's subset (the module docstring); ``actor_step`` adds the actor's and the
        temperature's terms."""
        policy = self.policy
        replay, following = batch["replay"], batch["next"]
        obs = policy.critic_inputs(replay)[:, 0]
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_logp = model(following, mode="rsample", noise=next_noise)
            next_q = self.targets(policy.critic_inputs(following)[:, 0], next_action[:, 0], subset)
            target = soft_q_target(batch["reward"], batch["discount"], batch["terminated"], next_q, next_logp[:, 0], alpha)
        q = self.critics(obs, policy.replayed_action(replay)[:, 0])
        loss = critic_loss(q, target)
        terms = {"loss/critic": loss.detach(), "sac/q_mean": q.detach().mean(), "sac/target_mean": target.mean(), "sac/alpha": alpha}
        if actor_step:
            action, logp = model(replay, mode="rsample", noise=actor_noise)
            detached = {name: p.detach() for name, p in self.critics.named_parameters()}
            q_pi = torch.func.functional_call(self.critics, detached, (obs, action[:, 0]))
            l_actor = actor_loss(q_pi, logp[:, 0], alpha, self.options.actor_q)
            loss = loss + l_actor
            terms.update({"loss/actor": l_actor.detach(), "sac/entropy": -logp.detach().mean()})
            if self.options.learn_alpha:
                l_alpha = temperature_loss(self.log_alpha, logp[:, 0], self.target_entropy)
                loss = loss + l_alpha
                terms["loss/alpha"] = l_alpha.detach()
        return LossOutput(loss, terms)

    def __call__(self, model, batch, targets=None, norm=None, at_sampling_weights: bool = False, rows: slice | None = None) -> LossOutput:
        """The loss of ``batch``, or with ``rows`` of those rows of it (one learner process's
        share, ``mmrl/train/off_policy.py``): the noise is drawn for the whole batch either
        way, so the processes' shares together take one process's draws."""
        n, o = batch["reward"].shape[0], self.options
        next_noise = torch.randn(n, 1, self.action_dim, generator=self.generator)
        actor_noise = torch.randn(n, 1, self.action_dim, generator=self.generator)
        m = o.target_critics
        subset = sorted(torch.randperm(o.num_critics, generator=self.generator)[:m].tolist()) if m is not None and m < o.num_critics else None
        if rows is not None:
            batch, next_noise, actor_noise = _rows_of(batch, rows), next_noise[rows], actor_noise[rows]
        device = batch["reward"].device
        return self.terms(model, batch, actor_noise.to(device), next_noise.to(device), subset, actor_step=self.updates % o.actor_every == 0)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        self.updates += 1
        if self.updates % self.options.target_every == 0:
            tau = self.options.tau
            for target, online in zip(self.targets.parameters(), self.critics.parameters()):
                target.lerp_(online, tau)

    def state_dict(self) -> dict:
        return {
            "critics": {k: v.detach().cpu() for k, v in self.critics.state_dict().items()},
            "targets": {k: v.detach().cpu() for k, v in self.targets.state_dict().items()},
            "log_alpha": self.log_alpha.detach().cpu(), "generator": self.generator.get_state(), "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.critics.load_state_dict(state["critics"])
        self.targets.load_state_dict(state["targets"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.generator.set_state(state["generator"])
        self.updates = int(state["updates"])


def _rows_of(tree: dict, rows: slice) -> dict:
    return {k: _rows_of(v, rows) if isinstance(v, dict) else v[rows] for k, v in tree.items()}
