"""The SmolVLA pipeline on the tabletop's spatial family, end to end on a micro budget: demos
(`mmrl collect`) → a fresh SmolVLA directory in LeRobot's layout that mmrl writes
(scripts/write_smolvla_start.py) → SFT (configs/tabletop_spatial_smolvla_sft.yaml) → `mmrl
export --format lerobot` → the export loaded through the smolvla loader → one GRPO update
(configs/tabletop_spatial_smolvla_grpo.yaml). Every stage runs through the CLI's function in
this process, on the shipped configs with only their budgets shrunk."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _write_start():
    spec = importlib.util.spec_from_file_location("write_smolvla_start", ROOT / "scripts" / "write_smolvla_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _observation(seed: int = 0) -> dict:
    """One tabletop-shaped observation in LeRobot's raw keys (64 px top camera, 4-dim state)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "observation.images.top": torch.rand(2, 3, 64, 64, generator=g),
        "observation.state": 0.1 * torch.randn(2, 4, generator=g),
        "task": ["push the block on the left into the green zone", "push the block at the top into the green zone"],
    }


QUIET = ["log.progress=false", "log.tensorboard=false", "eval.at_start=false", "eval.at_end=false"]


def test_demos_start_sft_export_load_rl(tmp_path):
    pytest.importorskip("mujoco")
    pytest.importorskip("transformers")
    from mmrl.cli import main
    from mmrl.core.weights import load_pretrained, resolve_weights_dir
    from mmrl.demos import read_demos
    from mmrl.policies.smolvla import lerobot_actions
    from mmrl.policies.vla.lerobot_format import read_lerobot_policy, read_lerobot_weights

    # demos: two episodes of the spatial family
    demos = tmp_path / "demos"
    assert main(["collect", "--task", "spatial_left", "spatial_top", "--episodes-per-task", "1", "--out", str(demos)]) == 0

    # the start: LeRobot's layout, sized and normalized from the demos
    start, vlm = tmp_path / "start" / "policy", tmp_path / "start" / "smolvlm"
    assert _write_start().main(["--demos", str(demos), "--out", str(start)]) == 0
    files = read_lerobot_policy(start, "start", ("smolvla",))
    assert files.config["input_features"]["observation.state"]["shape"] == [4] and files.config["output_features"]["action"]["shape"] == [2]
    assert list(files.config["input_features"]) == ["observation.images.top", "observation.state"]
    assert files.config["vlm_model_name"] == str(vlm) and (vlm / "config.json").is_file()
    actions = torch.as_tensor(np.concatenate([e.action for e in read_demos(demos)]), dtype=torch.float64)
    post = files.normalizer("postprocessor", "unnormalizer_processor").stats["action"]
    torch.testing.assert_close(post["mean"].double(), actions.mean(0), rtol=1e-5, atol=1e-6)  # statistics of the demos

    # SFT: 2 steps of the shipped config
    sft = tmp_path / "sft"
    overrides = [f"policy.checkpoint={start}", f"policy.vlm_dir={vlm}", f"data.path={demos}", "data.batch_size=8", "total_steps=2", *QUIET]
    assert main(["train", str(ROOT / "configs" / "tabletop_spatial_smolvla_sft.yaml"), "--run-dir", str(sft), *overrides]) == 0

    # export with the CLI; the export reloads with the SFT run's actions for a fixed observation and noise
    exported = tmp_path / "sft_export"
    assert main(["export", str(sft), "--format", "lerobot", "--out", str(exported)]) == 0
    trained = load_pretrained(resolve_weights_dir(sft)).eval()
    noise = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(3))
    ours = trained.lerobot_chunk(_observation(), noise)
    theirs = lerobot_actions(str(exported), _observation(), noise, vlm_dir=str(vlm))
    assert ours.shape == (2, 4, 2) and torch.equal(ours, theirs)
    assert not torch.equal(theirs, lerobot_actions(str(start), _observation(), noise, vlm_dir=str(vlm)))  # SFT moved the weights
    assert json.loads((exported / "config.json").read_text()) == files.config

    # RL: one update of the shipped GRPO config from the export, loaded through the smolvla loader.
    # The spatial family's success is 0 for this policy, so the update is rewarded by the dense
    # env return (potential shaping) to give advantages that differ within the group.
    rl = tmp_path / "rl"
    overrides = [
        f"policy.checkpoint={exported}", f"policy.vlm_dir={vlm}", "total_steps=1", "env.num_envs=4", "env.max_episode_steps=8", "env.kwargs.reward_mode=dense",
        "rewards=[{type: return}]", "algo.groups_per_step=1", "algo.group_size=4", "algo.num_minibatches=1", "algo.micro_batches=1", "optim.warmup_steps=0", *QUIET,
    ]
    assert main(["train", str(ROOT / "configs" / "tabletop_spatial_smolvla_grpo.yaml"), "--run-dir", str(rl), *overrides]) == 0
    metrics = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["adv/nonzero_fraction"] > 0 and metrics[-1]["grad_norm"] > 0
    after = load_pretrained(resolve_weights_dir(rl))
    assert type(after).__name__ == "SmolVLAPolicy" and str(after.files.path) == str(exported)
    before = read_lerobot_weights(exported)
    now = after.lerobot_state_dict()
    expert = [k for k in before if k.startswith("model.vlm_with_expert.lm_expert.")]
    assert expert and any(not torch.equal(now[k], before[k]) for k in expert)
