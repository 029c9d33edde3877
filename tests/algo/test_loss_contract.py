"""The contract of a loss module, checked for every loss in the registry (``mmrl list
losses``): built from its config's defaults beside a tiny policy it can train, it returns a
finite scalar with named terms whose gradient reaches the policy, it learns in the direction
it promises, what it ``requires`` of the run config is refused naming the field, and its
state survives ``state_dict`` / ``load_state_dict``. A new loss gets these checks by being
registered; one that this file cannot build fails here until it has a case in ``CASES``."""

from __future__ import annotations

import copy
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable

import pytest
import torch

from mmrl.algo.losses import Loss, LossOutput, Targets
from mmrl.config import from_dict
from mmrl.errors import ConfigError
from mmrl.registry import LOSSES
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer
from tests.conftest import point_reach_config

# ---------------------------------------------------------------- the cases: a tiny run per loss

SQUASHED_MLP = {"type": "gaussian_mlp", "hidden_sizes": [16, 16], "squash": "tanh", "state_dependent_std": True}


def _point_reach(loss: str, **policy) -> dict:
    return point_reach_config(
        env={"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4}, algo={"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "loss": {"type": loss}},
        policy={"type": "gaussian_mlp", "hidden_sizes": [16, 16], **policy}, eval={"episodes": 1, "at_start": False, "at_end": False},
    )


def _sac() -> dict:
    data = point_reach_config(
        algo={"group_size": 1, "groups_per_step": 8, "ppo_epochs": 1, "loss": {"type": "sac"}}, policy=dict(SQUASHED_MLP),
        rewards=[{"type": "success"}], eval={"episodes": 1, "at_start": False, "at_end": False},
    )
    data["algo"]["loss"]["buffer_size"] = 1000  # the buffer the batch comes from, not an option of the loss's maths
    return data


def _nft() -> dict:
    pytest.importorskip("diffusers")
    return {
        "name": "nft", "seed": 0, "total_steps": 1,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "denoising": {"transition": "flow_ode", "logp_granularity": "chain", "num_inference_steps": 4}},
        "sampler": {"type": "prompt", "data": {"num_prompts": 2}, "batch_groups": 2},
        "rewards": [{"type": "jpeg_compressibility"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "loss": {"type": "nft"}},
        "eval": {"every": 0, "at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    }


@dataclass
class Case:
    """A run config whose ``algo.loss`` is ``{type: <the loss>}`` (its defaults), and what the
    loss promises to learn: ``advantage`` (a positive advantage raises the decision's
    log-prob, a negative one lowers it; ``negative_ignored``: leaves it as it is),
    ``supervised`` (its loss on a demonstration batch falls), ``velocity`` (the flow's
    prediction moves toward a sample with a positive advantage, away with a negative one),
    ``critic`` (its critic loss falls on a fixed batch of transitions)."""

    config: Callable[[], dict]
    learns: str
    negative_ignored: bool = False


CASES: dict[str, Case] = {
    "policy_gradient": Case(lambda: _point_reach("policy_gradient"), "advantage"),
    "self_imitation": Case(lambda: _point_reach("self_imitation"), "advantage", negative_ignored=True),
    "sft": Case(lambda: _point_reach("sft"), "supervised"),
    "nft": Case(_nft, "velocity"),
    "sac": Case(_sac, "critic"),
}


@dataclass
class Built:
    """A loss as the learner built it, the model it trains and one batch for it."""

    name: str
    case: Case
    trainer: Trainer
    loss: Loss
    batch: Any

    @property
    def model(self):
        return self.trainer.learner.model

    @property
    def policy(self):
        return self.trainer.learner.policy

    def targets(self, adv: torch.Tensor | float) -> Targets:
        n = self.batch.batch_size
        adv = torch.full((n,), float(adv)) if not isinstance(adv, torch.Tensor) else adv
        return Targets(adv[:, None].to(self.batch.mask), index=torch.arange(n))

    def norm(self, targets: Targets | None) -> dict:
        if self.case.learns == "supervised" or self.case.learns == "critic":
            return {}
        if self.name == "self_imitation":  # the learner's normalizer of the self-imitation loss
            return {"count": self.loss.counts(self.batch, targets).clamp_min(self.loss.count_floor)}
        return self.trainer.learner.normalizers(self.batch, targets)

    def __call__(self, adv: torch.Tensor | float = 1.0) -> LossOutput:
        if self.case.learns == "critic":
            return self.loss(self.model, self.batch)
        targets = None if self.case.learns == "supervised" else self.targets(adv)
        self.loss.begin_update(0)
        self.loss.begin_epoch(0)
        return self.loss(self.model, self.batch, targets, self.norm(targets))


def build(name: str, tmp_path, config: dict | None = None) -> Built:
    if name not in CASES:
        pytest.fail(f"the registered loss {name!r} has no case in tests/algo/test_loss_contract.py: add one to CASES (a tiny run config and what it learns)")
    case = CASES[name]
    data = config if config is not None else case.config()
    assert data["algo"]["loss"]["type"] == name
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / "run")
    loss = trainer.learner.loss
    assert isinstance(loss, Loss) and isinstance(loss, LOSSES.get(name))
    if case.learns == "critic":  # transitions from the replay buffer, as the learner draws them
        trainer.rl_step(0)  # below learning_starts: fills the buffer only
        return Built(name, case, trainer, loss, trainer.learner.off_policy.buffer.sample(32))
    rollout = trainer.engine.collect(0, trainer.learner.version).rollout
    if case.learns == "supervised":  # demonstrations: the observations seen, a fixed action chunk
        policy = trainer.learner.policy
        obs = rollout.replay["obs"][:, 0]
        batch = {"obs": obs, "actions": torch.full((obs.shape[0], policy.chunk, policy.action_dim), 0.25), "action_mask": torch.ones(obs.shape[0], policy.chunk)}
    else:
        batch = rollout
    return Built(name, case, trainer, loss, batch)


def _sgd_step(built: Built, out: LossOutput, lr: float) -> None:
    params = [p for p in built.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p.sub_(lr * g)


NAMES = LOSSES.names()


def test_every_case_names_a_registered_loss():
    assert set(CASES) <= set(NAMES), sorted(set(CASES) - set(NAMES))


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("name", NAMES)
def test_the_loss_is_a_finite_scalar_with_named_terms_and_its_gradient_reaches_the_policy(name, tmp_path):
    built = build(name, tmp_path)
    out = built(adv=1.0)
    assert isinstance(out, LossOutput)
    assert out.loss.dim() == 0 and out.loss.requires_grad and torch.isfinite(out.loss)
    assert out.terms and all(isinstance(k, str) and "/" in k for k in out.terms)
    assert all(t.dim() == 0 and not t.requires_grad and torch.isfinite(t) for t in out.terms.values()), out.terms
    policy = [p for p in built.policy.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, policy, allow_unused=True)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads), f"{name}: no gradient reaches the policy's parameters"


def _decision_logp(built: Built) -> torch.Tensor:
    """Each sample's summed log-prob of its valid decisions, at the current weights."""
    with torch.no_grad():
        return (built.model(built.batch.replay) * built.batch.mask).sum(1)


def _flow_error(built: Built) -> float:
    """How far the flow's x0 prediction at fixed noisy latents is from the samples."""
    policy, loss = built.policy, built.loss
    x0 = policy.final_samples(built.batch.replay)
    n = x0.shape[0]
    sigma = torch.full((n,), float(loss.sigmas[1]))
    s = sigma.view(-1, *[1] * (x0.dim() - 1))
    x_t = (1 - s) * x0 + s * torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        v = policy.velocity(built.batch.replay, x_t, sigma, torch.arange(n))
    return float(((x_t - s * v - x0) ** 2).mean())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_loss_learns_in_the_direction_it_promises(name, sign, tmp_path):
    built = build(name, tmp_path)
    case = built.case
    if case.learns in ("supervised", "critic") and sign < 0:
        pytest.skip(f"{name} reads no advantage")
    if case.learns == "advantage":
        # one decision's advantage, the others' 0: that decision's log-prob moves, by its sign
        adv = torch.zeros(built.batch.batch_size)
        adv[0] = sign
        before = _decision_logp(built)
        _sgd_step(built, built(adv), lr=1e-3)
        change = float(_decision_logp(built)[0] - before[0])
        if sign < 0 and case.negative_ignored:
            assert change == 0.0
        else:
            assert change * sign > 0, (sign, change)
    elif case.learns == "velocity":
        before = _flow_error(built)
        for _ in range(3):
            _sgd_step(built, built(5.0 * sign), lr=0.05)
        after = _flow_error(built)
        assert (after < before) if sign > 0 else (after > before), (before, after)
    elif case.learns == "supervised":
        before = float(built().loss.detach())
        _sgd_step(built, built(), lr=1e-2)
        assert float(built().loss.detach()) < before
    elif case.learns == "critic":  # the same noise and target subset each time: a fixed regression
        noise = built.loss.generator.get_state()
        optimizer = torch.optim.Adam([p for g in built.loss.parameter_groups() for p in g["params"]], lr=1e-3)

        def critic_loss() -> torch.Tensor:
            built.loss.generator.set_state(noise)
            out = built()
            return out.loss, float(out.terms["loss/critic"])

        _, before = critic_loss()
        for _ in range(10):
            optimizer.zero_grad()
            critic_loss()[0].backward()
            optimizer.step()
        assert critic_loss()[1] < before
    else:
        pytest.fail(f"unknown kind of learning {case.learns!r}")


def _owner_and_field(config, dotted: str):
    *path, name = dotted.split(".")
    node = config
    for part in path:
        node = getattr(node, part)
    return node, name


def _other_values(config, dotted: str, value) -> list:
    """Values of the field ``dotted`` other than ``value`` that its own type allows."""
    owner, name = _owner_and_field(config, dotted)
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, (int, float)):
        return [value + 0.01 if isinstance(value, float) else value + 1]
    hint = typing.get_type_hints(type(owner)).get(name) if is_dataclass(owner) else None
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    if not choices and is_dataclass(owner):
        choices = next((f.metadata.get("choices") or () for f in fields(owner) if f.name == name), ())
    return [c for c in choices if c != value]


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *path, name = dotted.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node[name] = value
    return data


@pytest.mark.parametrize("name", NAMES)
def test_what_the_loss_requires_is_refused_naming_the_field(name, tmp_path):
    requires = LOSSES.get(name).requires
    if not requires:
        pytest.skip(f"{name} requires nothing of the run config")
    if name not in CASES:
        build(name, tmp_path)  # fails: no case
    data = CASES[name].config()
    config = from_dict(TrainConfig, data)  # the case meets every requirement
    for r in requires:
        refusals = []
        for other in _other_values(config, r.field, r.value):
            with pytest.raises(ConfigError) as e:
                from_dict(TrainConfig, _set(data, r.field, other))
            refusals.append((other, e.value))
        assert refusals, f"{name}: found no other value of {r.field} to try"
        # the field's own validation may refuse some values first; the loss's requirement refuses the others
        mine = [(v, e) for v, e in refusals if f"algo.loss {name} needs" in str(e)]
        assert mine, [str(e) for _, e in refusals]
        assert all(e.field == r.field for _, e in mine), [(e.field, str(e)) for _, e in mine]


def _perturbed(state):
    if isinstance(state, dict):
        return {k: _perturbed(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state + 1 if state.is_floating_point() else state.clone()
    if isinstance(state, bool):
        return state
    if isinstance(state, int):
        return state + 1
    return copy.deepcopy(state)


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
    return a == b


@pytest.mark.parametrize("name", NAMES)
def test_the_losses_state_round_trips(name, tmp_path):
    built = build(name, tmp_path)
    state = built.loss.state_dict()
    if not state:
        built.loss.load_state_dict({})
        assert built.loss.state_dict() == {}
        return
    changed = _perturbed(state)
    assert not _equal(changed, state)
    built.loss.load_state_dict(copy.deepcopy(changed))
    assert _equal(built.loss.state_dict(), changed)
    assert torch.isfinite(built().loss)  # and the loss runs from the loaded state
