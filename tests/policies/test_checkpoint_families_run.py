"""The VLA checkpoint families (LeRobot SmolVLA / π0 / π0.5, OpenVLA, OpenVLA-OFT) are ordinary
mmrl policies in a run: from each one's contract example (a tiny checkpoint in its format), a
run resumed from its checkpoint equals the run straight through, bit for bit, and a run whose
episodes a rollout worker process samples trains to the same weights."""

from __future__ import annotations

import importlib

import pytest
import torch

from mmrl.config import from_dict
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import train
from tests.policies.test_contract import RUN, _merge, contract_of

pytest.importorskip("transformers")
pytest.importorskip("mujoco")

FAMILIES = ["smolvla", "pi0", "pi05", "openvla", "openvla_oft"]


def _config(name: str, directory, **changes) -> TrainConfig:
    contract = contract_of(name)
    sections = contract["train"]
    if "prepare" in contract:
        module, _, function = contract["prepare"].partition(":")
        prepared = directory / "prepared"
        sections = _merge(sections, getattr(importlib.import_module(module), function)(prepared))
    # the tabletop's dense reward summed over the episode: advantages that are not all zero
    env = sections["env"]
    dense = {"env": {**env, "kwargs": {**env.get("kwargs", {}), "reward_mode": "dense"}}, "rewards": [{"type": "return"}]}
    return from_dict(TrainConfig, _merge(_merge(_merge(RUN, sections), dense), {"total_steps": 2, "checkpoint": {"every": 1, "keep": 3}, **changes}))


def _weights(run, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_resumed_run_equals_the_straight_run_and_a_rollout_worker_trains_the_same(name, tmp_path):
    straight = tmp_path / "straight"
    train(_config(name, tmp_path), straight)
    split = tmp_path / "split"
    train(_config(name, tmp_path, total_steps=1), split)
    train(_config(name, tmp_path), split, resume=True)
    a, b, first = _weights(straight, 2), _weights(split, 2), _weights(straight, 1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], first[k]) for k in a)  # the second update changed the weights
    worker = tmp_path / "worker"
    train(_config(name, tmp_path, rollout={"workers": 1}), worker)
    w = _weights(worker, 2)
    assert all(torch.equal(a[k], w[k]) for k in a)
