"""The group-relative policy-gradient core, as pure tensor functions.

One registry per axis, each filled on import of its module: advantages
(:mod:`~mmrl.algo.advantage`), objectives (:mod:`~mmrl.algo.objective`), aggregations
(:mod:`~mmrl.algo.aggregation`), KL estimators (:mod:`~mmrl.algo.kl`), group filters
(:mod:`~mmrl.algo.filters`) and off-policy corrections (:mod:`~mmrl.algo.correction`);
:mod:`~mmrl.algo.masks` narrows loss masks. (Several reward components become one reward
before any of these, in :mod:`mmrl.core.reward_aggregation`.)
Each registered method comes with its own config dataclass (its options and defaults).
"""

from mmrl.algo import advantage, aggregation, correction, filters, kl, masks, objective
from mmrl.algo.advantage import clip_advantages, discounted_returns, grpo, median, passk, psr_nsr, rloo
from mmrl.algo.aggregation import const_norm, seq_mean_token_mean, seq_mean_token_sum, token_mean
from mmrl.algo.correction import apply_correction, mis, no_correction, tis
from mmrl.algo.filters import accuracy_band, apply_filters, zero_variance
from mmrl.algo.kl import gaussian_kl, k1, k2, k3, kl_in_reward
from mmrl.algo.masks import top_entropy_mask, truncation_mask
from mmrl.algo.objective import cispo, decoupled_ppo, gspo, ppo_clip, reinforce

__all__ = [
    "advantage",
    "aggregation",
    "correction",
    "filters",
    "kl",
    "masks",
    "objective",
    "grpo",
    "rloo",
    "median",
    "psr_nsr",
    "passk",
    "clip_advantages",
    "discounted_returns",
    "ppo_clip",
    "cispo",
    "gspo",
    "reinforce",
    "decoupled_ppo",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "const_norm",
    "k1",
    "k2",
    "k3",
    "gaussian_kl",
    "kl_in_reward",
    "zero_variance",
    "accuracy_band",
    "apply_filters",
    "no_correction",
    "tis",
    "mis",
    "apply_correction",
    "truncation_mask",
    "top_entropy_mask",
]
