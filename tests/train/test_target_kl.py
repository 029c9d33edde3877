"""``algo.target_kl``: an update's epochs stop early, before the first optimizer step whose
minibatch has drifted past the target (the approximate KL to the sampling policy)."""

import torch

from mmrl.config import from_dict
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer
from tests.train.test_critic import gae_config

EPOCHS, MINIBATCHES = 8, 4


def _one_update(tmp_path, name, target_kl=None, steps_allowed=None):
    """The weights and metrics after one update of the GAE recipe at a high learning rate;
    ``steps_allowed`` makes every optimizer step after that many a no-op."""
    data = gae_config(total_steps=1, optim={"lr": 0.03}, eval={"at_start": False, "at_end": False})
    data["algo"] = {**data["algo"], "ppo_epochs": EPOCHS, "num_minibatches": MINIBATCHES, "target_kl": target_kl}
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / name)
    learner = trainer.learner
    if steps_allowed is not None:
        step, taken = learner.optimizer.step, []

        def limited(*args, **kwargs):
            if len(taken) < steps_allowed:
                taken.append(1)
                return step(*args, **kwargs)

        learner.optimizer.step = limited
    collected = trainer.engine.collect(0, learner.version)
    _, _, stats = learner.learn(collected.rollout, collected.spare, 0)
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    return weights, stats


def test_target_kl_stops_the_update_before_the_step_that_passes_it(tmp_path):
    """A small target stops the update part-way: the steps taken are exactly the first k of
    the same run without a target (all later ones dropped, the one past the target included),
    and every step taken started within the target."""
    target = 0.02
    stopped, stats = _one_update(tmp_path, "stopped", target_kl=target)
    fraction = stats["update/steps_fraction"]
    k = round(fraction * EPOCHS * MINIBATCHES)
    assert 1 <= k < EPOCHS * MINIBATCHES, fraction
    assert stats["approx_kl"] <= target  # the mean of the steps taken, each measured before its step
    first_k, _ = _one_update(tmp_path, "first_k", steps_allowed=k)
    one_more, _ = _one_update(tmp_path, "one_more", steps_allowed=k + 1)
    assert all(torch.equal(stopped[n], first_k[n]) for n in stopped)
    assert any(not torch.equal(stopped[n], one_more[n]) for n in stopped)


def test_a_target_never_reached_changes_nothing(tmp_path):
    """A target far above the update's KL runs every step: the same weights, to the bit, as
    no target."""
    free, stats = _one_update(tmp_path, "free")
    capped, capped_stats = _one_update(tmp_path, "capped", target_kl=1e6)
    assert capped_stats["update/steps_fraction"] == 1.0 and "update/steps_fraction" not in stats
    assert all(torch.equal(free[n], capped[n]) for n in free)
