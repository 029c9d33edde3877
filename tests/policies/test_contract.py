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
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mmrl import registry
from mmrl.config import from_dict, to_dict
from mmrl.core.policy import PolicyModule
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
        rollout = trainer.engine.collect(0, trainer.learner.version).rollout
        return Built(trainer.policy, trainer, rollout, trainer.learner.model)
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
