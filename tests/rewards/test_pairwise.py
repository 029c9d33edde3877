"""pairwise_preference (a trained Bradley–Terry model as a reward) and visual_consistency."""

import numpy as np
import pytest
import torch

from mmrl.core.reward_aggregation import aggregate_rewards
from mmrl.config import from_dict
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import RewardContext, RewardSet, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.core.weights import latest_checkpoint
from mmrl.registry import REWARDS
from mmrl.rewards.pairwise import win_rate

pytest.importorskip("cv2")

TINY = {"type": "bt_image", "image_size": 16, "channels": [8, 16], "hidden": 16, "prompt": {"dim": 8, "buckets": 64}}


def _reward_cfg(**data) -> RewardConfig:
    return from_dict(REWARDS.entry(data["type"]).config, data, "rewards[0]")


def _rollout(images, prompts, group_size, metadata=None):
    b = len(images)
    info = {"images": torch.as_tensor(np.asarray(images)), "prompt": list(prompts)}
    if metadata is not None:
        info["metadata"] = metadata
    return Rollout(group_id=torch.arange(b // group_size).repeat_interleave(group_size), old=OldLogProbs(torch.zeros(b, 1)), mask=torch.ones(b, 1), replay={}, info=info)


def test_win_rate_lies_in_0_1_sums_to_half_the_group_size_and_is_antisymmetric():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(24, generator=gen) * 3
    groups = torch.arange(4).repeat_interleave(6)
    w = win_rate(scores, groups)
    assert ((w >= 0) & (w <= 1)).all()
    assert torch.allclose(w.reshape(4, 6).sum(1), torch.full((4,), 3.0), atol=1e-5)
    pair = win_rate(torch.tensor([2.0, -1.0]), torch.tensor([0, 0]))
    assert torch.allclose(pair.sum(), torch.tensor(1.0)) and pair[0] > 0.5
    assert torch.allclose(win_rate(scores + 7.0, groups), w, atol=1e-6)  # only comparisons matter
    assert win_rate(torch.tensor([5.0]), torch.tensor([0])).item() == 0.5


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A bt_image model trained for a few steps through the loop on written pairs."""
    from mmrl.data.preferences import write_preferences
    from mmrl.tasks.shapes.world import ObjectGroup, Scene, render_scene
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import Trainer

    root = tmp_path_factory.mktemp("rm")
    images, rows = [], {"train": [], "held_out": []}
    for i, (colour, other) in enumerate([("red", "blue"), ("blue", "green"), ("green", "red")] * 4):
        images += [render_scene(Scene((ObjectGroup(1, colour, "circle"),)), 16, 2 * i), render_scene(Scene((ObjectGroup(1, other, "circle"),)), 16, 2 * i + 1)]
        rows["train" if i < 9 else "held_out"].append({"prompt": f"a {colour} circle", "chosen": 2 * i, "rejected": 2 * i + 1, "metadata": {}})
    write_preferences(root / "pairs", "image", rows, images)
    cfg = from_dict(TrainConfig, {"name": "rm", "total_steps": 3, "policy": TINY, "algo": {"type": "sft"},
                                  "data": {"type": "preferences", "path": str(root / "pairs"), "batch_size": 8}, "log": {"progress": False, "tensorboard": False}})
    summary = Trainer(cfg, root / "run").train()
    return root / "run", summary


@pytest.mark.numerics
def test_a_trained_model_round_trips_through_its_checkpoint_and_loads_as_a_reward(trained_run):
    from mmrl.core.weights import load_pretrained
    from mmrl.tasks.shapes.world import ObjectGroup, Scene, render_scene

    run, summary = trained_run
    assert 0 <= summary["eval"]["pairwise_accuracy"] <= 1 and summary["eval"]["pairs"] == 3
    ckpt = latest_checkpoint(run)
    assert (ckpt / "model.safetensors").is_file()
    model = load_pretrained(ckpt).eval()
    images = np.stack([render_scene(Scene((ObjectGroup(1, c, "square"),)), 16, s) for s, c in enumerate(["red", "blue", "green", "red"] * 2)])
    prompts = ["a red square"] * 4 + ["a blue square"] * 4
    rollout = _rollout(images, prompts, group_size=4)
    with torch.no_grad():
        expected = model.score(prompts, torch.from_numpy(images))
    for where in (run, ckpt):  # a run directory (its latest checkpoint) or the checkpoint itself
        pointwise = build_reward(_reward_cfg(type="pairwise_preference", model=str(where), mode="pointwise", batch_size=3), RewardContext())
        assert torch.allclose(pointwise(rollout), expected, atol=1e-6)  # batches of 3: float sums may differ in the last bit
    rate = build_reward(_reward_cfg(type="pairwise_preference", model=str(run), mode="win_rate"), RewardContext())(rollout)
    assert torch.allclose(rate, win_rate(expected, rollout.group_id))
    assert torch.allclose(rate.reshape(2, 4).sum(1), torch.tensor([2.0, 2.0]), atol=1e-5)


def test_the_bt_reward_and_the_verifier_combine_through_log_tamed(trained_run):
    from mmrl.tasks.shapes.world import ObjectGroup, Scene, render_scene

    run, _ = trained_run
    scenes = [Scene((ObjectGroup(1, c, "circle"),)) for c in ("red", "blue", "red", "green")]
    images = np.stack([render_scene(s, 16, k) for k, s in enumerate(scenes)])
    rollout = _rollout(images, ["a red circle"] * 4, group_size=2)
    cfgs = [_reward_cfg(type="pairwise_preference", model=str(run), mode="win_rate"), _reward_cfg(type="shapes_geneval", mode="strict")]
    rewards = RewardSet(cfgs, "log_tamed", RewardContext())
    columns = rewards.score(rollout)
    assert torch.equal(columns[:, 1], REWARDS.get("shapes_geneval")(rollout, cfgs[1]))
    combined = rewards.combine(columns, rollout.group_id)
    assert torch.isfinite(combined).all()
    assert torch.allclose(combined, aggregate_rewards(columns, rollout.group_id, [1.0, 1.0], "log_tamed"))


def test_a_run_that_is_not_a_reward_model_or_a_missing_one_is_a_config_error(tmp_path):
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match="no such run"):
        build_reward(_reward_cfg(type="pairwise_preference", model=str(tmp_path / "nope")), RewardContext())
    with pytest.raises(ConfigError, match="model"):
        _reward_cfg(type="pairwise_preference")


def test_visual_consistency_scores_identical_images_above_varied_ones():
    from mmrl.tasks.shapes.world import ObjectGroup, Scene, render_scene

    same = [render_scene(Scene((ObjectGroup(1, "red", "circle"),)), 32, 0)] * 4
    varied = [render_scene(Scene((ObjectGroup(1, c, "circle"),)), 32, k) for k, c in enumerate(["red", "blue", "green", "yellow"])]
    similar = [render_scene(Scene((ObjectGroup(1, "red", "circle"),)), 32, k) for k in range(4)]  # one colour, other layouts
    rollout = _rollout(same + varied + similar, ["a circle"] * 12, group_size=4)
    for layout_weight in (0.0, 0.5):
        r = build_reward(_reward_cfg(type="visual_consistency", layout_weight=layout_weight), RewardContext())(rollout).reshape(3, 4)
        assert ((r >= 0) & (r <= 1 + 1e-6)).all()
        assert torch.allclose(r[0], torch.ones(4))
        assert r[1].max() < 0.2 and r[2].min() > r[1].max()
