"""mmrl's off-policy corrections (``mmrl/algo/correction.py``) against TRL 1.16's vLLM
importance-sampling correction and verl 0.9.1's rollout correction, on identical tensors
(docs/parity.md is the table).

**TRL** computes its ratio inside ``GRPOTrainer._generate_and_score_completions``, which
needs a model, generation and rewards, so it cannot be called in isolation. The test runs
that method's own lines: the block between the comments "Compute the importance sampling
ratio when using vLLM" and "Compute the per-token log probabilities for the reference
model", taken from the installed source and executed on the test's tensors with the
attributes ``__init__`` copies from a real ``GRPOConfig``. In TRL 1.16 the block reads::

    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = self.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)        # (B, 1): the product
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)                 # no clamp
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    elif mode in ["sequence_mask", "token_mask"]:
        ratio = ratio.masked_fill((ratio < (clip_min or -inf)) | (ratio > (clip_max or inf)), 0.0)

``_compute_loss`` then multiplies the per-token policy loss by the ratio before adding
β·KL; it is run as in ``test_trl.py`` with the ratio among its inputs.

**verl**: ``rollout_corr_helper.compute_rollout_correction_weights`` (TIS and IcePop),
``compute_rollout_rejection_mask`` (``*_k1`` rejection) and ``core_algos``'s vanilla
policy loss with ``rollout_is_weights``, called directly.
"""

from __future__ import annotations

import inspect
import textwrap
from types import SimpleNamespace

import pytest
import torch

from mmrl.algo import aggregation, correction, kl, objective
from mmrl.algo.correction import CorrectionConfig, MISConfig, TISConfig, apply_correction, mis, tis
from mmrl.config import own_options
from tests.parity.conftest import TOLERANCE, Batch, assert_same_value_and_grad, random_batch, reference
from tests.parity.test_trl import trl_loss
from tests.parity.test_verl import actor_config

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

TRL_BLOCK = ("# Compute the importance sampling ratio when using vLLM", "# Compute the per-token log probabilities for the reference model")


@pytest.fixture(scope="session")
def rollout_corr():
    """verl.trainer.ppo.rollout_corr_helper (imports verl.protocol: the parity extra)."""
    return reference("verl.trainer.ppo.rollout_corr_helper")


def off_policy_batch(seed: int, scale: float = 0.6) -> tuple[Batch, torch.Tensor]:
    """A batch of 16 completions and behaviour log-probs μ whose log-ratios to the batch's
    old policy are ~N(0, scale²)."""
    b = random_batch(seed=seed, batch=16)
    gen = torch.Generator().manual_seed(seed + 1000)
    behaviour = b.old_logp + scale * torch.randn(b.old_logp.shape, generator=gen)
    return b, behaviour


def _trl_block(module):
    source = inspect.getsource(module.GRPOTrainer._generate_and_score_completions)
    start, end = (source.rindex("\n", 0, source.index(marker)) + 1 for marker in TRL_BLOCK)
    block = textwrap.dedent(source[start:end])
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in block, block
    return compile(block, f"<{module.__name__}: vLLM importance sampling ratio>", "exec")


def trl_ratio(module, old_logp, behaviour_logp, mask, **config):
    """TRL's ``importance_sampling_ratio`` for ``GRPOConfig(**config)``: [B, T] (token modes)
    or [B, 1] (sequence modes)."""
    args = module.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[], **config)
    trainer = SimpleNamespace(  # what GRPOTrainer.__init__ copies from args and the block reads
        use_vllm=True,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=args.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_max=args.vllm_importance_sampling_clip_max,
        vllm_importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
    )
    namespace = {
        **vars(module),
        "self": trainer,
        "completion_mask": mask,
        "tool_mask": None,
        "old_per_token_logps": old_logp,
        "sampling_per_token_logps": behaviour_logp,
    }
    exec(_trl_block(module), namespace)
    return namespace["vllm_importance_sampling_ratio"]


def on_valid(ratio, mask):
    """A [B, T] or [B, 1] weight on the valid decisions, 1 on padding (mmrl's convention)."""
    return torch.where(mask.bool(), ratio.expand_as(mask), 1.0)


# --- TRL -------------------------------------------------------------------------------

# TRL mode (+ GRPOConfig) ↔ mmrl correction (+ options)
TRL_MODES = {
    "token_truncate": ({"vllm_importance_sampling_clip_max": 1.5}, tis, {"level": "token", "cap": 1.5}),
    "token_truncate-min": (
        {"vllm_importance_sampling_clip_max": 1.5, "vllm_importance_sampling_clip_min": 0.7},
        tis, {"level": "token", "cap": 1.5, "floor": 0.7},
    ),
    "sequence_truncate": ({"vllm_importance_sampling_clip_max": 3.0}, tis, {"level": "sequence", "cap": 3.0}),
    "token_mask": (
        {"vllm_importance_sampling_clip_max": 1.5, "vllm_importance_sampling_clip_min": 0.6},
        mis, {"level": "token", "lo": 0.6, "hi": 1.5},
    ),
    "sequence_mask": ({"vllm_importance_sampling_clip_max": 3.0}, mis, {"level": "sequence", "hi": 3.0}),
    "sequence_mask-min": (
        {"vllm_importance_sampling_clip_max": None, "vllm_importance_sampling_clip_min": 0.3},
        mis, {"level": "sequence", "lo": 0.3, "hi": None},
    ),
}


@pytest.mark.parametrize("name", TRL_MODES)
def test_trl_importance_sampling_modes_equal_mmrl_corrections(grpo_trainer_module, name):
    config, fn, options = TRL_MODES[name]
    b, behaviour = off_policy_batch(seed=20)
    behaviour[3, 0] = float("nan")  # a token vLLM could not score: ratio 1 in both
    theirs = trl_ratio(grpo_trainer_module, b.old_logp, behaviour, b.mask, vllm_importance_sampling_mode=name.split("-")[0], **config)
    weight, keep, stats = fn(b.old_logp, behaviour, b.mask, **options)
    torch.testing.assert_close(weight, on_valid(theirs, b.mask), **TOLERANCE)
    changed = stats.get("correction/truncated_fraction", stats.get("correction/masked_fraction"))
    assert 0 < changed < 1  # the batch has ratios on both sides of a bound
    if fn is mis:
        assert torch.equal(keep, (on_valid(theirs, b.mask) != 0) & b.mask.bool())
    if name.startswith("token"):
        # TRL logs the mean and max of the ratio over the valid tokens, as mmrl's stats
        flat = theirs[b.mask.bool()]
        torch.testing.assert_close(stats["correction/weight_mean"], flat.mean(), **TOLERANCE)
        torch.testing.assert_close(stats["correction/weight_max"], flat.max(), **TOLERANCE)


def test_mmrl_defaults_are_trls(grpo_trainer_module):
    # GRPOConfig's defaults: sequence_mask, clip_max 3, no clip_min = mis's defaults; tis's cap is clip_max
    b, behaviour = off_policy_batch(seed=21)
    theirs = trl_ratio(grpo_trainer_module, b.old_logp, behaviour, b.mask)
    weight, _, stats = mis(b.old_logp, behaviour, b.mask, **own_options(MISConfig(), CorrectionConfig))
    torch.testing.assert_close(weight, on_valid(theirs, b.mask), **TOLERANCE)
    assert 0 < stats["correction/masked_fraction"] < 1
    args = grpo_trainer_module.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[])
    assert TISConfig().cap == args.vllm_importance_sampling_clip_max and TISConfig().floor == args.vllm_importance_sampling_clip_min


@pytest.mark.parametrize(
    "loss_type, aggregate, mode, fn, options",
    [
        ("dapo", aggregation.token_mean, "token_truncate", tis, {"level": "token", "cap": 1.5}),
        ("grpo", aggregation.seq_mean_token_mean, "sequence_mask", mis, {"level": "sequence", "hi": 3.0}),
    ],
)
def test_trl_weights_the_policy_loss_not_the_kl_as_apply_correction(grpo_trainer_module, loss_type, aggregate, mode, fn, options):
    # the weight multiplies the per-decision policy loss; β·KL is added unweighted; the
    # normaliser is the batch's mask (masked decisions count with weight 0)
    b, behaviour = off_policy_batch(seed=22)
    ratio = trl_ratio(
        grpo_trainer_module, b.old_logp, behaviour, b.mask, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=options["cap" if fn is tis else "hi"],
    )
    theirs = trl_loss(
        grpo_trainer_module, b, loss_type, extra_inputs={"importance_sampling_ratio": ratio},
        use_vllm=True, beta=0.04, use_bias_correction_kl=False,
    )
    weight, _, _ = fn(b.old_logp, behaviour, b.mask, **options)

    def ours(logp):
        per_decision, _ = objective.ppo_clip(logp, b.old_logp, b.adv[:, None], mask=b.mask)
        policy = aggregate(apply_correction(per_decision, weight), b.mask)
        return policy + 0.04 * aggregate(kl.k3(logp, b.ref_logp), b.mask)

    grad = assert_same_value_and_grad(ours, theirs, b.logp)
    assert (grad != 0).any()


# --- verl ------------------------------------------------------------------------------


@pytest.mark.parametrize("level, cap", [("token", 1.5), ("sequence", 2.0)])
def test_verl_truncated_is_weights_equal_tis(rollout_corr, level, cap):
    b, behaviour = off_policy_batch(seed=30)
    theirs, metrics = rollout_corr.compute_rollout_correction_weights(
        b.old_logp - behaviour, b.mask, rollout_is=level, rollout_is_threshold=cap
    )
    weight, _, stats = tis(b.old_logp, behaviour, b.mask, level=level, cap=cap)
    torch.testing.assert_close(weight * b.mask, theirs, **TOLERANCE)  # verl has 0 on padding
    assert 0 < stats["correction/truncated_fraction"] < 1
    assert stats["correction/weight_mean"].item() == pytest.approx(metrics["rollout_is_mean"], rel=1e-6)
    if level == "token":  # verl's sequence-level max and fractions are per sequence, untruncated
        assert stats["correction/weight_max"].item() == pytest.approx(metrics["rollout_is_max"], rel=1e-6)
        assert stats["correction/truncated_fraction"].item() == pytest.approx(metrics["rollout_is_ratio_fraction_high"], rel=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_icepop_equals_mis(rollout_corr, level):
    b, behaviour = off_policy_batch(seed=31)
    theirs, metrics = rollout_corr.compute_rollout_correction_weights(
        b.old_logp - behaviour, b.mask, rollout_is=level, rollout_is_threshold="0.5_2.0"
    )
    weight, _, stats = mis(b.old_logp, behaviour, b.mask, level=level, lo=0.5, hi=2.0)
    torch.testing.assert_close(weight * b.mask, theirs, **TOLERANCE)
    assert 0 < stats["correction/masked_fraction"] < 1
    assert stats["correction/masked_fraction"].item() == pytest.approx(metrics["rollout_is_oob_ratio"], rel=1e-6)


@pytest.mark.parametrize("option, level", [("token_k1", "token"), ("seq_sum_k1", "sequence"), ("seq_mean_k1", "geometric")])
def test_verl_k1_rejection_sampling_equals_mis_without_reweight(rollout_corr, option, level):
    # verl's k1 statistic is −ℓ = log(μ/π_old): threshold "a_b" keeps ρ = π_old/μ in [1/b, 1/a]
    b, behaviour = off_policy_batch(seed=32, scale=0.8 if level == "geometric" else 0.6)
    theirs, metrics = rollout_corr.compute_rollout_rejection_mask(
        b.old_logp - behaviour, b.mask, rollout_rs=option, rollout_rs_threshold="0.5_3.0"
    )
    weight, keep, stats = mis(b.old_logp, behaviour, b.mask, level=level, lo=1 / 3.0, hi=1 / 0.5, reweight=False)
    torch.testing.assert_close(keep.float(), theirs)
    torch.testing.assert_close(weight * b.mask, theirs)
    assert 0 < stats["correction/masked_fraction"] < 1
    assert stats["correction/masked_fraction"].item() == pytest.approx(metrics["rollout_rs_masked_fraction"], rel=1e-6)


def test_verl_vanilla_loss_with_rollout_is_weights_equals_apply_correction(core_algos, rollout_corr):
    b, behaviour = off_policy_batch(seed=33)
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    verl_weight, _ = rollout_corr.compute_rollout_correction_weights(b.old_logp - behaviour, b.mask, "token", 1.5)
    weight, _, _ = tis(b.old_logp, behaviour, b.mask, level="token", cap=1.5)

    def ours(logp):
        loss, _ = objective.ppo_clip(logp, b.old_logp, b.token_adv, mask=b.mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
        return aggregation.token_mean(apply_correction(loss, weight), b.mask)

    def theirs(logp):
        return core_algos.compute_policy_loss_vanilla(
            b.old_logp, logp, b.token_adv, b.mask, "token-mean", config, rollout_is_weights=verl_weight
        )[0]

    assert_same_value_and_grad(ours, theirs, b.logp)


def test_verl_rejection_sampling_normalises_by_the_returned_mask(core_algos, rollout_corr):
    # verl replaces response_mask by the rejection mask, so rejected decisions leave the
    # token-mean's normaliser: aggregating with mis's returned mask gives verl's loss, with
    # the batch's mask (mmrl's and TRL's convention) it is smaller by kept / valid.
    b, behaviour = off_policy_batch(seed=34)
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    rejection_mask, _ = rollout_corr.compute_rollout_rejection_mask(b.old_logp - behaviour, b.mask, "seq_sum_k1", "0.5_2.0")
    weight, keep, _ = mis(b.old_logp, behaviour, b.mask, level="sequence", lo=0.5, hi=2.0, reweight=False)

    def ours(logp, mask):
        loss, _ = objective.ppo_clip(logp, b.old_logp, b.token_adv, mask=b.mask, dual_clip=3.0)
        return aggregation.token_mean(apply_correction(loss, weight), mask)

    def theirs(logp):
        return core_algos.compute_policy_loss_vanilla(b.old_logp, logp, b.token_adv, rejection_mask, "token-mean", config)[0]

    assert_same_value_and_grad(lambda logp: ours(logp, keep), theirs, b.logp)
    shrink = keep.sum() / b.mask.sum()
    assert 0 < shrink < 1
    torch.testing.assert_close(ours(b.logp, b.mask), theirs(b.logp) * shrink, **TOLERANCE)


def test_every_registered_correction_is_compared():
    compared = {fn.__name__ for _, fn, _ in TRL_MODES.values()}
    assert compared | {"no_correction"} == {correction.CORRECTIONS.get(n).__name__ for n in correction.CORRECTIONS.names()}
