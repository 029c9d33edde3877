"""The reward hook's update: a reward component that learns during RL (``Reward.learns``),
from each step's samples after scoring them — an online discriminator on the toy task."""

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from mmrl.config import from_dict, option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import Reward
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.conftest import ROOT
from tests.rollout.test_engine import _same, _steps, toy


@dataclass
class OnlineDiscriminatorConfig(RewardConfig):
    type: str = option("_test_online_discriminator", "registered name of this component (see `mmrl list`)")
    lr: float = option(0.5, "Adam step of the discriminator", gt=0)


@REWARDS.register("_test_online_discriminator", config=OnlineDiscriminatorConfig)
class OnlineDiscriminator(Reward):
    """Test-only: P(real) of a logistic discriminator on a sample's token histogram, trained
    online (one Adam step per step) with reference sequences of token 3 as the positives
    and the policy's current samples as the negatives."""

    learns = True
    runs_in_worker = True

    def __init__(self, cfg, context):
        super().__init__(cfg, context)
        g = torch.Generator().manual_seed(context.seed)
        self.linear = torch.nn.Linear(8, 1, dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(1, 8, generator=g, dtype=torch.float64) * 0.1)
            self.linear.bias.zero_()
        self.optimizer = torch.optim.Adam(self.linear.parameters(), lr=cfg.lr)
        self.scored_with, self.updated_from = [], []  # the weights each call saw (the test reads them)

    def features(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(tokens.shape[0], 8, dtype=torch.float64).scatter_add_(1, tokens.long(), mask.double())
        return counts / mask.double().sum(1, keepdim=True).clamp(min=1)

    def __call__(self, rollout, *, policy=None, reference=None):
        self.scored_with.append(self.linear.weight.detach().clone())
        with torch.no_grad():
            return torch.sigmoid(self.linear(self.features(rollout.info["tokens"], rollout.mask))).squeeze(1).float()

    def update(self, rollout, scores, *, step, dist):
        self.updated_from.append(self.linear.weight.detach().clone())
        fake = self.features(rollout.info["tokens"], rollout.mask)
        total = dist.sum(fake.shape[0]).item()
        loss = torch.nn.functional.softplus(self.linear(fake)).sum() / total  # -log(1 - D) of this process's negatives
        if dist.rank == 0:  # the positives once, for all processes
            real = torch.zeros(len(fake) * dist.world, 8, dtype=torch.float64)
            real[:, 3] = 1.0
            loss = loss + torch.nn.functional.softplus(-self.linear(real)).sum() / total
        self.optimizer.zero_grad()
        loss.backward()
        for p in self.linear.parameters():  # all-reduce: one process's gradient on the whole batch
            p.grad = dist.sum(p.grad).to(p.grad)
        self.optimizer.step()
        return {"loss": dist.sum(loss.detach()).item()}

    def state_dict(self):
        return {"linear": self.linear.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        if state:
            self.linear.load_state_dict(state["linear"])
            self.optimizer.load_state_dict(state["optimizer"])


def learning(**sections):
    data = toy(rewards=[{"type": "token_fraction", "token": 3}, {"type": "_test_online_discriminator", "weight": 0.0}], eval={"at_start": False, "at_end": False})
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


def test_the_reward_learns_from_each_steps_samples_after_scoring_them(tmp_path):
    """The policy held (a vanishing learning rate): the discriminator's loss falls as it
    tells the samples from the references."""
    trainer = Trainer(from_dict(TrainConfig, learning(total_steps=6, optim={"lr": 1e-12})), tmp_path / "run")
    disc = trainer.rewards.components[1]
    losses = [trainer.rl_step(step)["reward_update/_test_online_discriminator/loss"] for step in range(6)]
    assert losses[-1] < losses[0]
    # each step scored with the weights its update then started from: score first, then learn
    assert len(disc.scored_with) == len(disc.updated_from) == 6
    for scored, updated in zip(disc.scored_with, disc.updated_from):
        assert torch.equal(scored, updated)
    assert not torch.equal(disc.updated_from[0], disc.updated_from[-1])


def test_a_learning_reward_resumes_exactly(tmp_path):
    data = learning(total_steps=5, checkpoint={"every": 3})
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 3}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    straight = _steps(read_metrics(tmp_path / "straight"))
    _same(_steps(read_metrics(tmp_path / "split")), straight)
    assert all("reward_update/_test_online_discriminator/loss" in r for r in straight)


@pytest.mark.numerics
def test_a_learning_reward_with_two_processes_matches_one_process(tmp_path, write_config):
    """torchrun: the update all-reduces the discriminator's gradient over the processes'
    samples, so two processes end with one's discriminator, scores and metrics (float64)."""
    path = write_config({**learning(total_steps=4, sampler={"type": "prompt", "batch_groups": 2}), "policy": {"type": "categorical_sequence", "dtype": "float64"}})
    launcher = tmp_path / "launch.py"  # the CLI, with this module's test component registered
    launcher.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nimport tests.core.test_learning_reward\nfrom mmrl.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, launcher, "train", path, "--run-dir", tmp_path / "one"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29543", launcher, "train", path, "--run-dir", tmp_path / "two"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    ra, rb = _steps(read_metrics(tmp_path / "one")), _steps(read_metrics(tmp_path / "two"))
    for x, y in zip(ra, rb):
        for key in ("reward_update/_test_online_discriminator/loss", "reward/_test_online_discriminator", "reward/total"):
            assert x[key] == pytest.approx(y[key], rel=0, abs=1e-12), (x["step"], key)
    a = torch.load(tmp_path / "one/checkpoints/step_00000004/state.pt", weights_only=True)
    b = torch.load(tmp_path / "two/checkpoints/step_00000004/state.pt", weights_only=True)
    wa = next(v for k, v in a["rewards"].items() if "online" in k)["linear"]
    wb = next(v for k, v in b["rewards"].items() if "online" in k)["linear"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-12)


def test_in_worker_processes_a_learning_reward_scores_on_the_learners_side(tmp_path):
    with pytest.raises(ConfigError, match=r"^rewards\[1\].type: got '_test_online_discriminator'; learns from each step's samples"):
        Trainer(from_dict(TrainConfig, learning(rollout={"mode": "async"})), tmp_path / "refused")
    train(from_dict(TrainConfig, learning(total_steps=3, rollout={"mode": "async", "score_on": "learner"})), tmp_path / "run")
    assert len(_steps(read_metrics(tmp_path / "run"))) == 3
