"""``policy_gradient``: the clipped-ratio family of section 3 as one loss module — the
objective (``algo.objective``) over the forward's log-probs and the old ones (with GAE's
``normalize: minibatch``, on advantages scaled by the minibatch's statistics), an off-policy
correction's stop-gradient weights (``algo.correction``), the aggregation
(``algo.aggregation``), the KL to the reference in the loss (``algo.kl``) and, with a
critic, its value loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl import registry
from mmrl.algo.correction import CorrectionConfig, apply_correction
from mmrl.algo.losses import Loss, LossConfig, LossOutput, Targets
from mmrl.algo.objective import ObjectiveConfig
from mmrl.algo.value import value_loss
from mmrl.config import own_options
from mmrl.core.policy import overrides
from mmrl.errors import ConfigError


@dataclass
class PolicyGradientConfig(LossConfig):
    pass


@registry.LOSSES.register("policy_gradient", PolicyGradientConfig)
class PolicyGradient(Loss):
    """The ratio objective, its correction, aggregation and KL (+ a critic's value loss)."""

    reads_old_logp = True
    reads_sampling_graph = True

    def __init__(self, algo, options: LossConfig, policy, *, reference=None, critic=None, sampling_graph: bool = False, **_):
        """``algo`` is the run's ``algo`` section; ``reference`` the frozen KL reference (None
        without a KL term); ``critic`` the ``critic`` section when a critic trains beside the
        policy; ``sampling_graph`` whether the batch's log-probs are the sampling pass's own
        (``batch.old.graph``, the learner's reuse of the sampling graph)."""
        self.algo, self.reference, self.critic, self.sampling_graph = algo, reference, critic, sampling_graph
        refusal = policy.likelihood_refusal()
        if refusal is not None:
            raise refusal
        if algo.kl.coef > 0 and algo.kl.type == "exact" and not overrides(policy, "exact_kl"):
            raise ConfigError("algo.kl.type", "exact", f"policy {type(policy).__name__} has no closed-form per-decision KL; use k1, k2 or k3")
        self.objective_fn = registry.OBJECTIVES.get(algo.objective.type)
        self.aggregate_fn = registry.AGGREGATIONS.get(algo.aggregation.type)
        self.kl_fn = registry.KL_ESTIMATORS.get(algo.kl.type) if algo.kl.type != "exact" else None
        entry = registry.CORRECTIONS.entry(algo.correction.type, "algo.correction.type")
        # a correction that reads the sampler's log-probs keeps them beside the exact old ones
        self.correction_fn = entry.obj if entry.traits.get("needs_behaviour", False) else None
        self.correction_options = {**own_options(algo.correction, CorrectionConfig), "log_ratio_clamp": algo.correction.log_ratio_clamp}
        self.objective_options = {**own_options(algo.objective, ObjectiveConfig), "log_ratio_clamp": algo.objective.log_ratio_clamp}
        # exactly 0 where every advantage is 0 (the objective says so), unless a KL term adds to
        # it or the minibatch's normalization moves that 0
        self.zero_at_zero_advantage = getattr(self.objective_fn, "zero_at_zero_advantage", False) and not algo.kl.in_loss_term and getattr(algo.advantage, "normalize", None) != "minibatch"
        self.needs_proximal = getattr(self.objective_fn, "needs_proximal", False) and not sampling_graph

    def __call__(self, model, batch, targets: Targets, norm: dict, at_sampling_weights: bool = False) -> LossOutput:
        """``at_sampling_weights`` takes the forward's log-probs as the old (and proximal) ones,
        i.e. every ratio is 1: the gradient of a first PPO step."""
        algo = self.algo
        mask, adv = batch.mask, targets.adv
        if "adv_shift" in norm:  # algo.advantage.normalize: minibatch, over the whole minibatch
            norm = dict(norm)
            adv = (adv - norm.pop("adv_shift").to(adv)) / norm.pop("adv_scale").to(adv)
        kl = None
        sampled = {"sampled_logp": batch.old.graph} if self.sampling_graph else {}
        value = {"value": True} if self.critic is not None else {}  # the values come from the same forward
        if algo.kl.in_loss_term and self.kl_fn is None:
            out = model(batch.replay, mode="log_prob_and_kl", reference=self.reference, **sampled, **value)
            (logp, kl), values = out if value else (out, None)
        else:
            out = model(batch.replay, **sampled, **value)
            logp, values = out if value else (out, None)
            if algo.kl.in_loss_term:
                kl = self.kl_fn(logp, batch.ref_logp)
        old = logp.detach() if at_sampling_weights else batch.old_logp
        options = dict(self.objective_options)
        if getattr(self.objective_fn, "needs_proximal", False):
            options["prox_logp"] = logp.detach() if at_sampling_weights else targets.prox_logp
        per_decision, stats = self.objective_fn(logp, old, adv, mask=mask, **options)
        decision_stats = {k if k.endswith("_max") else f"objective/{k}": v for k, v in stats.items()}
        if self.correction_fn is not None:
            # stop-gradient weights of pi_old / mu, per decision, on the objective's loss only
            # (the normalizers keep the batch's mask: a removed decision counts with weight 0)
            weight, kept, _ = self.correction_fn(old, batch.old.behaviour, mask, **self.correction_options)
            per_decision = apply_correction(per_decision, weight)
            decision_stats.update({"correction/weight_mean": weight, "correction/weight_max": weight, "correction/removed_fraction": (mask.bool() & ~kept).float()})
        with torch.no_grad():  # the approximate KL of the forward to the old policy, per decision
            log_ratio = torch.zeros_like(mask) if at_sampling_weights else (logp.detach() - batch.old_logp) * mask
            decision_stats["approx_kl"] = torch.exp(log_ratio) - 1 - log_ratio
        loss = self.aggregate_fn(per_decision, mask, **norm)
        terms = {"loss/policy": loss.detach()}
        if kl is not None:
            kl_loss = self.aggregate_fn(kl, mask, **norm)
            loss = loss + algo.kl.coef * kl_loss
            terms["kl/ref"] = kl_loss.detach()
        if values is not None:
            if targets.returns is not None:
                per = value_loss(values, targets.old_values.to(values), targets.returns.to(values), self.critic.value_clip)
                v_loss = (per * mask).sum() / norm["num_tokens"]  # mean over the minibatch's valid decisions, all processes
            else:  # the no-op piece of a process without rows
                v_loss = values.sum() * 0.0
            loss = loss + self.critic.value_coef * v_loss
            terms["loss/value"] = v_loss.detach()
        return LossOutput(loss, terms, decision_stats, logp)
