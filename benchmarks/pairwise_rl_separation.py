"""Does a learned reward still rank a policy's samples as the verifier does?

For each weights directory (an asset, a run directory) given, builds the policy of
configs/image_shapes_flow_grpo_pairwise.yaml with those weights, samples 16 stochastic images
per train and per held-out prompt (stream step 100, away from training's), scores them by
the config's two rewards (the pairwise model, the verifier) and prints the verifier
accuracy, the mean learned score, the mean score of verifier-correct and -wrong images and
the AUC (the probability that a correct image outscores a wrong one).

    .venv/bin/python benchmarks/pairwise_rl_separation.py assets/shapes_flow_sft runs/image_shapes_flow_grpo_pairwise

A reward that learns during RL (``adversarial``) starts untrained; ``--reward-state RUN``
loads the reward state of RUN's latest checkpoint (its discriminator) first.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from mmrl import registry
from mmrl.config import load_config
from mmrl.core.sampler import sampler_context
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.weights import build_policy
from mmrl.train.run_config import TrainConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", nargs="+", help="asset, run or checkpoint directories to load as policy.pretrained")
    parser.add_argument("--config", default="configs/image_shapes_flow_grpo_pairwise.yaml", help="run config: policy, prompts, and the rewards [learned, verifier]")
    parser.add_argument("--samples", type=int, default=16, help="images per prompt")
    parser.add_argument("--reward-state", default=None, help="a run directory whose latest checkpoint's reward state the rewards load (a discriminator trained during RL)")
    args = parser.parse_args()
    for weights in args.weights:
        cfg = load_config(TrainConfig, args.config, [f"policy.pretrained={weights}"])
        rewards = RewardSet(cfg.rewards, "weighted_sum", RewardContext(device=torch.device("cpu"), run_dir=Path("."), seed=0))
        if args.reward_state:
            from mmrl.core.weights import CHECKPOINT_STATE, latest_checkpoint

            rewards.load_state_dict(torch.load(latest_checkpoint(args.reward_state) / CHECKPOINT_STATE, weights_only=True)["rewards"])
        for split, source in (("train", cfg.sampler.data.train), ("held_out", cfg.sampler.data.eval)):
            sampler = registry.SAMPLERS.get("prompt")(dataclasses.replace(cfg.sampler, data=dataclasses.replace(cfg.sampler.data, train=source, eval=None)), sampler_context(cfg))
            torch.manual_seed(0)
            policy = build_policy(cfg.policy, sampler.policy_spec()).eval()
            with torch.no_grad():
                rollout = sampler.collect(policy, len(sampler.data.train), args.samples, 100)
                scores = rewards.score(rollout).numpy()
            learned, verifier = scores[:, 0], scores[:, 1]
            ok, bad = learned[verifier == 1], learned[verifier == 0]
            auc = float((ok[:, None] > bad[None, :]).mean()) if len(ok) and len(bad) else float("nan")
            print(f"{weights} {split}: n={len(learned)} verifier={verifier.mean():.3f} score={learned.mean():.3f} (sd {learned.std():.2f}) "
                  f"score|correct={ok.mean():.3f} score|wrong={bad.mean():.3f} AUC={auc:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
