"""A VLM agent's demonstrations: shortest walks of mmrl/MiniGridText-v0 with each observation's
image saved beside the .jsonl, read back by the conversations source, and SFT on them."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("minigrid")
pytest.importorskip("transformers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.data.sources import Conversations, ConversationsConfig  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.tasks.minigrid_text.demos import shortest_walk_episode, write_demos  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import Trainer, train  # noqa: E402

LEVEL = "MiniGrid-Empty-Random-5x5-v0"


def _config(path, **changes) -> dict:
    cfg = {
        "name": "vlm_sft", "seed": 0, "total_steps": 30, "device": "cpu",
        "env": {"type": "gym", "id": "mmrl/MiniGridText-v0", "num_envs": 4, "max_episode_steps": 8, "kwargs": {"level": LEVEL}},
        "sampler": {"type": "env"},
        "policy": {"type": "vlm_agent", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 4}, "max_context_tokens": 1024, "max_images": 8},
        "rewards": [{"type": "success"}],
        "algo": {"type": "sft"},
        "data": {"type": "conversations", "path": str(path), "batch_size": 4},
        "optim": {"lr": 0.003},
        "eval": {"at_start": False, "at_end": False, "episodes": 4}, "log": {"progress": False, "tensorboard": False},
    }
    cfg.update(changes)
    return cfg


def test_the_demonstrations_walk_to_the_goal_and_their_images_read_back_as_the_envs(tmp_path):
    path = write_demos(tmp_path, episodes=3, seed=5, level=LEVEL)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    episodes = Conversations(ConversationsConfig(path=str(path)), None, 0, 1, 0).samples["turns"]
    assert len(episodes) == 3
    for e, (row, episode) in enumerate(zip(rows, episodes)):
        walked = shortest_walk_episode(5 + e, LEVEL)
        assert [a for _, a in episode] == [w for _, w in walked]
        for (observation, _), (env_observation, _) in zip(episode, walked):
            assert observation["text"] == env_observation["text"]
            assert observation["image"].dtype == np.uint8 and np.array_equal(observation["image"], env_observation["image"])  # PNG is lossless


def test_sft_on_the_demonstrations_lowers_the_loss(tmp_path):
    path = write_demos(tmp_path, episodes=8, seed=0, level=LEVEL)
    run = tmp_path / "run"
    train(from_dict(TrainConfig, _config(path)), run)
    losses = [r["loss/sft"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss/sft" in r]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]


def test_a_missing_image_names_the_file_in_one_line(tmp_path):
    path = write_demos(tmp_path, episodes=1, seed=0, level=LEVEL)
    (tmp_path / "images" / "e0_t0.png").unlink()
    with pytest.raises(ConfigError, match=r"^data.path: got .*; line 1: cannot read the image .*e0_t0.png$"):
        Trainer(from_dict(TrainConfig, _config(path, total_steps=0)), tmp_path / "run")
    path.write_text(json.dumps({"turns": [[{"text": "hi", "image": 3}, "left"]]}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.path: got .*; line 1 is not"):
        Trainer(from_dict(TrainConfig, _config(path, total_steps=0)), tmp_path / "run2")
