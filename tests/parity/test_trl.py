"""mmrl's objectives, aggregations and KL term against TRL 1.16's GRPO loss
(``GRPOTrainer._compute_loss``), run on identical tensors (docs/parity.md is the table).

TRL computes the loss inside a trainer method, so each test runs that method on a trainer
built without ``__init__`` (no model, no data): it holds the attributes ``__init__`` would
copy from a real ``GRPOConfig``, and its log-prob hook returns the test's tensor.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from mmrl.algo import aggregation, kl, objective
from tests.parity.conftest import TOLERANCE, Batch, assert_same_value_and_grad, random_batch

# GRPOConfig's defaults still set a TrainingArguments field transformers 5 deprecates
pytestmark = [
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.numerics,  # two libraries' float32 arithmetic on the same tensors
]


class OneProcess:
    """The part of an accelerate.Accelerator the loss reads, for a single process."""

    num_processes = 1

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


def trl_loss(module, b: Batch, loss_type: str, extra_inputs: dict | None = None, **config):
    """TRL's ``_compute_loss`` as a function of the current log-probs, for ``GRPOConfig(loss_type=..., **config)``;
    ``extra_inputs`` join the batch the generation step would hand over (``importance_sampling_ratio``)."""
    args = module.GRPOConfig(
        output_dir="unused", use_cpu=True, bf16=False, report_to=[], loss_type=loss_type,
        **{"max_completion_length": b.mask.shape[1], "beta": 0.0, **config},
    )
    trainer = object.__new__(module.GRPOTrainer)
    # what GRPOTrainer.__init__ sets from args and _compute_loss reads
    trainer.args = args
    trainer.loss_type = args.loss_type
    trainer.beta = args.beta
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.max_completion_length = args.max_completion_length
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.use_vllm = args.use_vllm
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    trainer.aux_loss_enabled = False  # no mixture-of-experts router
    trainer.model = torch.nn.Module()  # only .training is read
    trainer.accelerator = OneProcess()
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    batch, length = b.mask.shape
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": b.mask,
        "advantages": b.adv,
        "old_per_token_logps": b.old_logp,
        "ref_per_token_logps": b.ref_logp,
        "num_items_in_batch": b.mask.sum(),
        **(extra_inputs or {}),
    }

    def loss(logp):
        trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, torch.ones_like(logp), None)
        return trainer._compute_loss(None, inputs)

    return loss


def mmrl_loss(b: Batch, objective_fn, aggregate, objective_options=None, aggregate_options=None, kl_coef=0.0, kl_fn=kl.k3):
    """mmrl's trainer loss: aggregate(objective) + kl_coef · aggregate(KL estimator)."""

    def loss(logp):
        per_decision, _ = objective_fn(logp, b.old_logp, b.adv[:, None], mask=b.mask, **(objective_options or {}))
        total = aggregate(per_decision, b.mask, **(aggregate_options or {}))
        if kl_coef:
            total = total + kl_coef * aggregate(kl_fn(logp, b.ref_logp), b.mask, **(aggregate_options or {}))
        return total

    return loss


# loss_type (+ TRL config) ↔ mmrl objective × aggregation (+ options). dr_grpo's budget is
# longer than the batch; TRL's delta (two-sided clipping of negative advantages) is dual clip.
LOSS_TYPES = {
    "grpo": ({}, objective.ppo_clip, {}, aggregation.seq_mean_token_mean, {}),
    "bnpo": ({}, objective.ppo_clip, {}, aggregation.token_mean, {}),
    "dr_grpo": ({"max_completion_length": 10}, objective.ppo_clip, {}, aggregation.const_norm, {"max_len": 10}),
    "dapo": ({"epsilon_high": 0.28}, objective.ppo_clip, {"eps_high": 0.28}, aggregation.token_mean, {}),
    "dapo-delta": ({"epsilon_high": 0.28, "delta": 3.0}, objective.ppo_clip, {"eps_high": 0.28, "dual_clip": 3.0}, aggregation.token_mean, {}),
    "cispo": ({"epsilon_high": 5.0}, objective.cispo, {"eps_high": 5.0}, aggregation.token_mean, {}),
}


@pytest.mark.parametrize("name", LOSS_TYPES)
def test_loss_type_equals_mmrl_objective_and_aggregation(grpo_trainer_module, name):
    config, objective_fn, objective_options, aggregate, aggregate_options = LOSS_TYPES[name]
    b = random_batch(seed=10, far_off=2.0)
    theirs = trl_loss(grpo_trainer_module, b, name.split("-")[0], **config)
    grad = assert_same_value_and_grad(mmrl_loss(b, objective_fn, aggregate, objective_options, aggregate_options), theirs, b.logp)
    _, stats = objective_fn(b.logp, b.old_logp, b.adv[:, None], mask=b.mask, **objective_options)
    clipped = stats["clipped"][b.mask.bool()]
    assert clipped.any() and not clipped.all() and (grad != 0).any()


def test_grpo_counts_empty_completions_in_the_sequence_mean_as_mmrl(grpo_trainer_module):
    # TRL's grpo averages over all B completions, also those with no valid token (verl
    # divides by the non-empty ones only: tests/parity/test_verl.py)
    b = random_batch(seed=16)
    b.mask[[2, 5]] = 0
    theirs = trl_loss(grpo_trainer_module, b, "grpo")
    assert_same_value_and_grad(mmrl_loss(b, objective.ppo_clip, aggregation.seq_mean_token_mean), theirs, b.logp)


@pytest.mark.parametrize(
    "loss_type, aggregate", [("grpo", aggregation.seq_mean_token_mean), ("luspo", aggregation.seq_mean_token_sum)]
)
def test_sequence_level_importance_sampling_equals_gspo(grpo_trainer_module, loss_type, aggregate):
    # TRL's importance_sampling_level="sequence" (GSPO; LUSPO scales it by the length)
    b = random_batch(seed=11, log_ratio_scale=6e-4)
    theirs = trl_loss(
        grpo_trainer_module, b, loss_type, importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4
    )
    ours = mmrl_loss(b, objective.gspo, aggregate, {"eps_low": 3e-4, "eps_high": 4e-4})
    grad = assert_same_value_and_grad(ours, theirs, b.logp)
    assert 0 < (grad != 0).any(-1).sum() < 8  # some sequences inside the band, some clipped


def test_kl_term_without_bias_correction_equals_k3(grpo_trainer_module):
    b = random_batch(seed=12)
    theirs = trl_loss(grpo_trainer_module, b, "grpo", beta=0.04, use_bias_correction_kl=False)
    ours = mmrl_loss(b, objective.ppo_clip, aggregation.seq_mean_token_mean, kl_coef=0.04)
    assert_same_value_and_grad(ours, theirs, b.logp)


def test_trls_default_bias_corrected_kl_adds_k3_to_the_gradient(grpo_trainer_module):
    # use_bias_correction_kl=True (TRL's default) multiplies the per-token KL by the
    # differentiable ratio w: on-policy (w = 1) the loss is unchanged but each token's
    # gradient gains β·k3 / (|y_i|·B) (grpo aggregation). mmrl's KL term has no such factor.
    b = random_batch(seed=13)
    b.old_logp = b.logp.detach().clone()
    theirs = trl_loss(grpo_trainer_module, b, "grpo", beta=0.04)
    ours = mmrl_loss(b, objective.ppo_clip, aggregation.seq_mean_token_mean, kl_coef=0.04)
    (their_grad, our_grad) = (torch.autograd.grad(fn(b.logp), b.logp)[0] for fn in (theirs, ours))
    torch.testing.assert_close(ours(b.logp), theirs(b.logp), **TOLERANCE)
    extra = 0.04 * kl.k3(b.logp.detach(), b.ref_logp) * b.mask / (b.mask.sum(-1, keepdim=True) * len(b.mask))
    torch.testing.assert_close(their_grad - our_grad, extra, **TOLERANCE)
    assert extra.abs().max() > 1e-4


def test_trls_k3_is_unclamped_and_mmrls_capped_as_verl(grpo_trainer_module):
    b = random_batch(seed=14)
    b.ref_logp[:, 0] = b.logp.detach()[:, 0] + 5.0  # δ = 5: k3 = 142.4, capped at 10 in mmrl
    theirs = trl_loss(grpo_trainer_module, b, "grpo", beta=0.04, use_bias_correction_kl=False)
    trl_form = lambda logp, ref: kl.k3(logp, ref, log_ratio_clamp=math.inf, cap=None)  # noqa: E731
    assert_same_value_and_grad(
        mmrl_loss(b, objective.ppo_clip, aggregation.seq_mean_token_mean, kl_coef=0.04, kl_fn=trl_form), theirs, b.logp
    )
    capped = mmrl_loss(b, objective.ppo_clip, aggregation.seq_mean_token_mean, kl_coef=0.04)(b.logp)
    # each of the 8 first tokens loses 142.41 − 10 in KL, weighted 0.04 / (|y_i|·8)
    lost = 0.04 * (math.exp(5.0) - 6 - 10) * (1 / b.mask.sum(-1)).sum() / 8
    torch.testing.assert_close(theirs(b.logp) - capped, lost, **TOLERANCE)


def test_trl_does_not_clamp_the_log_ratio(grpo_trainer_module):
    # a log-ratio of 25 with A < 0: TRL's loss has e^25, mmrl's default clamp stops at e^20;
    # log_ratio_clamp=30 gives TRL's value.
    b = random_batch(seed=15)
    b.adv[0] = -1.0
    b.old_logp[0, 0] = b.logp.detach()[0, 0] - 25.0
    theirs = trl_loss(grpo_trainer_module, b, "bnpo")
    assert_same_value_and_grad(
        mmrl_loss(b, objective.ppo_clip, aggregation.token_mean, {"log_ratio_clamp": 30.0}), theirs, b.logp
    )
    ours = mmrl_loss(b, objective.ppo_clip, aggregation.token_mean)(b.logp)
    torch.testing.assert_close((theirs(b.logp) - ours) * b.mask.sum(), torch.tensor(math.exp(25.0) - math.exp(20.0)), rtol=1e-5, atol=0)


def test_cispo_with_eps_low_is_not_trls_cispo(grpo_trainer_module):
    # eps_low makes mmrl's cispo two-sided (verl): weights below 1 − eps_low are raised, so
    # the gradient of those tokens differs from TRL's one-sided cap; the rest is equal.
    b = random_batch(seed=10, far_off=2.0)
    theirs = trl_loss(grpo_trainer_module, b, "cispo", epsilon_high=5.0)
    two_sided = mmrl_loss(b, objective.cispo, aggregation.token_mean, {"eps_low": 0.2, "eps_high": 5.0})
    their_grad = torch.autograd.grad(theirs(b.logp), b.logp)[0]
    our_grad = torch.autograd.grad(two_sided(b.logp), b.logp)[0]
    ratio = torch.exp(b.logp.detach() - b.old_logp)
    raised = (ratio < 0.8) & b.mask.bool()
    # the raised weight is 0.8 instead of w: the gradient −w·A/N becomes −0.8·A/N
    expected = torch.where(raised, -(0.8 - ratio) * b.adv[:, None] / b.mask.sum(), torch.zeros_like(ratio))
    torch.testing.assert_close(our_grad - their_grad, expected, **TOLERANCE)
    assert raised.sum() >= 3
