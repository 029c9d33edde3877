"""Reward components: built once per run, called on whole batches, may load a model from a
run directory and ask for the policy; plain functions still register."""

from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

from mmrl.config import from_dict, option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import FunctionReward, Reward, RewardContext, RewardSet, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.core.weights import resolve_weights_dir
from mmrl.errors import NonFiniteError
from mmrl.registry import REWARDS
from mmrl.train.run_config import TrainConfig
from mmrl.train.metrics import read_metrics
from mmrl.train.trainer import Trainer

EVENTS: dict[str, list] = {"built": [], "calls": []}


@dataclass
class ScorerConfig(RewardConfig):
    """A tiny scorer network loaded from a directory (or a run directory's latest checkpoint)."""

    path: str = option("", "weights directory or run directory of the scorer")


@REWARDS.register("_test_scorer", config=ScorerConfig)
class Scorer(Reward):
    """Scores the generated sample x0 with a linear network loaded once."""

    needs_policy = True

    def __init__(self, cfg, context):
        super().__init__(cfg, context)
        self.device = context.device_for(cfg)
        self.net = torch.nn.Linear(1, 1).to(self.device)
        from safetensors.torch import load_file

        self.net.load_state_dict(load_file(str(resolve_weights_dir(cfg.path) / "model.safetensors")))
        EVENTS["built"].append(str(self.device))

    @torch.no_grad()
    def __call__(self, rollout, *, policy=None, reference=None):
        assert policy is not None and not isinstance(policy, torch.nn.parallel.DistributedDataParallel)
        EVENTS["calls"].append(rollout.batch_size)
        x0 = rollout.info["sample"].float().to(self.device)
        return self.net(x0[:, :1]).squeeze(1)


def _scorer_run_dir(tmp_path, weight: float, bias: float):
    """A run directory whose latest checkpoint holds the scorer's weights."""
    ckpt = tmp_path / "scorer_run" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    save_file({"weight": torch.tensor([[weight]]), "bias": torch.tensor([bias])}, str(ckpt / "model.safetensors"))
    (ckpt / "state.pt").write_bytes(b"")
    (tmp_path / "scorer_run" / "checkpoints" / "latest").write_text("step_00000010")
    return tmp_path / "scorer_run"


@pytest.mark.learning
def test_a_model_backed_reward_is_built_once_called_per_batch_and_drives_learning(tmp_path, learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): reward gain, step 12 over step 1 3.52 to
    7.89 (>= 0.1).
    """
    EVENTS["built"].clear(), EVENTS["calls"].clear()
    run = _scorer_run_dir(tmp_path, weight=-1.0, bias=0.0)  # prefers small x0
    cfg = from_dict(TrainConfig, {
        "name": "scorer", "seed": learning_seed, "total_steps": 12, "sampler": {"type": "prompt"},
        "policy": {"type": "gaussian_chain"}, "rewards": [{"type": "_test_scorer", "path": str(run)}],
        "algo": {"group_size": 8, "groups_per_step": 4}, "optim": {"lr": 0.01},
        "eval": {"episodes": 16}, "log": {"progress": False, "tensorboard": False},
    })
    Trainer(cfg, tmp_path / "rl").train()
    assert EVENTS["built"] == ["cpu"]  # once per run, on the training device
    assert EVENTS["calls"][:13] == [16] + [32] * 12  # the evaluation before training (16 episodes), then one call per step on the whole batch
    records = [r for r in read_metrics(tmp_path / "rl") if "reward/_test_scorer" in r]
    learned(records[-1]["reward/_test_scorer"] - records[0]["reward/_test_scorer"], 0.1, name="reward gain, step 12 over step 1")


def test_plain_functions_register_through_the_adapter_and_may_ask_for_the_policy():
    def plain(rollout, cfg):
        return rollout.rewards_seen

    def wants_policy(rollout, cfg, policy):
        return torch.full((rollout.batch_size,), float(policy))

    cfg = RewardConfig(type="x")
    a, b = FunctionReward(plain, cfg, RewardContext()), FunctionReward(wants_policy, cfg, RewardContext())
    assert not a.needs_policy and b.needs_policy and not b.needs_reference
    rollout = Rollout(group_id=torch.zeros(3, dtype=torch.long), old=OldLogProbs(torch.zeros(3, 1)), mask=torch.ones(3, 1), replay={})
    assert b(rollout, policy=7).tolist() == [7.0, 7.0, 7.0]
    assert isinstance(build_reward(from_dict(REWARDS.entry("success").config, {"type": "success"}), RewardContext()), FunctionReward)


def test_reward_set_scores_columns_combines_them_and_names_a_non_finite_component():
    @dataclass
    class _Cfg(RewardConfig):
        pass

    rollout = Rollout(group_id=torch.tensor([0, 0, 1, 1]), old=OldLogProbs(torch.zeros(4, 1)), mask=torch.ones(4, 1), replay={}, info={"success": torch.tensor([1.0, 0.0, 1.0, 1.0]), "return": torch.tensor([2.0, 4.0, 6.0, 8.0])})
    cfgs = [from_dict(REWARDS.entry("success").config, {"type": "success", "weight": 2.0}), from_dict(REWARDS.entry("return").config, {"type": "return", "weight": 0.5})]
    rewards = RewardSet(cfgs, "weighted_sum", RewardContext())
    scores = rewards.score(rollout)
    assert scores.tolist() == [[1.0, 2.0], [0.0, 4.0], [1.0, 6.0], [1.0, 8.0]]
    assert rewards.combine(scores, rollout.group_id).tolist() == [3.0, 2.0, 5.0, 6.0]
    bad = Rollout(group_id=torch.zeros(2, dtype=torch.long), old=OldLogProbs(torch.zeros(2, 1)), mask=torch.ones(2, 1), replay={}, info={"success": torch.tensor([1.0, float("nan")]), "return": torch.zeros(2)})
    with pytest.raises(NonFiniteError, match="step 5: reward 'success' is nan"):
        rewards.score(bad, step=4)


def test_two_components_of_one_type_get_their_own_metric_names():
    """A weight-0 monitor beside a trained reward of the same type (strict beside partial
    verifier) must not hide it: the second of a type is numbered."""
    cfgs = [from_dict(REWARDS.entry(t).config, {"type": t}) for t in ("success", "return", "success", "success")]
    rewards = RewardSet(cfgs, "weighted_sum", RewardContext())
    assert rewards.names == ["success", "return", "success_2", "success_3"]
    assert len(set(rewards.state_dict())) == 4
