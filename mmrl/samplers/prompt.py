"""``prompt`` sampler: G samples per prompt record, many groups per batched ``policy.sample``.

Records come from a prompt dataset (:mod:`mmrl.data.prompts`): JSONL, CSV, a saved
``datasets`` dataset, or the integer conditions 0 … n−1 of the toy configs.

What the policy receives: one input per sample, the G samples of a group next to each other
— a LongTensor [N] of condition ids on the policy's device when the prompts are conditions
(the toy policies take these), else a list of N prompts: a string, or an
:class:`~mmrl.data.prompts.ImagePrompt` (the text and its images) for a record with images.

Which record a group gets: the train records form a stream of epochs (each a permutation
drawn from (run seed, epoch), :class:`~mmrl.data.prompts.EpochOrder`). Step s starts at
stream position P_s, and global group g of step s gets the record at position P_s + g.
Steps advance by ``algo.groups_per_step``: P_{s+1} = P_s + groups_per_step. The trainer's
refill rounds (DAPO dynamic sampling) ask for groups g ≥ groups_per_step; they read further
along the stream without consuming it (the next step still starts at P_{s+1}), because how
many refills a process needs differs between processes and they cannot agree on it without
communicating. ``state_dict`` holds the next step and its P, so ``--resume`` continues the
stream exactly, even with a different ``groups_per_step``.

Randomness: one ``policy.sample`` call per run of at most ``batch_groups`` groups; calls
start at global group indices divisible by ``batch_groups`` (and at the first of a
process's groups), and a call's generator is seeded with ``group_seed(seed, step, first
global group of the call)``. A group's record depends only on (seed, stream position,
group index), so one process and N processes give identical samples whenever their calls
hold the same groups: when every process's first group and group count are multiples of
``batch_groups`` (e.g. ``groups_per_step / processes`` is), and always with batch_groups 1.

Partial rollouts (``rollout.over_provision`` o > 1, APRIL): a process holding groups
[f, f + L) of a step keeps ⌈(f + L)·o⌉ − ⌈f·o⌉ groups in flight and decodes them in one
batch, whatever ``batch_groups`` says; the call ends as soon as L groups have finished every
sample, and the step trains on those (the oldest first). The other groups stay in flight:
their unfinished completions pause with the tokens generated so far and continue in the next
step's batch under the weights of then, beside fresh records that refill the batch. Every
token is tagged with the policy version that sampled it (``info["decision_version"]`` [B, T]),
and a sample's ``policy_version`` is its oldest token's, so the staleness metrics and the
learner's old log-probs treat it by its oldest part. The groups in flight are part of
``state_dict``: ``--resume`` continues them. The first such step takes its fresh records at
stream positions P + ⌈f·o⌉ and advances the stream by ⌈groups_per_step·o⌉; later steps take L
fresh records at P + f (a group out for each group in) and advance by groups_per_step. One
process and N processes sample different batches here (the batch decides when to stop).

Samples per prompt (``budget``): ``algo.group_size`` each, or, with ``budget.type: knapsack``,
the step's ``groups_per_step × group_size`` samples shared among its records by their pass
rates (:mod:`mmrl.samplers.budgets`, Knapsack RL). The rates come from ``observe``: the
outcome of every scored training sample (a pass when its combined reward is ≥
``accuracy_threshold``), gathered over the learner processes, kept per record and
checkpointed in ``state_dict``. Each round of ``groups_per_step`` groups (the step's, then each
refill round's) is shared once, from the rates of its records, so every process gives a group
the same size; a refill round is shared after the rounds before it were scored. With partial
rollouts the fresh records of each step share their ``group_size`` each.

Per sample, ``rollout.info`` holds the policy's own info plus the record: ``prompt`` (what
the policy received), ``answer`` (list, None where the record has none), ``metadata``
(list of dicts, shared by a group's samples: read them, do not change them) and
``record_id`` (LongTensor, the record's row in its source); training samples also hold
``train_index`` (LongTensor, the record's index among the train records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import math

import torch
from torch import Tensor, nn

from mmrl.config import option
from mmrl.core.component_config import SamplerConfig
from mmrl.core.policy import Policy, Sample
from mmrl.core.reward import RewardSet
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.core.sampler import Sampler, SamplerContext, group_seed
from mmrl.core.statistics import wilson_interval
from mmrl.data.prompts import EpochOrder, PromptData, PromptDataConfig, PromptRecord, clusters_by, prompt_input
from mmrl.errors import ConfigError
from mmrl.registry import POLICIES, SAMPLERS
from mmrl.samplers.budgets import BudgetConfig, PassHistory, allocate
from mmrl.samplers.partial import partial_metrics


@dataclass
class PromptSamplerConfig(SamplerConfig):
    """Prompt-conditioned generation: G samples per prompt record."""

    type: str = option("prompt", "registered name of this component (see `mmrl list`)")
    data: PromptDataConfig = option(factory=PromptDataConfig, doc="prompt records: sources, fields and the held-out split")
    batch_groups: int = option(8, "groups per batched policy.sample call (calls start at global group indices divisible by it)", ge=1)
    eval_batch_size: int = option(64, "evaluation samples per policy.sample call", ge=1)
    eval_all: bool = option(False, "evaluate every held-out record once, whatever eval.episodes says")
    eval_deterministic: bool = option(True, "evaluate deterministic samples (greedy tokens, mean transitions); false: seeded samples drawn as in training (samplers that always inject noise, such as a multistep consistency sampler)")
    accuracy_threshold: float = option(1.0, "evaluation: a sample is correct when its combined reward is >= this")
    cluster_key: str | None = option(
        None,
        "records sharing this metadata value (e.g. question_id: the paraphrases of one question) are consecutive in the epoch order, so they meet in one step when groups_per_step is a multiple of the cluster size (paraphrase_consistency needs this); null = records shuffled one by one",
    )
    category_key: str | None = option("category", "metadata key whose values get their own evaluation accuracy/<value> (null = none)")
    shared_noise: bool = option(
        False,
        "training: the G samples of a group start from one initial noise (DanceGRPO), so the group's differences come from the stochastic steps alone; needs a policy that shares_initial_noise (image_diffusion, video_diffusion). Evaluation keeps one noise per sample",
    )
    budget: BudgetConfig = option(factory=BudgetConfig, doc="samples per prompt: fixed (algo.group_size) or shared by pass rate (knapsack)")


def _device(policy: Policy) -> torch.device:
    param = next(iter(policy.parameters()), None) if isinstance(policy, nn.Module) else None
    return param.device if param is not None else torch.device("cpu")


def _call_ranges(first: int, end: int, batch_groups: int) -> list[tuple[int, int]]:
    """[first, end) cut at the multiples of ``batch_groups``."""
    ranges = []
    while first < end:
        stop = min(end, (first // batch_groups + 1) * batch_groups)
        ranges.append((first, stop))
        first = stop
    return ranges


@SAMPLERS.register("prompt", config=PromptSamplerConfig)
class PromptSampler(Sampler):
    """Groups of G samples per prompt record (texts or conditions), batched across groups."""

    keeps_sampling_graph = True
    partial_rollouts = True  # rollout.over_provision
    partial_rollouts_need = "sample_partial"  # of the policy: it pauses and continues completions
    progress_metrics = {"success": "success_rate", "eval_acc": "eval/accuracy"}

    def __init__(self, sampler_cfg: PromptSamplerConfig, ctx: SamplerContext):
        self.config = sampler_cfg
        self.seed = ctx.seed
        self.groups_per_step = ctx.groups_per_step
        self.log_probs = ctx.log_probs  # the run's loss reads log-probs; else final samples suffice
        budget = sampler_cfg.budget
        # knapsack: each train record's recent outcomes (observe), from which a step's records
        # share its samples; sizes[(step, round)]: the group sizes of a round of groups_per_step
        self.history = PassHistory(budget.history, budget.min_history) if budget.type == "knapsack" else None
        self.observes_rewards = self.history is not None
        self.sizes: dict[tuple[int, int], list[int]] = {}
        if self.history is not None:
            if sampler_cfg.shared_noise:
                raise ConfigError("sampler.budget.type", budget.type, "gives groups different sizes, and sampler.shared_noise starts each group from one noise of a fixed group size; use one of the two")
            if not budget.min_size <= ctx.group_size <= budget.max_size:
                raise ConfigError("sampler.budget.min_size" if budget.min_size > ctx.group_size else "sampler.budget.max_size", budget.min_size if budget.min_size > ctx.group_size else budget.max_size,
                                  f"must leave algo.group_size ({ctx.group_size}), what a prompt without a pass rate gets, between min_size and max_size")
        if sampler_cfg.shared_noise:
            policy_cls = POLICIES.get(ctx.policy_type, "policy.type")
            if not policy_cls.shares_initial_noise:
                raise ConfigError("sampler.shared_noise", True, f"policy {ctx.policy_type!r} starts no denoising chain from a noise it could share; policies that do: image_diffusion, video_diffusion")
        self.data = PromptData.load(sampler_cfg.data, "sampler.data")
        key = sampler_cfg.cluster_key
        self.order = EpochOrder(len(self.data.train), self.seed, clusters_by(self.data.train, key) if key else None)
        # the step that the stream position `next_position` starts (see the module docstring)
        self.next_step, self.next_position = 0, 0
        self.over_provision = ctx.over_provision
        # partial rollouts: the groups in flight, each {"record": train index, "born": step,
        # "rows": [policy state or None] * G, "versions": [[version per decision]] * G}
        self.in_flight: list[dict[str, Any]] = []
        self.provisioned = False  # the first partial-rollout step has taken its ⌈·o⌉ records

    def policy_spec(self) -> dict:
        n = self.data.num_conditions
        return {"num_prompts": n, "prompt_file": self.config.data.train} if n is not None else {}

    def _inputs(self, records: list[PromptRecord], copies: int | list[int], device: torch.device) -> Tensor | list[str]:
        """One input per sample: ``copies`` of each record (a count per record, or one for all)."""
        copies = [copies] * len(records) if isinstance(copies, int) else copies
        if self.data.kind == "condition":
            return torch.tensor([r.prompt for r in records], dtype=torch.long, device=device).repeat_interleave(torch.tensor(copies, device=device))
        return [prompt for r, n in zip(records, copies) for prompt in [prompt_input(r)] * n]

    def _rollout(self, sample: Sample, inputs, records: list[PromptRecord], copies: int | list[int], group_id: Tensor, keep_graph: bool = False, train_index: list[int] | None = None) -> Rollout:
        logp = sample.logp.detach()
        mask = sample.mask.float() if sample.mask is not None else torch.ones_like(logp)
        copies = [copies] * len(records) if isinstance(copies, int) else copies
        per_sample = [r for r, n in zip(records, copies) for _ in range(n)]
        extra = {"train_index": torch.tensor([i for i, n in zip(train_index, copies) for _ in range(n)], dtype=torch.long, device=logp.device)} if train_index is not None else {}
        return Rollout(
            group_id=group_id.to(logp.device),
            old=OldLogProbs(logp, deferred=sample.logp_deferred, graph=sample.logp if keep_graph else None),
            mask=mask,
            replay=sample.replay,
            entropy=sample.entropy,
            info={
                **sample.info,
                "prompt": inputs,
                "answer": [r.answer for r in per_sample],
                "metadata": [r.metadata for r in per_sample],
                "record_id": torch.tensor([r.record_id for r in per_sample], dtype=torch.long, device=logp.device),
                **extra,
            },
        )

    def _step_start(self, step: int, advance: int | None = None) -> int:
        """Stream position of global group 0 of ``step``; moves the anchor to ``step + 1``
        (``advance`` records on: ``groups_per_step`` unless partial rollouts say otherwise)."""
        start = self.next_position + (step - self.next_step) * self.groups_per_step
        self.next_step, self.next_position = step + 1, start + (self.groups_per_step if advance is None else advance)
        return start

    @torch.no_grad()
    def collect(self, policy: Policy, num_groups: int, group_size: int, step: int, group_offset: int = 0, keep_graph: bool = False, version: int = 0) -> Rollout:
        """This process's groups of ``step`` (the module docstring); ``keep_graph`` asks the
        policy (``keeps_sampling_graph``) to keep its log-probs' autograd graph and carries them
        to ``Rollout.old.graph``. ``version``: the policy's weights version, which
        tags each decision of a partial rollout."""
        if self.over_provision > 1:
            return self._collect_partial(policy, num_groups, group_size, step, group_offset, version)
        start = self._step_start(step)
        device = _device(policy)
        options = {"keep_graph": True} if keep_graph else {}
        if self.config.shared_noise:
            options["noise_group_size"] = group_size
        if not self.log_probs and policy.samples_final_only:
            options["final_only"] = True  # the loss reads final samples: no chain is stored
        parts = []
        for first, end in _call_ranges(group_offset, group_offset + num_groups, self.config.batch_groups):
            index = self.order.indices(start + first, end - first)
            records = [self.data.train[i] for i in index]
            sizes = self._group_sizes(step, start, first, end, group_size)
            inputs = self._inputs(records, sizes, device)
            generator = torch.Generator().manual_seed(group_seed(self.seed, step, first))
            sample = policy.sample(inputs, generator, **options)
            group_id = torch.arange(first, end).repeat_interleave(torch.tensor(sizes))
            parts.append(self._rollout(sample, inputs, records, sizes, group_id, keep_graph, train_index=index))
        return Rollout.cat(parts)

    def _group_sizes(self, step: int, start: int, first: int, end: int, group_size: int) -> list[int]:
        """Samples of global groups [first, end) of ``step`` (whose group 0 is at stream
        position ``start``): ``group_size`` each, or (knapsack) their share of their round's
        budget. A round is groups_per_step consecutive groups (the step's, then each refill
        round's); its sizes are worked out once, from the pass rates of its records, so
        every process computes the same sizes."""
        if self.history is None:
            return [group_size] * (end - first)
        out = []
        for g in range(first, end):
            round_ = g // self.groups_per_step
            if (step, round_) not in self.sizes:
                self.sizes = {k: v for k, v in self.sizes.items() if k[0] == step}  # earlier steps' are spent
                index = self.order.indices(start + round_ * self.groups_per_step, self.groups_per_step)
                self.sizes[step, round_] = self._allocate(index, group_size)
            out.append(self.sizes[step, round_][g % self.groups_per_step])
        return out

    def _allocate(self, index: list[int], group_size: int) -> list[int]:
        """Knapsack sizes of the train records ``index`` from a budget of ``group_size`` each."""
        b = self.config.budget
        return allocate([self.history.rate(i) for i in index], group_size * len(index), group_size, b.min_size, b.max_size, b.alpha, b.explore, b.value)

    def observe(self, rollout: Rollout, reward: Tensor, gather=None) -> None:
        """Knapsack: add the outcome of each scored training sample (a pass when its
        combined ``reward`` is ≥ ``accuracy_threshold``) to its record's history. ``gather``
        concatenates a tensor's rows over the learner processes, so every process keeps the
        same histories."""
        if self.history is None or "train_index" not in rollout.info:
            return
        gather = gather or (lambda t: t)
        index = gather(torch.as_tensor(rollout.info["train_index"]).cpu())
        passed = gather((torch.as_tensor(reward).cpu() >= self.config.accuracy_threshold).float())
        self.history.add(index.tolist(), passed.tolist())

    def _collect_partial(self, policy: Policy, num_groups: int, group_size: int, step: int, group_offset: int, version: int) -> Rollout:
        """Partial rollouts (module docstring): finish ``num_groups`` groups of the ones in
        flight and the fresh ones, keep the rest in flight."""
        o = self.over_provision
        provision = math.ceil((group_offset + num_groups) * o) - math.ceil(group_offset * o)
        if self.provisioned:
            first, advance = group_offset, self.groups_per_step
        else:
            first, advance = math.ceil(group_offset * o), math.ceil(self.groups_per_step * o)
        start = self._step_start(step, advance)
        fresh = max(0, provision - len(self.in_flight))
        self.provisioned = True
        index = self.order.indices(start + first, fresh)
        sizes = self._allocate(index, group_size) if self.history is not None and index else [group_size] * len(index)
        groups = self.in_flight + [
            {"record": i, "born": step, "rows": [None] * n, "versions": [[] for _ in range(n)]} for i, n in zip(index, sizes)
        ]
        active = [(g, r) for g, group in enumerate(groups) for r, st in enumerate(group["rows"]) if st is None or st["reason"] == "paused"]
        open_rows = [0] * len(groups)
        for g, _ in active:
            open_rows[g] += 1
        done_before = sum(1 for n in open_rows if n == 0)
        if active and done_before < num_groups:

            def enough(ended: list[int]) -> bool:
                closed = [0] * len(groups)
                for i in ended:
                    closed[active[i][0]] += 1
                return done_before + sum(1 for g, n in enumerate(open_rows) if n and closed[g] == n) >= num_groups

            records = [self.data.train[groups[g]["record"]] for g, _ in active]
            generator = torch.Generator().manual_seed(group_seed(self.seed, step, group_offset))
            states = policy.sample_partial(self._inputs(records, 1, _device(policy)), [groups[g]["rows"][r] for g, r in active], generator, enough)
            for (g, r), st in zip(active, states):
                old = groups[g]["rows"][r]
                groups[g]["versions"][r] += [version] * (len(st["logp"]) - (len(old["logp"]) if old else 0))
                groups[g]["rows"][r] = st
        finished = [g for g, group in enumerate(groups) if all(st is not None and st["reason"] != "paused" for st in group["rows"])][:num_groups]
        if len(finished) < num_groups:
            raise RuntimeError(f"partial rollouts: {len(finished)} of {num_groups} groups finished (the policy's sample_partial stopped early)")
        self.in_flight = [group for g, group in enumerate(groups) if g not in set(finished)]
        out = [groups[g] for g in finished]
        records = [self.data.train[group["record"]] for group in out]
        sizes = [len(group["rows"]) for group in out]
        inputs = self._inputs(records, sizes, _device(policy))
        sample = policy.sample_of_states(inputs, [st for group in out for st in group["rows"]])
        group_id = torch.arange(group_offset, group_offset + num_groups).repeat_interleave(torch.tensor(sizes))
        rollout = self._rollout(sample, inputs, records, sizes, group_id, train_index=[group["record"] for group in out])
        versions = [v for group in out for v in group["versions"]]
        tags = torch.zeros(rollout.mask.shape, dtype=torch.long)
        for row, v in enumerate(versions):
            tags[row, : len(v)] = torch.tensor(v, dtype=torch.long)
        oldest = torch.tensor([min(v) if v else version for v in versions], dtype=torch.long)
        born = torch.tensor([group["born"] for group in out for _ in group["rows"]], dtype=torch.long)
        return rollout.with_(policy_version=oldest, info={**rollout.info, "decision_version": tags.to(rollout.mask.device), "steps_in_flight": (step - born + 1).to(rollout.mask.device)})

    def metrics(self, rollout: Rollout) -> dict[str, Tensor]:
        """Per-sample values the trainer averages over all collected samples: ``success_rate``
        when the policy reports success; for text completions, ``completion_length`` (tokens,
        EOS or stop string included) and ``truncated_rate`` (the fraction cut off by the
        token budget); with knapsack budgets ``budget/group_size``, the size of each
        sample's group (its mean is Σ n² / Σ n over the groups: ``group_size`` when even)."""
        out = {}
        if "success" in rollout.info:
            out["success_rate"] = torch.as_tensor(rollout.info["success"]).float().reshape(-1)
        if "completions" in rollout.info:
            out["completion_length"] = rollout.mask.float().sum(1).cpu()
        if "truncated" in rollout.info:
            out["truncated_rate"] = torch.as_tensor(rollout.info["truncated"]).float().reshape(-1).cpu()
        out.update(partial_metrics(rollout))  # partial rollouts: how many steps a sample took, and its versions' spread
        if self.history is not None:  # knapsack: the size of each sample's group (its mean is groups' spread: group_size when even)
            _, index, counts = torch.unique(rollout.group_id.cpu(), return_inverse=True, return_counts=True)
            out["budget/group_size"] = counts[index].float()
        return out

    @torch.no_grad()
    def evaluate(self, policy: Policy, episodes: int, seed: int, rewards: RewardSet | None = None) -> dict[str, Any]:
        """Deterministic samples (greedy tokens / mean transitions; seeded samples drawn as in
        training with ``eval_deterministic`` false) on the held-out records —
        the train records when there is no held-out split — in source order: the first
        ``episodes``, cycling when there are fewer records, or every record once with
        ``eval_all``. Call k's generator (a chain's starting noise) is seeded with
        ``group_seed(seed, 0, first sample of the call)``.

        ``rewards`` (the run's :class:`RewardSet`) scores the samples; ``combine`` sees the samples of one record
        as one group. Returns ``reward_mean``; ``accuracy``, the fraction of samples whose
        combined reward is ≥ ``accuracy_threshold``, with its 95% Wilson interval
        (``accuracy_ci_low``, ``accuracy_ci_high``, samples taken as independent);
        ``accuracy/<value>`` per value of the metadata key ``category_key`` where records
        have it, with its interval (``/ci_low``, ``/ci_high``) and count (``/n``);
        ``reward/<name>``, each component's mean, when there are several; ``success_rate`` when the policy reports ``success``; ``episodes``; and
        ``media``, the policy's ``media(rollout)`` (sample images or videos to write as
        files, :mod:`mmrl.media`) when it gives any.
        """

        pool = self.data.held_out or self.data.train
        n = len(pool) if self.config.eval_all else episodes
        device = _device(policy)
        parts = []
        for first in range(0, n, self.config.eval_batch_size):
            positions = range(first, min(n, first + self.config.eval_batch_size))
            records = [pool[i % len(pool)] for i in positions]
            inputs = self._inputs(records, 1, device)
            generator = torch.Generator().manual_seed(group_seed(seed, 0, first))
            sample = policy.sample(inputs, generator, deterministic=self.config.eval_deterministic)
            parts.append(self._rollout(sample, inputs, records, 1, torch.tensor([i % len(pool) for i in positions])))
        rollout = Rollout.cat(parts)

        metrics: dict[str, Any] = {"episodes": n}
        if rewards is None:
            raise ValueError("the prompt sampler's evaluation scores its samples with the run's rewards: pass rewards= (a RewardSet)")
        if rewards.components:
            scores = rewards.score(rollout, policy=policy)
            combined = rewards.combine(scores, rollout.group_id.cpu())
            correct = (combined >= self.config.accuracy_threshold).float()
            low, high = wilson_interval(correct.sum().item(), n)
            metrics.update(reward_mean=combined.mean().item(), accuracy=correct.mean().item(), accuracy_ci_low=low, accuracy_ci_high=high)
            if len(rewards.names) > 1:  # each component's mean, weighted or not (a weight-0 component is a monitor)
                for k, name in enumerate(rewards.names):
                    metrics[f"reward/{name}"] = scores[:, k].mean().item()
            key = self.config.category_key
            if key is not None:
                categories: dict[str, list[int]] = {}
                for i, metadata in enumerate(rollout.info["metadata"]):
                    if key in metadata:
                        categories.setdefault(str(metadata[key]), []).append(i)
                for category, rows in sorted(categories.items()):
                    hits = correct[rows].sum().item()
                    low, high = wilson_interval(hits, len(rows))
                    metrics[f"accuracy/{category}"] = hits / len(rows)
                    metrics[f"accuracy/{category}/ci_low"], metrics[f"accuracy/{category}/ci_high"] = low, high
                    metrics[f"accuracy/{category}/n"] = len(rows)
        if "success" in rollout.info:
            metrics["success_rate"] = torch.as_tensor(rollout.info["success"]).float().mean().item()
        media = getattr(policy, "media", None)
        if media is not None and (samples := media(rollout)):
            metrics["media"] = samples
        return metrics

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"next_step": self.next_step, "next_position": self.next_position}
        if self.history is not None:
            state["pass_history"] = self.history.state_dict()
        if self.provisioned:
            state.update(in_flight=[{**g, "rows": [dict(st) if st else None for st in g["rows"]], "versions": [list(v) for v in g["versions"]]} for g in self.in_flight], provisioned=True)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state.get("next_step", 0))
        self.next_position = int(state.get("next_position", 0))
        self.in_flight = list(state.get("in_flight", []))
        self.provisioned = bool(state.get("provisioned", False))
        if self.history is not None:
            self.history.load_state_dict(state.get("pass_history", {}))
