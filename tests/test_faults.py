"""A fault of code the user brought (a simulator's env.reset/env.step, an env wrapper, a
reward component) ends `mmrl train`, `mmrl eval` and `mmrl collect` in the default mode
(`rollout.workers: 0`) with one line naming what raised and where, exit code 1, and the last
checkpoint intact; `MMRL_DEBUG=1` prints the traceback; a bug in mmrl's own code keeps its
traceback. (Faults in rollout worker processes: tests/rollout/test_engine.py.)"""

from dataclasses import dataclass

import gymnasium
import pytest

from mmrl.cli import main
from mmrl.config import option
from mmrl.core.sampler import group_seed
from mmrl.envs.point_reach import PointReachEnv
from mmrl.registry import REWARDS
from mmrl.samplers.success import SuccessSource
from mmrl.train.run_config import RewardConfig
from tests.conftest import point_reach_config, run_mmrl
from tests.rollout.test_engine import toy
from tests.test_cli import _error_line

FAULTY = f"{__name__}:FaultyReach-v0"  # "module:id": a subprocess imports this module, which registers the id


class FaultyReach(PointReachEnv):
    """mmrl/PointReach-v0 whose env number ``fault_env`` (in the order a vector env makes
    them) raises in ``fault_in`` ("step" or "reset") at step ``fault_step`` after its
    ``fault_wave``-th seeded reset. Every training update and every evaluation of up to
    ``num_envs`` episodes resets each env once with seeds, so wave w is update w of a run
    without evaluations."""

    made = 0  # envs made in this process (tests reset it)

    def __init__(self, fault_env: int = 1, fault_wave: int = 3, fault_step: int = 1, fault_in: str = "step", **kwargs):
        super().__init__(**kwargs)
        self.number, FaultyReach.made = FaultyReach.made, FaultyReach.made + 1
        self.fault = (fault_env, fault_wave, fault_step, fault_in)
        self.waves = self.steps = 0

    def _raise_if_due(self, where: str) -> None:
        if (self.number, self.waves, self.steps, where) == self.fault:
            raise RuntimeError(f"simulated simulator fault at step {self.steps}\nsecond line of the message")

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.waves, self.steps = self.waves + 1, 0
        self._raise_if_due("reset")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.steps += 1
        self._raise_if_due("step")
        return super().step(action)


gymnasium.register(id="FaultyReach-v0", entry_point=FaultyReach)


@dataclass
class _RaisesAfter(RewardConfig):
    after: int = option(2, "calls before the reward raises", ge=0)


_reward_calls = {"n": 0}


@REWARDS.register("_test_raises_after", config=_RaisesAfter)
def _raises_after(rollout, cfg):
    """Test-only: 1 for every sample until ``after`` calls, then a ValueError."""
    _reward_calls["n"] += 1
    if _reward_calls["n"] > cfg.after:
        raise ValueError("no score for this sample")
    return [1.0] * rollout.batch_size


@pytest.fixture(autouse=True)
def _fresh_counts():
    FaultyReach.made = 0
    _reward_calls["n"] = 0


def faulty_config(**sections) -> dict:
    """PointReach through FaultyReach (env 1 raises at the first step of update 3 by default):
    4 envs, 2 groups of 2, a checkpoint every update, no evaluation."""
    kwargs = sections.pop("kwargs", {})
    return point_reach_config(**{
        "seed": 7, "total_steps": 6, "env": {"type": "gym", "id": FAULTY, "num_envs": 4, "kwargs": kwargs},
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1}, "checkpoint": {"every": 1},
        "eval": {"at_start": False, "at_end": False, "episodes": 4}, **sections,
    })


def _train_seed(seed: int, step: int, group: int) -> int:
    return group_seed(seed, step, group) % 2**31  # a training wave's reset seed (mmrl/samplers/env.py)


def test_a_simulator_fault_in_the_default_mode_is_one_line_and_the_checkpoint_before_it_resumes(tmp_path, write_config, capsys):
    run = tmp_path / "run"
    proc = run_mmrl("train", write_config(faulty_config()), "--run-dir", run)
    err = proc.stderr.strip()
    assert proc.returncode == 1, err[-3000:]
    # env 1 runs an episode of group 0; update 3 collects at step index 2
    assert err.splitlines() == [
        f"mmrl: stopped: env.step (env '{FAULTY}', env index 1, reset seed {_train_seed(7, 2, 0)}, seed 7, update 3, groups 0-1) "
        "raised RuntimeError: simulated simulator fault at step 1; the last checkpoint is left intact"
    ]
    assert (run / "checkpoints/latest").read_text() == "step_00000002"
    assert main(["train", str(run), "--resume", "total_steps=4"]) == 0  # a fresh process: its waves 1-2 are updates 3-4
    assert (run / "checkpoints/latest").read_text() == "step_00000004"
    capsys.readouterr()


@pytest.mark.parametrize("fault_in, call", [("reset", "env.reset"), ("step", "env.step")])
def test_mmrl_debug_prints_the_traceback_with_the_simulators_own_exception(tmp_path, write_config, capsys, monkeypatch, fault_in, call):
    monkeypatch.setenv("MMRL_DEBUG", "1")
    path = write_config(faulty_config(kwargs={"fault_wave": 1, "fault_in": fault_in, "fault_step": 0 if fault_in == "reset" else 1}))
    assert main(["train", str(path), "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert any(line.startswith("RuntimeError: simulated simulator fault at step") for line in err) and "second line of the message" in err
    assert any("self._raise_if_due(" in line for line in err)  # the simulator's own frame
    assert "The above exception was the direct cause of the following exception:" in err
    assert err[-1].startswith(f"mmrl: stopped: {call} (env '{FAULTY}', env index 1, reset seed {_train_seed(7, 0, 0)}, seed 7, update 1, groups 0-1) raised RuntimeError")


@pytest.mark.parametrize("sampler", ["env", "prompt"])
def test_a_reward_that_raises_is_one_line_naming_the_reward(tmp_path, write_config, capsys, sampler):
    raising = {"type": "_test_raises_after", "after": 2}
    if sampler == "env":
        data, source = point_reach_config(seed=3, total_steps=5, rewards=[{"type": "success"}, raising], eval={"at_start": False}), "env 'mmrl/PointReach-v0'"
    else:
        data, source = toy(seed=3, rewards=[{"type": "token_fraction", "token": 3}, raising]), "sampler 'prompt'"
    assert main(["train", str(write_config(data)), "--run-dir", str(tmp_path / "run")]) == 1
    groups = data["algo"]["groups_per_step"]
    assert _error_line(capsys) == (
        f"mmrl: stopped: reward '_test_raises_after' (rewards[1], {source}, seed 3, update 3, groups 0-{groups - 1}) "
        "raised ValueError: no score for this sample; the last checkpoint is left intact"
    )


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_simulator_fault_in_an_evaluation_is_one_line(tmp_path, write_config, capsys, command):
    if command == "eval":  # `mmrl eval` of a config: its first wave is the evaluation
        path = write_config(faulty_config(kwargs={"fault_wave": 1}))
        assert main(["eval", str(path), "--out", str(tmp_path / "eval")]) == 1
        phase, kept = "evaluation of the config's weights", ""
    else:  # waves: updates 1 and 2, then the evaluation after update 2
        path = write_config(faulty_config(kwargs={"fault_wave": 3}, eval={"every": 2, "at_start": False, "at_end": False, "episodes": 4}))
        assert main(["train", str(path), "--run-dir", str(tmp_path / "run")]) == 1
        phase, kept = "evaluation after update 2", "; the last checkpoint is left intact"
        assert (tmp_path / "run/checkpoints/latest").read_text() == "step_00000001"  # update 2's checkpoint follows its evaluation
    reset_seed = 2**31 + group_seed(7 + 1_000_003, 0, 1) % 2**31  # evaluation episode 1 (mmrl/samplers/env.py)
    assert _error_line(capsys) == (
        f"mmrl: stopped: env.step (env '{FAULTY}', env index 1, reset seed {reset_seed}, seed 7, {phase}) raised RuntimeError: simulated simulator fault at step 1{kept}"
    )


def test_a_simulator_fault_in_collect_is_one_line(tmp_path, capsys, monkeypatch):
    from mmrl.envs.tabletop.env import TabletopEnv

    def step(self, action):
        raise RuntimeError("simulated tabletop fault")

    monkeypatch.setattr(TabletopEnv, "step", step)
    code = main(["collect", "--task", "spatial_left", "--episodes-per-task", "1", "--seed", "5", "--obs-mode", "state", "--out", str(tmp_path / "demos")])
    assert code == 1
    assert _error_line(capsys) == "mmrl: stopped: env.step (env 'mmrl/Tabletop-v0', reset seed 5, task 'spatial_left') raised RuntimeError: simulated tabletop fault"


def test_a_bug_in_mmrl_itself_keeps_its_traceback(tmp_path, write_config, monkeypatch):
    """mmrl's own code right after the env's step (reading its success flags) raises: not the
    simulator's fault, so the exception leaves `main` as it is (Python prints its traceback)."""

    def broken(self, info, no_success):
        raise KeyError("a bug in mmrl")

    monkeypatch.setattr(SuccessSource, "flags", broken)
    path = write_config(faulty_config(kwargs={"fault_wave": 0}))
    with pytest.raises(KeyError, match="a bug in mmrl"):
        main(["train", str(path), "--run-dir", str(tmp_path / "run")])
