import math

import pytest
import torch

from mmrl.core.statistics import commit_statistics

from mmrl.core.weights import build_policy, load_pretrained, save_pretrained
from mmrl.errors import ConfigError
from mmrl.policies.gaussian_mlp import GaussianMLPConfig, GaussianMLPPolicy
from mmrl.registry import POLICIES

SPEC = {"obs_dim": 5, "action_dim": 2, "action_low": [0.0, -2.0], "action_high": [2.0, 2.0]}
VARIANTS = {
    "default": {},
    "chunk3": {"action_chunk": 3},
    "state_dependent_std": {"state_dependent_std": True, "activation": "relu"},
    "obs_norm": {"obs_norm": True},
    "anneal_std": {"final_log_std": -2.0, "log_std_anneal_decisions": 12},
    "tanh_squash": {"squash": "tanh", "init_log_std": 0.5},
}


def make(spec=SPEC, **fields) -> GaussianMLPPolicy:
    torch.manual_seed(0)
    return build_policy(GaussianMLPConfig(hidden_sizes=[16, 16], **fields), spec)


def obs_batch(n=6, seed=1):
    return 3.0 + 2.0 * torch.randn(n, SPEC["obs_dim"], generator=torch.Generator().manual_seed(seed))


def test_registered_under_its_type_name():
    assert POLICIES.get("gaussian_mlp") is GaussianMLPPolicy
    assert POLICIES.entry("gaussian_mlp").config is GaussianMLPConfig


@pytest.mark.numerics
@pytest.mark.parametrize("variant", VARIANTS)
def test_sample_shapes_and_log_prob_of_replay_equals_sampling_logp(variant):
    policy = make(**VARIANTS[variant])
    chunk = policy.config.action_chunk
    sample = policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    assert sample.output.shape == (6, chunk, 2)
    assert sample.logp.shape == sample.entropy.shape == (6, 1)
    assert sample.replay["obs"].shape == (6, 1, 5)
    assert sample.replay["action"].shape == (6, 1, chunk, 2)
    if policy.config.obs_norm or policy.config.final_log_std is not None:  # statistics / std cap move after sampling; the replay must not care
        policy.sample(obs_batch(seed=7) * 5, torch.Generator().manual_seed(1))
    replay = {k: torch.cat([v, v], 1) for k, v in sample.replay.items()}  # T = 2 decisions
    logp = policy.log_prob(replay)
    assert logp.shape == (6, 2)
    torch.testing.assert_close(logp, sample.logp.expand(6, 2), atol=1e-5, rtol=1e-6)  # 12 rows in one pass: another batch (measured: equal)


def test_logp_and_entropy_are_those_of_a_diagonal_gaussian_over_the_chunk():
    policy = make(action_chunk=2)
    sample = policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    obs_n, action_n = sample.replay["obs"][:, 0], sample.replay["action"][:, 0].reshape(6, -1)
    dist = torch.distributions.Normal(policy.net(obs_n), policy.log_std.exp())
    torch.testing.assert_close(sample.logp[:, 0], dist.log_prob(action_n).sum(-1))
    torch.testing.assert_close(sample.entropy[:, 0], dist.entropy().sum(-1))


def test_actions_are_scaled_to_finite_bounds_and_left_alone_when_unbounded():
    bounded = make()
    mean = bounded.sample(obs_batch(), deterministic=True).output
    # the head starts near zero, so the deterministic action is the centre of [low, high]
    torch.testing.assert_close(mean, torch.tensor([1.0, 0.0]).expand_as(mean), atol=0.1, rtol=0)
    sample = bounded.sample(obs_batch(), torch.Generator().manual_seed(0))
    action_n = sample.replay["action"][:, 0]
    torch.testing.assert_close(sample.output, torch.tensor([1.0, 0.0]) + torch.tensor([1.0, 2.0]) * action_n)

    unbounded = make({"obs_dim": 5, "action_dim": 2, "action_low": [-math.inf] * 2, "action_high": [math.inf] * 2})
    sample = unbounded.sample(obs_batch(), torch.Generator().manual_seed(0))
    torch.testing.assert_close(sample.output, sample.replay["action"][:, 0])


def test_deterministic_sample_is_the_mean_and_ignores_the_generator():
    policy = make()
    a = policy.sample(obs_batch(), torch.Generator().manual_seed(0), deterministic=True).output
    b = policy.sample(obs_batch(), torch.Generator().manual_seed(1), deterministic=True).output
    c = policy.sample(obs_batch(), torch.Generator().manual_seed(0)).output
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_same_generator_seed_gives_the_same_sample():
    policy = make()
    a = policy.sample(obs_batch(), torch.Generator().manual_seed(3))
    b = policy.sample(obs_batch(), torch.Generator().manual_seed(3))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)


@pytest.mark.parametrize("variant", ["default", "state_dependent_std", "tanh_squash"])
def test_positive_advantage_raises_that_actions_log_prob_after_one_adam_step(variant):
    policy = make(**VARIANTS[variant])
    sample = policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    advantage = torch.zeros(6, 1)
    advantage[2] = 1.0
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    loss = -(advantage * policy.log_prob(sample.replay)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    after = policy.log_prob(sample.replay).detach()
    assert after[2, 0] > sample.logp[2, 0] + 1e-3


def _commit(policy):
    commit_statistics(policy, lambda t: t)  # one process: the pending sums as they are


def test_obs_norm_statistics_move_only_on_commit_and_only_from_training_samples():
    policy = make(obs_norm=True)
    policy.sample(obs_batch(), deterministic=True)
    policy.eval()
    policy.sample(obs_batch(), torch.Generator().manual_seed(0))  # sampled evaluation
    policy.train()
    _commit(policy)
    assert torch.equal(policy.obs_stats.mean, torch.zeros(5))
    obs = obs_batch(n=64)
    policy.sample(obs, torch.Generator().manual_seed(0))
    assert torch.equal(policy.obs_stats.mean, torch.zeros(5))  # fixed within a step
    _commit(policy)
    torch.testing.assert_close(policy.obs_stats.mean, obs.mean(0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(policy.obs_stats.var, obs.var(0, unbiased=False), atol=1e-3, rtol=1e-3)
    # the next step's rows merge into the running statistics (parallel Welford)
    more = obs_batch(n=32, seed=5) * 2
    policy.sample(more[:20], torch.Generator().manual_seed(0))
    policy.sample(more[20:], torch.Generator().manual_seed(0))
    _commit(policy)
    both = torch.cat([obs, more])
    torch.testing.assert_close(policy.obs_stats.mean, both.mean(0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(policy.obs_stats.var, both.var(0, unbiased=False), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("update, pretrained, moves", [("auto", False, True), ("auto", True, False), ("always", True, True), ("never", False, False)])
def test_a_pretrained_policy_keeps_its_loaded_statistics_unless_told_otherwise(tmp_path, update, pretrained, moves):
    # fine-tuning a behaviour-cloned policy: its network was fitted to its loaded statistics
    source = make(obs_norm=True)
    source.sample(obs_batch(n=64), torch.Generator().manual_seed(0))
    _commit(source)
    save_pretrained(source, tmp_path / "sft")
    cfg = GaussianMLPConfig(hidden_sizes=[16, 16], obs_norm=True, obs_norm_update=update, pretrained=str(tmp_path / "sft") if pretrained else None)
    policy = build_policy(cfg, SPEC)  # with pretrained set, the saved weights and statistics load on top
    before = policy.obs_stats.mean.clone()
    for batch in (obs_batch(n=32, seed=7) * 3, {"state": obs_batch(n=32, seed=8) * 3}):  # a flat or a structured env's observation
        policy.sample(batch, torch.Generator().manual_seed(0))
    policy.sft_loss({"state": obs_batch(n=8, seed=9) * 3, "actions": torch.zeros(8, 1, 2)})
    _commit(policy)
    assert (not torch.equal(policy.obs_stats.mean, before)) == moves


def test_weights_without_annealing_load_into_an_annealed_policy_whose_clock_starts_at_zero(tmp_path):
    # a behaviour-cloned policy fine-tuned with annealed exploration noise
    source = make(obs_norm=True)
    save_pretrained(source, tmp_path / "sft")
    cfg = GaussianMLPConfig(hidden_sizes=[16, 16], obs_norm=True, final_log_std=-2.0, log_std_anneal_decisions=12, pretrained=str(tmp_path / "sft"))
    policy = build_policy(cfg, SPEC)
    assert policy.sampled_decisions.value.item() == 0.0 and torch.equal(policy.net[0].weight, source.net[0].weight)
    policy.sample(obs_batch(n=6), torch.Generator().manual_seed(0))
    _commit(policy)
    assert policy.sampled_decisions.value.item() == 6.0


def test_weights_saved_before_the_statistics_modules_still_load():
    policy = make(obs_norm=True, final_log_std=-2.0, log_std_anneal_decisions=12)
    state = policy.state_dict()
    legacy = {k.replace("obs_stats.", "obs_").replace("sampled_decisions.value", "sampled_decisions"): v for k, v in state.items()}
    legacy["obs_mean"] = torch.full((5,), 3.0)
    fresh = make(obs_norm=True, final_log_std=-2.0, log_std_anneal_decisions=12)
    fresh.load_state_dict(legacy)
    assert torch.equal(fresh.obs_stats.mean, torch.full((5,), 3.0))


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_and_load_pretrained_round_trip_gives_exactly_equal_outputs(tmp_path, variant):
    policy = make(**VARIANTS[variant])
    policy.sample(obs_batch(n=32), torch.Generator().manual_seed(0))
    _commit(policy)  # moves obs_norm statistics and the annealing clock
    save_pretrained(policy, tmp_path / "policy")
    loaded = load_pretrained(tmp_path / "policy")
    assert isinstance(loaded, GaussianMLPPolicy) and loaded.config == policy.config
    a = policy.sample(obs_batch(), torch.Generator().manual_seed(4))
    b = loaded.sample(obs_batch(), torch.Generator().manual_seed(4))
    assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
    assert torch.equal(policy.log_prob(a.replay), loaded.log_prob(a.replay))


def test_config_rejects_min_log_std_above_max():
    from mmrl.config import from_dict
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match="policy.min_log_std"):
        from_dict(GaussianMLPConfig, {"type": "gaussian_mlp", "min_log_std": 2.0, "max_log_std": 1.0}, "policy")


def test_learned_log_std_below_the_cap_keeps_its_gradient_and_above_it_gets_none():
    policy = make(init_log_std=-0.5, final_log_std=-1.0, log_std_anneal_decisions=1)
    policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    _commit(policy)  # the cap is now -1.0
    with torch.no_grad():
        policy.log_std.copy_(torch.tensor([-0.2, -1.5]))  # above the cap, below it
    sample = policy.sample(obs_batch(), torch.Generator().manual_seed(1))
    torch.testing.assert_close(sample.replay["log_std_cap"], torch.full((6, 1), -1.0))
    policy.log_prob(sample.replay).sum().backward()
    assert policy.log_std.grad[0] == 0 and policy.log_std.grad[1] != 0


def test_config_rejects_final_log_std_above_init():
    from mmrl.config import from_dict
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match="policy.final_log_std"):
        from_dict(GaussianMLPConfig, {"type": "gaussian_mlp", "init_log_std": -1.0, "final_log_std": 0.0}, "policy")


@pytest.mark.numerics
def test_annealed_log_std_cap_moves_linearly_with_training_samples_only():
    policy = make(init_log_std=-0.5, final_log_std=-2.0, log_std_anneal_decisions=12)
    assert policy.log_std_cap() == -0.5
    first = policy.sample(obs_batch(), torch.Generator().manual_seed(0))  # 6 decisions at cap -0.5
    torch.testing.assert_close(first.replay["log_std_cap"], torch.full((6, 1), -0.5))
    assert policy.log_std_cap() == -0.5  # the clock moves when the step's samples are committed
    _commit(policy)
    assert policy.log_std_cap() == pytest.approx(-1.25)
    # neither the mean action nor sampling in eval mode (sampled evaluation) moves the clock
    policy.sample(obs_batch(), deterministic=True)
    policy.eval()
    policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    policy.train()
    _commit(policy)
    assert policy.log_std_cap() == pytest.approx(-1.25)
    second = policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    # the learned log std (-0.5) is above the cap: the noise has the cap's std
    obs_n, action_n = second.replay["obs"][:, 0], second.replay["action"][:, 0].reshape(6, -1)
    expected = torch.distributions.Normal(policy.net(obs_n), math.exp(-1.25)).log_prob(action_n).sum(-1)
    torch.testing.assert_close(second.logp[:, 0], expected)
    torch.testing.assert_close(second.entropy[:, 0], torch.full((6,), 2 * (-1.25 + 0.5 * math.log(2 * math.pi) + 0.5)))
    for _ in range(3):
        policy.sample(obs_batch(), torch.Generator().manual_seed(0))
    _commit(policy)
    assert policy.log_std_cap() == pytest.approx(-2.0)  # stays at final_log_std
    # an early decision's log-prob is still that of its own (higher) cap
    torch.testing.assert_close(policy.log_prob(first.replay), first.logp, atol=1e-5, rtol=1e-6)  # another pass (measured: equal)


def test_annealed_noise_shrinks_the_spread_of_sampled_actions_around_the_same_mean():
    policy = make(init_log_std=0.0, final_log_std=-3.0, log_std_anneal_decisions=1000)
    obs = obs_batch(n=1000)
    early = policy.sample(obs, torch.Generator().manual_seed(0)).replay["action"][:, 0, 0]
    _commit(policy)
    late = policy.sample(obs, torch.Generator().manual_seed(0)).replay["action"][:, 0, 0]
    mean = policy.sample(obs, deterministic=True).replay["action"][:, 0, 0]
    assert (early - mean).std().item() == pytest.approx(1.0, rel=0.1)
    assert (late - mean).std().item() == pytest.approx(math.exp(-3.0), rel=0.1)


def test_tanh_squash_keeps_env_actions_inside_the_bounds_and_its_logp_is_the_change_of_variables():
    policy = make(squash="tanh", init_log_std=1.0)  # std e: most pre-squash samples lie past ±1
    sample = policy.sample(obs_batch(200), torch.Generator().manual_seed(0))
    u = sample.replay["action"][:, 0, 0]  # [N, 2] pre-squash
    assert (u.abs() > 1).float().mean() > 0.4
    low, high = torch.tensor(SPEC["action_low"]), torch.tensor(SPEC["action_high"])
    assert bool(((sample.output >= low) & (sample.output <= high)).all())
    torch.testing.assert_close(sample.output[:, 0], torch.tensor([1.0, 0.0]) + torch.tensor([1.0, 2.0]) * torch.tanh(u))
    # log pi(a) = log N(u; mu, sigma) - sum log(1 - tanh(u)^2), in float64 as the reference
    mean = policy.net(sample.replay["obs"][:, 0]).double()
    gauss = torch.distributions.Normal(mean, policy.log_std.exp().double()).log_prob(u.double()).sum(-1)
    reference = gauss - torch.log1p(-torch.tanh(u.double()) ** 2).sum(-1)
    torch.testing.assert_close(sample.logp[:, 0].double(), reference, atol=1e-4, rtol=1e-5)  # float32 Jacobian of |u| <= ~5
    # a density over the bounded action: it integrates to 1 over (-1, 1) (one dimension, fixed mu, sigma)
    grid = torch.linspace(-1 + 1e-6, 1 - 1e-6, 200_001, dtype=torch.float64)
    mu, sigma = 0.3, 1.5
    density = torch.distributions.Normal(mu, sigma).log_prob(torch.atanh(grid)).exp() / (1 - grid**2)
    assert abs(torch.trapezoid(density, grid).item() - 1.0) < 1e-3
    # deterministic: tanh of the mean, inside the bounds
    det = policy.sample(obs_batch(200), deterministic=True).output[:, 0]
    torch.testing.assert_close(det, torch.tensor([1.0, 0.0]) + torch.tensor([1.0, 2.0]) * torch.tanh(policy.net(policy._normalize(obs_batch(200)))))


def test_tanh_squash_behaviour_cloning_fits_demo_actions_at_the_bounds():
    policy = make(squash="tanh")
    obs = obs_batch(32)
    actions = torch.tensor([2.0, -2.0]).expand(32, 1, 2)  # both at a bound
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = policy.sft_loss({"obs": obs, "actions": actions})
        assert torch.isfinite(loss)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    det = policy.sample(obs, deterministic=True).output[:, 0]
    assert loss.item() < first
    assert bool((det[:, 0] > 1.9).all() and (det[:, 1] < -1.8).all())


def test_tanh_squash_needs_finite_bounds():
    with pytest.raises(ConfigError, match="policy.squash"):
        make({"obs_dim": 5, "action_dim": 2, "action_low": [-math.inf, -1.0], "action_high": [math.inf, 1.0]}, squash="tanh")
