"""A learned success source (env.success_model): the debounce rule, training reading the
learned success of an env whose flag is hidden while evaluation counts the true flag, and
one-line errors for bad combinations."""

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.component_config import SuccessModelConfig
from mmrl.core.policy import Sample
from mmrl.core.weights import save_pretrained
from mmrl.envs.gym import GymEnvConfig
from mmrl.errors import ConfigError
from mmrl.policies.learned_success import LearnedSuccessConfig, LearnedSuccessModel
from mmrl.rewards.env import SuccessRewardConfig, success
from mmrl.core.sampler import sampler_context
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig
from mmrl.samplers.success import debounced_success
from mmrl.train.run_config import AlgoConfig, PolicyConfig, TrainConfig
from tests.samplers.test_structured_obs import ColourSide  # noqa: F401  (registers test/ColourSide-v0)


# ------------------------------------------------------------------ the rule


def _probabilities(*rows):
    return torch.tensor(rows, dtype=torch.float32).T  # one row per episode → [T, N]


def test_a_single_frame_above_the_threshold_does_not_fire_under_debounce_2():
    p = _probabilities([0.1, 0.9, 0.2, 0.9, 0.1], [0.1, 0.9, 0.9, 0.2, 0.1], [0.6, 0.4, 0.6, 0.4, 0.6])
    assert debounced_success(p, 0.5, debounce=2).tolist() == [False, True, False]
    assert debounced_success(p, 0.5, debounce=1).tolist() == [True, True, True]
    assert debounced_success(p, 0.95, debounce=1).tolist() == [False, False, False]


def test_the_threshold_is_inclusive_and_a_run_must_be_unbroken():
    p = _probabilities([0.5, 0.5, 0.5], [0.7, 0.49, 0.7])
    assert debounced_success(p, 0.5, debounce=3).tolist() == [True, False]
    assert debounced_success(p, 0.5, debounce=2).tolist() == [True, False]


def test_at_end_the_run_must_reach_each_episodes_own_last_decision():
    p = _probabilities([0.9, 0.9, 0.1, 0.1], [0.1, 0.9, 0.9, 0.1], [0.1, 0.1, 0.9, 0.9])
    lengths = torch.tensor([4, 3, 4])
    assert debounced_success(p, 0.5, 2, at="any", lengths=lengths).tolist() == [True, True, True]
    # episode 1 ends after 3 decisions: its run (0.9, 0.9) reaches its end; what follows is not its own
    assert debounced_success(p, 0.5, 2, at="end", lengths=lengths).tolist() == [False, True, True]
    assert debounced_success(p, 0.5, 2, at="any", lengths=torch.tensor([1, 2, 4])).tolist() == [False, False, True]


# ------------------------------------------------------------------ in the env sampler


class AlwaysRight:
    """Pushes +1 every step: a success for "go right" episodes (x reaches 2 at step 2, where
    ColourSide terminates), a failure for "go left" ones (x runs to 5 until the time limit)."""

    def sample(self, inputs, generator=None, deterministic=False):
        n = len(inputs["instruction"])
        return Sample(output=torch.ones(n, 1, 1), logp=torch.zeros(n, 1), replay={"state": inputs["state"][:, None]})


def state_classifier(directory):
    """A learned_success model whose logit is 10·relu(x) − 15 of the state x: P ≥ 1/2 exactly
    when x ≥ 1.5, whatever the image (its weights are set by hand)."""
    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {"image_size": 8, "state_dim": 1, "channels": [4], "hidden": 4, "shift": 0, "prompt": {"dim": 4, "buckets": 16}}, "policy"))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.head[0].weight[0, -1] = 1.0  # the state is the last input of the head
        model.head[2].weight[0, 0] = 10.0
        model.head[2].bias[0] = -15.0
    save_pretrained(model, directory)
    return directory


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return state_classifier(tmp_path_factory.mktemp("classifier"))


def make_sampler(model=None, hide=True, num_envs=8, rewards=("success",), keep_frames=0, **success_model):
    success_cfg = SuccessModelConfig(path=str(model), **success_model) if model is not None else None
    env = GymEnvConfig(id="test/ColourSide-v0", num_envs=num_envs, hide_success=hide, success_model=success_cfg)
    sampler = EnvSamplerConfig(keep_frames=keep_frames)
    cfg = TrainConfig(env=env, policy=PolicyConfig(), sampler=sampler, algo=AlgoConfig(group_size=2), rewards=[SuccessRewardConfig(type=r) for r in rewards])
    return EnvSampler(cfg.sampler, sampler_context(cfg))


def _sides(rollout_or_policy_inputs):
    return torch.tensor([text == "go right" for text in rollout_or_policy_inputs])


class Watching(AlwaysRight):
    def __init__(self):
        self.first = None

    def sample(self, inputs, generator=None, deterministic=False):
        self.first = self.first or list(inputs["instruction"])
        return super().sample(inputs, generator, deterministic)


def test_training_reads_the_learned_success_of_a_hidden_env_and_logs_the_true_one(classifier):
    sampler = make_sampler(classifier, debounce=1)
    policy = Watching()
    rollout = sampler.collect(policy, num_groups=4, group_size=2, step=0)
    right = _sides(policy.first).float()
    assert 0 < right.sum() < 8
    # the classifier fires at x = 2 for every episode: the wrong-way ones are its false positives
    assert rollout.info["success"].tolist() == [1.0] * 8 == rollout.info["learned_success"].tolist()
    assert torch.equal(rollout.info["env_success"], right)
    assert torch.equal(success(rollout, SuccessRewardConfig()), torch.ones(8))  # the success reward reads the learned source
    metrics = sampler.metrics(rollout)
    assert torch.equal(metrics["success_rate"], right) and torch.equal(metrics["learned_success_rate"], torch.ones(8))
    assert torch.equal(metrics["success_agreement"], right)
    sampler.close()


def test_debounce_2_misses_a_success_the_env_ends_at_once_and_catches_a_lasting_one(classifier):
    sampler = make_sampler(classifier, debounce=2)
    policy = Watching()
    rollout = sampler.collect(policy, num_groups=4, group_size=2, step=0)
    right = _sides(policy.first).float()
    # "go right" ends at x = 2 (one frame over the threshold); "go left" stays over it from x = 2 to 5
    assert torch.equal(rollout.info["learned_success"], 1 - right)
    assert rollout.info["length"].tolist() == [2 if r else 5 for r in right.tolist()]
    sampler.close()


def test_a_learned_success_that_terminates_ends_training_episodes_where_it_fires(classifier):
    sampler = make_sampler(classifier, debounce=2, terminates=True)
    policy = Watching()
    rollout = sampler.collect(policy, num_groups=4, group_size=2, step=0)
    right = _sides(policy.first)
    # "go left": over the threshold at x = 2 and 3, so it fires after decision 3 and the episode ends there
    assert rollout.info["length"].tolist() == [2 if r else 3 for r in right.tolist()]
    assert rollout.mask.sum(1).tolist() == rollout.info["length"].float().tolist()  # one decision per step
    assert not rollout.info["truncated"][~right].any()
    sampler.close()


def test_evaluation_counts_the_true_flag_and_reports_the_learned_one_beside_it(classifier):
    sampler = make_sampler(classifier, debounce=1, terminates=True)
    result = sampler.evaluate(AlwaysRight(), episodes=16, seed=0)
    truth = torch.tensor(result["successes"])
    assert 0 < truth.sum() < 16 and result["success_rate"] == truth.mean().item()
    assert result["learned_successes"] == [1.0] * 16 and result["learned_success_rate"] == 1.0
    assert result["success_agreement"] == result["success_rate"]
    assert result["length_mean"] > 2  # evaluation runs episodes to the env's own end, whatever the learned success says
    sampler.close()


def test_a_hidden_flag_without_a_model_leaves_training_no_success_and_evaluation_the_truth():
    sampler = make_sampler(None, rewards=("return",), keep_frames=2)  # a trajectory reward's keyframes are kept as before
    rollout = sampler.collect(AlwaysRight(), num_groups=2, group_size=2, step=0)
    assert "success" not in rollout.info and "env_success" in rollout.info and "trajectory" in rollout.info
    with pytest.raises(ConfigError, match="rollout.info"):
        success(rollout, SuccessRewardConfig())
    assert "success_rate" in sampler.metrics(rollout)
    assert 0 < sampler.evaluate(AlwaysRight(), episodes=8, seed=0)["success_rate"] < 1
    sampler.close()


def _one_line(error: ConfigError) -> str:
    text = str(error)
    assert "\n" not in text
    return text


def test_bad_success_sources_are_refused_with_one_line(tmp_path, classifier):
    with pytest.raises(ConfigError) as e:
        make_sampler(None)
    assert "env.hide_success" in _one_line(e.value) and "success reward" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_sampler(tmp_path / "missing")
    assert "env.success_model.path" in _one_line(e.value) and "missing" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        make_sampler(tmp_path / "empty")
    assert "holds no checkpoint" in _one_line(e.value)


def test_a_classifier_of_other_observation_shapes_is_refused_naming_both(tmp_path):
    model = LearnedSuccessModel(from_dict(LearnedSuccessConfig, {"image_size": 16, "cameras": 2, "state_dim": 4, "channels": [4], "prompt": {"dim": 4, "buckets": 16}}, "policy"))
    save_pretrained(model, tmp_path / "other")
    with pytest.raises(ConfigError) as e:
        make_sampler(tmp_path / "other")
    line = _one_line(e.value)
    assert "images [8, 8, 3] and state [1]" in line and "images [2, 16, 16, 3] and state [4]" in line


@pytest.mark.parametrize("threshold", [0.0, 1.0, 1.5])
def test_a_threshold_outside_0_1_is_refused_naming_the_field(threshold):
    with pytest.raises(ConfigError) as e:
        from_dict(GymEnvConfig, {"type": "gym", "id": "test/ColourSide-v0", "success_model": {"path": "runs/x", "threshold": threshold}}, "env")
    assert "env.success_model.threshold" in _one_line(e.value)


def test_partial_rollouts_with_a_learned_source_are_refused(classifier):
    env = GymEnvConfig(id="test/ColourSide-v0", num_envs=8, success_model=SuccessModelConfig(path=str(classifier)))
    cfg = TrainConfig(env=env, policy=PolicyConfig(), sampler=EnvSamplerConfig(), algo=AlgoConfig(group_size=2), rewards=[SuccessRewardConfig()])
    cfg.rollout.over_provision = 2.0
    with pytest.raises(ConfigError) as e:
        EnvSampler(cfg.sampler, sampler_context(cfg))
    assert "env.success_model" in _one_line(e.value) and "over_provision" in str(e.value)


def test_a_tabletop_whose_success_does_not_terminate_goes_on_reporting_success_until_its_time_limit():
    gymnasium = pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    import numpy as np

    import mmrl.envs  # noqa: F401  (registers mmrl/Tabletop-v0)
    from mmrl.envs.tabletop.expert import expert_action

    env = gymnasium.make("mmrl/Tabletop-v0", task="goal", image_size=16, max_episode_steps=60, terminate_on_success=False)
    env.reset(seed=3)
    flags, ended = [], None
    while ended is None:
        _, reward, terminated, truncated, info = env.step(expert_action(env, noise=0.0, rng=np.random.default_rng(0)) if not any(flags) else np.zeros(2, np.float32))
        flags.append(bool(info["success"]))
        assert not terminated and reward == float(info["success"])
        ended = len(flags) if truncated else None
    env.close()
    first = flags.index(True)
    assert ended == 60 and first < 59 and all(flags[first:])  # solved, left alone: success stays and the episode runs on
    with pytest.raises(ConfigError, match="env.kwargs.terminate_on_success"):
        gymnasium.make("mmrl/Tabletop-v0", task="goal", terminate_on_success="no")


def test_help_lists_the_options_of_the_success_model_section():
    from mmrl.config import describe

    rows = {name: doc for name, _, _, doc in describe(GymEnvConfig)}
    assert {"success_model", "success_model.threshold", "success_model.debounce", "success_model.terminates", "hide_success"} <= set(rows)
