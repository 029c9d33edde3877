"""``TrainConfig``: everything a run needs, one docstring'd field at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import Component, option
from mmrl.env_wrappers import WrapperConfig
from mmrl.errors import ConfigError


@dataclass
class EnvConfig(Component):
    """Base of env sections; the ``type`` picks an adapter from ``mmrl list envs``."""

    id: str = option("", "environment id (a gymnasium id, or the simulator's own task id)")
    num_envs: int = option(8, "parallel environments in the vector env", ge=1)
    vectorization: Literal["sync", "async"] = option("sync", "gymnasium vector env kind (async = one process per env)")
    max_episode_steps: int | None = option(None, "override of the env's time limit (null keeps the env's own)", ge=1)
    success_key: str | None = option(None, "info key of the env's per-step success flag (null = the first the env reports of: success, is_success, succeed)")
    wrappers: list[WrapperConfig] = option(
        factory=list, doc="gymnasium wrappers applied to each single env before vectorization, first innermost: [{type: 'package.module:Class', kwargs: {...}}]"
    )


@dataclass
class PolicyConfig(Component):
    """Base of policy sections; the ``type`` picks a family from ``mmrl list policies``."""

    pretrained: str | None = option(None, "local directory of saved weights (config.yaml + model.safetensors) to start from")


@dataclass
class SamplerConfig(Component):
    """Base of sampler sections: ``env`` (simulators) or ``prompt`` (prompts/conditions)."""


@dataclass
class RewardConfig(Component):
    """Base of reward components; the ``type`` picks one from ``mmrl list rewards``."""

    weight: float = option(1.0, "weight of this component in the reward sum")


@dataclass
class DataConfig:
    path: str | None = option(None, "directory of demonstrations written by `mmrl collect` (algo.type: sft)")
    batch_size: int = option(64, "sft: samples per optimizer step (over all processes)", ge=1)
    max_episodes_per_task: int | None = option(None, "sft: use only the first N demonstrations of each task (few-shot SFT)", ge=1)


@dataclass
class AlgoConfig:
    type: Literal["rl", "sft"] = option(
        "rl", "rl: the group-relative policy-gradient loop; sft: behaviour cloning / supervised fine-tuning on data.path"
    )
    group_size: int = option(8, "G: samples per prompt / initial state (MC-GRPO: G+1)", ge=1)
    groups_per_step: int = option(8, "groups collected per training step (over all processes)", ge=1)
    advantage: str = option("grpo", "advantage estimator (mmrl list advantages)")
    std: Literal["group", "batch", "none"] = option("group", "advantage scale: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)")
    ddof: int = option(0, "delta degrees of freedom of the std (0 population as Flow-GRPO, 1 Bessel as TRL/verl)", ge=0, le=1)
    adv_eps: float = option(1e-6, "epsilon added to the std (TRL 1e-4, verl 1e-6)", gt=0)
    psr_weight: float = option(0.1, "psr_nsr: advantage of positive samples (W-REINFORCE lambda)", ge=0)
    nsr_weight: float = option(1.0, "psr_nsr: magnitude of the negative samples' advantage", ge=0)
    adv_clip: float | None = option(None, "clip advantages to [-adv_clip, adv_clip] (null = no clip)", gt=0)
    multi_reward: Literal["sum_then_normalize", "normalize_then_sum"] = option(
        "sum_then_normalize", "several reward components: weighted sum then advantage, or per-component advantages then sum"
    )
    filters: list[str] = option(factory=list, doc="group filters applied before the update (zero_variance, accuracy_band)")
    accuracy_lo: float = option(0.1, "accuracy_band: lowest group mean reward kept", ge=0)
    accuracy_hi: float = option(0.9, "accuracy_band: highest group mean reward kept", ge=0)
    resample_rounds: int = option(0, "extra collection rounds to refill the batch after filtering (DAPO dynamic sampling)", ge=0)
    objective: str = option("ppo_clip", "per-decision surrogate (mmrl list objectives)")
    eps_low: float = option(0.2, "lower clip range of the importance ratio", ge=0)
    eps_high: float = option(0.2, "upper clip range (DAPO clip-higher 0.28; CISPO absolute cap)", ge=0)
    dual_clip: float | None = option(None, "dual-clip constant c for negative advantages (null = off)", gt=1)
    behav_weight_cap: float = option(5.0, "decoupled_ppo: behaviour weights above this are zeroed", gt=0)
    log_ratio_clamp: float = option(20.0, "log-ratios are clamped to +-this before exp", gt=0)
    aggregation: str = option("token_mean", "how per-decision losses become one number (mmrl list aggregations)")
    max_len: int | None = option(None, "const_norm: the fixed length L divided by (null = longest in batch)", ge=1)
    kl_coef: float = option(0.0, "weight of the KL to the reference policy (0 = no reference kept)", ge=0)
    kl_estimator: str = option("k3", "KL estimator: k1, k2 or k3")
    kl_in_reward: bool = option(False, "subtract coef * sum_t KL from the reward instead of adding a loss term")
    top_entropy_rho: float | None = option(None, "train only the top-rho fraction of decisions by entropy (80/20 rule)", gt=0, le=1)
    mask_truncated: bool = option(False, "drop samples that were truncated (no EOS / time limit) from the loss")
    advantage_level: Literal["sequence", "step"] = option(
        "sequence", "sequence: one advantage per sample; step: per decision, from group-relative returns-to-go (env samplers)"
    )
    step_reward_weight: float = option(0.0, "step level: weight of the env's per-step rewards added to the returns-to-go", ge=0)
    gamma: float = option(1.0, "step level: discount of the returns-to-go", ge=0, le=1)
    ppo_epochs: int = option(1, "passes over each rollout", ge=1)
    num_minibatches: int = option(1, "minibatches per epoch (whole groups are never split across processes)", ge=1)
    replay_size: int = option(
        0, "self-imitation (SIL, Oh et al. 2018): keep up to this many positive-advantage samples of past steps and, after each update, take replay_steps optimizer steps of -A+ logpi on replay_batch of them (0 = off)", ge=0
    )
    replay_steps: int = option(4, "self-imitation optimizer steps after each update", ge=1)
    replay_batch: int = option(64, "samples drawn from the memory per self-imitation step", ge=1)
    replay_loss: Literal["logp", "sft"] = option(
        "logp", "self-imitation loss: -A+ logpi of the replayed decisions, or the policy's own supervised loss (flow matching, token cross-entropy) on the executed actions, weighted by A+"
    )
    micro_batches: int = option(1, "gradient accumulation: each minibatch's forward/backward runs in this many pieces before its one optimizer step (same update, less memory)", ge=1)

    def validate(self, path: str) -> None:
        from mmrl import registry

        p = f"{path}." if path else ""
        registry.ADVANTAGES.entry(self.advantage, p + "advantage")
        registry.OBJECTIVES.entry(self.objective, p + "objective")
        registry.AGGREGATIONS.entry(self.aggregation, p + "aggregation")
        registry.KL_ESTIMATORS.entry(self.kl_estimator, p + "kl_estimator")
        for i, name in enumerate(self.filters):
            registry.FILTERS.entry(name, f"{p}filters[{i}]")
        if self.accuracy_lo > self.accuracy_hi:
            raise ConfigError(p + "accuracy_lo", self.accuracy_lo, f"must be <= accuracy_hi ({self.accuracy_hi})")
        if self.advantage in ("grpo", "rloo", "median") and self.group_size < 2:
            raise ConfigError(p + "group_size", self.group_size, f"must be >= 2 for the group-relative advantage {self.advantage!r}")


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
    sampler: SamplerConfig = option(factory=lambda: SamplerConfig(type=""), doc="sampler section")
    rewards: list[RewardConfig] = option(factory=list, doc="reward components, each with a type and a weight")
    algo: AlgoConfig = option(factory=AlgoConfig, doc="the group-relative core: advantage, filters, objective, aggregation, KL")
    data: DataConfig = option(factory=DataConfig, doc="demonstrations for algo.type: sft")
    optim: OptimConfig = option(factory=OptimConfig, doc="optimizer")
    eval: EvalConfig = option(factory=EvalConfig, doc="evaluation")
    log: LogConfig = option(factory=LogConfig, doc="logging")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="checkpoints")

    def validate(self, path: str) -> None:
        if not self.policy.type:
            raise ConfigError("policy.type", None, "required; see `mmrl list policies`")
        if not self.sampler.type:
            raise ConfigError("sampler.type", None, "required; env or prompt")
        if self.algo.type == "sft":
            if not self.data.path:
                raise ConfigError("data.path", None, "algo.type sft needs a directory of demonstrations (written by `mmrl collect`)")
        elif not self.rewards:
            raise ConfigError("rewards", [], "at least one reward component is required; see `mmrl list rewards`")
        if self.device not in ("auto", "cpu", "mps") and not self.device.startswith("cuda"):
            raise ConfigError("device", self.device, "allowed: auto, cpu, cuda, cuda:N, mps")
