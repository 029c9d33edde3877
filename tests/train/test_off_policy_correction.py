"""``algo.correction`` in the loop: a sampler whose log-probs differ from the learner's (a
serving engine, a lower precision, a stale worker) is corrected by the weights pi_old / mu,
where pi_old is the learner's exact recompute and mu what the sampler reported."""

import math
from dataclasses import dataclass

import pytest

from mmrl.config import from_dict, option
from mmrl.errors import ConfigError
from mmrl.policies.toy.config import CategoricalSequenceConfig
from mmrl.policies.toy.model import CategoricalSequencePolicy
from mmrl.registry import POLICIES
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import train

SHIFT = 0.1  # what the perturbing backend subtracts from every log-prob it reports


@dataclass
class _PerturbedConfig(CategoricalSequenceConfig):
    type: str = option("perturbed_sequence", "registered name")


@POLICIES.register("perturbed_sequence", config=_PerturbedConfig)
class _PerturbedSequence(CategoricalSequencePolicy):
    """Samples exactly as categorical_sequence and reports log-probs SHIFT too low, as a
    backend with its own numerics would."""

    def sample(self, inputs, generator=None, deterministic=False):
        out = super().sample(inputs, generator, deterministic)
        out.logp = out.logp - SHIFT * out.mask
        return out


def _run(tmp_path, name, policy, correction):
    cfg = from_dict(TrainConfig, {
        "name": name, "seed": 0, "total_steps": 1, "sampler": {"type": "prompt"}, "policy": {"type": policy},
        "rewards": [{"type": "token_fraction", "token": 3}],
        "algo": {"group_size": 8, "groups_per_step": 4, "correction": correction},
        "optim": {"lr": 0.01}, "eval": {"at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    })
    train(cfg, tmp_path / name)
    (record,) = [r for r in read_metrics(tmp_path / name) if "grad_norm" in r]
    return record


def test_truncated_weights_scale_each_decisions_loss_by_the_ratio_of_the_exact_to_the_reported_log_prob(tmp_path):
    exact = _run(tmp_path, "exact", "categorical_sequence", {"type": "none"})
    corrected = _run(tmp_path, "tis", "perturbed_sequence", {"type": "tis", "cap": 3.0})
    # the learner recomputes pi_old exactly, so the objective is the exact run's, and every
    # decision's loss is weighted by exp(logp_old - (logp_old - SHIFT)) = e^SHIFT
    assert corrected["correction/weight_mean"] == pytest.approx(math.exp(SHIFT), rel=1e-6)
    assert corrected["correction/weight_max"] == pytest.approx(math.exp(SHIFT), rel=1e-6)
    assert corrected["correction/removed_fraction"] == 0.0
    # the same samples (the backend only reports other numbers): the gradient scales by e^SHIFT
    assert corrected["reward/total"] == exact["reward/total"]
    assert corrected["grad_norm"] == pytest.approx(math.exp(SHIFT) * exact["grad_norm"], rel=1e-5)
    assert "correction/weight_mean" not in exact


def test_a_ratio_outside_the_masked_band_removes_the_decisions_from_the_update(tmp_path):
    kept = _run(tmp_path, "kept", "perturbed_sequence", {"type": "mis", "level": "token", "hi": 1.2})
    removed = _run(tmp_path, "removed", "perturbed_sequence", {"type": "mis", "level": "token", "hi": 1.05})  # e^0.1 = 1.105
    assert kept["correction/removed_fraction"] == 0.0 and kept["grad_norm"] > 0
    assert removed["correction/removed_fraction"] == 1.0 and removed["grad_norm"] == 0.0


def test_without_a_correction_the_reported_log_probs_are_the_old_ones(tmp_path):
    """correction none trusts the sampler: the ratio at the sampling weights is e^SHIFT, not 1."""
    trusted = _run(tmp_path, "trusted", "perturbed_sequence", {"type": "none"})
    assert trusted["objective/ratio"] == pytest.approx(math.exp(SHIFT), rel=1e-5)


def test_decoupled_ppo_with_a_correction_is_a_config_error():
    with pytest.raises(ConfigError, match="algo.correction.type"):
        from_dict(TrainConfig, {"policy": {"type": "categorical_sequence"}, "sampler": {"type": "prompt"}, "rewards": [{"type": "token_fraction"}],
                                "algo": {"objective": {"type": "decoupled_ppo"}, "correction": {"type": "tis"}}})
