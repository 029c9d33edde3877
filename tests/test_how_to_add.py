"""docs/architecture.md, "How to add a component": each kind is added once here, in a package
this file writes (on ``sys.path``, as a plugin or a new folder of mmrl would be imported), with
the number of files the doc's table gives; each works once registered. What a test registers is
taken out of the registries again afterwards, so other tests see mmrl's own components only."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import gymnasium
import pytest
import torch

from mmrl import registry
from mmrl.config import from_dict
from mmrl.core.weights import build_policy, save_pretrained
from mmrl.commands.export import export_policy
from mmrl.policies.reward_model.inputs import INPUT_KINDS
from mmrl.tools.tool import TOOLS
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import train
from tests.conftest import ROOT, point_reach_config
from tests.policies.test_input_kinds import VECTOR_KIND, W
from tests.policies.test_input_kinds import _pairs as vector_pairs

# ---------------------------------------------------------------- what each kind's files hold

LOSS = {
    "howto_loss.py": '''
        """REINFORCE: -A log pi of every valid decision, averaged over the minibatch's decisions."""
        from dataclasses import dataclass

        from mmrl.algo.losses import Loss, LossConfig, LossOutput
        from mmrl.config import option
        from mmrl.registry import LOSSES


        @dataclass
        class ReinforceConfig(LossConfig):
            type: str = option("howto_reinforce", "the loss module (mmrl list losses)")


        @LOSSES.register("howto_reinforce", ReinforceConfig)
        class Reinforce(Loss):
            """-A log pi, no ratio and no clipping."""

            zero_at_zero_advantage = True

            def __init__(self, algo, options, policy, **_):
                pass

            def __call__(self, model, batch, targets, norm, at_sampling_weights=False):
                logp = model(batch.replay)
                loss = -(targets.adv * batch.mask * logp).sum() / norm["num_tokens"]
                return LossOutput(loss, {"loss/policy": loss.detach()}, logp=logp)
    ''',
}

REWARD = {
    "howto_reward.py": '''
        """A reward for finishing early: minus a cost per decision taken."""
        from dataclasses import dataclass

        from mmrl.config import option
        from mmrl.core.component_config import RewardConfig
        from mmrl.registry import REWARDS


        @dataclass
        class DecisionCostConfig(RewardConfig):
            per_decision: float = option(0.01, "cost of each decision", ge=0)


        @REWARDS.register("howto_decision_cost", config=DecisionCostConfig)
        def decision_cost(rollout, cfg):
            """-per_decision x the sample's valid decisions."""
            return -cfg.per_decision * rollout.mask.sum(1)
    ''',
}

POLICY = {
    "howto_policy/__init__.py": '''
        """A Gaussian whose mean is linear in the observation."""
    ''',
    "howto_policy/config.py": '''
        from dataclasses import dataclass

        from mmrl.config import option
        from mmrl.core.component_config import PolicyConfig


        @dataclass
        class LinearGaussianConfig(PolicyConfig):
            """A Gaussian whose mean is linear in the observation."""

            type: str = option("howto_gaussian", "registered name of this component (see `mmrl list`)")
            init_log_std: float = option(-0.5, "initial log standard deviation of every action dimension")
            checkpoint: str | None = option(None, "a directory in the howto_line format to start from")
    ''',
    "howto_policy/model.py": '''
        import math

        import torch
        from torch import nn

        from howto_policy.config import LinearGaussianConfig
        from mmrl.core.policy import PolicyModule, Sample
        from mmrl.registry import POLICIES

        CONTRACT = {
            "train": {
                "env": {"type": "gym", "id": "mmrl/PointReach-v0", "num_envs": 4, "kwargs": {"max_steps": 6, "min_steps": 3}},
                "sampler": {"type": "env"},
                "policy": {"type": "howto_gaussian"},
                "rewards": [{"type": "success"}],
            },
        }


        @POLICIES.register("howto_gaussian", config=LinearGaussianConfig, contract=CONTRACT)
        class LinearGaussian(PolicyModule):
            """N(W o + b, diag(sigma^2)): one action per decision."""

            export_layouts = {"howto_line": "weights.json: the mean's weight and bias and the log std"}

            def __init__(self, config, spec):
                super().__init__()
                self.config, self.spec = config, spec
                self.mean = nn.Linear(int(spec["obs_dim"]), int(spec["action_dim"]))
                self.log_std = nn.Parameter(torch.full((int(spec["action_dim"]),), config.init_log_std))
                if config.checkpoint:
                    from howto_policy.checkpoint import read

                    read(self, config.checkpoint)

            def _log_prob(self, obs, action):
                z = (action - self.mean(obs)) / self.log_std.exp()
                return (-0.5 * z * z - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

            def sample(self, inputs, generator=None, deterministic=False):
                obs = (inputs["state"] if isinstance(inputs, dict) else inputs).float()
                mean = self.mean(obs)
                action = mean if deterministic else mean + self.log_std.exp() * torch.randn(mean.shape, generator=generator)
                action = action.detach()
                logp = self._log_prob(obs, action).detach()[:, None]
                return Sample(output=action[:, None], logp=logp, replay={"obs": obs[:, None], "action": action[:, None]})

            def log_prob(self, replay):
                b, t = replay["obs"].shape[:2]
                return self._log_prob(replay["obs"].reshape(b * t, -1), replay["action"].reshape(b * t, -1)).view(b, t)

            def export(self, fmt, out):
                from howto_policy.checkpoint import write

                write(self, out)
    ''',
}

CHECKPOINT_FORMAT = {
    "howto_policy/checkpoint.py": '''
        """The howto_line format: weights.json, {"weight": [[...]], "bias": [...], "log_std": [...]}."""
        import json
        from pathlib import Path

        import torch

        from mmrl.hub import pretrained_dir


        def read(policy, checkpoint):
            data = json.loads((pretrained_dir(checkpoint, "policy.checkpoint") / "weights.json").read_text())
            with torch.no_grad():
                policy.mean.weight.copy_(torch.tensor(data["weight"]))
                policy.mean.bias.copy_(torch.tensor(data["bias"]))
                policy.log_std.copy_(torch.tensor(data["log_std"]))


        def write(policy, out):
            Path(out).mkdir(parents=True)
            data = {"weight": policy.mean.weight.tolist(), "bias": policy.mean.bias.tolist(), "log_std": policy.log_std.tolist()}
            (Path(out) / "weights.json").write_text(json.dumps(data))
    ''',
}

ENV = {
    "howto_env.py": '''
        """A point on a line that should reach 0, registered with gymnasium on import."""
        import gymnasium
        import numpy as np


        class LineEnv(gymnasium.Env):
            observation_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)
            action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self.x, self.steps = float(self.np_random.uniform(-1, 1)), 0
                return np.array([self.x], np.float32), {"success": False}

            def step(self, action):
                self.x = float(np.clip(self.x + 0.3 * float(action[0]), -1, 1))
                self.steps += 1
                success = abs(self.x) < 0.1
                return np.array([self.x], np.float32), float(success), success, self.steps >= 5, {"success": success}


        gymnasium.register(id="HowtoLine-v0", entry_point=LineEnv)
    ''',
}

TOOL = {
    "howto_tool.py": '''
        from mmrl.tools.tool import TOOLS


        @TOOLS.register("howto_reverse")
        def reverse(text: str) -> str:
            """Reverse a string.

            Args:
                text: the string to reverse
            """
            return text[::-1]
    ''',
}

REWARD_MODEL = {"howto_vector.py": VECTOR_KIND}  # a Bradley-Terry model of a new kind of item (feature vectors), and that kind

KINDS = {"loss": LOSS, "reward": REWARD, "policy family": POLICY, "checkpoint format": CHECKPOINT_FORMAT, "env": ENV, "tool": TOOL, "reward model": REWARD_MODEL}
REGISTRIES = (registry.LOSSES, registry.REWARDS, registry.POLICIES, registry.ENVS, TOOLS, INPUT_KINDS)


def tiny_run(algo: dict | None = None, **sections) -> TrainConfig:
    """One step of 2 groups of 2 on PointReach (or ``sections``' env), no evaluation."""
    algo = {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, **(algo or {})}
    data = point_reach_config(total_steps=1, algo=algo, eval={"at_start": False, "at_end": False}, rewards=[{"type": "success"}])
    data.update(sections)
    return from_dict(TrainConfig, data)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def documented_files() -> dict[str, int]:
    """The "new files" column of the table in docs/architecture.md's "How to add a component"."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## How to add a component", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| ([a-z ]+) \| (\d+) \|", text, re.M)}


@pytest.fixture
def add(tmp_path, monkeypatch):
    """``add(kind)``: write the kind's files into a package folder on ``sys.path`` and return
    their paths; afterwards their registrations, modules and gymnasium ids are taken out."""
    folder = tmp_path / "ext"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    known = {reg: set(reg.names()) for reg in REGISTRIES}  # names() loads the built-ins first
    ids = set(gymnasium.registry)
    written = []

    def write(kind: str) -> list:
        files = []
        for relative, source in KINDS[kind].items():
            path = folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source).lstrip())
            files.append(path)
        written.extend(files)
        return files

    yield write
    for reg, names in known.items():
        for name in set(reg.names()) - names:
            del reg._entries[name]  # a registry has no removal: plugins never need one
    for env_id in set(gymnasium.registry) - ids:
        del gymnasium.registry[env_id]
    for module in [m for m in sys.modules if m.split(".")[0] in {p.relative_to(folder).parts[0].removesuffix(".py") for p in written}]:
        del sys.modules[module]


def test_the_table_names_every_kind_this_file_adds():
    assert set(documented_files()) == set(KINDS)


def test_a_loss_is_one_module_and_trains(add, tmp_path, monkeypatch):
    files = add("loss")
    assert len(files) == documented_files()["loss"]
    import howto_loss  # noqa: F401  (in mmrl/algo/losses/ the registry imports it; a plugin names it as an mmrl.losses entry point)

    summary = train(tiny_run(algo={"loss": {"type": "howto_reinforce"}}), tmp_path / "run")
    assert summary["step"] == 1
    assert metrics(tmp_path / "run")[-1]["loss/policy"] is not None
    # its edit elsewhere: a case in the loss contract test (a tiny run and what it learns), whose checks it then passes
    from tests.algo import test_loss_contract as contract

    case = contract.Case(lambda: point_reach_config(env={"num_envs": 4}, algo={"group_size": 2, "groups_per_step": 2, "loss": {"type": "howto_reinforce"}}), "advantage")
    monkeypatch.setitem(contract.CASES, "howto_reinforce", case)
    contract.test_the_loss_is_a_finite_scalar_with_named_terms_and_its_gradient_reaches_the_policy("howto_reinforce", tmp_path / "finite")
    for sign in (1.0, -1.0):
        contract.test_the_loss_learns_in_the_direction_it_promises("howto_reinforce", sign, tmp_path / f"learns{sign}")


def test_a_reward_is_one_module_and_scores_a_run(add, tmp_path):
    files = add("reward")
    assert len(files) == documented_files()["reward"]
    import howto_reward  # noqa: F401

    train(tiny_run(rewards=[{"type": "success"}, {"type": "howto_decision_cost", "per_decision": 0.5}]), tmp_path / "run")
    last = metrics(tmp_path / "run")[-1]
    assert last["reward/howto_decision_cost"] == -0.5 * last["episode_length"]


def test_a_policy_family_is_one_folder_that_passes_the_contract_form_and_trains(add, tmp_path):
    files = add("policy family")
    assert len(files) == documented_files()["policy family"]
    import howto_policy.model  # noqa: F401  (mmrl walks policies/ and the mmrl.policies entry points)
    from tests.policies.test_contract import RUN, contract_of

    contract = contract_of("howto_gaussian")  # the form every registered policy's example must have
    summary = train(from_dict(TrainConfig, {**RUN, **contract["train"]}), tmp_path / "run")
    assert summary["step"] == 1
    entry = registry.POLICIES.entry("howto_gaussian")
    policy = build_policy(from_dict(entry.config, contract["train"]["policy"], "policy"), {"obs_dim": 4, "action_dim": 2})
    sample = policy.sample(torch.randn(8, 4), torch.Generator().manual_seed(0))
    assert torch.equal(policy.log_prob(sample.replay), sample.logp)  # ratio exactly 1


def test_a_checkpoint_format_is_one_module_of_its_family_that_reads_and_exports(add, tmp_path):
    files = add("checkpoint format")
    add("policy family")
    assert len(files) == documented_files()["checkpoint format"]
    import howto_policy.model  # noqa: F401

    brought = tmp_path / "brought"
    brought.mkdir()
    weights = {"weight": [[0.5, -0.25, 0.125, 1.0], [0.0, 1.0, -1.0, 0.5]], "bias": [0.25, -0.75], "log_std": [-1.0, -2.0]}
    (brought / "weights.json").write_text(json.dumps(weights))
    entry = registry.POLICIES.entry("howto_gaussian")
    policy = build_policy(from_dict(entry.config, {"type": "howto_gaussian", "checkpoint": str(brought)}, "policy"), {"obs_dim": 4, "action_dim": 2})
    assert policy.mean.weight.tolist() == weights["weight"] and policy.log_std.tolist() == weights["log_std"]
    save_pretrained(policy, tmp_path / "saved")
    out = export_policy(tmp_path / "saved", "howto_line", tmp_path / "exported")
    assert json.loads((out / "weights.json").read_text()) == weights


def test_an_env_is_one_module_and_trains(add, tmp_path):
    files = add("env")
    assert len(files) == documented_files()["env"]
    # env: {type: gym, id: "module:Id"} imports the module, which registers the id (an env of
    # mmrl's own registers mmrl/<Id> in envs/; tests/test_plugin_example.py covers an installed
    # package's mmrl.envs entry point)
    summary = train(tiny_run(env={"type": "gym", "id": "howto_env:HowtoLine-v0", "num_envs": 4}), tmp_path / "run")
    assert summary["step"] == 1 and metrics(tmp_path / "run")[-1]["episode_length"] <= 5  # LineEnv's episodes, not PointReach's


def test_a_tool_is_one_module_and_the_tool_env_calls_it(add):
    files = add("tool")
    assert len(files) == documented_files()["tool"]
    import howto_tool  # noqa: F401  (mmrl/tools/ is walked: a module there needs no import)
    from mmrl.envs.tool_env import ToolEnv
    from mmrl.tasks.long_arithmetic.env import LongArithmeticEnv

    env = ToolEnv(LongArithmeticEnv(), tools=["howto_reverse"])
    obs, _ = env.reset(seed=0)
    assert "- howto_reverse: Reverse a string." in obs
    obs, reward, terminated, truncated, info = env.step('{"tool": "howto_reverse", "arguments": {"text": "mmrl"}}')
    assert obs == "Result of howto_reverse:\nlrmm" and info["tool_calls"] == 1 and not (terminated or truncated)


def test_a_reward_model_is_one_module_and_trains_on_its_pairs(add, tmp_path):
    """A reward model of a new kind of item (feature vectors): its kind and its model in one
    module; it learns the preference its pairs encode through the training loop."""
    files = add("reward model")
    assert len(files) == documented_files()["reward model"]
    import howto_vector  # noqa: F401  (in policies/reward_model/ the registries import it; a plugin names it as an mmrl.policies entry point)
    from mmrl.core.weights import latest_checkpoint, load_pretrained

    vector_pairs(tmp_path / "pairs", 64, 16, seed=0)
    cfg = from_dict(TrainConfig, {"name": "rm", "seed": 0, "total_steps": 40, "policy": {"type": "howto_bt_vector"}, "algo": {"type": "sft"}, "optim": {"lr": 0.05},
                                  "data": {"type": "preferences", "path": str(tmp_path / "pairs"), "batch_size": 16}, "log": {"progress": False, "tensorboard": False}})
    summary = train(cfg, tmp_path / "run")
    assert summary["eval"]["pairs"] == 16 and summary["eval"]["pairwise_accuracy"] >= 0.8  # 0.5: chance
    learned = load_pretrained(latest_checkpoint(tmp_path / "run")).linear.weight.detach().flatten().double()
    assert torch.nn.functional.cosine_similarity(learned, torch.tensor(W), dim=0) > 0.9
