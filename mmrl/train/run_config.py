"""``TrainConfig``: everything a run needs, one docstring'd field at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from mmrl.algo.advantage import AdvantageConfig, GroupNormConfig, trains_on_step_rewards
from mmrl.algo.correction import CorrectionConfig
from mmrl.algo.aggregation import AggregationConfig
from mmrl.algo.filters import FilterConfig
from mmrl.algo.kl import KLConfig
from mmrl.algo.losses import LossConfig, check_requirements
from mmrl.algo.losses.policy_gradient import PolicyGradientConfig
from mmrl.algo.objective import ObjectiveConfig, PPOClipConfig
from mmrl.config import MovedKey, option
from mmrl.core.component_config import EnvConfig, PolicyConfig, RewardConfig, SamplerConfig
from mmrl.data.sources import DataSourceConfig, DemonstrationsConfig
from mmrl.errors import ConfigError
from mmrl.registry import ADVANTAGES, ENGINES, LOSSES
from mmrl.core.critic import CriticConfig
from mmrl.rollout.config import RolloutConfig, check_refill_rounds


@dataclass
class SelfImitationConfig:
    """Self-imitation (SIL, Oh et al. 2018): a memory of past positive-advantage samples and,
    after each update, supervised steps on them (``mmrl/train/self_imitation.py``)."""

    size: int = option(0, "samples kept in the memory (first in, first out); 0 = off", ge=0)
    steps: int = option(4, "optimizer steps on the memory after each update", ge=1)
    batch: int = option(64, "samples drawn from the memory per step (over all processes)", ge=1)
    loss: Literal["logp", "sft"] = option(
        "logp", "-A+ logpi of the replayed decisions, or the policy's own supervised loss (flow matching, token cross-entropy) on the executed actions, weighted by A+"
    )
    in_checkpoint: bool = option(True, "save the memory in checkpoints (false: smaller checkpoints; a resumed run refills the memory, so resume is not bit-exact)")


_PER_AXIS = "since the per-axis algo sections"


@dataclass
class AlgoConfig:
    """The group-relative core: one section per axis, each with a ``type`` and that method's
    own options (``mmrl list advantages|objectives|aggregations|filters|kl``); presets in
    ``configs/presets/`` pick one per axis."""

    # Every key of the flat algo section that moved when each axis became its own section
    # (commit 39e7e88; benchmarks/RESULTS.md reads old commands with it): configs and saved
    # runs of earlier mmrl are told where each one lives now.
    moved_keys: ClassVar[dict[str, MovedKey]] = {
        "std": MovedKey("advantage.std", _PER_AXIS),
        "ddof": MovedKey("advantage.ddof", _PER_AXIS),
        "adv_eps": MovedKey("advantage.eps", _PER_AXIS),
        "adv_clip": MovedKey("advantage.clip", _PER_AXIS),
        "psr_weight": MovedKey("advantage.psr_weight", _PER_AXIS, "psr_nsr"),
        "nsr_weight": MovedKey("advantage.nsr_weight", _PER_AXIS, "psr_nsr"),
        "advantage_level": MovedKey("advantage.level", _PER_AXIS),
        "gamma": MovedKey("advantage.gamma", _PER_AXIS),
        "step_reward_weight": MovedKey("advantage.step_reward_weight", _PER_AXIS),
        "multi_reward": MovedKey("reward_aggregation", _PER_AXIS, note="sum_then_normalize is now weighted_sum"),
        "accuracy_lo": MovedKey("filters[i].lo", _PER_AXIS, "accuracy_band"),
        "accuracy_hi": MovedKey("filters[i].hi", _PER_AXIS, "accuracy_band"),
        "eps_low": MovedKey("objective.eps_low", _PER_AXIS),
        "eps_high": MovedKey("objective.eps_high", _PER_AXIS),
        "dual_clip": MovedKey("objective.dual_clip", _PER_AXIS),
        "behav_weight_cap": MovedKey("objective.behav_weight_cap", _PER_AXIS, "decoupled_ppo"),
        "log_ratio_clamp": MovedKey("objective.log_ratio_clamp", _PER_AXIS),
        "max_len": MovedKey("aggregation.max_len", _PER_AXIS, "const_norm"),
        "kl_coef": MovedKey("kl.coef", _PER_AXIS),
        "kl_estimator": MovedKey("kl.type", _PER_AXIS),
        "kl_in_reward": MovedKey("kl.in_reward", _PER_AXIS),
        "replay_size": MovedKey("self_imitation.size", _PER_AXIS),
        "replay_steps": MovedKey("self_imitation.steps", _PER_AXIS),
        "replay_batch": MovedKey("self_imitation.batch", _PER_AXIS),
        "replay_loss": MovedKey("self_imitation.loss", _PER_AXIS),
    }

    type: Literal["rl", "sft"] = option(
        "rl", "rl: the group-relative policy-gradient loop; sft: supervised fine-tuning on the data section's batches (no rollouts)"
    )
    group_size: int = option(8, "G: samples per prompt / initial state (MC-GRPO: G+1)", ge=1)
    groups_per_step: int = option(8, "groups collected per training step (over all processes)", ge=1)
    reward_aggregation: Literal["weighted_sum", "normalize_then_sum", "log_tamed"] = option(
        "weighted_sum", "several reward components: weighted sum, per-group normalized then summed, or log(1+r) on high-variance components then summed"
    )
    log_tamed_threshold: Literal["mean", "median"] = option("mean", "log_tamed: tame components whose coefficient of variation exceeds the mean or the median of all components'")
    advantage: AdvantageConfig = option(factory=GroupNormConfig, doc="advantage estimator and its options")
    filters: list[FilterConfig] = option(factory=list, doc="group filters applied before the update, e.g. [{type: zero_variance}]")
    correction: CorrectionConfig = option(
        factory=CorrectionConfig, doc="off-policy correction of samples whose sampler log-probs differ from the learner's: tis, mis (mmrl list corrections); none"
    )
    resample_rounds: int = option(0, "extra collection rounds to refill the batch after filtering (DAPO dynamic sampling)", ge=0)
    loss: LossConfig = option(factory=PolicyGradientConfig, doc="the loss module one piece of a minibatch backpropagates (mmrl list losses): policy_gradient is the objective, aggregation, kl and correction below")
    objective: ObjectiveConfig = option(factory=PPOClipConfig, doc="per-decision surrogate and its options")
    aggregation: AggregationConfig = option(factory=AggregationConfig, doc="how per-decision losses become one number")
    kl: KLConfig = option(factory=KLConfig, doc="KL to the reference policy")
    top_entropy_rho: float | None = option(None, "train only the top-rho fraction of decisions by entropy (80/20 rule)", gt=0, le=1)
    mask_truncated: bool = option(False, "drop samples that were truncated (no EOS / time limit) from the loss")
    ppo_epochs: int = option(1, "passes over each rollout", ge=1)
    num_minibatches: int = option(1, "optimizer steps per epoch, each on one slice of a global permutation of the batch", ge=1)
    target_kl: float | None = option(
        None, "stop an update's epochs early: a minibatch whose approximate KL to the sampling policy (over all processes) exceeds this takes no step, and the update ends there (null: every step runs)", gt=0
    )
    micro_batches: int | None = option(
        None,
        "gradient accumulation: each minibatch's forward/backward runs in this many pieces before its one optimizer step (same update, less memory); null: on a CPU as many as keep a piece's activations under micro_batch_mb by the policy's estimate (policy.activation_bytes), else 1",
        ge=1,
    )
    micro_batch_mb: float = option(4.0, "micro_batches null, on a CPU: the most megabytes (2^20 bytes) of the policy's activation estimate one piece may hold (a piece whose tensors outgrow the cache runs slower)", gt=0)
    reuse_sampling_graph: Literal["auto"] | bool = option(
        False,
        "one on-policy pass (ppo_epochs 1, num_minibatches 1): sample with grad on the trained steps and backpropagate the loss through the sampling pass's own log-probs instead of recomputing them (the same gradient, one forward less, but the activations of every sampled step are held until the update, so it is opt-in); auto: whenever that is exact and saves a forward (a policy and sampler that can keep the graph, micro_batches null or 1, no exact KL in the loss, no mixed precision); true: always (an error where it cannot be exact); false: never",
    )
    self_imitation: SelfImitationConfig = option(factory=SelfImitationConfig, doc="self-imitation of past positive-advantage samples")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.correction.type != "none" and self.objective.type == "decoupled_ppo":
            raise ConfigError(p + "correction.type", self.correction.type, "decoupled_ppo already weights stale samples by their behaviour ratio; use correction none with it, or ppo_clip with the correction")
        traits = ADVANTAGES.entry(self.advantage.type, p + "advantage.type").traits
        needed = traits.get("min_group_size", 1)
        from_buffer = LOSSES.entry(self.loss.type, p + "loss.type").traits.get("trains_from_buffer", False)
        if from_buffer and self.filters:
            raise ConfigError(p + "filters", [f.type for f in self.filters], f"algo.loss {self.loss.type} trains from the replay buffer, which keeps every transition: use []")
        for name, default in (("ppo_epochs", 1), ("num_minibatches", 1), ("target_kl", None)):
            if from_buffer and getattr(self, name) != default:
                raise ConfigError(p + name, getattr(self, name), f"algo.loss {self.loss.type} draws every optimizer step's batch from its replay buffer (algo.loss.utd, batch_size): leave it {default}")
        if from_buffer and self.self_imitation.size > 0:
            raise ConfigError(p + "self_imitation.size", self.self_imitation.size, f"algo.loss {self.loss.type} already learns from past transitions (its replay buffer): use 0")
        if self.group_size < needed and not from_buffer:  # declared where the advantage registers (a loss on the replay buffer reads no advantage)
            raise ConfigError(p + "group_size", self.group_size, f"must be >= {needed} for the group-relative advantage {self.advantage.type!r}")
        if traits.get("needs_values", False) and self.advantage.level != "step":
            raise ConfigError(
                p + "advantage.level", self.advantage.level,
                f"{self.advantage.type} gives every decision its own advantage from the critic's values, so it is always step: leave it step, or use a group-relative advantage (grpo, rloo) for one per sample",
            )
        for field, default in (("step_groups", "decision"), ("episode_weight", 0.0)):
            value = getattr(self.advantage, field)
            if value != default and (self.advantage.level != "step" or traits.get("needs_values", False)):
                raise ConfigError(p + f"advantage.{field}", value, "shapes the group-relative step-level advantage: needs level: step with a group-relative advantage (grpo, rloo, ...)")
        if getattr(self.advantage, "normalize", None) == "minibatch":
            if self.loss.type != "policy_gradient":
                raise ConfigError(p + "advantage.normalize", "minibatch", f"is applied by the policy_gradient loss, and algo.loss.type is {self.loss.type!r}: use batch, group or none")
            if self.self_imitation.size > 0:
                raise ConfigError(p + "advantage.normalize", "minibatch", "self-imitation keeps the batch's advantages, which minibatch leaves unscaled: use batch, or self_imitation.size 0")
        if self.advantage.step_reward_gate is not None and not trains_on_step_rewards(self.advantage):
            raise ConfigError(
                p + "advantage.step_reward_gate", self.advantage.step_reward_gate,
                "gates the env's step rewards, which this run does not train on: set step_reward_weight > 0 with level: step or a value baseline (gae), or leave it null",
            )
        if self.reuse_sampling_graph is True:
            if self.ppo_epochs != 1 or self.num_minibatches != 1:
                raise ConfigError(
                    p + "reuse_sampling_graph", True,
                    f"needs one on-policy pass (ppo_epochs 1 and num_minibatches 1, got {self.ppo_epochs} and {self.num_minibatches}): later passes run at changed weights; use auto or false",
                )
            if self.micro_batches not in (None, 1):
                raise ConfigError(
                    p + "reuse_sampling_graph", True,
                    f"backpropagates the whole sampling graph at once, so micro_batches must be null or 1 (got {self.micro_batches}); use auto or false",
                )


@dataclass
class OptimConfig:
    lr: float = option(3e-4, "Adam learning rate", gt=0)
    betas: list[float] = option(factory=lambda: [0.9, 0.999], doc="Adam betas")
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    adam_eps: float = option(1e-8, "Adam epsilon", gt=0)
    max_grad_norm: float | None = option(1.0, "clip the global gradient norm (null = no clipping)", gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = option("constant", "learning rate over the training steps after the warm-up: constant, or decaying linearly / by a half cosine to lr * final_lr_ratio at total_steps")
    warmup_steps: int = option(0, "training steps of linear warm-up from lr / (warmup_steps + 1) to lr", ge=0)
    final_lr_ratio: float = option(0.0, "linear/cosine: the learning rate at the last step as a fraction of lr", ge=0, le=1)
    frozen: list[str] = option(factory=list, doc="parameter-name prefixes to keep fixed (e.g. [backbone.vision] freezes a VLA's image encoder); each must match a parameter")


@dataclass
class EvalConfig:
    every: int = option(0, "evaluate every N steps (0 = only at the end)", ge=0)
    episodes: int = option(16, "evaluation episodes / samples", ge=1)
    at_start: bool = option(True, "evaluate before the first update (logged at step 0: the curves' starting point); a resumed run has it already")
    at_end: bool = option(True, "evaluate after the last step")


@dataclass
class LogConfig:
    every: int = option(1, "write metrics every N steps", ge=1)
    tensorboard: bool = option(True, "also write TensorBoard events (a view of metrics.jsonl)")
    progress: bool = option(True, "show a progress bar with the live reward / success rate")


@dataclass
class CheckpointConfig:
    every: int = option(0, "write a checkpoint every N steps (0 = only at the end and on SIGTERM/SIGINT)", ge=0)
    keep: int = option(2, "checkpoints kept on disk (oldest are deleted)", ge=1)


@dataclass
class TrainConfig:
    name: str = option("run", "run name, used for the default run directory")
    seed: int = option(0, "seed of every random choice in the run", ge=0)
    total_steps: int = option(100, "training steps (one rollout + its updates each)", ge=0)
    run_dir: str | None = option(None, "output directory (default runs/<name>)")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps", choices=None)
    mixed_precision: Literal["no", "fp16", "bf16"] = option("no", "accelerate mixed precision")
    env: EnvConfig | None = option(None, "environment section (env samplers)")
    policy: PolicyConfig = option(factory=lambda: PolicyConfig(type=""), doc="policy section")
    sampler: SamplerConfig = option(factory=lambda: SamplerConfig(type=""), doc="sampler section (algo.type sft may leave it out: no rollouts, evaluation by the data source)")
    rewards: list[RewardConfig] = option(factory=list, doc="reward components, each with a type and a weight")
    algo: AlgoConfig = option(factory=AlgoConfig, doc="the group-relative core: advantage, filters, objective, aggregation, KL")
    data: DataSourceConfig = option(factory=DemonstrationsConfig, doc="where algo.type: sft takes its batches (data.type: demonstrations, completions, preferences)")
    critic: CriticConfig = option(factory=CriticConfig, doc="the value network of an advantage that reads values (algo.advantage.type: gae)")
    rollout: RolloutConfig = option(factory=RolloutConfig, doc="rollout workers: sync or async, where they run, how stale a sample may be")
    optim: OptimConfig = option(factory=OptimConfig, doc="optimizer")
    eval: EvalConfig = option(factory=EvalConfig, doc="evaluation")
    log: LogConfig = option(factory=LogConfig, doc="logging")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="checkpoints")

    def validate(self, path: str) -> None:
        if not self.policy.type:
            raise ConfigError("policy.type", None, "required; see `mmrl list policies`")
        if not self.sampler.type and self.algo.type == "rl":
            raise ConfigError("sampler.type", None, "required; env or prompt (only algo.type sft may go without: its evaluation is then the data source's)")
        if self.algo.type == "sft":
            if not self.data.path:
                raise ConfigError("data.path", None, f"algo.type sft needs data: the {self.data.type} source reads data.path")
        elif not self.rewards:
            raise ConfigError("rewards", [], "at least one reward component is required; see `mmrl list rewards`")
        if self.algo.type == "rl":
            loss = self.algo.loss.type
            check_requirements(loss, LOSSES.get(loss, "algo.loss.type").requires, self)
        intervener = getattr(self.sampler, "intervener", None)
        if intervener is not None and (self.algo.type != "rl" or not LOSSES.entry(self.algo.loss.type, "algo.loss.type").traits.get("trains_from_buffer", False)):
            raise ConfigError("sampler.intervener", intervener.type, f"an intervener's actions carry no log-prob for algo.loss {self.algo.loss.type!r} to learn from: use a loss that trains from the replay buffer (sac), or null")
        self._validate_rollout()
        self._validate_critic()
        if self.device not in ("auto", "cpu", "mps") and not self.device.startswith("cuda"):
            raise ConfigError("device", self.device, "allowed: auto, cpu, cuda, cuda:N, mps")

    def _validate_rollout(self) -> None:
        ro, algo = self.rollout, self.algo
        ENGINES.entry(ro.engine, "rollout.engine")
        if algo.type == "sft" and ro.mode == "async":
            raise ConfigError("rollout.mode", "async", "algo.type sft samples nothing; use mode: sync")
        if ro.num_workers and algo.reuse_sampling_graph is True:
            raise ConfigError("algo.reuse_sampling_graph", True, f"the sampling graph cannot leave a worker process (rollout.workers: {ro.num_workers}); use auto or false")
        check_refill_rounds(ro, algo.resample_rounds)
        if ro.mode == "async" and ro.schedule == "free" and ro.stale == "correct" and algo.correction.type == "none" and algo.objective.type != "decoupled_ppo":
            raise ConfigError("rollout.stale", "correct", "keeps stale samples for a correction to weight: set algo.correction (tis, mis) or algo.objective decoupled_ppo, or use stale: drop")
        if ro.over_provision > 1:
            self._validate_partial_rollouts()

    def _validate_critic(self) -> None:
        from mmrl.registry import SAMPLERS

        kind = self.algo.advantage.type
        needs = ADVANTAGES.entry(kind, "algo.advantage.type").traits.get("needs_values", False) and self.algo.type == "rl"
        if needs and self.critic.type == "none":
            raise ConfigError("critic.type", "none", f"algo.advantage.type {kind} learns a value baseline: set critic.type to mlp (a network of its own) or value_head (on the policy's features)")
        if not needs and self.critic.type != "none":
            raise ConfigError("critic.type", self.critic.type, f"nothing reads its values: algo.advantage.type {kind} is group-relative (gae trains a critic); use none")
        if needs:
            sampler = SAMPLERS.get(self.sampler.type, "sampler.type")
            if not getattr(sampler, "records_step_rewards", False):
                raise ConfigError(
                    "algo.advantage.type", kind,
                    f"GAE runs over the decisions of env episodes and their step rewards; sampler.type {self.sampler.type!r} records none (a prompt sampler's sample is one outcome: use a group-relative advantage)",
                )
            if getattr(self.algo.advantage, "bootstrap_truncated", False) and not getattr(sampler, "records_final_replay", False):
                raise ConfigError(
                    "algo.advantage.bootstrap_truncated", True,
                    f"bootstraps from the final observation of an episode a time limit cut (info['final_replay']), which sampler.type {self.sampler.type!r} does not record: use false, or a sampler that does (env)",
                )

    def _validate_partial_rollouts(self) -> None:
        from mmrl.core.policy import overrides
        from mmrl.registry import POLICIES, SAMPLERS

        ro, algo, o = self.rollout, self.algo, self.rollout.over_provision
        sampler = SAMPLERS.get(self.sampler.type, "sampler.type") if self.sampler.type else None
        if algo.type == "sft" or sampler is None or not getattr(sampler, "partial_rollouts", False):
            raise ConfigError("rollout.over_provision", o, f"sampler.type {self.sampler.type or '(none)'!r} cannot carry unfinished samples to the next step; partial rollouts need a sampler that can (prompt, env), or 1")
        policy = POLICIES.get(self.policy.type, "policy.type") if self.policy.type else None
        need = getattr(sampler, "partial_rollouts_need", None)
        if need is not None and (policy is None or not overrides(policy, need)):
            raise ConfigError("rollout.over_provision", o, f"policy.type {self.policy.type!r} cannot pause a sample and continue it; partial rollouts need a policy with sample_partial (text_lm, text_vlm), or 1")
        if need is not None:
            policy.check_partial_rollouts(self.policy)  # what of the policy's options pausing needs (a text policy's generation backend)
        if algo.resample_rounds:
            raise ConfigError("rollout.over_provision", o, f"refill rounds (algo.resample_rounds: {algo.resample_rounds}) and partial rollouts both decide which groups a step trains on: use one of them")
        if algo.reuse_sampling_graph is True:
            raise ConfigError("algo.reuse_sampling_graph", True, "a partial rollout's earlier tokens were sampled in earlier steps, without a graph: use auto or false with rollout.over_provision")
