"""Suite evaluation: per-task success with confidence intervals, tables, videos, metrics."""

import json
from dataclasses import dataclass
from types import SimpleNamespace

import gymnasium
import numpy as np
import torch
from gymnasium import spaces

from mmrl.config import option
from mmrl.core.policy import PolicyModule, Sample
from mmrl.envs.gym import GymEnvConfig
from mmrl.core.statistics import wilson_interval
from mmrl.commands.evaluate import evaluate_suite
from mmrl.media import OUTCOME_COLOURS, _wrap, annotate_episode
from mmrl.registry import POLICIES
from mmrl.core.sampler import sampler_context
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
from mmrl.train.checkpoint import Checkpointer
from mmrl.train.run_config import AlgoConfig, PolicyConfig, TrainConfig
from mmrl.train.metrics import read_metrics


class SideTask(gymnasium.Env):
    """Task "left" or "right": move the state coordinate to that side within 5 steps."""

    instructions = ["go left", "go right"]

    def __init__(self, task="left"):
        self.task = task
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (8, 8, 3), np.uint8),
                "state": spaces.Box(-np.inf, np.inf, (1,), np.float32),
                "instruction": spaces.Text(max_length=16, charset="abcdefghijklmnopqrstuvwxyz "),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def _obs(self):
        image = np.full((8, 8, 3), self.t * 40, np.uint8)  # frames differ step by step
        return {"image": image, "state": np.array([self.x], np.float32), "instruction": f"go {self.task}"}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.x, self.t = 0.0, 0
        return self._obs(), {}

    def step(self, action):
        self.x += float(action[0])
        self.t += 1
        success = self.x * (1 if self.task == "right" else -1) >= 2
        return self._obs(), float(success), success, self.t >= 5, {"success": success}


gymnasium.register("test/SideTask-v0", entry_point=SideTask)


@dataclass
class GoRightConfig(PolicyConfig):
    type: str = option("test_go_right", "registered name")


@POLICIES.register("test_go_right", config=GoRightConfig)
class GoRight(PolicyModule):
    """Always pushes right with a learnable gain (test policy)."""

    def __init__(self, config, spec):
        super().__init__()
        self.config = config
        self.gain = torch.nn.Parameter(torch.ones(1))

    def sample(self, inputs, generator=None, deterministic=False):
        n = inputs["state"].shape[0]
        return Sample(output=self.gain.detach().expand(n).reshape(n, 1, 1).clone(), logp=torch.zeros(n, 1), replay={"state": inputs["state"][:, None]})

    def log_prob(self, replay):
        return torch.zeros(replay["state"].shape[:2]) * self.gain


def _config():
    return TrainConfig(
        env=GymEnvConfig(id="test/SideTask-v0", num_envs=3, kwargs={"task": "right"}),
        policy=GoRightConfig(),
        sampler=EnvSamplerConfig(),
        algo=AlgoConfig(group_size=2),
    )


def test_suite_tables_videos_and_metrics(tmp_path):
    cfg = _config()
    run_dir = tmp_path / "run"
    policy = GoRight(cfg.policy, {})
    Checkpointer(run_dir).save(7, policy, torch.optim.SGD(policy.parameters(), lr=0.1), {}, "")
    suite = SimpleNamespace(name="sides", env={"type": "gym", "id": "test/SideTask-v0", "num_envs": 3}, tasks=["left", "right"], episodes_per_task=4, seeds=[0, 1])
    summary = evaluate_suite(cfg, run_dir, suite, videos=2)

    rows = {r["task"]: r for r in summary["tasks"]}
    assert rows["right"]["success_rate"] == 1.0 and rows["left"]["success_rate"] == 0.0
    assert rows["left"]["episodes"] == 8  # 4 episodes x 2 seeds
    assert summary["overall"]["success_rate"] == 0.5
    assert summary["overall"]["ci95_low"] == wilson_interval(8, 16)[0]
    out = run_dir / "eval" / "sides"
    assert "| right | 8 | 1.000 |" in (out / "results.md").read_text()
    assert (out / "results.csv").read_text().splitlines()[0] == "task,episodes,successes,success_rate,ci95_low,ci95_high"
    assert json.loads((out / "results.json").read_text())["step"] == 7
    videos = sorted(p.name for p in (out / "videos").glob("*.mp4"))
    assert videos == ["left_0_failure.mp4", "left_1_failure.mp4", "right_0_success.mp4", "right_1_success.mp4"]
    import imageio.v2 as imageio

    frames = imageio.mimread(out / "videos" / "right_0_success.mp4")
    assert len(frames) == 3  # reset frame + 2 steps (success after two pushes of +1)
    assert frames[0].shape == (256, 256, 3)  # 8x8 observations enlarged to be written on
    assert _dominance(np.asarray(frames[0]), green=True) > 80  # "success" in green, through the H.264 encoding
    failure = np.asarray(imageio.mimread(out / "videos" / "left_0_failure.mp4")[0])
    assert _dominance(failure, green=False) > 80
    record = read_metrics(run_dir)[-1]
    assert record["step"] == 7 and record["suite/sides/success_rate"] == 0.5 and record["suite/sides/left/success_rate"] == 0.0


def test_evaluation_returns_the_instruction_of_each_recorded_episode():
    cfg = _config()
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    try:
        result = sampler.evaluate(GoRight(cfg.policy, {}), 4, seed=0, videos=2)
    finally:
        sampler.close()
    assert result["instructions"] == ["go right", "go right"] and len(result["frames"]) == 2


def _dominance(frame: np.ndarray, green: bool) -> int:
    """How far the outcome band (the bottom eighth) leans to green (or red): the largest
    G − R (or R − G) of its pixels."""
    band = frame[-frame.shape[0] // 8 :].astype(int)
    diff = band[..., 1] - band[..., 0]
    return int((diff if green else -diff).max())


def test_the_overlay_writes_the_instruction_on_top_and_the_outcome_at_the_bottom():
    frames = np.full((3, 64, 64, 3), 128, np.uint8)
    out = annotate_episode(frames, "put the red block left of the blue block", success=True)
    assert out.shape == (3, 256, 256, 3) and out.dtype == np.uint8  # 64 px enlarged 4x, every frame alike
    assert (out[:, :24] != 128).any(axis=(0, 2, 3)).sum() > 15  # rows of text under the top
    assert (out[:, 96:160] == 128).all()  # the middle of the image is left as it was
    assert (out[:, -20:] != 128).any() and (frames == 128).all()  # the input is not drawn on


def test_the_outcome_is_green_for_a_success_and_red_for_a_failure():
    frames = np.full((1, 128, 128, 3), 128, np.uint8)
    success, failure = annotate_episode(frames, "pick the cube", True)[0], annotate_episode(frames, "pick the cube", False)[0]
    assert _dominance(success, green=True) > 150 and _dominance(success, green=False) <= 0
    assert _dominance(failure, green=False) > 150 and _dominance(failure, green=True) <= 0
    assert OUTCOME_COLOURS[True] != OUTCOME_COLOURS[False]


def test_frames_already_wide_enough_keep_their_size():
    frames = np.zeros((2, 240, 320, 3), np.uint8)
    assert annotate_episode(frames, None, False).shape == (2, 240, 320, 3)


def test_a_long_instruction_is_wrapped_and_its_rest_cut_to_the_frame_width():
    def fits(text):
        return len(text) <= 12

    assert _wrap("pick up the red cube", fits, 2) == ["pick up the", "red cube"]
    lines = _wrap("put the red block on the left of the blue block", fits, 2)
    assert lines[0] == "put the red" and lines[1].endswith("...") and all(fits(line) for line in lines)
    assert _wrap("unbelievablylongword", fits, 2) == ["unbelieva..."]
