"""EnvSampler throughput vs stepping the same vector env by hand with the same policy forward.

The hand loop is what a minimal GRPO script does per wave: a seeded reset (the G copies of a
group share the seed), then policy forward → clip → ``env.step`` until every episode has
ended. The EnvSampler additionally records masks, returns, success, step rewards and the
replay the trainer needs. Prints env steps/s of both and their ratio (target ≥ 0.95).

    .venv/bin/python benchmarks/rollout_overhead.py                       # Reacher-v5 (MuJoCo), 16 envs
    .venv/bin/python benchmarks/rollout_overhead.py --env maniskill:PushCube-v1 --num-envs 8
    .venv/bin/python benchmarks/rollout_overhead.py --env maniskill:PushCube-v1 --sim-backend gpu --device cuda --num-envs 1024
    .venv/bin/python benchmarks/rollout_overhead.py --env tabletop_warp:spatial --num-envs 256   # MuJoCo Warp worlds, state

``tabletop_warp:TASK`` is the tabletop suite in one batch of MuJoCo Warp worlds (state
observations; ``--sim-backend cuda`` puts the worlds on CUDA), stepped by hand on the state
tensor. A simulator that returns torch tensors (ManiSkill's GPU backend, MuJoCo Warp) is
stepped by hand with torch ops on its device, as the sampler does; what both leave on the host is one
``alive.any()`` per env step (the loop's stopping test).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from mmrl.config import from_dict
from mmrl.core.sampler import sampler_context
from mmrl.core.weights import build_policy
from mmrl.registry import SAMPLERS
from mmrl.train.run_config import TrainConfig


def hand_loop(env, policy, seeds, low, high):
    obs, _ = env.reset(seed=seeds)
    if isinstance(obs, dict):  # the tabletop's {state, instruction}: the policy reads the state
        return tensor_hand_loop(env, policy, obs, low, high, key="state")
    if isinstance(obs, torch.Tensor):
        return tensor_hand_loop(env, policy, obs, low, high)
    alive = np.ones(env.num_envs, dtype=bool)
    steps = 0
    generator = torch.Generator().manual_seed(0)
    while alive.any():
        with torch.no_grad():
            action = policy.sample(torch.as_tensor(obs, dtype=torch.float32), generator).output[:, 0].numpy()
        obs, _, term, trunc, _ = env.step(np.clip(action, low, high))
        alive &= ~(term | trunc)
        steps += env.num_envs
    return steps


def tensor_hand_loop(env, policy, obs, low, high, key=None):
    view = (lambda o: o[key]) if key else (lambda o: o)  # noqa: E731  (what the policy reads)
    device = view(obs).device
    low, high = torch.as_tensor(low, device=device), torch.as_tensor(high, device=device)
    alive = torch.ones(env.num_envs, dtype=torch.bool, device=device)
    steps = 0
    generator = torch.Generator().manual_seed(0)
    while alive.any():
        with torch.no_grad():
            action = policy.sample(view(obs).float(), generator).output[:, 0].to(device)
        obs, _, term, trunc, _ = env.step(torch.minimum(torch.maximum(action, low), high))
        alive &= ~(term | trunc)
        steps += env.num_envs
    return steps


def interleaved_rates(sampler, policy, hand, groups: int, group_size: int, rounds: int) -> tuple[float, float]:
    """Median env steps/s of ``sampler.collect`` and of ``hand(env, policy, seeds, low, high)``
    (one wave of the same groups by hand) over interleaved rounds, after one warm-up each."""
    low, high = sampler.action_low, sampler.action_high
    seeds = [s for g in range(groups) for s in [1000 + g] * group_size]

    def run_sampler(step):
        before = sampler.env_steps
        sampler.collect(policy, groups, group_size, step)
        return sampler.env_steps - before

    run_sampler(0), hand(sampler.env, policy, seeds, low, high)  # warm-up
    rate_sampler, rate_hand = [], []
    for r in range(rounds):  # interleaved: machine noise hits both alike
        t0 = time.perf_counter()
        n = run_sampler(r + 1)
        rate_sampler.append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        n = hand(sampler.env, policy, [s + r for s in seeds], low, high)
        rate_hand.append(n / (time.perf_counter() - t0))
    return statistics.median(rate_sampler), statistics.median(rate_hand)


def build(env: str, num_envs: int, group_size: int, sim_backend: str | None = None, device: str = "cpu", **env_options):
    """The env sampler of ``env`` (``adapter:id``, or ``tabletop_warp:TASK``) with ``num_envs``
    envs, and a Gaussian MLP policy for it on ``device``."""
    adapter, env_id = env.split(":", 1)
    if adapter == "tabletop_warp":
        section = {"type": adapter, "task": env_id, "obs_mode": "state", "layout": "nominal", **({"device": sim_backend} if sim_backend else {})}
    else:
        section = {"type": adapter, "id": env_id, **({"sim_backend": sim_backend} if sim_backend else {})}
    cfg = from_dict(
        TrainConfig,
        {
            "env": {**section, "num_envs": num_envs, **env_options},
            "policy": {"type": "gaussian_mlp", "hidden_sizes": [64, 64]},
            "sampler": {"type": "env"},
            "rewards": [{"type": "return"}],
            "algo": {"group_size": group_size, "groups_per_step": num_envs // group_size},
        },
    )
    sampler = SAMPLERS.get("env")(cfg.sampler, sampler_context(cfg))
    return sampler, build_policy(cfg.policy, sampler.policy_spec()).to(device)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="gym:Reacher-v5", help="adapter:id, e.g. gym:Reacher-v5, maniskill:PushCube-v1, or tabletop_warp:TASK (MuJoCo Warp worlds)")
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sim-backend", default=None, help="maniskill: physx_cpu (default) or gpu (returns CUDA tensors); tabletop_warp: the warp device (cpu, cuda)")
    p.add_argument("--device", default="cpu", help="the policy's device (cuda beside a GPU simulator)")
    args = p.parse_args()
    torch.set_num_threads(1)
    sampler, policy = build(args.env, args.num_envs, args.group_size, args.sim_backend, args.device)
    s, h = interleaved_rates(sampler, policy, hand_loop, args.num_envs // args.group_size, args.group_size, args.rounds)
    sampler.close()
    print(f"{args.env} num_envs={args.num_envs}: EnvSampler {s:.0f} env steps/s, by hand {h:.0f} env steps/s")
    print(f"ratio EnvSampler/hand: {s / h:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
