"""mmrl's ``sac`` loss against TorchRL 0.10.1's ``SACLoss`` on the same transitions, networks
and noise: the critic, actor and temperature losses and their gradients (docs/parity.md)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mmrl.algo.losses.sac import SAC, SACConfig
from mmrl.policies.gaussian_mlp import GaussianMLPConfig, GaussianMLPPolicy
from mmrl.train.run_config import AlgoConfig
from tests.parity.conftest import reference

pytestmark = pytest.mark.numerics

B, OBS, ACT = 32, 5, 3


class _LocScale(nn.Module):
    """The policy's Gaussian before the tanh, as TorchRL's actor reads it."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, obs):
        mean, log_std = self.policy._mean_log_std(obs)
        return mean, log_std.exp()


class _Q(nn.Module):
    def __init__(self, member):
        super().__init__()
        self.member = member

    def forward(self, observation, action):
        return self.member(torch.cat([observation, action], -1))


def _copy_stacked(params, members) -> None:
    """Write the ensemble ``members``' weights into TorchRL's stacked [N, ...] parameters."""
    for key, value in params.items(include_nested=True, leaves_only=True):
        name = ".".join(key if isinstance(key, tuple) else (key,))
        suffix = name.split("member.", 1)[1]
        value.data.copy_(torch.stack([m.state_dict()[suffix] for m in members]))


@pytest.mark.parametrize("layer_norm", [False, True])
def test_sac_losses_and_gradients_equal_torchrls_sacloss(layer_norm):
    objectives = reference("torchrl.objectives")
    modules = reference("torchrl.modules")
    import tensordict  # TorchRL's own dependency
    import tensordict.nn as tensordict_nn
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(GaussianMLPConfig(hidden_sizes=[16, 16], activation="relu", squash="tanh", state_dependent_std=True, init_log_std=-0.3),
                               {"obs_dim": OBS, "action_dim": ACT, "action_low": [-1.0] * ACT, "action_high": [1.0] * ACT})
    with torch.no_grad():  # a mean and std away from the near-zero initial head
        policy.net[-1].weight.normal_(0, 0.3)
    gamma, alpha, entropy = 0.95, 0.3, -2.5
    options = SACConfig(gamma=gamma, num_critics=2, critic_hidden_sizes=[16, 16], critic_layer_norm=layer_norm, init_alpha=alpha, target_entropy=entropy)
    sac = SAC(AlgoConfig(), options, policy, seed=0)
    with torch.no_grad():  # targets apart from the online critics, as after some training
        for p in sac.targets.parameters():
            p.add_(0.05 * torch.randn_like(p))

    g = torch.Generator().manual_seed(1)
    obs, next_obs = torch.randn(B, OBS, generator=g), torch.randn(B, OBS, generator=g)
    u = torch.randn(B, ACT, generator=g)  # the replayed pre-tanh actions
    reward = torch.randn(B, generator=g)
    terminated = torch.rand(B, generator=g) < 0.3
    batch = {"replay": {"obs": obs[:, None], "action": u[:, None, None]}, "next": {"obs": next_obs[:, None]},
             "reward": reward, "discount": torch.full((B,), gamma), "terminated": terminated}

    actor = modules.ProbabilisticActor(
        tensordict_nn.TensorDictModule(_LocScale(policy), in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=modules.TanhNormal, distribution_kwargs={"low": -1.0, "high": 1.0, "tanh_loc": False},
    )
    qvalue = modules.ValueOperator(_Q(sac.critics.members[0]), in_keys=["observation", "action"])
    theirs = objectives.SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2", alpha_init=alpha, target_entropy=entropy, delay_qvalue=True)
    theirs.make_value_estimator(objectives.ValueEstimators.TD0, gamma=gamma)
    _copy_stacked(theirs.qvalue_network_params, sac.critics.members)
    _copy_stacked(theirs.target_qvalue_network_params, sac.targets.members)
    td = tensordict.TensorDict({
        "observation": obs, "action": torch.tanh(u),
        "next": {"observation": next_obs, "reward": reward[:, None], "done": terminated[:, None], "terminated": terminated[:, None]},
    }, [B])

    torch.manual_seed(7)  # TorchRL draws a' (the target's) and then ã (the actor's) from the global generator
    out = theirs(td)
    torch.manual_seed(7)
    next_noise, actor_noise = torch.randn(B, ACT), torch.randn(B, ACT)
    ours = sac.terms(policy, batch, actor_noise[:, None], next_noise[:, None])

    tol = {"rtol": 1e-5, "atol": 1e-6}
    for mine, name in (("loss/critic", "loss_qvalue"), ("loss/actor", "loss_actor"), ("loss/alpha", "loss_alpha")):
        torch.testing.assert_close(ours.terms[mine], out[name].detach(), **tol, msg=name)
    assert math.isclose(float(ours.terms["sac/alpha"]), alpha, rel_tol=1e-6)

    policy_params = list(policy.parameters())
    their_q = [v for _, v in theirs.qvalue_network_params.items(include_nested=True, leaves_only=True)]
    their_names = [".".join(k).split("member.", 1)[1] for k, _ in theirs.qvalue_network_params.items(include_nested=True, leaves_only=True)]
    total = out["loss_qvalue"] + out["loss_actor"] + out["loss_alpha"]
    their_grads = torch.autograd.grad(total, [*policy_params, *their_q, theirs.log_alpha])
    our_grads = torch.autograd.grad(ours.loss, [*policy_params, *sac.critics.parameters(), sac.log_alpha])
    n = len(policy_params)
    for a, b in zip(our_grads[:n], their_grads[:n]):
        torch.testing.assert_close(a, b, **tol)
    ours_by_name = [k for k, _ in sac.critics.named_parameters()]
    assert len(their_names) * 2 == len(ours_by_name)
    for name, grad in zip(their_names, their_grads[n:-1]):
        for i in range(2):
            index = ours_by_name.index(f"members.{i}.{name}")
            torch.testing.assert_close(our_grads[n + index], grad[i], **tol, msg=f"critic {i} {name}")
    torch.testing.assert_close(our_grads[-1], their_grads[-1], **tol)
