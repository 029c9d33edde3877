"""The ``adversarial`` reward (Adv-GRPO): a discriminator of reference images against the
policy's current samples, trained during RL; and the frozen shapes encoder it may read."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("cv2")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.reward import RewardContext  # noqa: E402
from mmrl.core.rollout import OldLogProbs, Rollout  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.tasks.shapes.world import parse_prompt, render_scene  # noqa: E402
from mmrl.train.distributed import Collectives  # noqa: E402
from mmrl.train.metrics import read_metrics  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import train  # noqa: E402
from mmrl.rewards.adversarial import Adversarial, AdversarialConfig  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.rollout.test_engine import _same, _steps  # noqa: E402

SHAPES = ROOT / "examples" / "shapes_single_count"
ENCODER = ROOT / "assets" / "shapes_encoder"
PROMPTS = [json.loads(line)["prompt"] for line in (SHAPES / "train.jsonl").read_text().splitlines()]


def _rollout(images: np.ndarray, prompts: list[str]) -> Rollout:
    n = len(images)
    return Rollout(group_id=torch.arange(n), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={}, info={"images": torch.from_numpy(images), "prompt": prompts})


def _smudged(scene, seed: int) -> np.ndarray:
    """A render as a weak generator draws it: blurred, with its colours washed towards grey
    and pixel noise (what the policy's samples are against the renders)."""
    import cv2

    rng = np.random.RandomState(seed)
    image = cv2.GaussianBlur(render_scene(scene, 24, seed), (5, 5), 1.5).astype(np.float32)
    grey = image.mean(-1, keepdims=True)
    image = 0.6 * image + 0.4 * grey + rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def _batch(seed: int, n: int, real: bool) -> Rollout:
    rng = np.random.RandomState(seed)
    prompts = [PROMPTS[i] for i in rng.randint(len(PROMPTS), size=n)]
    seeds = rng.randint(1 << 30, size=n)
    draw = (lambda scene, s: render_scene(scene, 24, s)) if real else _smudged
    return _rollout(np.stack([draw(parse_prompt(p), int(s)) for p, s in zip(prompts, seeds)]), prompts)


def _reward(**options) -> Adversarial:
    return Adversarial(from_dict(AdversarialConfig, {"type": "adversarial", "encoder": str(ENCODER), **options}), RewardContext(seed=0))


@pytest.mark.parametrize("features, least_auc", [("pixels", 0.9), ("encoder", 0.8)])
def test_the_discriminator_separates_references_from_the_samples_it_was_trained_against(features, least_auc):
    """Each update renders the batch's prompts as references and takes the batch's images as
    samples; after 30 updates new references outscore new samples of new prompts. (The
    encoder reads attributes, which blur and washed colours barely change: measured AUC 0.89
    on its features, 0.97 on pixels.)"""
    reward = _reward(features=features, lr=3e-3)
    dist = Collectives()
    untrained = reward(_batch(1, 8, real=False))
    assert torch.equal(untrained, torch.zeros(8))  # no signal before D's first update
    history = [reward.update(_batch(100 + step, 32, real=False), torch.zeros(32), step=step, dist=dist) for step in range(30)]
    assert history[-1]["loss"] < history[0]["loss"]
    # the logits' common level swings from step to step; the balanced accuracy does not
    assert np.mean([(h["accuracy_real"] + h["accuracy_fake"]) / 2 for h in history[-5:]]) > 0.7
    real, fake = reward(_batch(7, 48, real=True)), reward(_batch(8, 48, real=False))
    auc = (real[:, None] > fake[None, :]).float().mean().item()
    assert auc > least_auc, auc
    probability = _reward(features=features, lr=3e-3, score="probability")
    probability.load_state_dict(reward.state_dict())
    torch.testing.assert_close(probability(_batch(7, 48, real=True)), torch.sigmoid(real))


def test_the_conditional_discriminator_learns_which_prompt_an_image_shows():
    """Samples that are clean renders of *another* train prompt: only the prompt tells them
    from the references, and the projection term learns it (an unconditional D cannot)."""

    def mismatched(seed: int, n: int) -> Rollout:
        rng = np.random.RandomState(seed)
        prompts = [PROMPTS[i] for i in rng.randint(len(PROMPTS), size=n)]
        others = [PROMPTS[(PROMPTS.index(p) + 1 + rng.randint(len(PROMPTS) - 1)) % len(PROMPTS)] for p in prompts]
        return _rollout(np.stack([render_scene(parse_prompt(o), 24, int(rng.randint(1 << 30))) for o in others]), prompts)

    dist = Collectives()
    aucs = {}
    for conditional in (True, False):
        reward = _reward(features="encoder", conditional=conditional, lr=3e-3)
        for step in range(40):
            reward.update(mismatched(200 + step, 32), torch.zeros(32), step=step, dist=dist)
        real, fake = reward(_batch(9, 48, real=True)), reward(mismatched(10, 48))
        aucs[conditional] = (real[:, None] > fake[None, :]).float().mean().item()
    assert aucs[True] > 0.85 and aucs[False] < 0.7, aucs


def test_the_shipped_encoder_loads_and_reads_held_out_scenes():
    """assets/shapes_encoder: f(x) is [B, 64] for any image size, and its heads count the
    colours and place the objects of renders of held-out scenes (combinations it never
    saw). Its shape counts are near the majority guess (benchmarks/results/images.md), so they are
    not asserted."""
    from mmrl.tasks.shapes.encoder import attribute_accuracy, load_shapes_encoder, render_dataset
    from mmrl.tasks.shapes.world import split_scenes

    encoder = load_shapes_encoder(ENCODER)
    assert not any(p.requires_grad for p in encoder.parameters())
    assert (ENCODER / "model.safetensors").stat().st_size < 1_000_000
    images = torch.from_numpy(np.stack([render_scene(parse_prompt("two red circles"), 24, seed) for seed in range(3)]))
    assert encoder(images).shape == (3, 64)
    assert encoder(torch.zeros(2, 32, 32, 3, dtype=torch.uint8)).shape == (2, 64)
    _, held = split_scenes(0.2, 0)
    figures = attribute_accuracy(encoder, *render_dataset(held[:200], 1, 24, seed=5))
    assert figures["colour_count"] > 0.95 and figures["grid"] > 0.95, figures


def test_a_missing_or_foreign_encoder_directory_is_a_one_line_error(tmp_path):
    from mmrl.tasks.shapes.encoder import load_shapes_encoder

    with pytest.raises(ConfigError, match=r"^encoder: got '.*'; expected a shapes encoder directory"):
        load_shapes_encoder(tmp_path)
    (tmp_path / "config.yaml").write_text("type: bt_image\n")
    (tmp_path / "model.safetensors").write_bytes((ENCODER / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=r"describes a 'bt_image', not a shapes_encoder"):
        load_shapes_encoder(tmp_path)


def test_bad_options_are_one_line_errors_naming_the_field(tmp_path):
    def build(**options):
        return from_dict(AdversarialConfig, {"type": "adversarial", **options}, "rewards[0]")

    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.conditional: got True; a directory of reference images has no prompts"):
        build(references=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.score: got 'odds'"):
        build(score="odds")
    with pytest.raises(ConfigError, match=r"^rewards.adversarial.references: got '.*nowhere'; shapes, or a directory"):
        _reward(features="pixels", references=str(tmp_path / "nowhere"), conditional=False)
    with pytest.raises(ConfigError, match=r"^rewards.adversarial.encoder: got '.*missing'; expected a shapes encoder directory"):
        _reward(encoder=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="holds no reference images"):
        _reward(features="pixels", references=str(tmp_path), conditional=False)
    reward = _reward(features="pixels")
    rollout = _rollout(np.zeros((2, 24, 24, 3), dtype=np.uint8), ["a red circle", "a blue dog"])
    with pytest.raises(ConfigError, match=r"sample 1's is not a shapes scene: 'a blue dog' is not a shapes prompt"):
        reward.update(rollout, torch.zeros(2), step=0, dist=Collectives())


def test_references_from_a_directory_train_an_unconditional_discriminator(tmp_path):
    import cv2

    for i in range(6):
        cv2.imwrite(str(tmp_path / f"ref{i}.png"), cv2.cvtColor(render_scene(parse_prompt(PROMPTS[i]), 32, i), cv2.COLOR_RGB2BGR))
    reward = _reward(features="pixels", references=str(tmp_path), conditional=False, lr=3e-3)
    for step in range(25):  # the 32x32 references are resized to the samples' 24x24
        metrics = reward.update(_batch(300 + step, 16, real=False), torch.zeros(16), step=step, dist=Collectives())
    assert metrics["accuracy_real"] > 0.8 and metrics["accuracy_fake"] > 0.8


# ------------------------------------------------------------------ through the trainer


def _image_run(**sections) -> dict:
    """A tiny text-conditioned image policy on the shapes prompts, rewarded by the
    adversarial reward alone (pixels: no encoder needed)."""
    data = {
        "name": "adversarial", "seed": 0, "total_steps": 3,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 16, "conditioning": "text", "text_injection": "pooled", "block_out_channels": [8, 16], "norm_num_groups": 4,
                                                          "text_hidden_size": 16, "text_layers": 0, "text_heads": 2, "pooling_heads": 2, "max_prompt_tokens": 8},
                   "denoising": {"num_inference_steps": 3, "logp_reduction": "mean"}},
        "sampler": {"type": "prompt", "data": {"train": str(SHAPES / "train.jsonl"), "eval": str(SHAPES / "eval.jsonl")}, "batch_groups": 2},
        "rewards": [{"type": "adversarial", "features": "pixels", "width": 8, "hidden": 16, "lr": 3e-3}],
        "algo": {"group_size": 2, "groups_per_step": 4},
        "optim": {"lr": 1e-3}, "eval": {"every": 0, "at_end": False}, "checkpoint": {"every": 0},
        "log": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


def test_rl_with_the_adversarial_reward_alone_trains_the_policy_and_the_discriminator(tmp_path):
    train(from_dict(TrainConfig, _image_run(total_steps=4)), tmp_path / "run")
    steps = _steps(read_metrics(tmp_path / "run"))
    assert len(steps) == 4
    assert steps[0]["reward/adversarial"] == 0.0  # the untrained D gives no signal
    assert all(r["reward/adversarial"] != 0.0 for r in steps[1:])
    assert all(0 <= r[f"reward_update/adversarial/{k}"] <= 1 for r in steps for k in ("accuracy_real", "accuracy_fake"))
    assert steps[-1]["reward_update/adversarial/loss"] < steps[0]["reward_update/adversarial/loss"]
    assert any(r["loss/policy"] != 0.0 for r in steps[1:])


def test_its_state_resumes_exactly(tmp_path):
    data = _image_run(total_steps=4, checkpoint={"every": 2})
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 2}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    _same(_steps(read_metrics(tmp_path / "split")), _steps(read_metrics(tmp_path / "straight")))
    a = torch.load(tmp_path / "straight/checkpoints/step_00000004/state.pt", weights_only=True)["rewards"]["0:adversarial"]
    b = torch.load(tmp_path / "split/checkpoints/step_00000004/state.pt", weights_only=True)["rewards"]["0:adversarial"]
    assert a["updates"] == b["updates"] == 4
    for k in a["discriminator"]:
        assert torch.equal(a["discriminator"][k], b["discriminator"][k]), k


@pytest.mark.numerics
def test_two_processes_match_one_process(tmp_path, write_config):
    """torchrun: each process renders the references of its own samples (seeded by their
    global rows) and the update all-reduces D's gradient, so two processes end with one's
    discriminator and log its metrics. The policy is held (lr 1e-12: its float32 update
    differs across process counts by rounding, which would change the images); D is float64."""
    path = write_config(_image_run(total_steps=3, optim={"lr": 1e-12}, checkpoint={"every": 3},
                                   rewards=[{"type": "adversarial", "features": "encoder", "encoder": str(ENCODER), "hidden": 16, "lr": 3e-3, "dtype": "float64"}]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "mmrl", "train", path, "--run-dir", tmp_path / "one"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29547", "-m", "mmrl", "train", path, "--run-dir", tmp_path / "two"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    ra, rb = _steps(read_metrics(tmp_path / "one")), _steps(read_metrics(tmp_path / "two"))
    assert len(ra) == len(rb) == 3
    for x, y in zip(ra, rb):
        for key in ("reward_update/adversarial/loss", "reward_update/adversarial/accuracy_real", "reward_update/adversarial/r1", "reward/adversarial"):
            assert x[key] == pytest.approx(y[key], rel=0, abs=1e-10), (x["step"], key)
    a = torch.load(tmp_path / "one/checkpoints/step_00000003/state.pt", weights_only=True)["rewards"]["0:adversarial"]["discriminator"]
    b = torch.load(tmp_path / "two/checkpoints/step_00000003/state.pt", weights_only=True)["rewards"]["0:adversarial"]["discriminator"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-10)
