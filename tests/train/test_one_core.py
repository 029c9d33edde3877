"""The one-core claim, checked: one algorithm preset, unchanged, trains a text LM, an image
denoiser and a robot policy through the same loop."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

from mmrl.config import load_config, option, to_dict
from mmrl.core.component_config import RewardConfig
from mmrl.registry import REWARDS
from mmrl.train.run_config import TrainConfig
from mmrl.train.metrics import read_metrics
from mmrl.train.trainer import Trainer
from tests.conftest import ROOT

PRESET = "defaults=presets/dapo"
# DAPO masks truncated samples out of the loss: a random LM's completions must be able to end
# (any of these characters stops one), and a random robot policy must be able to succeed
# before the time limit (a wide success radius, a long limit), or no decision would train.
STOPS = list("abcdefghijklmnopqrstuvwxyz0123456789")
ALGO_KEYS = ("advantage", "objective", "aggregation", "filters", "resample_rounds", "mask_truncated", "kl")


@dataclass
class _VowelFractionConfig(RewardConfig):
    type: str = option("_test_vowel_fraction", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_vowel_fraction", config=_VowelFractionConfig)
def _vowel_fraction(rollout, cfg):
    """Test-only: the fraction of a completion's characters that are vowels (graded, so DAPO's
    zero-variance filter keeps groups of a random model)."""
    return torch.tensor([sum(c in "aeiou" for c in text) / max(len(text), 1) for text in rollout.info["completions"]])


def text_config(tmp_path) -> TrainConfig:
    pytest.importorskip("transformers")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say something about {w}:"}) + "\n" for w in ("cats", "rain", "maps", "tea")))
    config = tmp_path / "text.yaml"
    config.write_text(
        "name: text\n"
        "policy: {type: text_lm, tiny: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64},"
        f" generation: {{max_new_tokens: 6, stop_strings: {json.dumps(STOPS)}}}}}\n"
        f"sampler: {{type: prompt, data: {{train: {data}}}, batch_groups: 4}}\n"
        "rewards: [{type: _test_vowel_fraction}]\n"
        "algo: {group_size: 4, groups_per_step: 4}\n"
        "optim: {lr: 0.001}\n"
    )
    return load_config(TrainConfig, config, [PRESET, "total_steps=2"])


def image_config(tmp_path) -> TrainConfig:
    pytest.importorskip("diffusers")
    pytest.importorskip("cv2")
    return load_config(TrainConfig, ROOT / "configs/image_ddpo_jpeg.yaml", [PRESET, "total_steps=2", "algo.groups_per_step=2", "sampler.batch_groups=2", "algo.group_size=4"])


def robot_config(tmp_path) -> TrainConfig:
    return load_config(TrainConfig, ROOT / "configs/point_reach_grpo.yaml", [PRESET, "total_steps=2", "env.num_envs=8", "env.kwargs.success_radius=0.6", "env.kwargs.max_steps=100", "algo.groups_per_step=2", "algo.group_size=4"])


MODALITIES = {"text": text_config, "image": image_config, "robot": robot_config}


def test_the_dapo_preset_gives_every_modality_the_same_algorithm(tmp_path):
    algos = {}
    for name, make in MODALITIES.items():
        algo = to_dict(make(tmp_path).algo)
        algos[name] = {k: algo[k] for k in ALGO_KEYS}
    assert algos["text"] == algos["image"] == algos["robot"]
    assert algos["robot"]["objective"]["eps_high"] == 0.28 and algos["robot"]["filters"][0]["type"] == "zero_variance"


@pytest.mark.parametrize("modality", list(MODALITIES))
def test_one_dapo_preset_trains_text_image_and_robot_policies_through_one_loop(tmp_path, modality):
    cfg = MODALITIES[modality](tmp_path)
    cfg.log.progress = cfg.log.tensorboard = False
    cfg.eval.at_end = False
    trainer = Trainer(cfg, tmp_path / modality)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    assert any(not torch.equal(after[n], p) for n, p in before.items()), f"{modality}: no parameter moved"
    rows = [m for m in read_metrics(tmp_path / modality) if "reward/total" in m]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
