"""The learned_success classifier: its loss, the labelled-frames source, learning to tell
success from failure on held-out episodes, save/load, and train-reward's one-line errors."""

import json

import numpy as np
import pytest
import torch

from mmrl.cli import main
from mmrl.config import from_dict
from mmrl.data.success_frames import SuccessFrames, SuccessFramesConfig, held_out_split, labelled_frames, mover_mean_interval
from mmrl.demos import Episode, write_demos
from mmrl.policies.learned_success import LearnedSuccessConfig, LearnedSuccessModel, balanced_bce

SIZE = 16
TINY = {"type": "learned_success", "image_size": SIZE, "state_dim": 2, "channels": [8, 16], "strides": [1, 2], "hidden": 16, "shift": 1, "prompt": {"dim": 8, "buckets": 64}}
ZONES = ("red", "blue")
COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220)}


def _frame(zones: dict, block: tuple[int, int]) -> np.ndarray:
    """A 16x16 table: two 5x5 coloured zones and a white 2x2 block."""
    image = np.full((SIZE, SIZE, 3), 90, np.uint8)
    for name, (r, c) in zones.items():
        image[r : r + 5, c : c + 5] = COLOURS[name]
    image[block[0] : block[0] + 2, block[1] : block[1] + 2] = 255
    return image


def synthetic_episode(rng: np.random.Generator, success: bool, steps: int = 6) -> Episode:
    """The block slides to the instructed zone (a success) or stops in the other zone or
    between them (a failure); the state is noise, so only the image and the instruction tell."""
    rows = rng.permutation([1, 10])
    zones = {"red": (int(rows[0]), int(rng.integers(0, 11))), "blue": (int(rows[1]), int(rng.integers(0, 11)))}
    target = ZONES[int(rng.integers(2))]
    if success:
        end = zones[target]
    elif rng.random() < 0.5:
        end = zones[ZONES[1 - ZONES.index(target)]]
    else:
        end = (6, int(rng.integers(0, 14)) - 1)
    end = (end[0] + 1, max(0, end[1]) + 1)
    start = np.array([int(rng.integers(0, 14)), int(rng.integers(0, 14))])
    path = [tuple(np.round(start + (np.array(end) - start) * t / (steps - 1)).astype(int)) for t in range(steps)]
    return Episode(
        image=np.stack([_frame(zones, p) for p in path]), state=rng.normal(size=(steps, 2)).astype(np.float32),
        action=np.zeros((steps, 2), np.float32), reward=np.zeros(steps, np.float32), success=success,
        instruction=f"push the block into the {target} zone", task=target, seed=0,
    )


def write_synthetic(directory, n: int, seed: int, success_fraction: float = 0.5):
    rng = np.random.default_rng(seed)
    write_demos(directory, [synthetic_episode(rng, i < round(success_fraction * n)) for i in range(n)])
    return directory


def test_balanced_bce_weighs_the_two_classes_alike_and_is_the_plain_mean_for_one_class():
    logits, labels = torch.tensor([2.0, -1.0, 0.5, 0.3]), torch.tensor([1.0, 0.0, 0.0, 0.0])
    per = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    assert torch.allclose(balanced_bce(logits, labels), 0.5 * per[0] + 0.5 * per[1:].mean())
    assert torch.allclose(balanced_bce(logits, torch.ones(4)), torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(4)))


def test_labelled_frames_take_the_last_k_frames_and_optional_early_negatives():
    rng = np.random.default_rng(0)
    episodes = [synthetic_episode(rng, True), synthetic_episode(rng, False)]
    frames = labelled_frames(episodes, last_frames=2, early_negatives_gap=None)
    assert frames["label"].tolist() == [1, 1, 0, 0] and frames["episode"].tolist() == [0, 0, 1, 1]
    assert np.array_equal(frames["image"][1], episodes[0].image[-1]) and np.array_equal(frames["image"][0], episodes[0].image[-2])
    early = labelled_frames(episodes, last_frames=1, early_negatives_gap=4)
    # steps 0 and 1 of the 6-step success are at least 4 steps before its end: negatives; the failure adds none
    assert early["label"].tolist() == [1, 0, 0, 0] and early["episode"].tolist() == [0, 0, 0, 1]
    assert np.array_equal(early["image"][1], episodes[0].image[0])


def with_step_success(episode: Episode, solved_from: int | None) -> Episode:
    """``episode`` with its per-step success: true after action ``solved_from`` on (None: never)."""
    flags = np.zeros(len(episode), bool)
    if solved_from is not None:
        flags[solved_from:] = True
    episode.step_success = flags
    return episode


def test_step_labels_give_each_frame_the_success_of_the_state_it_shows():
    rng = np.random.default_rng(0)
    solved = with_step_success(synthetic_episode(rng, True), solved_from=4)  # the block is in the zone in frame 5, after action 4
    failed = with_step_success(synthetic_episode(rng, False), solved_from=None)
    frames = labelled_frames([solved, failed], last_frames=1, early_negatives_gap=None, labels="step")
    # frames 1..5 of each 6-step episode (frame 0 is the reset state: unlabelled)
    assert frames["episode"].tolist() == [0] * 5 + [1] * 5
    assert frames["label"].tolist() == [0, 0, 0, 0, 1] + [0] * 5
    assert np.array_equal(frames["image"][4], solved.image[5]) and np.array_equal(frames["image"][0], solved.image[1])


def test_held_out_split_is_by_episode_within_each_outcome_and_depends_on_its_seed_only():
    outcomes = [True] * 10 + [False] * 6
    held = held_out_split(outcomes, 0.2, seed=3)
    assert held[:10].sum() == 2 and held[10:].sum() == 1
    assert np.array_equal(held, held_out_split(outcomes, 0.2, seed=3)) and not held_out_split(outcomes, 0.0, 3).any()


def test_mover_interval_of_a_mean_of_two_proportions_contains_it_and_reduces_to_half_width_for_equal_intervals():
    low, high = mover_mean_interval(0.9, (0.8, 0.96), 0.6, (0.45, 0.73))
    assert low < 0.75 < high
    # equal intervals: half-widths shrink by 1/sqrt(2) (the mean of two independent estimates)
    low, high = mover_mean_interval(0.5, (0.4, 0.6), 0.5, (0.4, 0.6))
    assert abs((0.5 - low) - 0.1 / np.sqrt(2)) < 1e-12 and abs((high - 0.5) - 0.1 / np.sqrt(2)) < 1e-12


def _config(episodes, **changes):
    cfg = {"name": "success", "seed": 0, "total_steps": 2, "policy": dict(TINY), "algo": {"type": "sft"},
           "data": {"type": "success_frames", "path": str(episodes), "batch_size": 16, "held_out": 0.25},
           "optim": {"lr": 0.003, "warmup_steps": 0}, "eval": {"every": 0}, "checkpoint": {"every": 0},
           "log": {"progress": False, "tensorboard": False}}
    for key, value in changes.items():
        merge = isinstance(value, dict) and isinstance(cfg.get(key), dict) and value.get("type", cfg[key].get("type")) == cfg[key].get("type")
        cfg[key] = {**cfg[key], **value} if merge else value
    return cfg


@pytest.mark.learning
@pytest.mark.parametrize("seed", [0, 1])
def test_the_classifier_learns_success_from_final_frames_on_held_out_episodes(tmp_path, write_config, capsys, learned, learning_seed, seed):
    """80 episodes (half successes), a quarter held out by episode: the instruction decides
    which zone counts, so the classifier must read both the image and the instruction."""
    data = write_synthetic(tmp_path / "episodes", 80, seed=seed)
    path = write_config(_config(data, seed=learning_seed + seed, total_steps=300))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run")]) == 0
    line = capsys.readouterr().out
    assert "held-out success accuracy" in line and "over 20 frames" in line
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "eval/success_accuracy" in r][-1]
    assert final["eval/success_accuracy_ci_low"] <= final["eval/success_accuracy"] <= final["eval/success_accuracy_ci_high"]
    assert final["eval/success_balanced_accuracy_ci_low"] <= final["eval/success_balanced_accuracy"] <= final["eval/success_balanced_accuracy_ci_high"]
    # chance is 0.5; 0.8 over 20 held-out frames is 3 standard errors above it
    learned(final["eval/success_balanced_accuracy"], 0.8, name="held-out balanced accuracy")


def test_saved_classifier_loads_back_with_equal_probabilities(tmp_path):
    from mmrl.core.weights import load_pretrained, save_pretrained

    torch.manual_seed(0)
    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {k: v for k, v in TINY.items() if k != "type"}, "policy"))
    episode = synthetic_episode(np.random.default_rng(0), True)
    obs = {"image": torch.from_numpy(episode.image), "state": torch.from_numpy(episode.state), "instruction": [episode.instruction] * len(episode)}
    save_pretrained(model, tmp_path / "weights")
    loaded = load_pretrained(tmp_path / "weights")
    assert isinstance(loaded, LearnedSuccessModel)
    assert torch.equal(model.eval().success_probability(obs), loaded.eval().success_probability(obs))


def test_two_cameras_are_read_by_one_shared_tower_in_camera_order():
    torch.manual_seed(0)
    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {**{k: v for k, v in TINY.items() if k != "type"}, "cameras": 2, "shift": 0}, "policy")).eval()
    images = torch.randint(0, 256, (3, 2, SIZE, SIZE, 3), dtype=torch.uint8)
    obs = {"image": images, "state": torch.zeros(3, 2), "instruction": ["push the block into the red zone"] * 3}
    swapped = {**obs, "image": images.flip(1)}
    assert not torch.allclose(model.logits(obs), model.logits(swapped))  # the head knows which camera is which
    with pytest.raises(ValueError, match=r"\[N, 2, 16, 16, 3\]"):
        model.logits({**obs, "image": images[:, 0]})


def test_the_shift_augmentation_moves_images_by_at_most_shift_pixels():
    torch.manual_seed(0)
    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {**{k: v for k, v in TINY.items() if k != "type"}, "shift": 2}, "policy"))
    image = torch.zeros(1, SIZE, SIZE, 3, dtype=torch.uint8)
    image[0, 8, 8] = 255
    moved = model.augment_images(image.expand(64, -1, -1, -1).contiguous())
    where = [tuple(int(i) for i in torch.nonzero(m[..., 0])[0]) for m in moved]
    offsets = {(r - 8, c - 8) for r, c in where}
    assert all(abs(dr) <= 2 and abs(dc) <= 2 for dr, dc in offsets) and len(offsets) > 10
    assert all((m > 0).sum() == 3 for m in moved)  # one white pixel, nothing else changes


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("episodes"), 12, seed=0)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"policy": {"image_size": 32}}, ["data.path", "images [16, 16, 3]", "images [32, 32, 3]"]),
        ({"policy": {"state_dim": 3}}, ["data.path", "state [2]", "state [3]"]),
        ({"policy": {"type": "bt_image", "image_size": SIZE, "channels": [8], "prompt": {"dim": 8, "buckets": 64}}}, ["policy.type", "bt_image", "learned_success"]),
        ({"data": {"path": "/no/such/dir"}}, ["data.path", "/no/such/dir", "no such directory"]),
        ({"data": {"held_out": 0.95}}, ["data.held_out", "0.95", "leaves no"]),
        ({"data": {"type": "completions", "path": "x.jsonl"}}, ["data.type", "completions", "success_frames"]),
    ],
)
def test_bad_classifier_input_exits_2_with_one_line(tmp_path, episodes_dir, write_config, capsys, changes, expected):
    path = write_config(_config(episodes_dir, **changes))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    for part in expected:
        assert part in line, line


def test_episodes_of_a_single_outcome_are_refused_naming_the_directory(tmp_path, write_config, capsys):
    data = write_synthetic(tmp_path / "only_successes", 6, seed=0, success_fraction=1.0)
    path = write_config(_config(data))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "data.path" in line and str(data) in line and "all successful" in line and "--keep-failures" in line


def test_step_labels_need_per_step_success_that_shows_a_solved_frame(tmp_path, write_config, capsys):
    rng = np.random.default_rng(0)
    plain = write_synthetic(tmp_path / "plain", 8, seed=0)
    path = write_config(_config(plain, data={"labels": "step"}))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "data.labels" in line and "8 of 8 episodes carry no per-step success" in line and "labels: outcome" in line
    # success ends each episode at its last action: no recorded frame shows it
    ended = [with_step_success(synthetic_episode(rng, i < 4), 5 if i < 4 else None) for i in range(8)]
    write_demos(tmp_path / "ended", ended)
    path = write_config(_config(tmp_path / "ended", data={"labels": "step"}))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run2")]) == 2
    line = _error_line(capsys)
    assert "data.labels" in line and "one class only" in line and "terminate_on_success" in line
    path = write_config(_config(tmp_path / "ended", data={"labels": "step", "last_frames": 2}))
    assert main(["train-reward", str(path), "--run-dir", str(tmp_path / "run3")]) == 2
    assert "data.last_frames" in _error_line(capsys)


def test_the_source_reads_several_directories_and_holds_out_whole_episodes(tmp_path):
    successes = write_synthetic(tmp_path / "s", 8, seed=0, success_fraction=1.0)
    failures = write_synthetic(tmp_path / "f", 8, seed=1, success_fraction=0.0)
    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {k: v for k, v in TINY.items() if k != "type"}, "policy"))
    cfg = from_dict(SuccessFramesConfig, {"path": str(successes), "more_paths": [str(failures)], "last_frames": 2, "held_out": 0.25, "batch_size": 4}, "data")
    source = SuccessFrames(cfg, model, seed=0, world=1, rank=0)
    assert source.info == {"episodes": 16, "samples": 24, "held_out_episodes": 4}
    assert source.samples["label"].sum() == 12 and source.held_out["label"].sum() == 4
    metrics = source.evaluate(model)
    assert metrics["held_out_frames"] == 8 and 0 <= metrics["success_accuracy"] <= 1


def test_a_success_classifier_given_as_a_pairwise_reward_model_is_a_one_line_error(tmp_path):
    from mmrl.core.reward import RewardContext
    from mmrl.core.weights import save_pretrained
    from mmrl.errors import ConfigError
    from mmrl.rewards.pairwise import PairwisePreference, PairwisePreferenceConfig

    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {k: v for k, v in TINY.items() if k != "type"}, "policy"))
    save_pretrained(model, tmp_path / "classifier")
    with pytest.raises(ConfigError, match="'learned_success' model, a success classifier .*env.success_model.*bt_trajectory"):
        PairwisePreference(PairwisePreferenceConfig(model=str(tmp_path / "classifier")), RewardContext())
