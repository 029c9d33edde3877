"""Episodes on disk in LeRobotDataset v3's layout (``codebase_version`` ``v3.0``): parquet
tables, one mp4 per camera, and metadata, so that LeRobot's tools and any parquet + video
reader open what ``mmrl eval --save-episodes``, ``sampler.save_eval_episodes`` and
``mmrl collect --format lerobot`` write::

    meta/info.json                                  version, fps, counts, path templates, features
    meta/stats.json                                 per feature: min, max, mean, std, count
    meta/tasks.parquet                              index ``task`` (the instruction) → ``task_index``
    meta/episodes/chunk-000/file-000.parquet        one row per episode (below)
    data/chunk-000/file-000.parquet                 one row per step, all episodes
    videos/observation.images.<camera>/chunk-000/file-000.mp4
                                                    each camera's frames, all episodes in order

**Steps** (``data``): ``observation.state`` float32 [D] and ``action`` float32 [A] (fixed-size
lists), ``next.reward`` float32 and ``next.done`` bool (true on an episode's last step), and
LeRobot's own columns ``timestamp`` float32 (frame_index / fps), ``frame_index`` (step within
the episode), ``episode_index``, ``index`` (step within the dataset) and ``task_index``
(int64). Observation t is what the agent saw before action t, as in :mod:`mmrl.demos`.
``next.success`` bool, where every episode written has it (the env sampler records it): the
env's success flag after action t, i.e. whether the state observation t + 1 shows is a
success (LeRobot's datasets with a success signal name it so) — frame-level labels for a
success classifier (``success_frames`` with ``labels: step``).

**Episodes** (``meta/episodes``): LeRobot's ``episode_index``, ``tasks`` (list of the
instruction), ``length``, ``dataset_from_index`` / ``dataset_to_index`` (the episode's rows of
``data``, end exclusive), ``data/chunk_index`` / ``data/file_index``, per camera
``videos/<key>/chunk_index``, ``/file_index``, ``/from_timestamp`` and ``/to_timestamp`` (its
frames in the camera's mp4: frames round(from · fps) up to round(to · fps), end exclusive),
``meta/episodes/chunk_index`` / ``file_index``; and mmrl's ``success`` (bool), ``seed``
(int64), ``task_name`` (the env's task name) and ``costs/<name>`` (float64, e.g.
``costs/path_length``; NaN where an episode's env did not report that cost). LeRobot's
per-episode ``stats/...`` columns are not written; ``meta/stats.json`` holds the dataset's.

**Videos** are H.264 in its lossless RGB form (ffmpeg's ``libx264rgb`` at ``-qp 0``, stored
``gbrp``, written through imageio-ffmpeg): decoded to RGB24, every frame equals the uint8
frame written, bit for bit (tests/test_episodes.py decodes them with OpenCV). LeRobot's own
writer defaults to lossy AV1; any ffmpeg-based decoder (PyAV, torchcodec, OpenCV) reads
these. A camera key is ``observation.images.<camera>``, the camera's name (the env's
``cameras`` when known, else ``image``, or ``image_<k>`` for K cameras).

One chunk and one file per table and camera (LeRobot's 1000-file chunks and 100/500 MB
files are limits mmrl's evaluations and demonstrations stay far below; ``info.json`` states
them). The dataset is written into a temporary directory beside ``directory`` and renamed
into place, so a reader finds a whole dataset or none. Reading (:func:`read_episodes`)
gives :class:`Episode` objects equal to those written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.errors import ConfigError, MissingExtraError

CODEBASE_VERSION = "v3.0"
CHUNKS_SIZE = 1000
DATA_FILES_SIZE_IN_MB = 100
VIDEO_FILES_SIZE_IN_MB = 500
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
TASKS_PATH = "meta/tasks.parquet"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
IMAGE_PREFIX = "observation.images."



@dataclass
class Episode:
    """One demonstration: T steps of observations (``image``, ``state``), ``action`` and
    ``reward``, and what the episode was (``instruction``, ``task``, ``seed``, ``success``,
    and the ``costs`` its env reported, e.g. ``path_length``, ``steps``, ``collisions``).
    ``step_success`` (bool [T], optional): the env's success flag after each action.
    ``final_state`` (float32 [D], optional): the state observed after the last action, what
    an off-policy loss bootstraps a cut episode from; ``terminated``: the episode ended by
    the task (nothing to bootstrap), not by a time limit."""

    image: np.ndarray
    state: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    success: bool
    instruction: str
    task: str
    seed: int
    costs: dict[str, float] = field(default_factory=dict)
    step_success: np.ndarray | None = None
    final_state: np.ndarray | None = None
    terminated: bool = False

    def __len__(self) -> int:
        return int(self.action.shape[0])

    def prefix(self, steps: int) -> "Episode":
        """The episode's first ``steps`` steps (observations and actions 0..steps − 1), a
        view. Its ``success`` is the outcome its last observation shows: the env's flag
        after action ``steps`` − 2 (``step_success`` needed, ``steps`` >= 2); costs are the
        whole episode's and are dropped."""
        if not 2 <= steps <= len(self):
            raise ValueError(f"a prefix of an episode of {len(self)} steps has 2..{len(self)} steps, not {steps}")
        if self.step_success is None:
            raise ValueError("the outcome of a prefix needs the episode's step_success (episodes recorded by mmrl eval --save-episodes or mmrl collect)")
        return Episode(self.image[:steps], self.state[:steps], self.action[:steps], self.reward[:steps], bool(self.step_success[steps - 2]),
                       self.instruction, self.task, self.seed, {}, self.step_success[:steps])

    def check(self, where: str = "episode") -> None:
        """Raise ValueError unless the arrays have the format's dtypes and agree on T >= 1."""
        expected = {"image": (np.uint8, None), "state": (np.float32, 2), "action": (np.float32, 2), "reward": (np.float32, 1)}
        for key, (dtype, ndim) in expected.items():
            value = getattr(self, key)
            if not isinstance(value, np.ndarray) or value.dtype != dtype or (ndim is not None and value.ndim != ndim):
                got = f"{value.dtype} array of shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
                raise ValueError(f"{where}.{key}: expected a {np.dtype(dtype)} array{f' with {ndim} dimensions' if ndim else ''}, got {got}")
        lengths = {key: getattr(self, key).shape[0] for key in expected}
        if self.step_success is not None:
            if not isinstance(self.step_success, np.ndarray) or self.step_success.dtype != np.bool_ or self.step_success.ndim != 1:
                got = f"{self.step_success.dtype} array of shape {self.step_success.shape}" if isinstance(self.step_success, np.ndarray) else type(self.step_success).__name__
                raise ValueError(f"{where}.step_success: expected a bool array with 1 dimension, got {got}")
            lengths["step_success"] = self.step_success.shape[0]
        if self.final_state is not None and (not isinstance(self.final_state, np.ndarray) or self.final_state.dtype != np.float32 or self.final_state.shape != self.state.shape[1:]):
            got = f"{self.final_state.dtype} array of shape {self.final_state.shape}" if isinstance(self.final_state, np.ndarray) else type(self.final_state).__name__
            raise ValueError(f"{where}.final_state: expected a float32 array of shape {self.state.shape[1:]} (one state), got {got}")
        if len(set(lengths.values())) != 1 or lengths["action"] < 1:
            raise ValueError(f"{where}: every array needs the same number T >= 1 of steps, got {lengths}")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise MissingExtraError("pyarrow", "data", "episodes in LeRobotDataset v3's layout") from None
    return pyarrow


def _imageio_ffmpeg(what: str):
    try:
        import imageio_ffmpeg
    except ImportError:
        raise MissingExtraError("imageio-ffmpeg", "data", what) from None
    return imageio_ffmpeg


def camera_keys(cameras: list[str] | None, count: int) -> list[str]:
    """The video keys of ``count`` cameras named ``cameras`` (or ``image`` / ``image_<k>``)."""
    if cameras is None or len(cameras) != count:
        cameras = ["image"] if count == 1 else [f"image_{k}" for k in range(count)]
    return [IMAGE_PREFIX + str(name) for name in cameras]


def _camera_frames(episode: Episode) -> np.ndarray:
    """[T, K, H, W, 3] frames of an episode with one or K cameras."""
    return episode.image[:, None] if episode.image.ndim == 4 else episode.image


def _stats(values: np.ndarray) -> dict[str, Any]:
    """LeRobot's statistics of a feature: min, max, mean and std over the rows of [N, D]
    values, and the count N."""
    values = values.astype(np.float64)
    return {"min": values.min(0).tolist(), "max": values.max(0).tolist(), "mean": values.mean(0).tolist(), "std": values.std(0).tolist(), "count": [len(values)]}


def check_new_directory(directory: str | os.PathLike, field: str) -> Path:
    """``directory`` as a Path, unless it exists with files in it (a ConfigError naming ``field``)."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(field, str(directory), "already exists and is not empty; write episodes to a new directory")
    return directory


def _image_stats(frames: np.ndarray) -> dict[str, Any]:
    """LeRobot's statistics of a camera: per channel over every pixel, in [0, 1], each shaped
    [3, 1, 1]; summed frame by frame (a float copy of all frames would not fit)."""
    total, squares = np.zeros(3), np.zeros(3)
    for frame in frames:
        pixels = frame.reshape(-1, 3).astype(np.float64) / 255.0
        total += pixels.sum(0)
        squares += np.square(pixels).sum(0)
    n = frames.shape[0] * frames.shape[1] * frames.shape[2]
    mean = total / n
    std = np.sqrt(np.maximum(squares / n - mean**2, 0.0))
    low, high = frames.reshape(-1, 3).min(0) / 255.0, frames.reshape(-1, 3).max(0) / 255.0
    shaped = lambda v: np.asarray(v, dtype=np.float64).reshape(3, 1, 1).tolist()  # noqa: E731
    return {"min": shaped(low), "max": shaped(high), "mean": shaped(mean), "std": shaped(std), "count": [int(len(frames))]}


def _write_video(path: Path, frames: np.ndarray, fps: int) -> None:
    """uint8 RGB frames [N, H, W, 3] as lossless H.264 (libx264rgb, qp 0)."""
    imageio_ffmpeg = _imageio_ffmpeg("writing episode videos")
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames.shape[1:3]
    writer = imageio_ffmpeg.write_frames(
        str(path), (width, height), fps=fps, codec="libx264rgb", pix_fmt_in="rgb24", pix_fmt_out="rgb24",
        quality=None, macro_block_size=1, output_params=["-qp", "0"], ffmpeg_log_level="error",
    )
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def _read_video(path: Path, height: int, width: int) -> np.ndarray:
    """Every frame of an mp4 as uint8 RGB [N, H, W, 3]."""
    imageio_ffmpeg = _imageio_ffmpeg("reading episode videos")
    if not path.is_file():
        raise ConfigError("episodes", str(path), "a video named by meta/episodes is missing")
    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    next(reader)  # the stream's metadata
    frames = [np.frombuffer(raw, np.uint8).reshape(height, width, 3) for raw in reader]
    return np.stack(frames) if frames else np.zeros((0, height, width, 3), np.uint8)


def write_episodes(
    directory: str | os.PathLike, episodes: list[Episode], *, fps: int = 10, cameras: list[str] | None = None,
    robot_type: str | None = None, metadata: dict[str, Any] | None = None,
) -> Path:
    """Write ``episodes`` to ``directory`` (which must not hold files yet) in the layout of the
    module docstring; ``cameras`` name the image streams, ``metadata`` (JSON-able: env id,
    kwargs, ...) goes into ``info.json`` under ``mmrl``. Returns the directory."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    try:
        import pandas
    except ImportError:
        raise MissingExtraError("pandas", "data", "episodes in LeRobotDataset v3's layout") from None
    directory = check_new_directory(directory, "episodes directory")
    if not episodes:
        raise ConfigError("episodes", 0, "nothing to write: at least one episode")
    for i, episode in enumerate(episodes):
        episode.check(f"episodes[{i}]")
    first = episodes[0]
    frame_shape = _camera_frames(first).shape[1:]
    state_dim, action_dim = first.state.shape[1], first.action.shape[1]
    for i, episode in enumerate(episodes):
        shapes = (_camera_frames(episode).shape[1:], episode.state.shape[1], episode.action.shape[1])
        if shapes != (frame_shape, state_dim, action_dim):
            raise ValueError(f"episodes[{i}]: frames, state and action of shapes {shapes}; episode 0 has {(frame_shape, state_dim, action_dim)} (one dataset holds one kind of episode)")
    keys = camera_keys(cameras, frame_shape[0])
    instructions = list(dict.fromkeys(str(e.instruction) for e in episodes))
    task_index = {text: i for i, text in enumerate(instructions)}
    cost_names = sorted({name for e in episodes for name in e.costs})

    directory.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        lengths = np.array([len(e) for e in episodes])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        frame_index = np.concatenate([np.arange(n) for n in lengths])
        episode_index = np.repeat(np.arange(len(episodes)), lengths)
        state = np.concatenate([e.state for e in episodes]).astype(np.float32)
        action = np.concatenate([e.action for e in episodes]).astype(np.float32)
        reward = np.concatenate([e.reward for e in episodes]).astype(np.float32)
        done = frame_index == np.repeat(lengths - 1, lengths)
        tasks = np.repeat([task_index[str(e.instruction)] for e in episodes], lengths)
        data = pa.table({
            "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(state.reshape(-1)), state_dim),
            "action": pa.FixedSizeListArray.from_arrays(pa.array(action.reshape(-1)), action_dim),
            "next.reward": pa.array(reward),
            "next.done": pa.array(done),
            "timestamp": pa.array((frame_index / fps).astype(np.float32)),
            "frame_index": pa.array(frame_index.astype(np.int64)),
            "episode_index": pa.array(episode_index.astype(np.int64)),
            "index": pa.array(np.arange(len(frame_index), dtype=np.int64)),
            "task_index": pa.array(tasks.astype(np.int64)),
        })
        step_success = all(e.step_success is not None for e in episodes)
        if step_success:
            data = data.append_column("next.success", pa.array(np.concatenate([e.step_success for e in episodes])))
        path = temp / DATA_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True)
        pq.write_table(data, path)

        video_features, image_stats = {}, {}
        for k, key in enumerate(keys):
            frames = np.concatenate([_camera_frames(e)[:, k] for e in episodes])
            _write_video(temp / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0), frames, fps)
            height, width = frames.shape[1:3]
            video_features[key] = {
                "dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channels"],
                "info": {"video.height": height, "video.width": width, "video.codec": "h264", "video.pix_fmt": "gbrp", "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False},
            }
            image_stats[key] = _image_stats(frames)

        episode_columns: dict[str, Any] = {
            "episode_index": pa.array(np.arange(len(episodes), dtype=np.int64)),
            "tasks": pa.array([[str(e.instruction)] for e in episodes], type=pa.list_(pa.string())),
            "length": pa.array(lengths.astype(np.int64)),
            "data/chunk_index": pa.array(np.zeros(len(episodes), np.int64)),
            "data/file_index": pa.array(np.zeros(len(episodes), np.int64)),
            "dataset_from_index": pa.array(starts.astype(np.int64)),
            "dataset_to_index": pa.array((starts + lengths).astype(np.int64)),
        }
        for key in keys:
            episode_columns[f"videos/{key}/chunk_index"] = pa.array(np.zeros(len(episodes), np.int64))
            episode_columns[f"videos/{key}/file_index"] = pa.array(np.zeros(len(episodes), np.int64))
            episode_columns[f"videos/{key}/from_timestamp"] = pa.array(starts / fps)
            episode_columns[f"videos/{key}/to_timestamp"] = pa.array((starts + lengths) / fps)
        episode_columns["meta/episodes/chunk_index"] = pa.array(np.zeros(len(episodes), np.int64))
        episode_columns["meta/episodes/file_index"] = pa.array(np.zeros(len(episodes), np.int64))
        episode_columns["success"] = pa.array([bool(e.success) for e in episodes])
        episode_columns["seed"] = pa.array([int(e.seed) for e in episodes], type=pa.int64())
        episode_columns["task_name"] = pa.array([str(e.task) for e in episodes])
        for name in cost_names:
            episode_columns[f"costs/{name}"] = pa.array([float(e.costs.get(name, math.nan)) for e in episodes])
        path = temp / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True)
        pq.write_table(pa.table(episode_columns), path)

        # LeRobot keeps its tasks as a pandas frame indexed by the task text
        pandas.DataFrame({"task_index": np.arange(len(instructions), dtype=np.int64)}, index=pandas.Index(instructions, name="task")).to_parquet(temp / TASKS_PATH)

        scalar = {"dtype": None, "shape": [1], "names": None}
        features = {
            **video_features,
            "observation.state": {"dtype": "float32", "shape": [state_dim], "names": None},
            "action": {"dtype": "float32", "shape": [action_dim], "names": None},
            "next.reward": {**scalar, "dtype": "float32"},
            "next.done": {**scalar, "dtype": "bool"},
            "timestamp": {**scalar, "dtype": "float32"},
            "frame_index": {**scalar, "dtype": "int64"},
            "episode_index": {**scalar, "dtype": "int64"},
            "index": {**scalar, "dtype": "int64"},
            "task_index": {**scalar, "dtype": "int64"},
            **({"next.success": {**scalar, "dtype": "bool"}} if step_success else {}),
        }
        info = {
            "codebase_version": CODEBASE_VERSION, "robot_type": robot_type,
            "total_episodes": len(episodes), "total_frames": int(lengths.sum()), "total_tasks": len(instructions),
            "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILES_SIZE_IN_MB, "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB,
            "fps": fps, "splits": {"train": f"0:{len(episodes)}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": features,
            "mmrl": {"costs": cost_names, **(metadata or {})},
        }
        (temp / INFO_PATH).write_text(json.dumps(info, indent=4) + "\n")
        stats = {
            **image_stats,
            "observation.state": _stats(state), "action": _stats(action), "next.reward": _stats(reward[:, None]),
            "timestamp": _stats((frame_index / fps)[:, None]), "frame_index": _stats(frame_index[:, None]),
            "episode_index": _stats(episode_index[:, None]), "index": _stats(np.arange(len(frame_index))[:, None]), "task_index": _stats(tasks[:, None]),
        }
        (temp / STATS_PATH).write_text(json.dumps(stats, indent=4) + "\n")
        if directory.exists():
            directory.rmdir()  # empty (checked above): the rename needs the name free
        os.replace(temp, directory)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return directory


def read_info(directory: str | os.PathLike) -> dict[str, Any]:
    """``meta/info.json`` of a dataset in this layout (version checked)."""
    path = Path(directory) / INFO_PATH
    if not path.is_file():
        raise ConfigError("episodes", str(directory), f"no {INFO_PATH}: not a dataset in LeRobotDataset v3's layout (mmrl eval --save-episodes, mmrl collect --format lerobot)")
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("episodes", str(path), f"not valid JSON: {e}") from None
    if info.get("codebase_version") != CODEBASE_VERSION:
        raise ConfigError("episodes", str(path), f"codebase_version {info.get('codebase_version')!r}; this reader reads {CODEBASE_VERSION}")
    return info


def read_episodes(directory: str | os.PathLike) -> list[Episode]:
    """Every episode of a dataset in this layout, in ``episode_index`` order."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    directory = Path(directory)
    info = read_info(directory)
    fps = info["fps"]
    features = info["features"]
    keys = [key for key, feature in features.items() if feature.get("dtype") == "video"]

    def table(pattern: str):
        paths = sorted((directory / pattern).glob("chunk-*/file-*.parquet"))
        if not paths:
            raise ConfigError("episodes", str(directory / pattern), "holds no parquet files")
        return pa.concat_tables([pq.read_table(p) for p in paths]).to_pydict()

    rows = table("meta/episodes")
    data = table("data")
    order = np.argsort(data["index"])
    state = np.asarray(data["observation.state"], dtype=np.float32)[order] if "observation.state" in data else None
    action = np.asarray(data["action"], dtype=np.float32)[order]
    reward = np.asarray(data.get("next.reward", np.zeros(len(order))), dtype=np.float32)[order]
    step_success = np.asarray(data["next.success"], dtype=bool)[order] if "next.success" in data else None
    videos: dict[tuple[str, int, int], np.ndarray] = {}
    episodes = []
    for e in np.argsort(rows["episode_index"]):
        start, stop = int(rows["dataset_from_index"][e]), int(rows["dataset_to_index"][e])
        if not 0 <= start < stop <= len(order):
            raise ConfigError("episodes", str(directory), f"episode {rows['episode_index'][e]} names data rows [{start}, {stop}) of {len(order)}")
        cameras = []
        for key in keys:
            where = (key, int(rows[f"videos/{key}/chunk_index"][e]), int(rows[f"videos/{key}/file_index"][e]))
            if where not in videos:
                height, width = features[key]["shape"][:2]
                videos[where] = _read_video(directory / info["video_path"].format(video_key=key, chunk_index=where[1], file_index=where[2]), height, width)
            first = round(rows[f"videos/{key}/from_timestamp"][e] * fps)
            frames = videos[where][first : first + stop - start]
            if len(frames) != stop - start:
                raise ConfigError("episodes", str(directory), f"episode {rows['episode_index'][e]}: {key} holds {len(frames)} of its {stop - start} frames")
            cameras.append(frames)
        image = np.zeros((stop - start, 0), np.uint8) if not cameras else cameras[0] if len(cameras) == 1 else np.stack(cameras, axis=1)  # no cameras: a state-only env
        instruction = str(rows["tasks"][e][0])
        costs = {name[len("costs/"):]: float(rows[name][e]) for name in rows if name.startswith("costs/") and not math.isnan(rows[name][e])}
        episodes.append(Episode(
            image=image.astype(np.uint8),
            state=state[start:stop] if state is not None else np.zeros((stop - start, 0), np.float32),
            action=action[start:stop], reward=reward[start:stop],
            success=bool(rows["success"][e]) if "success" in rows else False,
            instruction=instruction,
            task=str(rows["task_name"][e]) if "task_name" in rows else instruction,
            seed=int(rows["seed"][e]) if "seed" in rows else -1,
            costs=costs,
            step_success=step_success[start:stop] if step_success is not None else None,
        ))
    return episodes
