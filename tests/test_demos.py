"""Demonstrations on disk: exact round trip, atomic writes, SFT samples with action chunks."""

import json

import numpy as np
import pytest

from mmrl import demos
from mmrl.demos import Episode, chunk_samples, read_demos, read_index, write_demos
from mmrl.errors import ConfigError


def _episode(steps: int, seed: int = 0, image_shape=(8, 8, 3), task="object_red") -> Episode:
    rng = np.random.default_rng(seed)
    return Episode(
        image=rng.integers(0, 256, size=(steps, *image_shape), dtype=np.uint8),
        state=rng.normal(size=(steps, 4)).astype(np.float32),
        action=rng.uniform(-1, 1, size=(steps, 2)).astype(np.float32),
        reward=np.r_[np.zeros(steps - 1), 1.0].astype(np.float32),
        success=bool(seed % 2 == 0),
        instruction=f"push the block number {seed} into the green zone",
        task=task,
        seed=2**31 - 1 - seed,
    )


def _assert_equal(a: Episode, b: Episode) -> None:
    for key in ("image", "state", "action", "reward"):
        x, y = getattr(a, key), getattr(b, key)
        assert x.dtype == y.dtype and np.array_equal(x, y), key
    for key in ("success", "instruction", "task", "seed"):
        assert getattr(a, key) == getattr(b, key) and type(getattr(a, key)) is type(getattr(b, key)), key


def test_write_then_read_round_trips_exactly(tmp_path):
    episodes = [_episode(5, 0), _episode(1, 1, image_shape=(2, 8, 8, 3)), _episode(12, 2)]
    write_demos(tmp_path / "d", episodes, metadata={"env_id": "mmrl/Tabletop-v0"})
    back = read_demos(tmp_path / "d")
    assert len(back) == 3
    for a, b in zip(episodes, back):
        _assert_equal(a, b)
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    assert index["format"] == "mmrl-demos" and index["version"] == 1 and index["env_id"] == "mmrl/Tabletop-v0"
    assert index["episodes"] == ["episode_000000.npz", "episode_000001.npz", "episode_000002.npz"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["episode_000000.npz", "episode_000001.npz", "episode_000002.npz", "index.json"]


def test_an_existing_directory_is_refused_unless_appending(tmp_path):
    write_demos(tmp_path, [_episode(3, 0)])
    with pytest.raises(ConfigError, match="already holds demonstrations"):
        write_demos(tmp_path, [_episode(3, 1)])
    write_demos(tmp_path, [_episode(4, 1)], append=True)
    back = read_demos(tmp_path)
    assert [len(e) for e in back] == [3, 4] and read_index(tmp_path)["episodes"][-1] == "episode_000001.npz"


def test_a_failed_write_leaves_neither_a_partial_file_nor_an_index(tmp_path, monkeypatch):
    def broken(f, **arrays):
        f.write(b"half an episode")
        raise OSError("disk full")

    monkeypatch.setattr(demos.np, "savez_compressed", broken)
    with pytest.raises(OSError, match="disk full"):
        write_demos(tmp_path / "d", [_episode(3)])
    assert list((tmp_path / "d").iterdir()) == []


def test_bad_directories_and_episodes_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="index.json"):
        read_demos(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": "other", "episodes": []}))
    with pytest.raises(ConfigError, match="mmrl-demos"):
        read_demos(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": "mmrl-demos", "version": 1, "episodes": ["episode_000000.npz"]}))
    with pytest.raises(ConfigError, match="missing"):
        read_demos(tmp_path)
    bad = _episode(3)
    bad.image = bad.image.astype(np.float32)
    with pytest.raises(ValueError, match="image"):
        write_demos(tmp_path / "new", [bad])
    short = _episode(3)
    short.action = short.action[:2]
    with pytest.raises(ValueError, match="same number"):
        write_demos(tmp_path / "new", [short])


def test_chunk_samples_give_every_step_its_next_actions_padded_with_the_last():
    a, b = _episode(3, 0), _episode(2, 1)
    samples = chunk_samples([a, b], chunk=4)
    assert samples["image"].shape == (5, 8, 8, 3) and samples["image"].dtype == np.uint8
    assert samples["state"].shape == (5, 4) and samples["state"].dtype == np.float32
    assert samples["actions"].shape == (5, 4, 2) and samples["action_mask"].shape == (5, 4)
    assert samples["instruction"] == [a.instruction] * 3 + [b.instruction] * 2
    assert np.array_equal(samples["image"][3], b.image[0]) and np.array_equal(samples["state"][1], a.state[1])
    # step 1 of episode a: actions 1, 2, then the last action (2) twice as padding
    assert np.array_equal(samples["actions"][1], a.action[[1, 2, 2, 2]])
    assert samples["action_mask"][1].tolist() == [1, 1, 0, 0]
    assert np.array_equal(samples["actions"][0, :3], a.action) and samples["action_mask"][0].tolist() == [1, 1, 1, 0]
    assert np.array_equal(samples["actions"][4], b.action[[1, 1, 1, 1]]) and samples["action_mask"][4].tolist() == [1, 0, 0, 0]
    one = chunk_samples([a], chunk=1)
    assert np.array_equal(one["actions"][:, 0], a.action) and one["action_mask"].all()
    with pytest.raises(ValueError):
        chunk_samples([a], chunk=0)
