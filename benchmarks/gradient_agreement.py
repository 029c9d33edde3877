"""Does one update's batch carry a learning signal? Gradient agreement of a training config.

Draws ``--batches`` independent training batches at the config's initial weights (e.g. an
SFT checkpoint through ``policy.pretrained=...``), exactly as ``mmrl train`` would, and
prints the cosine similarity between their policy gradients (at ratio 1), overall and per
module, with each batch's success rate, mean entropy per decision and the fraction of
samples with a non-zero group-relative advantage. A cosine near 1: the batch pins the
gradient down. Near 0: an update is mostly noise (see mmrl.train.diagnostics).

    .venv/bin/python benchmarks/gradient_agreement.py configs/tabletop_token_vla_grpo.yaml \
        policy.pretrained=runs/tabletop_token_vla_sft --batches 3
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from mmrl.config import load_config
from mmrl.train.run_config import TrainConfig
from mmrl.train.diagnostics import gradient_agreement
from mmrl.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for mmrl train")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(TrainConfig, args.config, args.overrides + ["log.progress=false", "log.tensorboard=false"])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        result = gradient_agreement(trainer, args.batches, first_step=1000)
        trainer.sampler.close()
    batch = cfg.algo.groups_per_step * cfg.algo.group_size
    print(f"{cfg.name}: {args.batches} batches of {batch} samples")
    for i, stats in enumerate(result["batches"]):
        print(f"  batch {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))
    print(f"gradient cosine between batches: {result['cosine']:+.3f} (pairs " + " ".join(f"{c:+.3f}" for c in result["pairs"]) + f"), |g| {result['grad_norm']:.3g}")
    for module, value in result["modules"].items():
        print(f"  {module:32s} {value:+.3f}")


if __name__ == "__main__":
    main()
