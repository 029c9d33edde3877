"""The reward models' input kinds as a registry (mmrl.policies.reward_model.inputs): a new kind
and its reward model, one module written here and put on ``sys.path`` as a plugin would be,
train on its preference pairs, score a rollout as the pairwise_preference reward and give
the contract batch, with no module of mmrl edited; an unknown kind is a one-line error."""

from __future__ import annotations

import re
import sys
import textwrap

import numpy as np
import pytest
import torch

from mmrl import registry
from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.core.weights import latest_checkpoint, load_pretrained
from mmrl.errors import ConfigError
from mmrl.policies.reward_model import RewardModel
from mmrl.policies.reward_model.inputs import INPUT_KINDS, input_kind, pair_kinds, pairwise_models
from tests.conftest import ROOT

VECTOR_KIND = '''
    """A reward model of feature vectors: its input kind and its model."""
    from dataclasses import dataclass

    import numpy as np
    import torch
    from torch import nn

    from mmrl.config import option
    from mmrl.core.component_config import PolicyConfig
    from mmrl.policies.reward_model import RewardModel
    from mmrl.policies.reward_model.inputs import InputKind, register_input_kind
    from mmrl.registry import POLICIES


    @register_input_kind("howto_vector")
    class VectorItems(InputKind):
        """A float vector [D]: pair lines hold the vectors, a rollout's info["vectors"] its samples'."""

        def read_pairs(self, directory, info, path, rows, prompts, field, frames):
            return tuple(np.asarray([r[side] for r in rows], dtype=np.float32) for side in ("chosen", "rejected"))

        def as_items(self, stored):
            return torch.from_numpy(stored)

        def rollout_items(self, model, rollout):
            return torch.as_tensor(rollout.info["vectors"], dtype=torch.float32)

        def contract_pair(self, config, generator):
            return torch.randn(2, config.dim, generator=generator), torch.randn(2, config.dim, generator=generator)


    @dataclass
    class VectorModelConfig(PolicyConfig):
        type: str = option("howto_bt_vector", "registered name of this component (see `mmrl list`)")
        dim: int = option(3, "length of a vector", ge=1)


    CONTRACT = {"policy": {"type": "howto_bt_vector"}, "sft_batch": "mmrl.policies.reward_model.model:contract_pairs"}


    @POLICIES.register("howto_bt_vector", config=VectorModelConfig, contract=CONTRACT)
    class VectorModel(RewardModel):
        """s = w . x, whatever the prompt."""

        input_kind = "howto_vector"

        def __init__(self, config, spec=None):
            super().__init__()
            self.config, self.spec = config, dict(spec or {})
            self.linear = nn.Linear(config.dim, 1, bias=False)

        def score(self, prompts, items):
            return self.linear(items.to(self.device).float()).squeeze(-1)
'''

W = np.array([1.0, -2.0, 0.5])  # the preference the pairs encode: the higher w . x is chosen


@pytest.fixture
def vector_kind(tmp_path, monkeypatch):
    """The module above on ``sys.path`` (one file); afterwards its registrations and module are taken out."""
    folder = tmp_path / "ext"
    folder.mkdir()
    (folder / "howto_vector.py").write_text(textwrap.dedent(VECTOR_KIND).lstrip())
    monkeypatch.syspath_prepend(str(folder))
    known = {reg: set(reg.names()) for reg in (INPUT_KINDS, registry.POLICIES)}
    yield folder
    for reg, names in known.items():
        for name in set(reg.names()) - names:
            del reg._entries[name]  # a registry has no removal: plugins never need one
    sys.modules.pop("howto_vector", None)


def _pairs(out, n_train: int, n_held_out: int, seed: int):
    from mmrl.data.preferences import write_preferences

    rng = np.random.default_rng(seed)
    rows = {"train": [], "held_out": []}
    for i in range(n_train + n_held_out):
        a, b = rng.normal(size=3), rng.normal(size=3)
        chosen, rejected = (a, b) if a @ W > b @ W else (b, a)
        rows["train" if i < n_train else "held_out"].append({"prompt": "which is better", "chosen": chosen.tolist(), "rejected": rejected.tolist(), "metadata": {}})
    return write_preferences(out, "howto_vector", rows)


def test_a_new_input_kind_is_one_module_whose_model_trains_on_its_pairs_and_scores_a_rollout(vector_kind, tmp_path):
    import howto_vector  # noqa: F401  (a plugin's policy module, loaded through its mmrl.policies entry point)
    from mmrl.data.preferences import merge_preferences, read_pairs
    from mmrl.policies.reward_model.model import contract_pairs
    from mmrl.rewards.pairwise import win_rate
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    assert [p.name for p in vector_kind.iterdir()] == ["howto_vector.py"]
    assert "howto_vector" in pair_kinds() and "howto_bt_vector" in pairwise_models()
    _pairs(tmp_path / "a", 64, 16, seed=0)
    _pairs(tmp_path / "b", 32, 8, seed=1)
    merged = merge_preferences(tmp_path / "pairs", [tmp_path / "a", tmp_path / "b"])  # no images file: the kind has none
    assert (merged["train"], merged["held_out"]) == (96, 16) and not (tmp_path / "pairs" / "images.npz").exists()
    read = read_pairs(tmp_path / "pairs", "train")
    assert read.kind == "howto_vector" and read.chosen.shape == (96, 3) and ((read.chosen - read.rejected) @ W > 0).all()

    # train: the preferences data source reads the pairs through the kind
    cfg = from_dict(TrainConfig, {"name": "rm", "seed": 0, "total_steps": 40, "policy": {"type": "howto_bt_vector"}, "algo": {"type": "sft"}, "optim": {"lr": 0.05},
                                  "data": {"type": "preferences", "path": str(tmp_path / "pairs"), "batch_size": 16}, "log": {"progress": False, "tensorboard": False}})
    summary = Trainer(cfg, tmp_path / "run").train()
    assert summary["eval"]["pairs"] == 16 and summary["eval"]["pairwise_accuracy"] >= 0.8  # 0.5: chance
    model = load_pretrained(latest_checkpoint(tmp_path / "run")).eval()
    learned = model.linear.weight.detach().flatten().double()
    assert torch.nn.functional.cosine_similarity(learned, torch.tensor(W), dim=0) > 0.9

    # score a rollout: the pairwise_preference reward reads the samples' items through the kind
    vectors = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    group_id = torch.arange(2).repeat_interleave(3)
    rollout = Rollout(group_id=group_id, old=OldLogProbs(torch.zeros(6, 1)), mask=torch.ones(6, 1), replay={}, info={"vectors": vectors, "prompt": ["which is better"] * 6})
    with torch.no_grad():
        expected = model.score(["which is better"] * 6, vectors)
    for mode, want in (("pointwise", expected), ("win_rate", win_rate(expected, group_id))):
        reward_cfg = from_dict(registry.REWARDS.entry("pairwise_preference").config, {"type": "pairwise_preference", "model": str(tmp_path / "run"), "mode": mode, "batch_size": 4}, "rewards[0]")
        assert torch.allclose(build_reward(reward_cfg, RewardContext())(rollout), want, atol=1e-6)

    # the contract batch: the kind's random items, a finite loss with a gradient
    batch = contract_pairs(model.train(), torch.Generator().manual_seed(0))
    assert batch["chosen"].shape == batch["rejected"].shape == (2, 3)
    loss = model.sft_loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and model.linear.weight.grad.abs().sum() > 0


def test_an_unknown_kind_is_one_line_naming_the_field_the_value_and_the_registered_kinds(tmp_path):
    with pytest.raises(ConfigError) as e:
        input_kind("vector", "data.path")
    message = str(e.value)
    assert "\n" not in message and message.startswith("data.path: got 'vector'; ")
    assert all(name in message for name in ("image", "image_set", "text", "trajectory", "observation"))
    (tmp_path / "info.json").write_text('{"kind": "vector", "train": 0, "held_out": 0}')
    (tmp_path / "train.jsonl").write_text("")
    from mmrl.data.preferences import read_pairs

    with pytest.raises(ConfigError, match=r"^data.path: got '.*'; info.json names kind 'vector'; kinds: image, image_set, text, trajectory$"):
        read_pairs(tmp_path, "train")


def test_every_reward_model_names_a_registered_kind_and_the_pairwise_ones_are_the_bradley_terry_models():
    models = {e.name: e.obj for e in registry.POLICIES.entries() if isinstance(e.obj, type) and issubclass(e.obj, RewardModel)}
    assert models and all(cls.input_kind in INPUT_KINDS for cls in models.values()), {n: c.input_kind for n, c in models.items()}
    assert pairwise_models() == ["bt_image", "bt_image_set", "bt_text", "bt_trajectory"]
    assert pair_kinds() == ["image", "image_set", "text", "trajectory"]
    assert not input_kind("observation").pairwise and "success classifier" in input_kind("observation").used_as


def test_no_module_branches_on_a_reward_models_input_kind():
    """What differs between kinds is a kind's hook, looked up, not an if/elif over kind names."""
    files = ["policies/reward_model/model.py", "rewards/pairwise.py", "mmrl/data/preferences.py", "mmrl/data/sources.py", "mmrl/commands/pairs.py"]
    branch = re.compile(r"""(input_kind|kind)\s*(==|!=|in)\s*\(?["']""")
    found = [f"{f}:{n}" for f in files for n, line in enumerate((ROOT / f).read_text().splitlines(), 1) if branch.search(line)]
    assert found == []
