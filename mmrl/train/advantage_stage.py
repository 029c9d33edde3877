"""The learner's first stage: the advantages of an update (group-relative over the samples
of all processes, step-level, or GAE from a critic's values) as :class:`Targets`, and the
training mask. It applies the run's estimator over all processes' samples; the estimators
themselves, pure functions of one batch, are :mod:`mmrl.algo.advantage`'s."""

from __future__ import annotations

import torch

from mmrl import registry
from mmrl.algo.advantage import AdvantageConfig, best_worst, clip_advantages, decision_rewards, group_weights, step_advantages
from mmrl.algo.kl import kl_in_reward
from mmrl.algo.losses import Targets
from mmrl.algo.masks import top_entropy_mask, truncation_mask
from mmrl.algo.value import TokenLayout
from mmrl.config import own_options
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError


class AdvantageStage:
    """``cfg`` is the run config, ``dist`` the collectives, ``critic_cfg`` the critic's section
    when a critic trains (its values come from ``model(..., mode="value")``). Advantages are
    computed from each sample's combined reward (``Rollout.reward``, set once where the
    samples are scored)."""

    def __init__(self, cfg, dist, critic_cfg=None):
        self.cfg, self.dist, self.critic_cfg = cfg, dist, critic_cfg
        self.advantage_fn = registry.ADVANTAGES.get(cfg.algo.advantage.type)

    def __call__(self, rollout: Rollout, model=None) -> tuple[Targets, torch.Tensor]:
        """The targets of this process's rows ([B] or [B, T] advantages; with a critic also its
        returns and values) and the per-sample keep mask, computed on the samples of all
        processes (batch statistics are global); each process then takes its own rows."""
        cfg = self.cfg.algo
        sizes = self.dist.sizes(rollout.batch_size)
        start = self.dist.offset(sizes)
        rows = slice(start, start + rollout.batch_size)
        width = self.dist.max(rollout.num_decisions)
        pad = lambda t: torch.nn.functional.pad(t.cpu(), (0, width - t.shape[1]))  # noqa: E731
        gather = lambda t: self.dist.gather_rows(t.cpu(), sizes)  # noqa: E731
        groups = gather(rollout.group_id)
        if rollout.reward is None:
            raise ValueError("the rollout reaches the learner unscored: its combined reward (Rollout.reward) is set where it is scored (RolloutWorker.score)")
        reward = gather(rollout.reward)
        if cfg.kl.in_reward_penalty:
            # PPO-RLHF: r - coef * sum_t KL(old || ref) of the sampled decisions
            # on the CPU, beside the rewards: the scorer keeps ref_logp there, the sampler may
            # leave old_logp and the mask on the policy's device
            penalty = kl_in_reward(torch.zeros(rollout.batch_size), rollout.old_logp.cpu(), rollout.ref_logp.cpu(), rollout.mask.cpu(), cfg.kl.coef, cfg.kl.type)
            reward = reward + gather(penalty)
        options = own_options(cfg.advantage, AdvantageConfig)
        values = {}
        if self.critic_cfg is not None:  # a learned value baseline (GAE): per decision
            adv, keep, values = self._value_advantages(model, rollout, reward, groups, gather, pad, rows, options)
        elif cfg.advantage.level == "step":
            step_rewards = gather(pad(rollout.step_rewards)) if rollout.step_rewards is not None else None
            if cfg.advantage.step_reward_weight > 0 and step_rewards is None:
                raise ConfigError("algo.advantage.step_reward_weight", cfg.advantage.step_reward_weight, "needs a sampler that records step rewards (the env sampler)")
            state_keys = None
            if cfg.advantage.step_groups == "state":
                if "state_keys" not in rollout.info:
                    raise ConfigError("algo.advantage.step_groups", "state", "needs a sampler that keys each decision's env state (the env sampler)")
                state_keys = gather(pad(rollout.info["state_keys"].long()))
            decision_index = gather(pad(rollout.info["decision_index"].long())) if "decision_index" in rollout.info else None
            adv, keep = step_advantages(
                self.advantage_fn, reward, groups, gather(pad(rollout.mask)), step_rewards, decision_index=decision_index,
                gamma=cfg.advantage.gamma, step_reward_weight=cfg.advantage.step_reward_weight, step_reward_gate=cfg.advantage.step_reward_gate,
                state_keys=state_keys, episode_weight=cfg.advantage.episode_weight, **options,
            )
            adv = adv[:, : rollout.num_decisions]
        else:
            adv, keep = self.advantage_fn(reward, groups, **options)
        adv, keep = best_worst(clip_advantages(adv, cfg.advantage.clip), keep, reward, groups, cfg.advantage.best_worst)
        adv = group_weights(adv, groups, cfg.advantage.group_weight)
        return Targets(adv[rows], **values), keep[rows]

    def _value_advantages(self, model, rollout: Rollout, reward, groups, gather, pad, rows, options):
        """An advantage that reads values (``needs_values``): the critic's values of every
        decision (one no-grad pass at the current weights), the per-decision rewards as the
        step-level returns compose them, over all processes' samples. Returns this process's
        critic targets and values beside the advantages."""
        cfg = self.cfg.algo
        on_device = rollout.to(next(model.parameters()).device)
        with torch.no_grad():
            values = old_values = model(on_device.replay, mode="value").detach().float().cpu()
            bootstrap = torch.zeros(rollout.batch_size)
            if options.get("bootstrap_truncated") and "final_replay" in rollout.info:  # episodes a time limit cut: V of the final observation
                final = model(on_device.info["final_replay"], mode="value").detach().float().cpu()[:, 0]
                cut = torch.as_tensor(rollout.info["truncated"], dtype=torch.bool).cpu()
                bootstrap = torch.where(cut, final, bootstrap)
        mask = gather(pad(rollout.mask))
        step_rewards = gather(pad(rollout.step_rewards)) if rollout.step_rewards is not None else None
        per_decision = decision_rewards(reward, mask, step_rewards, cfg.advantage.step_reward_weight, cfg.advantage.step_reward_gate)
        gamma: float | torch.Tensor = cfg.advantage.gamma
        steps = gather(pad(torch.as_tensor(rollout.info["decision_steps"]).cpu())).double() if "decision_steps" in rollout.info else None
        values = gather(pad(values)).double()
        decision_index = gather(pad(rollout.info["decision_index"].long())) if "decision_index" in rollout.info else None
        tokens = None
        if decision_index is not None and decision_index.numel() and int(decision_index.max()) + 1 < decision_index.shape[1]:
            # decisions of several columns (a language agent's turn, masked past its end): GAE
            # runs over the valid columns only, each decision's rewards and env steps on its last
            tokens = TokenLayout(decision_index, mask)
            per_decision, mask, values = tokens.compact(tokens.onto_last(per_decision)), tokens.compact(mask), tokens.compact(values)
            steps = tokens.compact(tokens.onto_last(steps if steps is not None else torch.ones_like(per_decision, dtype=torch.float64)))
        if steps is not None:  # an action chunk of k env steps: the next decision is k steps away
            gamma = cfg.advantage.gamma ** steps
        adv, keep, returns = self.advantage_fn(
            per_decision.double(), groups, values=values, mask=mask, gamma=gamma, bootstrap=gather(bootstrap).double(), **options,
        )
        if tokens is not None:
            adv, returns = tokens.expand(adv), tokens.expand(returns)
        width = rollout.num_decisions
        return adv[:, :width].float(), keep, {"returns": returns[rows, :width].float(), "old_values": old_values}

    def train_mask(self, rollout: Rollout, keep: torch.Tensor) -> torch.Tensor:
        """The sampled decisions of the kept samples, less truncated samples
        (``algo.mask_truncated``) and all but the top-entropy decisions (``top_entropy_rho``)."""
        cfg = self.cfg.algo
        # the advantages (and keep) are worked out on the CPU; the rollout stays where its
        # sampler left it (the policy's device)
        mask = rollout.mask * keep[:, None].to(rollout.mask.device, rollout.mask.dtype)
        if cfg.mask_truncated and "truncated" in rollout.info:
            mask = truncation_mask(mask, torch.as_tensor(rollout.info["truncated"], dtype=torch.bool, device=mask.device))
        if cfg.top_entropy_rho is not None and rollout.entropy is not None:
            mask = top_entropy_mask(mask, rollout.entropy, cfg.top_entropy_rho)
        return mask
