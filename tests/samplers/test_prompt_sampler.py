"""The ``prompt`` sampler: groups that share a prompt id, reproducible per (seed, step, group)."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.policy import Sample
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.weights import build_policy
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError
from mmrl.policies.toy import CategoricalSequenceConfig, GaussianChainConfig
from mmrl.registry import SAMPLERS
from mmrl.rewards.toy import TargetDistanceConfig, TokenFractionConfig
from mmrl.samplers.prompt import PromptSampler, PromptSamplerConfig
from mmrl.train.config import TrainConfig


def reward_set(train_cfg):
    return RewardSet(train_cfg.rewards, "weighted_sum", RewardContext())


def setup(policy_cfg, rewards, seed: int = 0, num_prompts: int = 4):
    train_cfg = TrainConfig(seed=seed, policy=policy_cfg, sampler=PromptSamplerConfig(type="prompt", num_prompts=num_prompts), rewards=rewards)
    sampler = PromptSampler(train_cfg.sampler, train_cfg)
    sampler.rewards = reward_set(train_cfg)
    torch.manual_seed(0)
    return sampler, build_policy(policy_cfg, sampler.policy_spec())


def sequence_setup(**kwargs):
    return setup(CategoricalSequenceConfig(type="categorical_sequence", eos_token=0), [TokenFractionConfig(type="token_fraction")], **kwargs)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


def assert_same_rollout(a: Rollout, b: Rollout):
    for name in ("group_id", "old_logp", "mask", "entropy", "replay", "info"):
        assert_same(getattr(a, name), getattr(b, name))


def test_prompt_sampler_is_registered_with_its_config():
    assert SAMPLERS.entry("prompt").obj is PromptSampler and SAMPLERS.entry("prompt").config is PromptSamplerConfig
    with pytest.raises(ConfigError, match="num_prompts"):
        from_dict(PromptSamplerConfig, {"type": "prompt", "num_prompts": 0}, "sampler")


def test_policy_spec_holds_the_number_of_prompts():
    sampler, policy = sequence_setup(num_prompts=3)
    assert sampler.policy_spec() == {"num_prompts": 3}
    assert policy.prompt_embedding.num_embeddings == 3


def test_collect_is_reproducible_and_depends_on_seed_and_step():
    sampler, policy = sequence_setup()
    a, b = sampler.collect(policy, 4, 8, step=2), sampler.collect(policy, 4, 8, step=2)
    assert_same_rollout(a, b)
    assert not torch.equal(a.replay["tokens"], sampler.collect(policy, 4, 8, step=3).replay["tokens"])
    other_seed, _ = sequence_setup(seed=1)
    assert not torch.equal(a.replay["tokens"], other_seed.collect(policy, 4, 8, step=2).replay["tokens"])


@pytest.mark.parametrize("policy_cfg", [CategoricalSequenceConfig(type="categorical_sequence", eos_token=0), GaussianChainConfig(type="gaussian_chain")])
def test_one_process_equals_two_processes_splitting_the_groups(policy_cfg):
    sampler, policy = setup(policy_cfg, [])
    whole = sampler.collect(policy, 8, 4, step=5)
    split = Rollout.cat([sampler.collect(policy, 4, 4, step=5, group_offset=0), sampler.collect(policy, 4, 4, step=5, group_offset=4)])
    assert_same_rollout(whole, split)


def test_groups_share_a_prompt_and_carry_global_ids():
    sampler, policy = sequence_setup()
    rollout = sampler.collect(policy, 3, 8, step=7, group_offset=5)
    assert rollout.batch_size == 24 and rollout.old_logp.shape == rollout.mask.shape == (24, 6)
    assert torch.equal(rollout.group_id, torch.tensor([5, 6, 7]).repeat_interleave(8))
    prompts = rollout.info["prompt"].view(3, 8)
    expected = torch.tensor([group_seed(0, 7, g) % 4 for g in (5, 6, 7)])
    assert prompts.dtype == torch.long and torch.equal(prompts, expected[:, None].expand(3, 8))
    assert torch.equal(rollout.replay["prompt"], rollout.info["prompt"])
    tokens = rollout.info["tokens"].view(3, 8, 6)
    assert all(len({tuple(t.tolist()) for t in group}) > 1 for group in tokens)  # G different samples per group
    assert rollout.info["truncated"].shape == (24,) and rollout.entropy.shape == (24, 6)


def test_rollout_logp_is_what_the_policy_recomputes_from_replay():
    sampler, policy = sequence_setup()
    rollout = sampler.collect(policy, 4, 8, step=0)[torch.arange(5, 20)]
    torch.testing.assert_close(policy.log_prob(rollout.replay), rollout.old_logp, atol=1e-5, rtol=0)


def test_evaluate_is_greedy_and_weights_the_reward_components():
    rewards = [TokenFractionConfig(type="token_fraction", token=3, weight=2.0), TokenFractionConfig(type="token_fraction", token=5, weight=-0.5)]
    sampler, policy = setup(CategoricalSequenceConfig(type="categorical_sequence"), rewards)
    metrics = sampler.evaluate(policy, episodes=10, seed=0, rewards=sampler.rewards)
    tokens = policy.sample(torch.arange(10) % 4, None, deterministic=True).output
    expected = (2.0 * (tokens == 3).float().mean(1) - 0.5 * (tokens == 5).float().mean(1)).mean().item()
    assert metrics == pytest.approx({"reward_mean": expected, "episodes": 10})
    assert sampler.evaluate(policy, episodes=10, seed=1, rewards=sampler.rewards) == metrics  # greedy: the seed cannot matter


def test_evaluate_of_the_chain_starts_from_seeded_noise():
    sampler, policy = setup(GaussianChainConfig(type="gaussian_chain"), [TargetDistanceConfig(type="target_distance")])
    a, b, c = (sampler.evaluate(policy, episodes=16, seed=s, rewards=sampler.rewards) for s in (0, 0, 1))
    assert a == b and a["reward_mean"] != c["reward_mean"]
    assert a["episodes"] == 16 and a["reward_mean"] < 0


class ConstantPolicy:
    """Outputs its prompt id; succeeds on prompt 2."""

    def sample(self, inputs, generator=None, deterministic=False):
        prompt = torch.as_tensor(inputs)
        return Sample(output=prompt, logp=torch.zeros(len(prompt), 1), replay={}, info={"sample": prompt.float()[:, None], "success": prompt == 2})

    def log_prob(self, replay):
        raise NotImplementedError


def test_evaluate_reports_success_rate_when_the_policy_reports_success():
    train_cfg = TrainConfig(sampler=PromptSamplerConfig(type="prompt"), rewards=[TargetDistanceConfig(type="target_distance", target=2.0)])
    metrics = PromptSampler(train_cfg.sampler, train_cfg).evaluate(ConstantPolicy(), episodes=8, seed=0, rewards=reward_set(train_cfg))
    # prompts 0 1 2 3 0 1 2 3: rewards -2 -1 0 -1 ..., success on the two 2s
    assert metrics == {"reward_mean": -1.0, "episodes": 8, "success_rate": 0.25}
