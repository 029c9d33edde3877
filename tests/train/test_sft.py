"""algo.type: sft — behaviour cloning from demonstrations on disk, then RL that starts from
the SFT run directory (policy.pretrained may name a run: its latest checkpoint is loaded)."""

import numpy as np
import pytest
from safetensors.torch import load_file

from mmrl.config import from_dict
from mmrl.demos import Episode, write_demos
from mmrl.envs.point_reach import PointReachEnv
from mmrl.errors import ConfigError
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.conftest import point_reach_config


def _expert_demos(directory, episodes: int) -> None:
    """A straight-line expert on mmrl/PointReach-v0 (full-speed steps toward the goal)."""
    env = PointReachEnv()
    demos = []
    for seed in range(episodes):
        obs, _ = env.reset(seed=10_000 + seed)
        states, actions = [], []
        while True:
            delta = obs[2:]
            action = np.clip(delta / max(np.abs(delta).max(), 1e-6), -1, 1) * min(1.0, np.abs(delta).max() / 0.2)
            states.append(obs)
            actions.append(action.astype(np.float32))
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        t = len(actions)
        demos.append(Episode(
            image=np.zeros((t, 0), np.uint8), state=np.stack(states).astype(np.float32), action=np.stack(actions),
            reward=np.zeros(t, np.float32), success=bool(info["success"]), instruction="", task="reach", seed=seed,
        ))
    write_demos(directory, demos)


def _sft_config(tmp_path, demos, **changes) -> TrainConfig:
    data = point_reach_config(
        name="sft", total_steps=150, run_dir=str(tmp_path / "sft"),
        policy={"type": "gaussian_mlp", "hidden_sizes": [32, 32]},
        algo={"type": "sft"}, data={"path": str(demos), "batch_size": 64},
        optim={"lr": 0.003}, eval={"episodes": 64},
    )
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return from_dict(TrainConfig, data)


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demos")
    _expert_demos(directory, 40)
    return directory


@pytest.mark.learning
def test_sft_from_expert_demos_raises_success_and_rl_continues_from_the_run_dir(tmp_path, demos, learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): success after 1 to 1 (>= 0.7); gain 1 to
    1 (>= 0.4); RL start success (4 episodes) - SFT end success 0 to 0 (>= -0.25).
    """
    before = Trainer(_sft_config(tmp_path, demos, seed=learning_seed, total_steps=0, run_dir=str(tmp_path / "init"))).evaluate(0)["success_rate"]
    summary = train(_sft_config(tmp_path, demos, seed=learning_seed))
    after = summary["eval"]["success_rate"]
    learned(after, 0.7, name="success after")
    learned(after - before, 0.4, name="gain")

    # RL from the SFT run: the policy starts where SFT ended (weights equal before any update).
    rl = point_reach_config(run_dir=str(tmp_path / "rl"), total_steps=0, policy={"type": "gaussian_mlp", "hidden_sizes": [32, 32], "pretrained": str(tmp_path / "sft")})
    trainer = Trainer(from_dict(TrainConfig, rl))
    latest = (tmp_path / "sft" / "checkpoints" / "latest").read_text().strip()
    saved = load_file(str(tmp_path / "sft" / "checkpoints" / latest / "model.safetensors"))
    state = trainer.policy.state_dict()
    assert all(np.allclose(saved[k].numpy(), state[k].detach().cpu().numpy()) for k in saved)
    learned(trainer.evaluate(0)["success_rate"] - after, -0.25, name="RL start success (4 episodes) - SFT end success")
    # the run's checkpoints/latest pointer file names the same weights
    from mmrl.core.weights import resolve_weights_dir

    pointer = tmp_path / "sft" / "checkpoints" / "latest"
    assert resolve_weights_dir(pointer) == resolve_weights_dir(tmp_path / "sft") == pointer.parent / latest


def test_few_shot_keeps_the_first_n_demonstrations_of_each_task(tmp_path, demos):
    trainer = Trainer(_sft_config(tmp_path, demos, total_steps=0, data={"path": str(demos), "max_episodes_per_task": 3}))
    assert trainer.learner.data.info["episodes"] == 3


def test_sft_without_demonstrations_is_a_config_error_naming_data_path(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        Trainer(_sft_config(tmp_path, None, data={"path": None})).train()


@pytest.mark.learning
def test_completions_source_fine_tunes_a_text_policy_then_rl_starts_from_that_run(tmp_path, learning_seed, learned):
    """data.type: completions — (prompt, completion) pairs teach a tiny text LM its answers;
    the SFT run directory is then the RL run's starting point, evaluated by exact match.

    Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): accuracy before 0 to 0 (<= 0.5);
    accuracy after 1 to 1 (>= 0.9)."""
    import json

    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)} for a in range(3) for b in range(3)]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    policy = {"type": "text_lm", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 3}}
    common = {"seed": learning_seed, "policy": policy, "sampler": {"type": "prompt", "data": {"train": str(path)}, "batch_groups": 2},
              "rewards": [{"type": "exact_match"}], "eval": {"episodes": 9}, "log": {"progress": False, "tensorboard": False}}
    sft = from_dict(TrainConfig, {**common, "name": "sft", "total_steps": 400, "algo": {"type": "sft"},
                                  "data": {"type": "completions", "path": str(path), "batch_size": 9}, "optim": {"lr": 0.003}})
    before = Trainer(from_dict(TrainConfig, {**common, "name": "init", "total_steps": 0}), tmp_path / "init").evaluate(0)["accuracy"]
    after = train(sft, tmp_path / "sft")["eval"]["accuracy"]
    learned(before, 0.5, higher=False, name="accuracy before")
    learned(after, 0.9, name="accuracy after")
    rl = from_dict(TrainConfig, {**common, "name": "rl", "total_steps": 1, "policy": {**policy, "pretrained": str(tmp_path / "sft")},
                                 "algo": {"group_size": 2, "groups_per_step": 2}})
    assert Trainer(rl, tmp_path / "rl").evaluate(0)["accuracy"] == after


def test_a_completions_source_without_the_completion_field_names_it(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n')
    cfg = from_dict(TrainConfig, {"policy": {"type": "text_lm"}, "sampler": {"type": "prompt", "data": {"train": str(path)}}, "algo": {"type": "sft"},
                                  "data": {"type": "completions", "path": str(path)}, "log": {"progress": False, "tensorboard": False}})
    with pytest.raises(ConfigError, match="data.completion_field"):
        Trainer(cfg, tmp_path / "run")


def test_a_completions_source_with_images_gives_image_prompts(tmp_path):
    pytest.importorskip("PIL")
    import json

    from PIL import Image

    from mmrl.data.prompts import ImagePrompt
    from mmrl.data.sources import Completions, CompletionsConfig

    Image.fromarray(np.full((8, 8, 3), 7, dtype=np.uint8)).save(tmp_path / "a.png")
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"prompt": "Grey level?", "completion": "7", "image": "a.png"}) + "\n" + json.dumps({"prompt": 12, "completion": "no image"}) + "\n")
    source = Completions(CompletionsConfig(path=str(path), batch_size=8), policy=None, seed=0, world=1, rank=0)
    batch = source.batch(0, "cpu")
    for prompt, completion in zip(batch["prompt"], batch["completion"]):
        if completion == "7":
            assert isinstance(prompt, ImagePrompt) and prompt.text == "Grey level?" and int(prompt.images[0][0, 0, 0]) == 7
        else:
            assert prompt == "12"
    assert {c for c in batch["completion"]} == {"7", "no image"}
