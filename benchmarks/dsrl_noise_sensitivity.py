"""How much a frozen flow or diffusion policy listens to its initial noise: what DSRL can
steer. For a DSRL config (its ``policy.policy`` is the frozen policy), on ``--states`` initial
observations of the config's env, decode ``--noises`` initial noises drawn from N(0, s²) for
each scale s, and print the standard deviation across noises of the decoded chunk's actions
(env units, averaged over states, chunk steps and action dims) and its largest value.

    python benchmarks/dsrl_noise_sensitivity.py configs/tabletop_spatial_flow_dsrl.yaml
    python benchmarks/dsrl_noise_sensitivity.py configs/tabletop_spatial_flow_dsrl.yaml policy.policy.pretrained=runs/my_start

A start whose chunks hardly change within the noise policy's ``noise_bound`` leaves DSRL
nothing to choose between (docs/dsrl.md, "Measured so far").
"""

from __future__ import annotations

import argparse

import torch

from mmrl.config import load_config
from mmrl.core.sampler import build_sampler
from mmrl.core.weights import build_policy
from mmrl.train.run_config import TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a DSRL run config (policy.type: dsrl)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config")
    parser.add_argument("--states", type=int, default=8, help="initial observations (env resets)")
    parser.add_argument("--noises", type=int, default=16, help="initial noises per observation and scale")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.5, 2.5], help="std of the noises")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cfg = load_config(TrainConfig, args.config, [*args.overrides, f"env.num_envs={args.states}"])
    torch.manual_seed(args.seed)
    sampler = build_sampler(cfg)
    try:
        base = build_policy(cfg.policy, sampler.policy_spec()).base
        seeds = list(range(10_000 + args.seed, 10_000 + args.seed + args.states))
        obs, _ = sampler.env_call("reset", seeds, seed=seeds)
        inputs = sampler.observation(obs, torch.device("cpu"))
    finally:
        sampler.close()
    generator = torch.Generator().manual_seed(args.seed)
    print(f"# {args.config} {' '.join(args.overrides)}: {args.states} initial states x {args.noises} noises, noise shape {tuple(base.noise_shape)}")
    print("| noise | mean std of the actions across noises | largest |")
    print("|---|---|---|")
    for scale in args.scales:
        chunks = []
        with torch.no_grad():
            for _ in range(args.noises):
                noise = scale * torch.randn(args.states, *base.noise_shape, generator=generator)
                chunks.append(base.sample_from_noise(inputs, noise).output.float())
        std = torch.stack(chunks).std(dim=0)  # [states, chunk, action]
        print(f"| N(0, {scale:g}²) | {std.mean():.3f} | {std.max():.3f} |")


if __name__ == "__main__":
    main()
