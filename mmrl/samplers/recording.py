"""Recording an env sampler's episodes: whole episodes, keyframes and evaluation videos.

Whole episodes (every observation, action, reward, the instruction, task, seed, success and
costs, as :class:`~mmrl.demos.Episode` objects) are kept on request: evaluation returns them
(``keep_episodes``, what ``mmrl eval --save-episodes`` writes) and writes them itself under
``save_eval_episodes``; training collections keep ``keep_frames`` keyframes of each
(:func:`mmrl.demos.keyframes`) in ``info["trajectory"]``, with ``info["instruction"]``, for a
trajectory reward model (``pairwise_preference`` with ``bt_trajectory``).

Evaluation's videos (``videos`` > 0) are the first camera's images of its first episodes:
frame 0 the reset observation, frame t the one seen after action t.

Keyframes and videos keep camera images, so they need an env with image observations; a
state-only env's whole episodes are kept with its state vector and no image. Keyframes need
whole episodes, which partial rollouts (``rollout.over_provision`` > 1) split across collections.

A language agent's episodes (an env that acts in text) are kept turn by turn instead
(:class:`TextEpisodeRecorder`) and written as JSON lines (:func:`write_text_episodes`): one
episode per line, ``{"turns": [[observation, reply], ...], "final_observation", "success",
"return", "rewards", "length", "truncated", "seed"}`` (``final_observation``: the env's answer
to the last reply) and, in a tool env, ``"tools"``: per turn ``{"tool_call": [...],
"tool_result": ...}`` where the reply called a tool, else ``{}`` — the ``conversations`` data
source's format, so saved episodes train by SFT as they are (``data.successful_only`` keeps the
solved ones: rejection sampling / expert iteration).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.samplers.partial import as_numpy


def check_recording(keep_frames: int, partial: bool, has_images: bool, env_name: str) -> None:
    """Raises a :class:`~mmrl.errors.ConfigError` for recording options this env sampler
    cannot serve (see the module docstring); ``partial``: it keeps episodes in flight,
    ``has_images``: the env has image observations."""
    if keep_frames and partial:
        raise ConfigError("sampler.keep_frames", keep_frames, "keeps whole episodes, which partial rollouts split across collections: use rollout.over_provision 1")
    if keep_frames and not has_images:
        raise ConfigError("sampler.keep_frames", keep_frames, f"keeps episodes' camera images; env {env_name!r} has no image observations")


def camera_names(env_cfg) -> list[str] | None:
    """The env's cameras as its section names them (``env.kwargs.cameras``: a name or a
    list), for the episodes written; None where it names none."""
    cameras = (getattr(env_cfg, "kwargs", None) or {}).get("cameras")
    return [cameras] if isinstance(cameras, str) else (list(cameras) if cameras else None)


class EpisodeRecorder:
    """Every observation (before each action) and action of a wave's first ``len(seeds)``
    envs, made into :class:`~mmrl.demos.Episode` objects once the wave's rollout says how
    long each episode lasted."""

    def __init__(self, obs, reset_info: dict, seeds: list[int]):
        self.seeds = list(seeds)
        n = len(seeds)
        self.instructions = [str(text) for text in obs["instruction"][:n]] if isinstance(obs, dict) and "instruction" in obs else [""] * n
        tasks = reset_info.get("task")
        self.tasks = [str(t) for t in tasks[:n]] if tasks is not None else self.instructions
        self.images, self.states, self.actions = [], [], []

    def step(self, obs, action) -> None:
        n = len(self.seeds)
        if not isinstance(obs, dict):  # a state-only env (a Box observation): its state, no image
            obs = {"state": as_numpy(obs)[:n].reshape(n, -1)}
        self.images.append(as_numpy(obs["image"])[:n].copy() if "image" in obs else np.zeros((n, 0), np.uint8))
        self.states.append(as_numpy(obs["state"])[:n].astype(np.float32) if "state" in obs else np.zeros((n, 0), np.float32))
        self.actions.append(as_numpy(action)[:n].astype(np.float32))

    def episodes(self, rollout: Rollout, rewards: list, success: list | None) -> list:
        """The episodes, given the wave's rollout and its per-step env rewards and success
        flags (the env's own, after each action: ``step_success``; None where the env
        reports no success)."""
        from mmrl.demos import Episode

        info = rollout.info
        n = len(self.seeds)
        lengths = info["length"].cpu().tolist()
        images, states, actions = np.stack(self.images, 1), np.stack(self.states, 1), np.stack(self.actions, 1)  # [n, S, ...]
        reward = np.stack([as_numpy(r)[:n] for r in rewards], 1).astype(np.float32)
        flags = np.stack([as_numpy(f)[:n] for f in success], 1).astype(bool) if success is not None else None
        out = []
        for i, steps in enumerate(lengths):
            costs = {name: float(value[i]) for name, value in info.get("costs", {}).items()}
            out.append(Episode(
                image=images[i, :steps].astype(np.uint8), state=states[i, :steps], action=actions[i, :steps],
                reward=reward[i, :steps], success=bool(info["success"][i]), instruction=self.instructions[i],
                task=self.tasks[i], seed=int(self.seeds[i]), costs=costs,
                step_success=flags[i, :steps] if flags is not None else None,
            ))
        return out


@dataclass
class TextEpisode:
    """One language-agent episode: each turn's observation text and the reply the policy
    wrote, the env's answer to the last reply, the env's reward after each turn, its success
    and whether a limit cut it; in a tool env, each turn's tool calls and their result."""

    turns: list[tuple[str, str]]
    rewards: list[float]
    success: bool
    truncated: bool
    seed: int
    final_observation: str = ""
    tools: list[dict] | None = None  # per turn: {"tool_call": [...], "tool_result": text}, or {} without a call

    def as_json(self) -> dict:
        saved = {
            "turns": [list(turn) for turn in self.turns], "final_observation": self.final_observation, "success": self.success,
            "return": float(sum(self.rewards)), "rewards": self.rewards, "length": len(self.turns), "truncated": self.truncated, "seed": self.seed,
        }
        if self.tools is not None:
            saved["tools"] = self.tools
        return saved


class TextEpisodeRecorder:
    """The turns of a wave's first ``len(seeds)`` envs of a language agent: each observation's
    text (before the turn; a Dict observation's ``"text"``), the turn's reply and the env's
    answer to it. ``tools``: the env runs tool calls (a ``tools`` env), so each turn's calls
    are read from its reply (:func:`mmrl.tools.calls.parse_turn`, as the env reads them)."""

    def __init__(self, seeds: list[int], tools: bool = False):
        self.seeds = list(seeds)
        self.tools = tools
        self.observations: list[list[str]] = []
        self.replies: list[list[str]] = []
        self.answers: list[list[str]] = []  # the env's observation after each turn

    def step(self, obs, action) -> None:
        self.observations.append(_texts(obs, len(self.seeds)))
        self.replies.append([str(t) for t in list(action)[: len(self.seeds)]])

    def answered(self, obs) -> None:
        """The env's observation after the turn :meth:`step` recorded last."""
        self.answers.append(_texts(obs, len(self.seeds)))

    def _tools(self, reply: str, answer: str) -> dict:
        from mmrl.tools.calls import parse_turn

        turn = parse_turn(reply)
        calls = [{"name": call.name, "arguments": call.arguments} for call in turn.calls] + [{"error": error} for error in turn.errors]
        return {"tool_call": calls, "tool_result": answer} if calls else {}

    def episodes(self, rollout: Rollout, rewards: list, success: list | None) -> list[TextEpisode]:
        info = rollout.info
        n = len(self.seeds)
        reward = np.stack([as_numpy(r)[:n] for r in rewards], 1).astype(np.float64)
        out = []
        for i, steps in enumerate(info["length"].cpu().tolist()):
            out.append(TextEpisode(
                turns=[(self.observations[t][i], self.replies[t][i]) for t in range(steps)],
                rewards=[float(r) for r in reward[i, :steps]], success=bool(info["success"][i]),
                truncated=bool(info["truncated"][i]), seed=int(self.seeds[i]),
                final_observation=self.answers[steps - 1][i] if steps else "",
                tools=[self._tools(self.replies[t][i], self.answers[t][i]) for t in range(steps)] if self.tools else None,
            ))
        return out


def _texts(obs, n: int) -> list[str]:
    """The first ``n`` envs' observation texts (a Dict observation's ``"text"``)."""
    texts = obs["text"] if isinstance(obs, dict) else obs
    return [str(t) for t in list(texts)[:n]]


def write_text_episodes(directory, episodes: list[TextEpisode], metadata: dict | None = None) -> Path:
    """``episodes.jsonl`` (one episode per line, :meth:`TextEpisode.as_json`) and ``info.json``
    (counts, success rate and ``metadata``) in ``directory``, a new one; written under a
    temporary name and renamed into place."""
    import json
    import os

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    tmp.mkdir()
    (tmp / "episodes.jsonl").write_text("".join(json.dumps(e.as_json()) + "\n" for e in episodes))
    info = {"format": "mmrl text episodes", "episodes": len(episodes), "turns": sum(len(e.turns) for e in episodes),
            "success_rate": float(np.mean([e.success for e in episodes])) if episodes else 0.0, "mmrl": metadata or {}}
    (tmp / "info.json").write_text(json.dumps(info, indent=2))
    if directory.exists():  # an empty directory (check_new_directory)
        directory.rmdir()
    tmp.rename(directory)
    return directory


def write_kept_episodes(directory, episodes: list, env, cameras: list[str] | None, metadata: dict) -> None:
    """Kept evaluation episodes written to ``directory``: a language agent's as JSON lines,
    a robot's in LeRobotDataset v3's layout (:mod:`mmrl.episodes`) at the env's frame rate."""
    if episodes and isinstance(episodes[0], TextEpisode):
        write_text_episodes(directory, episodes, metadata)
        return
    from mmrl.episodes import write_episodes

    fps = int((getattr(env, "metadata", None) or {}).get("render_fps") or 10)
    write_episodes(directory, episodes, fps=fps, cameras=cameras, metadata=metadata)


class VideoFrames:
    """The first camera's images of a wave's first ``record`` episodes (evaluation videos),
    with each one's instruction (None without language observations)."""

    def __init__(self, obs, record: int):
        self.record = record
        self.images = [first_camera(obs)[:record]]
        self.instructions = [str(text) for text in obs["instruction"][:record]] if "instruction" in obs else [None] * record

    def step(self, obs) -> None:
        self.images.append(first_camera(obs)[: self.record])

    def clips(self, rollout: Rollout) -> list[np.ndarray]:
        """Each recorded episode's frames [length + 1, H, W, 3]."""
        # frame 0 is the reset observation, frame t the one seen after action t; with
        # gymnasium's default next-step auto-reset the frame after the last action is the
        # episode's final observation
        stacked = np.stack(self.images, 1)  # [record, S + 1, H, W, 3]
        lengths = rollout.info["length"].tolist()
        return [stacked[i, : lengths[i] + 1] for i in range(self.record)]


def first_camera(obs) -> np.ndarray:
    """[N, H, W, 3] uint8 images of the first camera of a batch of image observations."""
    image = as_numpy(obs["image"])
    return image[:, 0] if image.ndim == 5 else image


def trajectory_info(episodes: list, keep_frames: int) -> dict:
    """What a training collection keeps of its episodes for a trajectory reward model:
    ``trajectory`` (``keep_frames`` keyframes of each) and ``instruction``."""
    from mmrl.demos import Trajectories

    return {"trajectory": Trajectories.from_episodes(episodes, keep_frames).store, "instruction": [episode.instruction for episode in episodes]}


def save_episodes(directory: str, env_steps: int, episodes: list, env, cameras: list[str] | None, env_name: str, seed: int) -> None:
    """An evaluation's episodes written to ``<directory>/env_steps_<N>`` (N: training env
    steps so far; :func:`write_kept_episodes`)."""
    write_kept_episodes(Path(directory) / f"env_steps_{env_steps:012d}", episodes, env, cameras, {"env": env_name, "seed": seed})
