"""mmrl's advantages, KL estimators, objectives and aggregations against verl 0.9.1's
``verl.trainer.ppo.core_algos``, run on identical tensors (docs/parity.md is the table)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmrl.algo import advantage, aggregation, kl, objective
from tests.parity.conftest import TOLERANCE, assert_same_value_and_grad, random_batch

pytestmark = pytest.mark.numerics  # two libraries' float32 arithmetic on the same tensors

# Six groups of four, ids neither contiguous nor sorted; group 11 has equal rewards.
GROUP_ID = torch.tensor([7, 3, 7, 11, 3, 5, 7, 11, 5, 3, 11, 7, 5, 3, 11, 5, 2, 2, 9, 9, 2, 9, 2, 9])
REWARDS = torch.tensor(
    [1.0, 0.0, 0.0, 0.5, 1.0, 0.3, 1.0, 0.5, 0.9, 1.0, 0.5, 0.0, 0.2, 0.0, 0.5, 0.7, 2.5, -1.0, 0.1, 0.4, 0.3, 1.7, 0.0, -0.6]
)


def verl_outcome(fn, rewards, group_id, **options):
    """One advantage per completion from a verl outcome estimator, which takes the score on
    the last token of [B, T] token rewards and string uids as the group index."""
    token_rewards = torch.zeros(len(rewards), 3)
    token_rewards[:, -1] = rewards
    uids = np.array([f"uid-{g}" for g in group_id.tolist()], dtype=object)
    adv, _ = fn(token_level_rewards=token_rewards, response_mask=torch.ones_like(token_rewards), index=uids, **options)
    return adv[:, 0]


def actor_config(**fields):
    """A verl ActorConfig carrying only what the policy losses read (clip ranges and the
    aggregation's global batch info, empty = the local batch)."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, **fields)


# --- advantages ------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["compute_grpo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage"])
@pytest.mark.parametrize("norm_by_std, std", [(True, "group"), (False, "none")])
def test_grpo_with_bessel_std_equals_verl(core_algos, estimator, norm_by_std, std):
    theirs = verl_outcome(getattr(core_algos, estimator), REWARDS, GROUP_ID, norm_adv_by_std_in_grpo=norm_by_std)
    ours, keep = advantage.grpo(REWARDS, GROUP_ID, eps=1e-6, std=std, ddof=1)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    assert keep.all()
    assert (ours[GROUP_ID == 11] == 0).all() and (ours != 0).sum() >= 18


def test_grpo_default_population_std_is_larger_by_bessels_factor(core_algos):
    # mmrl's default ddof=0 (as Flow-GRPO) divides by the population std: for groups of
    # four, |A| is sqrt(4/3) times verl's (up to the eps terms).
    theirs = verl_outcome(core_algos.compute_grpo_outcome_advantage, REWARDS, GROUP_ID, epsilon=1e-12)
    ours, _ = advantage.grpo(REWARDS, GROUP_ID, eps=1e-12)
    nonzero = theirs != 0  # not group 11, not a reward equal to its group's mean
    assert nonzero.sum() == 19
    torch.testing.assert_close(ours[nonzero] / theirs[nonzero], torch.full((19,), math.sqrt(4 / 3)), rtol=1e-5, atol=0)


def test_grpo_group_of_one_gets_zero_where_verl_passes_the_reward_through(core_algos):
    rewards, group_id = torch.tensor([0.7, 1.0, 0.0, -2.0]), torch.tensor([0, 1, 1, 2])
    theirs = verl_outcome(core_algos.compute_grpo_outcome_advantage, rewards, group_id)
    ours, _ = advantage.grpo(rewards, group_id, ddof=1)
    # verl: mean 0, std 1 for a group of one, so A = r / (1 + 1e-6); mmrl: A = 0
    torch.testing.assert_close(theirs[[0, 3]], torch.tensor([0.7, -2.0]) / (1 + 1e-6))
    torch.testing.assert_close(ours[[0, 3]], torch.zeros(2))
    torch.testing.assert_close(ours[1:3], theirs[1:3], **TOLERANCE)


@pytest.mark.parametrize("estimator", ["compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage"])
def test_rloo_equals_verl(core_algos, estimator):
    theirs = verl_outcome(getattr(core_algos, estimator), REWARDS, GROUP_ID)
    ours, _ = advantage.rloo(REWARDS, GROUP_ID)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)


def test_rloo_group_of_one_gets_zero_as_verls_vectorized_estimator(core_algos):
    rewards, group_id = torch.tensor([0.7, 1.0, 0.0]), torch.tensor([0, 1, 1])
    ours, _ = advantage.rloo(rewards, group_id)
    vectorized = verl_outcome(core_algos.compute_rloo_vectorized_outcome_advantage, rewards, group_id)
    looped = verl_outcome(core_algos.compute_rloo_outcome_advantage, rewards, group_id)
    torch.testing.assert_close(ours, vectorized, **TOLERANCE)
    assert ours[0] == 0 and looped[0] == pytest.approx(0.7)  # verl's looped RLOO keeps the raw reward


def test_passk_equals_verl_without_std_normalisation(core_algos):
    theirs = verl_outcome(
        core_algos.compute_grpo_passk_outcome_advantage, REWARDS, GROUP_ID, config={"norm_adv_by_std_in_grpo": False}
    )
    ours, _ = advantage.passk(REWARDS, GROUP_ID)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    assert (ours != 0).sum() == 3  # the best of each group without a tie at the top


def test_passk_verl_default_divides_the_gap_by_the_group_std(core_algos):
    rewards, group_id = torch.tensor([0.0, 1.0, 0.5, 0.2]), torch.zeros(4, dtype=torch.long)
    theirs = verl_outcome(
        core_algos.compute_grpo_passk_outcome_advantage, rewards, group_id, config={"norm_adv_by_std_in_grpo": True}
    )
    ours, _ = advantage.passk(rewards, group_id)
    # gap 1.0 − 0.5 = 0.5 on the best sample; verl divides it by the Bessel std + 1e-6
    torch.testing.assert_close(ours, torch.tensor([0.0, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(theirs, ours / (rewards.std() + 1e-6))


# --- KL estimators ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "verl_name, ours", [("kl", kl.k1), ("k1", kl.k1), ("mse", kl.k2), ("k2", kl.k2), ("low_var_kl", kl.k3), ("k3", kl.k3)]
)
def test_kl_estimators_equal_verl_kl_penalty(core_algos, verl_name, ours):
    gen = torch.Generator().manual_seed(1)
    logp = (-3 * torch.rand(4, 10, generator=gen)).requires_grad_()
    # δ = ref − logp from −30 to 30: inside the cap, under it, beyond verl's ±20 clamp
    ref_logp = logp.detach() + torch.linspace(-30, 30, 40).view(4, 10)
    weights = torch.rand(4, 10, generator=gen)
    assert_same_value_and_grad(
        lambda lp: (ours(lp, ref_logp) * weights).sum(),
        lambda lp: (core_algos.kl_penalty(lp, ref_logp, verl_name) * weights).sum(),
        logp,
    )
    if ours is kl.k3:
        capped = ours(logp, ref_logp) == 10
        assert 0 < capped.sum() < 40


# --- policy losses and aggregation -------------------------------------------------------

# verl loss_agg_mode ↔ mmrl aggregation, with local normalisers (no global batch info);
# verl's "token-sum" has no mmrl counterpart.
AGG_MODES = [
    ("token-mean", aggregation.token_mean),
    ("seq-mean-token-mean", aggregation.seq_mean_token_mean),
    ("seq-mean-token-sum", aggregation.seq_mean_token_sum),
    ("seq-mean-token-sum-norm", aggregation.const_norm),
]


@pytest.mark.parametrize("mode, aggregate", AGG_MODES)
def test_vanilla_ppo_equals_ppo_clip_with_dual_clip_three(core_algos, mode, aggregate):
    b = random_batch(seed=2, far_off=1.5)
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)

    def ours(logp):
        loss, _ = objective.ppo_clip(logp, b.old_logp, b.token_adv, mask=b.mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
        return aggregate(loss, b.mask)

    def theirs(logp):
        return core_algos.compute_policy_loss_vanilla(b.old_logp, logp, b.token_adv, b.mask, mode, config)[0]

    assert_same_value_and_grad(ours, theirs, b.logp)
    _, stats = objective.ppo_clip(b.logp, b.old_logp, b.token_adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    valid = b.mask.bool()
    assert stats["clipped"][valid].any() and not stats["clipped"][valid].all() and stats["dual_clipped"][valid].any()


@pytest.mark.parametrize(
    "mode, verl_info, aggregate, ours_info",
    [
        # dp_size 2: verl multiplies by the ranks, mmrl takes the global count / ranks
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 50}, aggregation.token_mean, {"num_tokens": 25}),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 16}, aggregation.seq_mean_token_mean, {"num_seqs": 8}),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 16}, aggregation.seq_mean_token_sum, {"num_seqs": 8}),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 32}, aggregation.const_norm, {"max_len": 32}),
    ],
)
def test_agg_loss_global_normalisers_map_to_aggregation_options(core_algos, mode, verl_info, aggregate, ours_info):
    b = random_batch(seed=3)
    per_decision = lambda logp: objective.reinforce(logp, b.old_logp, b.token_adv, mask=b.mask)[0]  # noqa: E731
    assert_same_value_and_grad(
        lambda logp: aggregate(per_decision(logp), b.mask, **ours_info),
        lambda logp: core_algos.agg_loss(per_decision(logp), b.mask, mode, **verl_info),
        b.logp,
    )


def test_vanilla_ppo_always_dual_clips_and_mmrl_only_when_asked(core_algos):
    b = random_batch(seed=2, far_off=1.5)
    config = actor_config(loss_agg_mode="token-mean")
    theirs = core_algos.compute_policy_loss_vanilla(b.old_logp, b.logp, b.token_adv, b.mask, "token-mean", config)[0]
    dual, stats = objective.ppo_clip(b.logp, b.old_logp, b.token_adv, mask=b.mask, dual_clip=3.0)
    plain, _ = objective.ppo_clip(b.logp, b.old_logp, b.token_adv, mask=b.mask)
    torch.testing.assert_close(aggregation.token_mean(dual, b.mask), theirs, **TOLERANCE)
    # mmrl's default (no dual clip) differs exactly where dual clip bounds the loss: A < 0, w > 3
    bounded = stats["dual_clipped"].bool() & b.mask.bool()
    excess = (plain - dual) * b.mask
    assert bounded.any() and torch.equal(excess != 0, bounded) and (excess[bounded] > 0).all()


@pytest.mark.parametrize("mode, aggregate", AGG_MODES[:2])
def test_gspo_equals_verl(core_algos, mode, aggregate):
    b = random_batch(seed=4, log_ratio_scale=6e-4)
    config = actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode=mode)

    def ours(logp):
        loss, _ = objective.gspo(logp, b.old_logp, b.token_adv, mask=b.mask, eps_low=3e-4, eps_high=4e-4)
        return aggregate(loss, b.mask)

    def theirs(logp):
        return core_algos.compute_policy_loss_gspo(b.old_logp, logp, b.token_adv, b.mask, mode, config)[0]

    grad = assert_same_value_and_grad(ours, theirs, b.logp)
    rows_with_gradient = (grad != 0).any(-1).sum()
    assert 0 < rows_with_gradient < 8  # some sequences inside the band, some clipped


def test_gspo_above_e10_verl_caps_the_ratio_and_its_gradient(core_algos):
    # a sequence log-ratio of 12 with A < 0 (unclipped): verl clamps the log-ratio at 10
    # including the token term, so value e^10 and no gradient; mmrl clamps only the
    # stop-gradient sequence ratio (±20 by default): value e^12, gradient e^12·|A|/n.
    old_logp = torch.zeros(1, 3)
    logp = torch.full((1, 3), 12.0, requires_grad=True)
    adv, mask = torch.full((1, 3), -1.0), torch.ones(1, 3)
    config = actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    theirs = core_algos.compute_policy_loss_gspo(old_logp, logp, adv, mask, "seq-mean-token-mean", config)[0]
    loss, _ = objective.gspo(logp, old_logp, adv, mask=mask, eps_low=3e-4, eps_high=4e-4)
    ours = aggregation.seq_mean_token_mean(loss, mask)
    torch.testing.assert_close(theirs, torch.tensor(math.exp(10.0)))
    torch.testing.assert_close(ours, torch.tensor(math.exp(12.0)))
    assert (torch.autograd.grad(theirs, logp)[0] == 0).all()
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.full((1, 3), math.exp(12.0) / 3))


def test_cispo_with_eps_low_and_one_plus_clip_high_equals_verl(core_algos):
    b = random_batch(seed=5, far_off=2.0)
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=4.0, loss_agg_mode="token-mean")

    def ours(logp):
        loss, _ = objective.cispo(logp, b.old_logp, b.token_adv, mask=b.mask, eps_low=0.2, eps_high=1 + 4.0)
        return aggregation.token_mean(loss, b.mask)

    def theirs(logp):
        return core_algos.compute_policy_loss_cispo(b.old_logp, logp, b.token_adv, b.mask, "token-mean", config)[0]

    assert_same_value_and_grad(ours, theirs, b.logp)
    ratio = torch.exp(b.logp.detach() - b.old_logp)[b.mask.bool()]
    assert (ratio > 5).any() and (ratio < 0.8).any()


@pytest.mark.parametrize("mode, aggregate", AGG_MODES)
def test_gpg_equals_reinforce(core_algos, mode, aggregate):
    b = random_batch(seed=6)
    config = actor_config(loss_agg_mode=mode)

    def ours(logp):
        loss, _ = objective.reinforce(logp, b.old_logp, b.token_adv, mask=b.mask)
        return aggregate(loss, b.mask)

    def theirs(logp):
        return core_algos.compute_policy_loss_gpg(b.old_logp, logp, b.token_adv, b.mask, mode, config)[0]

    assert_same_value_and_grad(ours, theirs, b.logp)


@pytest.mark.parametrize("mode, aggregate", [("seq-mean-token-mean", aggregation.seq_mean_token_mean), ("seq-mean-token-sum", aggregation.seq_mean_token_sum)])
def test_sequence_means_count_empty_rows_unlike_verl(core_algos, mode, aggregate):
    b = random_batch(seed=7)
    b.mask[[2, 5]] = 0  # two completions with no valid decision (e.g. truncated and masked)
    per_decision = lambda logp: objective.reinforce(logp, b.old_logp, b.token_adv, mask=b.mask)[0]  # noqa: E731
    theirs = core_algos.agg_loss(per_decision(b.logp), b.mask, mode)
    ours = aggregate(per_decision(b.logp), b.mask)
    # verl divides by the 6 non-empty rows, mmrl by all 8 (B) unless told num_seqs
    torch.testing.assert_close(ours, theirs * 6 / 8, **TOLERANCE)
    assert_same_value_and_grad(
        lambda logp: aggregate(per_decision(logp), b.mask, num_seqs=6),
        lambda logp: core_algos.agg_loss(per_decision(logp), b.mask, mode),
        b.logp,
    )
