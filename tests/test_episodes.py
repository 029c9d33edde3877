"""Episodes in LeRobotDataset v3's layout: read back exactly by mmrl and by a plain parquet +
video reader written here from the layout's description; costs; atomic writes; collect and
eval write it."""

import json

import numpy as np
import pytest

from mmrl.cli import main
from mmrl.commands.collect import collect
from mmrl.demos import Episode, read_demos, write_demos
from mmrl.episodes import read_episodes, write_episodes
from mmrl.errors import ConfigError

pytest.importorskip("pyarrow")
pytest.importorskip("imageio_ffmpeg")


def _episodes(cameras: int = 2, seed: int = 0) -> list[Episode]:
    """Random episodes of different lengths, instructions and outcomes (noise frames: the
    hardest content for a video codec to keep exact)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (steps, success) in enumerate([(5, True), (3, False), (7, True)]):
        shape = (steps, cameras, 16, 24, 3) if cameras > 1 else (steps, 16, 24, 3)
        out.append(Episode(
            image=rng.integers(0, 256, shape, dtype=np.uint8), state=rng.normal(size=(steps, 4)).astype(np.float32),
            action=rng.uniform(-1, 1, (steps, 2)).astype(np.float32), reward=np.eye(steps, dtype=np.float32)[-1] * success,
            success=success, instruction=["push the red block left", "push the blue block up"][i % 2], task=f"task_{i % 2}", seed=100 + i,
            costs={"path_length": float(rng.uniform()), "steps": float(steps), **({"collisions": 2.0} if i != 1 else {})},
            step_success=np.eye(steps, dtype=bool)[-1] & success,
        ))
    return out


def _same(a: Episode, b: Episode) -> None:
    for key in ("image", "state", "action", "reward"):
        x, y = getattr(a, key), getattr(b, key)
        assert x.dtype == y.dtype and np.array_equal(x, y), key
    assert (a.success, a.instruction, a.task, a.seed, a.costs) == (b.success, b.instruction, b.task, b.seed, b.costs)
    assert (a.step_success is None) == (b.step_success is None)
    if a.step_success is not None:
        assert b.step_success.dtype == np.bool_ and np.array_equal(a.step_success, b.step_success)


@pytest.mark.parametrize("cameras", [1, 2])
def test_written_episodes_read_back_exactly_frames_included(tmp_path, cameras):
    episodes = _episodes(cameras)
    write_episodes(tmp_path / "ds", episodes, fps=10, cameras=["top", "front"][:cameras])
    back = read_episodes(tmp_path / "ds")
    assert len(back) == 3
    for a, b in zip(episodes, back):
        _same(a, b)
    assert [e.task for e in read_demos(tmp_path / "ds")] == ["task_0", "task_1", "task_0"]  # the demonstrations reader reads the layout too


def test_a_plain_parquet_and_video_reader_finds_every_episode_where_the_layout_says(tmp_path):
    """A reader of LeRobotDataset v3 written from its description (pyarrow, pandas,
    ``datasets`` and OpenCV; none of mmrl's code) gets the same episodes."""
    cv2 = pytest.importorskip("cv2")
    datasets = pytest.importorskip("datasets")
    import pandas as pd
    import pyarrow.parquet as pq

    episodes = _episodes(2)
    root = tmp_path / "ds"
    write_episodes(root, episodes, fps=10, cameras=["top", "front"])
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 15, 2)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    features = info["features"]
    assert features["observation.images.top"]["dtype"] == "video" and features["observation.images.top"]["shape"] == [16, 24, 3]
    assert features["observation.state"] == {"dtype": "float32", "shape": [4], "names": None} and features["action"]["shape"] == [2]
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert name in features

    tasks = pd.read_parquet(root / "meta/tasks.parquet")
    assert tasks.index.name == "task" and tasks.loc["push the blue block up", "task_index"] == 1
    meta = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pandas()
    data = datasets.load_dataset("parquet", data_files=str(root / info["data_path"].format(chunk_index=0, file_index=0)), split="train", cache_dir=str(tmp_path / "cache"))
    stats = json.loads((root / "meta/stats.json").read_text())
    assert np.allclose(stats["action"]["mean"], np.concatenate([e.action for e in episodes]).mean(0), atol=1e-6)
    assert np.array(stats["observation.images.front"]["mean"]).shape == (3, 1, 1)

    def decode(key: str) -> np.ndarray:
        capture = cv2.VideoCapture(str(root / info["video_path"].format(video_key=key, chunk_index=0, file_index=0)))
        frames = []
        while True:
            ok, frame = capture.read()
            if not ok:
                return np.stack(frames)
            frames.append(frame[..., ::-1])  # BGR → RGB

    videos = {key: decode(f"observation.images.{key}") for key in ("top", "front")}
    for i, episode in enumerate(episodes):
        row = meta[meta["episode_index"] == i].iloc[0]
        start, stop = int(row["dataset_from_index"]), int(row["dataset_to_index"])
        assert stop - start == len(episode) == int(row["length"])
        steps = data.select(range(start, stop))
        assert steps["episode_index"] == [i] * len(episode) and steps["frame_index"] == list(range(len(episode)))
        assert np.array_equal(np.array(steps["action"], np.float32), episode.action)
        assert np.array_equal(np.array(steps["observation.state"], np.float32), episode.state)
        assert steps["next.done"][-1] and not any(steps["next.done"][:-1])
        assert tasks.index[steps["task_index"][0]] == episode.instruction == row["tasks"][0]
        assert bool(row["success"]) == episode.success and row["costs/path_length"] == episode.costs["path_length"]
        for k, key in enumerate(("top", "front")):
            first = round(row[f"videos/observation.images.{key}/from_timestamp"] * info["fps"])
            assert round(row[f"videos/observation.images.{key}/to_timestamp"] * info["fps"]) - first == len(episode)
            assert np.array_equal(videos[key][first : first + len(episode)], episode.image[:, k])  # lossless: bit for bit
    assert np.isnan(meta["costs/collisions"].iloc[1])  # a cost the episode's env did not report


def test_a_directory_with_files_is_refused_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import mmrl.episodes

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        write_episodes(tmp_path / "full", _episodes())

    def broken(path, frames, fps):
        raise OSError("disk full")

    monkeypatch.setattr(mmrl.episodes, "_write_video", broken)
    with pytest.raises(OSError):
        write_episodes(tmp_path / "ds", _episodes())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no dataset, no temporary directory


def test_reading_a_dataset_with_a_missing_video_or_a_foreign_version_names_it(tmp_path):
    write_episodes(tmp_path / "ds", _episodes(1), cameras=["top"])
    (tmp_path / "ds/videos/observation.images.top/chunk-000/file-000.mp4").unlink()
    with pytest.raises(ConfigError, match="file-000.mp4.*missing"):
        read_episodes(tmp_path / "ds")
    info = json.loads((tmp_path / "ds/meta/info.json").read_text())
    (tmp_path / "ds/meta/info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(ConfigError, match="v2.1"):
        read_episodes(tmp_path / "ds")


def test_per_step_success_is_the_next_success_column_and_is_left_out_unless_every_episode_has_it(tmp_path):
    import pyarrow.parquet as pq

    episodes = _episodes(1)
    write_episodes(tmp_path / "all", episodes, fps=10)
    data = pq.read_table(next((tmp_path / "all" / "data").glob("chunk-*/file-*.parquet"))).to_pydict()
    assert data["next.success"] == [False] * 4 + [True] + [False] * 3 + [False] * 6 + [True]  # lengths 5, 3, 7
    assert json.loads((tmp_path / "all/meta/info.json").read_text())["features"]["next.success"]["dtype"] == "bool"
    episodes[1].step_success = None
    write_episodes(tmp_path / "some", episodes, fps=10)
    assert "next.success" not in pq.read_table(next((tmp_path / "some" / "data").glob("chunk-*/file-*.parquet"))).column_names
    assert all(e.step_success is None for e in read_episodes(tmp_path / "some"))
    with pytest.raises(ValueError, match=r"episodes\[0\]: every array needs the same number"):
        episodes[0].step_success = np.zeros(2, bool)
        write_episodes(tmp_path / "bad", episodes, fps=10)


def test_costs_survive_the_demonstrations_format_too(tmp_path):
    episodes = _episodes(1)
    write_demos(tmp_path, episodes)
    for a, b in zip(episodes, read_demos(tmp_path)):
        _same(a, b)


def test_collect_writes_the_lerobot_layout_with_the_same_episodes_and_their_costs(tmp_path):
    kwargs = {"image_size": 16, "cameras": ["top", "front"]}
    collect(["spatial_left", "object_red"], 2, tmp_path / "npz", seed=7, env_kwargs=kwargs, noise=0.3)
    collect(["spatial_left", "object_red"], 2, tmp_path / "lerobot", seed=7, env_kwargs=kwargs, noise=0.3, layout="lerobot")
    npz, lerobot = read_demos(tmp_path / "npz"), read_episodes(tmp_path / "lerobot")
    assert len(npz) == len(lerobot) == 4
    for a, b in zip(npz, lerobot):
        _same(a, b)
        assert a.costs["steps"] == len(a) and a.costs["path_length"] > 0
        # the tabletop ends an episode at success: only its last step can be one
        assert not a.step_success[:-1].any() and bool(a.step_success[-1]) == a.success
    info = json.loads((tmp_path / "lerobot/meta/info.json").read_text())
    assert "observation.images.front" in info["features"] and info["mmrl"]["env_kwargs"] == kwargs
    with pytest.raises(ConfigError, match="append"):
        collect(["spatial_left"], 1, tmp_path / "other", env_kwargs=kwargs, layout="lerobot", append=True)


TINY_RUN = """
name: tiny
env: {type: gym, id: mmrl/Tabletop-v0, num_envs: 3, kwargs: {task: spatial, image_size: 16, cameras: [top, front]}, max_episode_steps: 6}
policy: {type: flow_vla, action_chunk: 2, denoising: {num_inference_steps: 2},
         backbone: {hidden_size: 16, num_layers: 1, num_heads: 2, intermediate_size: 32, vision_channels: [4, 8], patch_grid: 4}}
sampler: {type: env}
rewards: [{type: success}]
algo: {group_size: 2, groups_per_step: 1}
eval: {episodes: 4}
"""


def test_mmrl_eval_saves_each_evaluated_episode_with_its_outcome_and_costs(tmp_path, capsys):
    pytest.importorskip("mujoco")
    config = tmp_path / "run.yaml"
    config.write_text(TINY_RUN)
    assert main(["eval", str(config), "--out", str(tmp_path / "eval"), "--save-episodes", str(tmp_path / "episodes")]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    episodes = read_episodes(tmp_path / "episodes")
    assert len(episodes) == result["episodes"] == 4
    assert [float(e.success) for e in episodes] == result["successes"]
    assert all(e.image.shape == (len(e), 2, 16, 16, 3) and e.costs["steps"] == len(e) <= 6 for e in episodes)
    assert result["cost_path_length_mean"] == pytest.approx(np.mean([e.costs["path_length"] for e in episodes]))
    assert all(e.seed >= 2**31 and e.task.startswith("spatial_") for e in episodes)  # evaluation seeds, the env's task names
    assert all(e.step_success is not None and len(e.step_success) == len(e) and bool(e.step_success.any()) == e.success for e in episodes)
    capsys.readouterr()
    assert main(["eval", str(config), "--save-episodes", str(tmp_path / "episodes")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--save-episodes" in err[0] and "not empty" in err[0]


def test_the_collect_command_writes_the_lerobot_layout_and_refuses_to_append_to_it(tmp_path, capsys):
    pytest.importorskip("mujoco")
    out = tmp_path / "ds"
    assert main(["collect", "--task", "spatial_left", "--episodes-per-task", "2", "--image-size", "16", "--format", "lerobot", "--out", str(out)]) == 0
    episodes = read_episodes(out)
    assert [(e.task, e.seed, e.success) for e in episodes] == [("spatial_left", 0, True), ("spatial_left", 1, True)]
    capsys.readouterr()
    assert main(["collect", "--task", "spatial_left", "--episodes-per-task", "1", "--format", "lerobot", "--append", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "append" in err[0]
