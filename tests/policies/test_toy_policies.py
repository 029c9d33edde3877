"""The toy policies (tokens, denoising steps) and their rewards."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError
from mmrl.policies.toy import CategoricalSequenceConfig, CategoricalSequencePolicy, GaussianChainConfig, GaussianChainPolicy
from mmrl.registry import POLICIES, REWARDS
from mmrl.rewards.toy import TargetDistanceConfig, TokenFractionConfig, target_distance, token_fraction
from tests.kernel_emulation import check_recompute

SPEC = {"num_prompts": 4}
PROMPTS = torch.arange(32) % 4


def make(kind: str, seed: int = 0, **fields):
    torch.manual_seed(seed)
    if kind == "categorical_sequence":
        return build_policy(CategoricalSequenceConfig(type=kind, **fields), SPEC)
    return build_policy(from_dict(GaussianChainConfig, {"type": kind, **fields}, "policy"), SPEC)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rollout_of(sample, prompts) -> Rollout:
    mask = sample.mask if sample.mask is not None else torch.ones_like(sample.logp)
    return Rollout(group_id=prompts.clone(), old=OldLogProbs(sample.logp), mask=mask, replay=sample.replay, info=dict(sample.info))


KINDS = ["categorical_sequence", "gaussian_chain"]


def test_toy_policies_and_rewards_are_registered():
    assert {"categorical_sequence", "gaussian_chain"} <= set(POLICIES.names())
    assert {"token_fraction", "target_distance"} <= set(REWARDS.names())
    assert POLICIES.get("categorical_sequence") is CategoricalSequencePolicy and POLICIES.get("gaussian_chain") is GaussianChainPolicy
    assert POLICIES.entry("categorical_sequence").config is CategoricalSequenceConfig
    assert POLICIES.entry("gaussian_chain").config is GaussianChainConfig


@pytest.mark.numerics
@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_of_replay_equals_sampling_logp(kind):
    policy = make(kind, **({"eos_token": 0} if kind == "categorical_sequence" else {}))
    sample = policy.sample(PROMPTS, gen(1))
    logp = policy.log_prob(sample.replay)
    assert logp.shape == sample.logp.shape
    assert logp.requires_grad and not sample.logp.requires_grad
    torch.testing.assert_close(logp, sample.logp, atol=1e-5, rtol=0)  # the sampling loop against one pass (measured: equal)


@pytest.mark.parametrize("kind", KINDS)
def test_samples_depend_only_on_the_generator(kind):
    policy = make(kind)
    a, b, c = (policy.sample(PROMPTS, gen(s)) for s in (5, 5, 6))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.output, c.output)


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_pretrained_round_trip_exactly(kind, tmp_path):
    fields = {"eos_token": 1, "seq_len": 5} if kind == "categorical_sequence" else {"dim": 2, "denoising": {"num_inference_steps": 4}}
    policy = make(kind, **fields)
    save_pretrained(policy, tmp_path)
    torch.manual_seed(123)  # the rebuilt policy starts from different random weights
    loaded = load_pretrained(tmp_path)
    assert type(loaded) is type(policy) and loaded.config == policy.config and loaded.spec == SPEC
    a, b = policy.sample(PROMPTS, gen(2)), loaded.sample(PROMPTS, gen(2))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
    assert torch.equal(policy.log_prob(a.replay), loaded.log_prob(a.replay))


@pytest.mark.parametrize("kind", KINDS)
def test_policy_without_prompt_spec_says_which_sampler_to_use(kind):
    with pytest.raises(ConfigError, match="sampler.type: prompt"):
        POLICIES.get(kind)(POLICIES.entry(kind).config(type=kind), {})


# ---------------------------------------------------------------- categorical sequence


def test_eos_masks_later_tokens_and_flags_truncation():
    eos = 2
    policy = make("categorical_sequence", eos_token=eos)
    sample = policy.sample(torch.arange(64) % 4, gen(3))
    tokens, mask, truncated = sample.info["tokens"], sample.mask, sample.info["truncated"]
    is_eos = tokens == eos
    eos_before = torch.cumsum(is_eos.long(), 1) - is_eos.long() > 0  # an EOS at an earlier position
    assert torch.equal(mask, (~eos_before).float())  # the EOS itself stays a valid decision
    assert torch.all(tokens[eos_before] == eos)  # padding after EOS
    assert torch.equal(truncated, ~is_eos.any(1))
    assert truncated.any() and (~truncated).any() and (mask == 0).any()  # both cases occurred


def test_without_eos_every_token_is_valid_and_nothing_is_truncated():
    sample = make("categorical_sequence").sample(PROMPTS, gen(3))
    assert torch.equal(sample.mask, torch.ones(32, 6))
    assert not sample.info["truncated"].any()
    assert sample.output.shape == (32, 6) and sample.output.dtype == torch.long


def test_deterministic_sequence_is_greedy():
    policy = make("categorical_sequence", vocab_size=5, seq_len=4)
    sample = policy.sample(torch.arange(4), gen(0), deterministic=True)
    assert torch.equal(sample.output, policy.sample(torch.arange(4), gen(9), deterministic=True).output)
    with torch.no_grad():
        for pos in range(4):
            alternatives = []
            for token in range(5):
                tokens = sample.output.clone()
                tokens[:, pos] = token
                alternatives.append(policy.log_prob({"prompt": sample.replay["prompt"], "tokens": tokens})[:, pos])
            torch.testing.assert_close(sample.logp[:, pos], torch.stack(alternatives, 1).max(1).values)


def test_eos_token_outside_the_vocabulary_is_a_config_error():
    with pytest.raises(ConfigError, match="eos_token"):
        from_dict(CategoricalSequenceConfig, {"type": "categorical_sequence", "vocab_size": 8, "eos_token": 8}, "policy")


# ---------------------------------------------------------------- gaussian chain

# every transition of mmrl.denoising through the toy chain (the ones whose last step has
# std 0 with a std floor)
TRANSITIONS = {
    "flow_sde": {"transition": "flow_sde"},
    "flow_cps": {"transition": "flow_cps", "noise_level": 0.5, "min_std": 0.05},
    "flow_noise": {"transition": "flow_noise"},
    "ddim": {"transition": "ddim", "min_std": 0.05, "clip_denoised": 2.0},
    "ddpm": {"transition": "ddpm", "min_std": 0.05, "clip_denoised": 2.0},
    "ddim_last_steps_mean": {"transition": "ddim", "stochastic_steps": "last", "window_size": 3, "min_std": 0.05, "logp_reduction": "mean"},
    "flow_sde_window": {"transition": "flow_sde", "stochastic_steps": "window", "window_start": 2, "window_size": 3},
    "flow_sde_random_chain": {"transition": "flow_sde", "stochastic_steps": "random", "logp_granularity": "chain"},
}


def chain_policy(variant: str):
    return make("gaussian_chain", dim=2, denoising={"num_inference_steps": 6, **TRANSITIONS[variant]})


@pytest.mark.numerics
@pytest.mark.parametrize("variant", TRANSITIONS)
def test_chain_log_prob_of_replay_equals_sampling_logp_exactly(variant):
    policy = chain_policy(variant)
    sample = policy.sample(PROMPTS, gen(1))
    chain = sample.replay["chain"]
    first = policy.denoising.window[0]
    assert chain["latents"].shape == (32, 6 - first + 1, 2) and torch.equal(sample.output, chain["latents"][:, -1])
    assert chain["step_index"].tolist() == [list(range(first, 6))] * 32
    if policy.denoising.logp_granularity == "step":
        assert sample.logp.shape == sample.mask.shape == (32, 6 - first)
        assert torch.equal(sample.mask.bool(), chain["stochastic"]) and (sample.logp[~chain["stochastic"]] == 0).all()
    else:
        assert sample.logp.shape == (32, 1) and sample.mask is None and (chain["stochastic"].sum(1) == 1).all()
    assert policy.log_prob(sample.replay).requires_grad
    check_recompute(policy, sample, atol=1e-5)  # ratio 1 exactly at the sampling layout; a few ulps otherwise (measured: 6e-7)


@pytest.mark.numerics
def test_chain_step_log_prob_is_the_gaussian_of_the_mmrl_denoising_transition():
    from mmrl.denoising import make_transition

    policy = chain_policy("flow_sde")
    sample = policy.sample(PROMPTS, gen(4))
    chain = sample.replay["chain"]
    transition = make_transition(policy.denoising)
    k = 2
    step = torch.full((32,), k)
    with torch.no_grad():
        out = policy.chain_denoiser(sample.replay)(chain["latents"][:, k], transition.model_time(step), torch.arange(32))
        mean, std = transition.mean_std(step, chain["latents"][:, k], out, torch.ones(32, dtype=torch.bool))
    expected = torch.distributions.Normal(mean, std).log_prob(chain["latents"][:, k + 1]).sum(-1)
    torch.testing.assert_close(sample.logp[:, k], expected, atol=1e-5, rtol=0)  # torch's Normal sums in its own order (measured: 2.4e-7)


def test_deterministic_chain_has_no_decisions_and_follows_the_ode():
    policy = chain_policy("flow_sde")
    sample = policy.sample(PROMPTS, gen(4), deterministic=True)
    assert (sample.logp == 0).all() and (sample.mask == 0).all() and not sample.replay["chain"]["stochastic"].any()
    again = policy.sample(PROMPTS, gen(4), deterministic=True)
    assert torch.equal(sample.output, again.output)
    assert not torch.equal(sample.output, policy.sample(PROMPTS, gen(5), deterministic=True).output)  # x_init differs


def test_untrained_flow_chain_ode_path_stays_close_to_its_start():
    sample = make("gaussian_chain").sample(torch.arange(512) % 4, gen(0), deterministic=True)
    drift = sample.output - sample.replay["chain"]["latents"][:, 0]
    assert drift.abs().mean() < 0.3


@pytest.mark.parametrize("variant", ["flow_sde", "flow_noise", "ddim_last_steps_mean", "flow_sde_random_chain"])
def test_chain_exact_kl_is_zero_to_an_identical_reference_and_positive_after_a_perturbation(variant):
    import copy

    policy = chain_policy(variant)
    reference = copy.deepcopy(policy).requires_grad_(False)
    sample = policy.sample(PROMPTS, gen(3))
    kl = policy.exact_kl(sample.replay, reference)
    assert kl.shape == sample.logp.shape and torch.equal(kl, torch.zeros_like(kl))
    with torch.no_grad():
        policy.net[1].weight.add_(0.2 * torch.randn_like(policy.net[1].weight))
    kl = policy.exact_kl(sample.replay, reference)
    stochastic = sample.replay["chain"]["stochastic"]
    decisions = stochastic if policy.denoising.logp_granularity == "step" else stochastic.any(1, keepdim=True)
    assert (kl[decisions] > 0).all() and (kl[~decisions] == 0).all()
    kl.sum().backward()
    assert policy.net[1].weight.grad is not None and policy.net[1].weight.grad.abs().sum() > 0


def test_exact_kl_is_only_for_policies_that_have_a_closed_form():
    tokens = make("categorical_sequence")
    sample = tokens.sample(PROMPTS, gen(0))
    with pytest.raises(NotImplementedError, match="kl.type: exact"):
        tokens.exact_kl(sample.replay, tokens)
    chain = make("gaussian_chain")
    with pytest.raises(TypeError, match="denoising reference"):
        chain.exact_kl(chain.sample(PROMPTS, gen(0)).replay, tokens)


def test_chain_config_errors_name_the_denoising_field():
    with pytest.raises(ConfigError, match="policy.denoising.min_std"):
        from_dict(GaussianChainConfig, {"type": "gaussian_chain", "denoising": {"transition": "ddim"}}, "policy")
    with pytest.raises(ConfigError, match="policy.denoising.transition"):
        from_dict(GaussianChainConfig, {"type": "gaussian_chain", "denoising": {"transition": "euler"}}, "policy")
    with pytest.raises(ConfigError, match="policy.hidden"):
        from_dict(GaussianChainConfig, {"type": "gaussian_chain", "hidden": 33}, "policy")


# ---------------------------------------------------------------- rewards


def test_token_fraction_counts_only_valid_tokens():
    tokens = torch.tensor([[3, 3, 1, 3], [3, 0, 0, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    rollout = Rollout(group_id=torch.zeros(3, dtype=torch.long), old=OldLogProbs(torch.zeros(3, 4)), mask=mask, replay={}, info={"tokens": tokens})
    torch.testing.assert_close(token_fraction(rollout, TokenFractionConfig(type="token_fraction")), torch.tensor([2 / 3, 1 / 2, 0.0]))


def test_target_distance_is_minus_mean_absolute_error():
    sample = torch.tensor([[1.0, 3.5], [2.0, 2.0]])
    rollout = Rollout(group_id=torch.zeros(2, dtype=torch.long), old=OldLogProbs(torch.zeros(2, 1)), mask=torch.ones(2, 1), replay={}, info={"sample": sample})
    torch.testing.assert_close(target_distance(rollout, TargetDistanceConfig(type="target_distance")), torch.tensor([-1.25, 0.0]))


def test_reward_on_the_wrong_policy_names_the_policy_it_needs():
    rollout = Rollout(group_id=torch.zeros(2, dtype=torch.long), old=OldLogProbs(torch.zeros(2, 1)), mask=torch.ones(2, 1), replay={}, info={})
    with pytest.raises(ConfigError, match="gaussian_chain"):
        target_distance(rollout, TargetDistanceConfig(type="target_distance"))


# ---------------------------------------------------------------- behaviour


def reinforce(policy, reward_fn, steps: int, lr: float, groups: int = 8, group_size: int = 8, seed: int = 0) -> None:
    """Group-mean-baseline REINFORCE: minimise −mean(A · Σ_t m_t logp_t), A = r − mean_group(r)."""
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    prompts = (torch.arange(groups) % 4).repeat_interleave(group_size)
    for step in range(steps):
        sample = policy.sample(prompts, gen(1000 * (seed + 1) + step))
        reward = reward_fn(rollout_of(sample, prompts)).view(groups, group_size)
        advantage = (reward - reward.mean(1, keepdim=True)).view(-1)
        mask = sample.mask if sample.mask is not None else torch.ones_like(sample.logp)
        loss = -(advantage[:, None] * policy.log_prob(sample.replay) * mask).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def mean_reward(policy, reward_fn) -> float:
    prompts = torch.arange(256) % 4
    return reward_fn(rollout_of(policy.sample(prompts, gen(7)), prompts)).mean().item()


@pytest.mark.learning
def test_reinforce_makes_the_rewarded_token_more_frequent(learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): token fraction before 0.113 to 0.149 (<=
    0.2); token fraction after 1 to 1 (>= 0.6).
    """
    policy = make("categorical_sequence", seed=learning_seed)
    cfg = TokenFractionConfig(type="token_fraction", token=3)
    reward = lambda rollout: token_fraction(rollout, cfg)  # noqa: E731
    before = mean_reward(policy, reward)
    reinforce(policy, reward, steps=30, lr=3e-2, seed=learning_seed)
    after = mean_reward(policy, reward)
    learned(before, 0.2, higher=False, name="token fraction before")
    learned(after, 0.6, name="token fraction after")


@pytest.mark.learning
def test_reinforce_moves_the_chain_towards_the_target(learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): reward (minus distance) before -1.99 to
    -1.96 (<= -1.5); reward (minus distance) after -0.251 to -0.12 (>= -0.7).
    """
    policy = make("gaussian_chain", seed=learning_seed)
    cfg = TargetDistanceConfig(type="target_distance", target=2.0)
    reward = lambda rollout: target_distance(rollout, cfg)  # noqa: E731
    before = mean_reward(policy, reward)
    reinforce(policy, reward, steps=30, lr=1e-2, seed=learning_seed)
    after = mean_reward(policy, reward)
    learned(before, -1.5, higher=False, name="reward (minus distance) before")
    learned(after, -0.7, name="reward (minus distance) after")
