"""GRPO on a text config, mmrl against TRL's ``GRPOTrainer``, side by side in one run.

Both start from the same weights (the config's ``policy.pretrained`` run, e.g. the SFT model
of ``configs/text_arithmetic_sft.yaml``, or ``--init``), train on the same prompt set with the
same group size, prompts per update, number of updates, completion budget, temperature,
learning rate, clip range, KL coefficient and loss normalisation — the TRL settings are
derived from the mmrl config, and a config TRL cannot express is refused — and are then
scored by one evaluation: mmrl's greedy held-out evaluation with the config's rewards, run
on each trained model. TRL's reward function is the same reward set, so both optimise the
same number.

Prints, per trainer, the wall-clock per update (generation + loss + optimizer step, after
one warm-up update that is not counted) and the held-out accuracy after the updates, then
mmrl's speed-up (target ≥ 1.5×) and the accuracy difference (target ≥ 0). TRL runs on the
CPU with its defaults except where the mmrl config says otherwise; its gradient
checkpointing is switched off (mmrl does not checkpoint a tiny model either).

    .venv/bin/python benchmarks/trl_side_by_side.py configs/text_arithmetic_grpo.yaml \\
        [--updates 20] [--seeds 0 1 2] [override ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmrl.config import load_config
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.train.run_config import TrainConfig

# mmrl aggregation -> TRL loss_type with the same normalisation of the per-token losses
_LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}


def trl_arguments(cfg: TrainConfig, output_dir: str, updates: int, seed: int) -> dict:
    """GRPOConfig keyword arguments that mirror ``cfg``; ValueError for what TRL cannot express."""
    algo, gen = cfg.algo, cfg.policy.generation
    problems = []
    if algo.advantage.type != "grpo" or algo.advantage.std not in ("group", "none"):
        problems.append(f"algo.advantage ({algo.advantage.type}, std {getattr(algo.advantage, 'std', None)}): TRL has the group mean with group or no std")
    if algo.objective.type != "ppo_clip":
        problems.append(f"algo.objective.type {algo.objective.type}: TRL's GRPO loss is PPO-clip")
    if algo.aggregation.type not in _LOSS_TYPES:
        problems.append(f"algo.aggregation.type {algo.aggregation.type}: expected one of {sorted(_LOSS_TYPES)}")
    if algo.filters or algo.resample_rounds or algo.self_imitation.size:
        problems.append("algo.filters / resample_rounds / self_imitation have no TRL counterpart here")
    if algo.kl.coef and algo.kl.type != "k3":
        problems.append(f"algo.kl.type {algo.kl.type}: TRL's KL term is k3")
    if gen.stop_strings or gen.chat_template:
        problems.append("policy.generation.stop_strings / chat_template: keep the comparison to EOS-terminated plain prompts")
    if problems:
        raise ValueError("; ".join(problems))
    batch = algo.group_size * algo.groups_per_step
    eps_high = algo.objective.eps_high
    return dict(
        output_dir=output_dir, use_cpu=True, seed=seed, max_steps=updates * algo.num_minibatches * algo.ppo_epochs,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1],
        adam_epsilon=cfg.optim.adam_eps, weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.max_grad_norm or 0.0,
        num_generations=algo.group_size, per_device_train_batch_size=batch // algo.num_minibatches,
        steps_per_generation=algo.num_minibatches, num_iterations=algo.ppo_epochs,
        max_completion_length=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=0,
        epsilon=algo.objective.eps_low, epsilon_high=eps_high, beta=algo.kl.coef if algo.kl.coef else 0.0,
        loss_type=_LOSS_TYPES[algo.aggregation.type], scale_rewards="group" if algo.advantage.std == "group" else "none",
        mask_truncated_completions=algo.mask_truncated, gradient_checkpointing=False, disable_dropout=True,
        report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=10**6, dataloader_num_workers=0,
    )


def reward_function(rewards):
    """TRL's reward-function signature over mmrl's reward set: the same combined reward."""

    def score(prompts, completions, answer, **columns):
        n = len(completions)
        rollout = Rollout(
            group_id=torch.zeros(n, dtype=torch.long), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={},
            info={"prompt": list(prompts), "completions": list(completions), "answer": list(answer), "record_id": list(range(n)), "metadata": [{} for _ in range(n)]},
        )
        return rewards.combine(rewards.score(rollout), rollout.group_id).tolist()

    score.__name__ = "mmrl_rewards"
    return score


def new_trainer(cfg: TrainConfig, run_dir: Path):
    """An mmrl Trainer, after forgetting the accelerate state a TRL run left in this process."""
    from accelerate.state import AcceleratorState

    from mmrl.train.trainer import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    return Trainer(cfg, run_dir)


def run_mmrl(cfg: TrainConfig, run_dir: Path) -> tuple[float, object]:
    """Train with mmrl; seconds per update after the first, and the trainer."""
    trainer = new_trainer(cfg, run_dir)
    stamps = []
    original = trainer.rl_step

    def timed_step(*args, **kwargs):
        out = original(*args, **kwargs)
        stamps.append(time.perf_counter())
        return out

    trainer.rl_step = timed_step
    trainer.train()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), trainer


def run_trl(cfg: TrainConfig, trainer, updates: int, seed: int, out: Path) -> tuple[float, torch.nn.Module]:
    """Train TRL's GRPOTrainer from the same initial weights; seconds per update after the first."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = copy.deepcopy(trainer.initial_language_model)
    data = trainer.sampler.data.train
    dataset = Dataset.from_list([{"prompt": r.prompt, "answer": str(r.answer)} for r in data])
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = GRPOConfig(**trl_arguments(cfg, str(out), updates, seed))
    grpo = GRPOTrainer(model=model, reward_funcs=[reward_function(trainer.rewards)], args=args, train_dataset=dataset,
                       processing_class=trainer.policy.tokenizer, callbacks=[Stamp()])
    grpo.train()
    # an update is num_minibatches * ppo_epochs optimizer steps, the first of which generates:
    # time whole updates, from the end of the first to the end of the last
    steps_per_update = cfg.algo.num_minibatches * cfg.algo.ppo_epochs
    return (stamps[-1] - stamps[steps_per_update - 1]) / (updates - 1), grpo.model


def held_out_accuracy(trainer, language_model: torch.nn.Module) -> float:
    """mmrl's deterministic held-out evaluation of ``language_model``'s weights."""
    policy = trainer.policy
    saved = {k: v.clone() for k, v in policy.language_model.state_dict().items()}
    policy.language_model.load_state_dict(language_model.state_dict())
    try:
        policy.eval()
        with torch.no_grad():
            metrics = trainer.sampler.evaluate(policy, trainer.cfg.eval.episodes, seed=trainer.cfg.seed + 1_000_003, rewards=trainer.rewards)
    finally:
        policy.language_model.load_state_dict(saved)
    return metrics["accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config, as for mmrl train")
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--init", help="pretrained weights (a run or weights directory); default: the config's policy.pretrained")
    args = parser.parse_args()
    if args.updates < 2:
        parser.error("--updates must be >= 2 (the first update is a warm-up, not timed)")

    overrides = list(args.overrides) + [f"total_steps={args.updates}", "log.progress=false", "log.tensorboard=false", "eval.every=0", "eval.at_end=false", "checkpoint.every=0"]
    if args.init:
        overrides.append(f"policy.pretrained={args.init}")
    rows = []
    for k, seed in enumerate(args.seeds):
        cfg = load_config(TrainConfig, args.config, overrides + [f"seed={seed}"])
        trl_arguments(cfg, "-", args.updates, seed)  # refuse what TRL cannot express before training
        with tempfile.TemporaryDirectory() as tmp:
            probe = new_trainer(cfg, Path(tmp) / "initial")
            probe.initial_language_model = copy.deepcopy(probe.policy.language_model)
            before = held_out_accuracy(probe, probe.initial_language_model)
            # alternate which trainer runs first, so a change in the machine's load between
            # the two halves does not always favour the same one
            order = ("mmrl", "trl") if k % 2 == 0 else ("trl", "mmrl")
            for which in order:
                if which == "mmrl":
                    mmrl_seconds, trainer = run_mmrl(cfg, Path(tmp) / "mmrl")
                    mmrl_accuracy = held_out_accuracy(probe, trainer.policy.language_model)
                else:
                    trl_seconds, trl_model = run_trl(cfg, probe, args.updates, seed, Path(tmp) / "trl")
                    trl_accuracy = held_out_accuracy(probe, trl_model)
        rows.append((seed, before, mmrl_seconds, mmrl_accuracy, trl_seconds, trl_accuracy))
        print(f"seed {seed}: start {before:.3f} | mmrl {mmrl_seconds:.2f} s/update, held-out {mmrl_accuracy:.3f} | "
              f"TRL {trl_seconds:.2f} s/update, held-out {trl_accuracy:.3f} | speed-up {trl_seconds / mmrl_seconds:.2f}x", flush=True)

    speedups = [r[4] / r[2] for r in rows]
    print(f"{len(rows)} seed(s), {args.updates} updates, {torch.get_num_threads()} threads")
    print(f"mean held-out accuracy: start {statistics.mean(r[1] for r in rows):.3f}, mmrl {statistics.mean(r[3] for r in rows):.3f}, TRL {statistics.mean(r[5] for r in rows):.3f} "
          f"(mmrl - TRL {statistics.mean(r[3] - r[5] for r in rows):+.3f}; target >= 0)")
    print(f"speed-up, TRL s/update over mmrl s/update: mean {statistics.mean(speedups):.2f}x (target >= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
