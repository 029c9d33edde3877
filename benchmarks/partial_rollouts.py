"""Partial rollouts (``rollout.over_provision``, APRIL) against whole-batch decoding, on text
with a long tail of completion lengths; ratios measured in one run.

    python benchmarks/partial_rollouts.py                         # over_provision 1 (baseline), 1.5, 2
    python benchmarks/partial_rollouts.py --over-provision 1 2 --updates 12 --mean-length 48

The policy is a from-config text_lm (``--hidden``, ``--layers``) over the arithmetic prompts,
whose EOS logit is raised so that a completion ends at each token with probability about
1 / ``--mean-length``: lengths are roughly geometric, capped at ``--max-new-tokens``, the
long tail that reasoning models show (most completions are short, a few run to the cap and
hold the whole batch's decoding back). Each mode is a Trainer running GRPO updates in this
process; the modes' steps are interleaved (step k of every mode, then step k + 1), so machine
noise hits them alike. Prints, per mode, seconds per update, trained completion tokens per
second, the mean trained completion length, and the share of trained samples that
were continued from an earlier step; then each mode's ratios against the first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmrl.config import from_dict
from mmrl.core.component_config import RewardConfig
from mmrl.policies.text_lm import TextLMConfig, TextLMPolicy
from mmrl.registry import POLICIES, REWARDS
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EOS_BIAS = {"value": 0.0}


@POLICIES.register("_bench_long_tail_lm", config=TextLMConfig)
class LongTailLM(TextLMPolicy):
    """text_lm with its EOS logit raised by ``EOS_BIAS`` (set from --mean-length)."""

    def forward_logits(self, ids, mask, cache=None, logits_to_keep: int = 0, **model_inputs):
        logits = super().forward_logits(ids, mask, cache=cache, logits_to_keep=logits_to_keep, **model_inputs)
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[list(self.sampling.eos_token_ids)] = EOS_BIAS["value"]
        return logits + bias


@REWARDS.register("_bench_digit_fraction", config=RewardConfig)
def _digit_fraction(rollout, cfg):
    texts = rollout.info["completions"]
    return torch.tensor([sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts])


def config(args, over_provision: float) -> TrainConfig:
    return from_dict(TrainConfig, {
        "name": "partial_rollouts", "seed": 0, "total_steps": args.updates,
        "policy": {"type": "_bench_long_tail_lm", "tiny": {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": 4, "intermediate_size": 2 * args.hidden},
                   "generation": {"max_new_tokens": args.max_new_tokens}},
        "sampler": {"type": "prompt", "batch_groups": args.groups, "data": {"train": str(ROOT / "examples/arithmetic/train.jsonl")}},
        "rewards": [{"type": "_bench_digit_fraction"}],
        "algo": {"group_size": args.group_size, "groups_per_step": args.groups}, "optim": {"lr": args.lr},
        "rollout": {"over_provision": over_provision},
        "eval": {"at_start": False, "at_end": False, "every": 0}, "checkpoint": {"every": 0},
        "log": {"progress": False, "tensorboard": False},
    })


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--over-provision", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    p.add_argument("--updates", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="first updates left out (start-up; the first partial step starts every group fresh)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--mean-length", type=float, default=32.0)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--lr", type=float, default=1e-9, help="Adam's step: by default too small to move the weights, so the length distribution stays put and the modes decode the same work (the update's compute is the same)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()

    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for o in args.over_provision:
            trainers[o] = Trainer(config(args, o), Path(tmp) / f"o{o}")
        vocab = len(next(iter(trainers.values())).policy.tokenizer)
        # P(EOS) = e^b / (e^b + V - 1) at a random model's near-uniform logits: b for 1 / mean-length
        EOS_BIAS["value"] = math.log((vocab - 1) / (args.mean_length - 1))
        rows: dict[float, list[dict]] = {o: [] for o in trainers}
        for step in range(args.updates):
            for o, trainer in trainers.items():
                t0 = time.perf_counter()
                metrics = trainer.rl_step(step)
                seconds = time.perf_counter() - t0
                if step >= args.skip:
                    samples = args.groups * args.group_size
                    rows[o].append({"s": seconds, "tokens": metrics["completion_length"] * samples, "length": metrics["completion_length"],
                                    "resumed": metrics.get("partial/resumed_rate", 0.0), "span": metrics.get("partial/version_span", 0.0)})
        for trainer in trainers.values():
            trainer.metrics.close()

    print(f"# partial rollouts: {args.groups} groups x {args.group_size} per update, completion lengths ~ geometric(mean {args.mean_length:g}) capped at "
          f"{args.max_new_tokens}; text_lm {args.layers} layers x {args.hidden}; {args.updates} updates (first {args.skip} left out); "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| over_provision | s/update (median) | trained tokens/s | mean trained length | continued samples | version span |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for o, r in rows.items():
        s = statistics.median(x["s"] for x in r)
        tps = sum(x["tokens"] for x in r) / sum(x["s"] for x in r)
        summary[o] = (s, tps)
        print(f"| {o:g} | {s:.2f} | {tps:.0f} | {statistics.mean(x['length'] for x in r):.1f} | {statistics.mean(x['resumed'] for x in r):.2f} | "
              f"{statistics.mean(x['span'] for x in r):.2f} |")
    base = next(iter(summary))
    for o in list(summary)[1:]:
        print(f"ratio over_provision {o:g} / {base:g}: updates per hour {summary[base][0] / summary[o][0]:.2f}, trained tokens/s {summary[o][1] / summary[base][1]:.2f}")


if __name__ == "__main__":
    main()
