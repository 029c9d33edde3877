"""Deferred old log-probs: a policy may hand its rollout over without the exact log-probs of
the sampling parameters (``Sample.logp_deferred``); the trainer then takes them from the first
minibatch's own forward and one no-grad pass over the other rows before its first optimizer
step. The update must be the one an eager recompute gives."""

import dataclasses
import string

import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.component_config import RewardConfig
from mmrl.registry import REWARDS
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer
from tests.conftest import ROOT

pytest.importorskip("transformers")

pytestmark = pytest.mark.numerics  # every test compares two computations of one update


# The toy runs compared sum the same terms in other orders (other passes, rows left out), and
# Adam moves a weight by lr * m / (sqrt(v) + eps): a rounding difference d in a gradient entry
# near 0 moves it by up to lr * d / eps. In float32 that is up to lr; in float64 d is at most
# ~200 terms x 2**-53 x entries <= 1 (clipped), ~1e-7 a step, 1e-6 over the 8 optimizer steps,
# while a real mismatch moves weights by ~lr = 0.05 (measured: at most 1.3e-13 apart under
# ATEN_CPU_CAPABILITY default, avx2 and avx512).
TOY_WEIGHTS_ATOL = 1e-6


def _toy(**algo) -> TrainConfig:
    return from_dict(TrainConfig, {
        "name": "toy", "seed": 0, "total_steps": 2, "sampler": {"type": "prompt"},
        "policy": {"type": "categorical_sequence", "dtype": "float64"}, "rewards": [{"type": "token_fraction", "token": 3}],
        "algo": {"group_size": 8, "groups_per_step": 4, **algo}, "optim": {"lr": 0.05},
        "log": {"progress": False, "tensorboard": False},
    })


def _train(cfg: TrainConfig, run_dir, defer: bool):
    """Weights after training, the logged metrics, forward calls per step, and each step's
    rollout old_logp as the self-imitation memory would see it after the update."""
    trainer = Trainer(cfg, run_dir)
    policy = trainer.policy
    if defer:  # the policy reports wrong numbers and says so: the trainer must not use them
        sample = policy.sample
        policy.sample = lambda *a, **kw: dataclasses.replace(s := sample(*a, **kw), logp=s.logp - 1.0, logp_deferred=True)
    calls = []
    forward = trainer.learner.model.forward
    trainer.learner.model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
    handed_on = []
    update = trainer.learner.update
    def recorded_update(rollout, targets, *args):
        out = update(rollout, targets, *args)
        adv = targets.adv
        trained = ((adv[:, None] if adv.dim() == 1 else adv).to(rollout.mask.device) * rollout.mask != 0).any(1).cpu()
        handed_on.append((rollout.old.deferred, rollout.old_logp.detach().cpu(), trained))
        return out

    trainer.learner.update = recorded_update
    metrics = [trainer.rl_step(step) for step in range(cfg.total_steps)]
    weights = {n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}
    return weights, metrics, len(calls) // cfg.total_steps, handed_on


@pytest.mark.parametrize(
    ("algo", "passes"),
    [
        ({"num_minibatches": 1, "ppo_epochs": 1}, 1),  # the forward of the one step: no extra pass
        ({"num_minibatches": 2, "ppo_epochs": 1}, 3),  # + one pass over the second minibatch's rows
        ({"num_minibatches": 2, "ppo_epochs": 2, "micro_batches": 2}, 1 + 2 * 2 * 2),
        ({"num_minibatches": 2, "kl": {"coef": 0.1, "in_reward": True}}, 1 + 2),  # the reward's KL reads them first: one whole pass
        ({"num_minibatches": 2, "objective": {"type": "decoupled_ppo"}}, 1 + 2),  # the proximal pass is the old one
    ],
)
def test_deferred_old_logp_give_the_update_of_exact_ones(tmp_path, algo, passes):
    cfg = _toy(**algo)
    eager_weights, eager_metrics, _, eager_old = _train(cfg, tmp_path / "eager", defer=False)
    weights, metrics, calls, handed_on = _train(cfg, tmp_path / "deferred", defer=True)
    for name, value in eager_weights.items():
        torch.testing.assert_close(weights[name], value, atol=TOY_WEIGHTS_ATOL, rtol=0)
    assert calls == passes
    for (deferred, old, trained), (_, eager, _) in zip(handed_on, eager_old):
        # the exact numbers are handed on (e.g. to the self-imitation memory) for the samples
        # the update trained on; the others (advantage 0) ran in no pass and say so
        assert trained.any() and not (deferred and trained.all())
        exact = trained if deferred else torch.ones_like(trained)
        torch.testing.assert_close(old[exact], eager[exact], atol=1e-6, rtol=1e-5)
    for a, b in zip(eager_metrics, metrics):
        for key in ("loss/policy", "approx_kl", "objective/clipped", "grad_norm", "reward/total"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@REWARDS.register("_test_alphanumeric_fraction", config=RewardConfig)
def _alphanumeric_fraction(rollout, cfg):
    """Test-only: the fraction of a completion's characters that are letters or digits (a
    random byte-level model's completions differ in it, so the advantages are not all 0)."""
    texts = rollout.info["completions"]
    return torch.tensor([sum(c in string.ascii_letters + string.digits for c in t) / max(len(t), 1) for t in texts])


def _text(tmp_path, **algo) -> TrainConfig:
    return from_dict(TrainConfig, {
        "name": "text", "seed": 0, "total_steps": 2,
        "policy": {"type": "text_lm", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 12}},
        "sampler": {"type": "prompt", "data": {"train": str(ROOT / "examples/arithmetic/train.jsonl")}},
        "rewards": [{"type": "_test_alphanumeric_fraction"}],
        "algo": {"group_size": 4, "groups_per_step": 4, **algo}, "optim": {"lr": 0.01},
        "log": {"progress": False, "tensorboard": False},
    })


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_the_text_policys_default_deferred_old_logp_train_as_the_eager_recompute(tmp_path, num_minibatches):
    """text_lm's default (``old_logp: deferred``) against ``recompute`` (the log-probs of one
    teacher-forced pass inside ``sample``): the same weights after two updates."""
    results = {}
    for source in ("recompute", "deferred"):
        cfg = _text(tmp_path, num_minibatches=num_minibatches)
        cfg.policy.generation.old_logp = source
        trainer = Trainer(cfg, tmp_path / source)
        metrics = [trainer.rl_step(step) for step in range(2)]
        results[source] = ({n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}, metrics)
    (w_eager, m_eager), (w_deferred, m_deferred) = results["recompute"], results["deferred"]
    moved = False
    initial = Trainer(_text(tmp_path), tmp_path / "initial").learner.model.state_dict()
    for name, value in w_eager.items():
        torch.testing.assert_close(w_deferred[name], value, atol=1e-5, rtol=1e-4)
        moved |= not torch.equal(value, initial[name])
    assert moved
    for a, b in zip(m_eager, m_deferred):
        assert b["completion_length"] == a["completion_length"]  # the same samples
        # the teacher-forced pass's entropies of q against the decoding loop's: the documented 1e-4
        # per token bounds their mean (docs/text.md; measured: at most 6.4e-7)
        assert b["entropy"] == pytest.approx(a["entropy"], abs=1e-4)
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], abs=1e-5)


@REWARDS.register("_test_token_fraction_of_odd_groups", config=RewardConfig)
def _odd_groups(rollout, cfg):
    """Test-only: the fraction of token 3 in the samples of odd groups, 0.5 in even groups
    (whose advantages are then all 0)."""
    tokens, mask = rollout.info["tokens"], rollout.mask.to(rollout.info["tokens"].device)
    fraction = ((tokens == 3).float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return torch.where(rollout.group_id.to(fraction.device) % 2 == 0, torch.full_like(fraction, 0.5), fraction)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_samples_without_advantage_are_left_out_of_the_passes_and_the_update_is_the_same(tmp_path, defer, aggregation):
    results = {}
    for skip in (True, False):
        cfg = _toy(num_minibatches=2, ppo_epochs=2, aggregation=aggregation)
        cfg.rewards[0] = from_dict(RewardConfig, {"type": "_test_token_fraction_of_odd_groups"})
        trainer = Trainer(cfg, tmp_path / f"{skip}-{defer}")
        if not skip:  # the same objective, without the promise that advantage 0 gives loss 0
            trainer.learner.loss.zero_at_zero_advantage = False
        if defer:
            sample = trainer.policy.sample
            trainer.policy.sample = lambda *a, **kw: dataclasses.replace(s := sample(*a, **kw), logp=s.logp - 1.0, logp_deferred=True)
        rows = []
        forward = trainer.learner.model.forward
        trainer.learner.model.forward = lambda replay, *a, **kw: rows.append(len(replay["tokens"])) or forward(replay, *a, **kw)
        metrics = [trainer.rl_step(step) for step in range(2)]
        results[skip] = ({n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}, metrics, sum(rows))
    (w_skip, m_skip, rows_skip), (w_all, m_all, rows_all) = results[True], results[False]
    for name, value in w_all.items():
        torch.testing.assert_close(w_skip[name], value, atol=TOY_WEIGHTS_ATOL, rtol=0)
    for a, b in zip(m_all, m_skip):
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], abs=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert rows_skip < rows_all * 0.6  # the even half of the groups ran in no pass
