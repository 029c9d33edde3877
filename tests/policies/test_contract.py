"""The contract of every registered policy: it builds from a tiny example of itself, samples,
recomputes its own log-probs with ratio 1, and round-trips its weights. A new registration
gets these tests without writing any: the cases are parametrized over ``POLICIES.names()``.

Each policy declares its example where it registers, as the ``contract`` trait
(``@POLICIES.register(name, config=..., contract=CONTRACT)``), a plain dict of one of two kinds:

- a policy that samples: ``{"train": {...}, "ratio_atol": 0.0, "ratio_why": "..."}``.
  ``train`` is a train config's ``env`` / ``sampler`` / ``policy`` / ``rewards`` sections (and
  any other section it needs), which this file completes with one step of 2 groups of 2 on the
  CPU, without KL, evaluation or logging (:data:`RUN`); data paths are relative to the
  repository root, as in ``configs/``. ``ratio_atol`` (default 0: bit for bit) bounds
  |log_prob(replay) - the rollout's old log-prob| on every valid decision at the sampling
  weights; a policy that declares more says why in ``ratio_why`` (which float sums differ,
  and the gap measured). Where the old log-probs are deferred (``Rollout.old.deferred``)
  the trainer takes them from its own pass, so two passes at the same weights must agree to
  the bit (the first ratio is then exactly 1) and ``ratio_atol`` bounds the sampling pass's
  provisional numbers.
- a model trained supervised that samples nothing (a reward model, a success detector):
  ``{"policy": {...}, "spec": {...}, "sft_batch": "package.module:function"}``: its policy
  section, the spec it is built with (default none) and the function ``(model, generator) ->
  batch`` that makes a small batch of what its ``sft_loss`` trains on.

A sampling contract may add ``"prepare": "package.module:function"``: a function
``(directory) -> overrides`` that writes what the example needs (a checkpoint directory a
policy loads) under a temporary ``directory`` and returns the sections to merge into
``train`` (e.g. ``{"policy": {"checkpoint": ...}}``).

Optional capabilities (``CAPABILITIES`` in mmrl/core/policy.py: a hook of ``PolicyModule``
that the class overrides, or a flag it sets) are checked where the example has them, as
configured (``capabilities(policy)``): each has its own check in :data:`CHECKS`, run on the
example's rollout, on the inputs of its first ``sample`` call and on what that call
returned. A capability added to the table without a check here fails
``test_every_capability_has_its_check``.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mmrl import registry
from mmrl.config import from_dict, to_dict
from mmrl.core.policy import CAPABILITIES, PolicyModule, capabilities
from mmrl.core.weights import _plain, build_policy, load_pretrained, save_pretrained
from mmrl.errors import ConfigError
from tests.conftest import ROOT

# every policy mmrl or an installed plugin registers; a test module's own stand-ins (registered
# when that module is imported, so only in some sessions) are not policies users get
NAMES = [n for n in registry.POLICIES.names() if not registry.POLICIES.entry(n).obj.__module__.startswith("tests.")]
SAMPLING_KEYS = {"train", "ratio_atol", "ratio_why", "prepare"}
SUPERVISED_KEYS = {"policy", "spec", "sft_batch"}
GROUPS, GROUP_SIZE = 2, 2
# what a contract's train sections are completed with: one step, no KL (no reference pass),
# no evaluation, nothing logged, on the CPU (whose kernels the tolerances were measured on)
RUN = {
    "name": "contract", "seed": 0, "total_steps": 1, "device": "cpu",
    "algo": {"group_size": GROUP_SIZE, "groups_per_step": GROUPS, "kl": {"coef": 0.0}},
    "eval": {"at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
}
DECLARE = (
    "declare one where it registers: @POLICIES.register({name!r}, config=..., contract=CONTRACT) with CONTRACT a tiny example "
    "of the policy (see the docstring of tests/policies/test_contract.py and any policy under policies/)"
)


def contract_of(name: str) -> dict[str, Any]:
    """The policy's declared contract, checked for its form (an AssertionError says what is wrong)."""
    entry = registry.POLICIES.entry(name)
    contract = entry.traits.get("contract")
    assert contract is not None, f"policy {name!r} ({entry.obj.__module__}) declares no contract; " + DECLARE.format(name=name)
    assert isinstance(contract, dict), f"policy {name!r}: contract must be a dict, got {type(contract).__name__}"
    if "train" in contract:
        unknown = set(contract) - SAMPLING_KEYS
        assert not unknown, f"policy {name!r}: unknown contract keys {sorted(unknown)} (a sampling policy's are {sorted(SAMPLING_KEYS)})"
        train = contract["train"]
        assert isinstance(train, dict) and isinstance(train.get("policy"), dict), f"policy {name!r}: contract['train'] must hold a policy section"
        assert train["policy"].get("type") == name, f"policy {name!r}: contract['train']['policy']['type'] is {train['policy'].get('type')!r}"
        prepare = contract.get("prepare")
        assert prepare is None or (isinstance(prepare, str) and ":" in prepare), f"policy {name!r}: contract['prepare'] must name a function 'package.module:function'"
        atol = contract.get("ratio_atol", 0.0)
        assert isinstance(atol, (int, float)) and atol >= 0, f"policy {name!r}: ratio_atol must be a number >= 0, got {atol!r}"
        why = contract.get("ratio_why")
        if atol > 0:
            assert isinstance(why, str) and why.strip(), f"policy {name!r}: ratio_atol {atol} needs ratio_why: why recompute cannot be exact (which sums differ, the gap measured)"
        else:
            assert why is None, f"policy {name!r}: ratio_why without a ratio_atol > 0"
        return contract
    unknown = set(contract) - SUPERVISED_KEYS
    assert not unknown, f"policy {name!r}: unknown contract keys {sorted(unknown)} (a sampling policy declares 'train', a supervised one {sorted(SUPERVISED_KEYS)})"
    assert isinstance(contract.get("policy"), dict) and contract["policy"].get("type") == name, f"policy {name!r}: contract['policy'] must be its policy section, type {name!r}"
    assert isinstance(contract.get("sft_batch"), str) and ":" in contract["sft_batch"], f"policy {name!r}: contract['sft_batch'] must name a function 'package.module:function'"
    return contract


def _kind(name: str) -> str | None:
    contract = registry.POLICIES.entry(name).traits.get("contract")
    if not isinstance(contract, dict):
        return None
    return "sampling" if "train" in contract else "supervised"


SAMPLING = [n for n in NAMES if _kind(n) == "sampling"]
SUPERVISED = [n for n in NAMES if _kind(n) == "supervised"]


@dataclass
class Built:
    policy: PolicyModule
    trainer: Any = None  # sampling: the Trainer, its one collected rollout, the learner's model
    rollout: Any = None
    model: Any = None
    batch: Any = None  # supervised: the contract's batch
    inputs: Any = None  # sampling: the inputs of the collection's first sample call and its Sample
    sample: Any = None

    @property
    def valid(self) -> torch.Tensor:
        return self.rollout.mask > 0


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _build(name: str, directory) -> Built:
    contract = contract_of(name)
    if "train" in contract:
        from mmrl.train.run_config import TrainConfig
        from mmrl.train.trainer import Trainer

        train = contract["train"]
        if "prepare" in contract:
            module, _, function = contract["prepare"].partition(":")
            train = _merge(train, getattr(importlib.import_module(module), function)(directory / "prepared"))
        trainer = Trainer(from_dict(TrainConfig, _merge(RUN, train)), directory / "run")
        policy, calls = trainer.policy, []

        def recorded(inputs, *args, **kwargs):
            out = sample(inputs, *args, **kwargs)
            calls.append((inputs, out))
            return out

        sample, policy.sample = policy.sample, recorded
        try:
            rollout = trainer.engine.collect(0, trainer.learner.version).rollout
        finally:
            del policy.sample
        return Built(policy, trainer, rollout, trainer.learner.model, inputs=calls[0][0], sample=calls[0][1])
    entry = registry.POLICIES.entry(name)
    torch.manual_seed(0)
    policy = build_policy(from_dict(entry.config, contract["policy"], "policy"), contract.get("spec") or {})
    module, _, function = contract["sft_batch"].partition(":")
    batch = getattr(importlib.import_module(module), function)(policy, torch.Generator().manual_seed(0))
    return Built(policy, batch=batch)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name)``: the policy built from its contract (once per module); a sampling
    policy's Trainer and one collected rollout with it. Runs in the repository root, which
    the contracts' data paths are relative to."""
    cache: dict[str, Built] = {}
    cwd = os.getcwd()
    os.chdir(ROOT)

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    yield get
    os.chdir(cwd)
    for b in cache.values():
        if b.trainer is not None:
            b.trainer.metrics.close()
            b.trainer.engine.close()
            b.trainer.sampler.close()


# ------------------------------------------------------------------ every policy


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_declares_a_contract(name):
    contract_of(name)


@pytest.mark.parametrize("name", SAMPLING + SUPERVISED)
def test_builds_from_its_contract(name, built):
    policy = built(name).policy
    entry = registry.POLICIES.entry(name)
    assert type(policy) is entry.obj and isinstance(policy, PolicyModule)
    assert isinstance(policy.config, entry.config) and policy.config.type == name
    assert any(p.requires_grad for p in policy.parameters())


@pytest.mark.parametrize("name", SAMPLING + SUPERVISED)
def test_save_and_load_pretrained_round_trip(name, built, tmp_path):
    """mmrl's pretrained directory (config.yaml + model.safetensors): the loaded policy has
    the same config and spec and every state_dict tensor equal, and computes the same
    numbers on the same inputs (log-probs of the rollout's replay; the supervised loss of
    the contract's batch), to the bit."""
    b = built(name)
    policy = b.policy
    save_pretrained(policy, tmp_path / "saved")
    assert (tmp_path / "saved" / "config.yaml").is_file() and (tmp_path / "saved" / "model.safetensors").is_file()
    loaded = load_pretrained(tmp_path / "saved")
    assert type(loaded) is type(policy)
    assert to_dict(loaded.config) == to_dict(policy.config)
    assert _plain(getattr(loaded, "spec", {})) == _plain(getattr(policy, "spec", {}))  # what the sampler told it (action bounds, ...)
    saved, back = policy.state_dict(), loaded.state_dict()
    assert list(back) == list(saved)
    for key, value in saved.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape and torch.equal(back[key], value), key
    if b.rollout is not None:
        loaded.train(policy.training)
        with torch.no_grad():
            ours, theirs = policy.log_prob(b.rollout.replay), loaded.log_prob(b.rollout.replay)
        assert torch.equal(ours[b.valid], theirs[b.valid])
    else:
        training = policy.training
        policy.eval()
        loaded.eval()
        try:
            with torch.no_grad():
                assert torch.equal(policy(b.batch, mode="sft"), loaded(b.batch, mode="sft"))
        finally:
            policy.train(training)


# ------------------------------------------------------------------ policies that sample


@pytest.mark.parametrize("name", SAMPLING)
def test_samples_a_rollout_of_whole_groups_with_finite_log_probs(name, built):
    b = built(name)
    rollout, valid = b.rollout, b.valid
    n = GROUPS * GROUP_SIZE
    assert rollout.batch_size == n and rollout.old_logp.dim() == 2
    assert rollout.mask.shape == rollout.old_logp.shape
    assert ((rollout.mask == 0) | (rollout.mask == 1)).all() and valid.any(1).all()  # every sample takes a decision
    assert torch.unique(rollout.group_id, return_counts=True)[1].tolist() == [GROUP_SIZE] * GROUPS
    assert torch.isfinite(rollout.old_logp[valid]).all()
    if rollout.entropy is not None:
        assert rollout.entropy.shape == rollout.old_logp.shape and torch.isfinite(rollout.entropy[valid]).all()
    assert rollout.rewards.shape == (n, len(b.trainer.cfg.rewards)) and torch.isfinite(rollout.rewards).all()
    part = rollout[torch.tensor([n - 1, 0])]  # the replay slices by sample
    with torch.no_grad():
        assert b.model(part.replay).shape == (2, rollout.num_decisions)


@pytest.mark.numerics
@pytest.mark.parametrize("name", SAMPLING)
def test_recompute_at_the_sampling_weights_gives_ratio_one(name, built):
    """log_prob(replay) at the sampling weights: twice the same numbers to the bit, with and
    without grad (the trainer's deferred old log-probs come from one pass, the first
    minibatch's ratio from the other), and the rollout's old log-probs within the declared
    ``ratio_atol`` (0: equal to the bit)."""
    b = built(name)
    rollout, valid = b.rollout, b.valid
    with torch.no_grad():
        exact = b.model(rollout.replay)
    again = b.model(rollout.replay)  # as the update's first forward runs it
    assert exact.shape == rollout.old_logp.shape and again.requires_grad
    assert torch.equal(exact[valid], again.detach()[valid]), f"{name}: two passes of log_prob over one replay at the same weights differ"
    atol = contract_of(name).get("ratio_atol", 0.0)
    gap = (exact - rollout.old_logp.to(exact))[valid].abs().max().item()
    what = "provisional (deferred) " if rollout.old.deferred else ""
    message = (
        f"{name}: the rollout's {what}old log-probs are {gap:.3g} from log_prob(replay) at the sampling weights; "
        f"the contract declares ratio_atol {atol} (if recompute cannot be exact, measure the gap and declare ratio_atol with its ratio_why)"
    )
    if atol == 0:
        assert torch.equal(exact[valid], rollout.old_logp.to(exact)[valid]), message
    else:
        assert gap <= atol, message


# ------------------------------------------------------------------ models trained supervised


@pytest.mark.parametrize("name", SUPERVISED)
def test_the_contract_batch_gives_a_finite_loss_with_a_gradient_and_a_deterministic_evaluation(name, built):
    b = built(name)
    model, training = b.policy, b.policy.training
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(b.batch, mode="sft")
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is None or torch.isfinite(g).all() for g in grads)
        assert any(g is not None and bool((g != 0).any()) for g in grads)
        model.eval()  # augmentations (flips, shifts) only train
        with torch.no_grad():
            assert torch.equal(model(b.batch, mode="sft"), model(b.batch, mode="sft"))
    finally:
        model.zero_grad(set_to_none=True)
        model.train(training)


@pytest.mark.parametrize("name", SUPERVISED)
def test_a_model_that_samples_nothing_says_so_in_one_line(name, built):
    with pytest.raises(ConfigError) as e:
        built(name).policy.sample(None)
    assert "\n" not in str(e.value) and name in str(e.value)


# ------------------------------------------------------------------ optional capabilities


def _finite(x: torch.Tensor, valid: torch.Tensor | None = None) -> bool:
    return bool(torch.isfinite(x if valid is None else x[valid]).all())


def _check_rsample(b: Built) -> None:
    """A fresh action per replayed decision, in [-1, 1], differentiable in the parameters,
    with a finite log-prob; the same noise gives the same action; the replayed actions are in
    the same space."""
    policy, replay, valid = b.policy, b.rollout.replay, b.valid
    shape = (*b.rollout.mask.shape, policy.action_values)
    action, logp = policy.rsample(replay, generator=torch.Generator().manual_seed(0))
    assert action.shape == shape and logp.shape == b.rollout.mask.shape
    assert action.abs().max() <= 1 and _finite(logp, valid)
    grads = torch.autograd.grad(action.sum(), [p for p in policy.parameters() if p.requires_grad], allow_unused=True)
    assert any(g is not None and bool((g != 0).any()) for g in grads), "rsample's action does not depend on the parameters"
    again, _ = policy.rsample(replay, generator=torch.Generator().manual_seed(0))
    assert torch.equal(action.detach(), again.detach())
    executed = policy.replayed_action(replay)
    assert executed.shape == shape and executed.abs().max() <= 1


def _check_demo_replay(b: Built) -> None:
    """The policy's own actions written as a demonstration replay give back the actions it
    replayed, clipped to the bounds; actions far outside them give back the bounds."""
    policy, inputs, sample = b.policy, b.inputs, b.sample
    with torch.no_grad():
        executed = policy.replayed_action(sample.replay)[:, :1].clamp(-1, 1)
        back = policy.replayed_action(policy.demo_replay(inputs, sample.output))
        assert back.shape == executed.shape and torch.allclose(back, executed, atol=1e-3)
        far = torch.where(sample.output >= 0, 1e6, -1e6).to(sample.output)
        edge = policy.replayed_action(policy.demo_replay(inputs, far))
        assert torch.allclose(edge, torch.where(far >= 0, 1.0, -1.0).reshape(edge.shape).to(edge), atol=1e-3)
        assert set(policy.demo_replay(inputs, None)) <= set(policy.demo_replay(inputs, sample.output))


def _check_sample_from_noise(b: Built) -> None:
    """The same initial noise gives the same chunk, given as a tensor or by a function of the
    observations' features; the log-probs are zero."""
    policy, inputs, sample = b.policy, b.inputs, b.sample
    n = sample.output.shape[0]
    noise = torch.randn(n, *policy.noise_shape, generator=torch.Generator().manual_seed(0))
    first, again = policy.sample_from_noise(inputs, noise), policy.sample_from_noise(inputs, noise.clone())
    assert first.output.shape == sample.output.shape and torch.equal(first.output, again.output)
    assert first.info["features"].shape == (n, policy.noise_feature_dim)
    assert torch.equal(policy.sample_from_noise(inputs, lambda features: noise).output, first.output)
    assert not first.logp.any()


def _check_imitation_batch(b: Built) -> None:
    """The rollout's replay as a supervised batch gives a finite loss."""
    with torch.no_grad():
        loss = b.policy.sft_loss(b.policy.imitation_batch(b.rollout.replay))
    assert loss.dim() == 0 and torch.isfinite(loss)


def _check_exact_kl(b: Built) -> None:
    """The closed-form KL of each decision to the policy itself is zero."""
    with torch.no_grad():
        kl = b.policy.exact_kl(b.rollout.replay, b.policy)
    assert kl.shape == b.rollout.mask.shape and kl[b.valid].abs().max() <= 1e-6


def _check_critic_inputs(b: Built) -> None:
    with torch.no_grad():
        x = b.policy.critic_inputs(b.rollout.replay)
    assert x.shape == (*b.rollout.mask.shape, b.policy.critic_input_dim) and _finite(x, b.valid)


def _check_value_features(b: Built) -> None:
    with torch.no_grad():
        x = b.policy.value_features(b.rollout.replay)
    assert x.shape == (*b.rollout.mask.shape, b.policy.value_feature_dim) and _finite(x, b.valid)


def _check_activation_bytes(b: Built) -> None:
    """An estimate of bytes per sample: a positive number, or None where there is none."""
    estimate = b.policy.activation_bytes(b.rollout.replay)
    assert estimate is None or (math.isfinite(estimate) and estimate > 0)


def _check_keeps_sampling_graph(b: Built) -> None:
    """``sample(..., keep_graph=True)``'s log-probs carry the parameters' graph, with the
    values the contract's ``ratio_atol`` allows of log_prob(replay) at those weights."""
    s = b.policy.sample(b.inputs, torch.Generator().manual_seed(0), keep_graph=True)
    valid = s.mask > 0 if s.mask is not None else torch.ones_like(s.logp, dtype=torch.bool)
    assert s.logp.requires_grad and _finite(s.logp.detach(), valid)
    with torch.no_grad():
        exact = b.policy.log_prob(s.replay)
    assert (exact - s.logp.detach())[valid].abs().max() <= contract_of(b.policy.config.type).get("ratio_atol", 0.0)


def _check_samples_final_only(b: Built) -> None:
    """``sample(..., final_only=True)``: zero log-probs and a replay whose final samples read back."""
    with torch.no_grad():
        s = b.policy.sample(b.inputs, torch.Generator().manual_seed(0), final_only=True)
        final = b.policy.final_samples(s.replay)
    assert not s.logp.any() and final.shape[0] == b.sample.logp.shape[0] and _finite(final)


def _check_sample_partial(b: Built) -> None:
    """Samples run to their end through ``sample_partial`` become a sample with finite log-probs.
    Partial rollouts are the prompt sampler's: an example that samples env observations (a
    language agent) is given text prompts."""
    inputs = b.inputs if isinstance(b.inputs, list) else ["What is 1 + 1?", "Name a colour."]
    n = len(inputs)
    states = b.policy.sample_partial(inputs, [None] * n, torch.Generator().manual_seed(0), lambda ended: len(ended) >= n)
    assert len(states) == n
    sample = b.policy.sample_of_states(inputs, states)
    valid = sample.mask > 0 if sample.mask is not None else torch.ones_like(sample.logp, dtype=torch.bool)
    assert sample.logp.shape[0] == n and _finite(sample.logp, valid)


def _check_continuation_log_prob(b: Built) -> None:
    """A finite, non-positive log-likelihood per continuation, its mean over tokens no lower than its sum."""
    args = (["What is 1 + 1?", "Name a colour."], ["<think>1 + 1 = 2</think><answer>", ""], ["2", "red"])
    total = b.policy.continuation_log_prob(*args, reduce="sum")
    mean = b.policy.continuation_log_prob(*args, reduce="mean")
    assert total.shape == mean.shape == (2,) and _finite(total) and bool((total <= 0).all()) and bool((mean >= total - 1e-6).all())


# every capability's own checks, given the built example (its rollout, its first sample call)
CHECKS = {
    "rsample": _check_rsample,
    "demo_replay": _check_demo_replay,
    "sample_from_noise": _check_sample_from_noise,
    "imitation_batch": _check_imitation_batch,
    "exact_kl": _check_exact_kl,
    "critic_inputs": _check_critic_inputs,
    "value_features": _check_value_features,
    "activation_bytes": _check_activation_bytes,
    "keeps_sampling_graph": _check_keeps_sampling_graph,
    "samples_final_only": _check_samples_final_only,
    "sample_partial": _check_sample_partial,
    "continuation_log_prob": _check_continuation_log_prob,
}


def test_every_capability_has_its_check():
    assert set(CAPABILITIES) <= set(vars(PolicyModule)), f"capabilities not declared on PolicyModule: {sorted(set(CAPABILITIES) - set(vars(PolicyModule)))}"
    missing = set(CAPABILITIES) - set(CHECKS)
    assert not missing, f"capabilities without a check: {sorted(missing)}; add one to CHECKS in tests/policies/test_contract.py"
    assert not set(CHECKS) - set(CAPABILITIES), f"checks of capabilities mmrl does not declare: {sorted(set(CHECKS) - set(CAPABILITIES))}"


@pytest.mark.parametrize("name", SAMPLING + SUPERVISED)
def test_each_capability_it_has_passes_its_checks(name, built):
    b = built(name)
    for capability in sorted(capabilities(b.policy)):
        assert b.rollout is not None, f"{name}: has {capability!r}, whose checks read a rollout; its contract samples none"
        training = b.policy.training
        try:
            CHECKS[capability](b)
        except AssertionError as e:
            raise AssertionError(f"{name}: capability {capability!r}: {e}") from e
        finally:
            b.policy.zero_grad(set_to_none=True)
            b.policy.train(training)
