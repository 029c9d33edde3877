"""Throughput of mmrl's tabletop suite (``mmrl/Tabletop-v0``): EnvSampler vs a hand loop, and sync vs async envs.

(a) EnvSampler collecting waves of episodes vs a hand loop stepping the same vector env with
    the same policy call (seeded reset, ``policy.sample`` on the dict observations, clip, the
    chunk's ``env.step`` calls until every episode has ended). Image observations are rendered
    inside ``env.step`` in both. The default policy draws uniform action chunks, so the env
    dominates and the sampler's own overhead shows (target ratio >= 0.9); ``--policy
    token_vla`` uses the tiny token VLA of configs/tabletop_token_vla_sft.yaml instead.
(b) The same env vectorized with gymnasium's SyncVectorEnv and AsyncVectorEnv (spawn
    workers, observations through pipes since they hold a Text instruction), stepped with
    the same random actions: env steps/s of each and async/sync.

(c) EnvSampler with the env's ``image_every`` set to the policy's action chunk (images
    rendered only where a chunk starts, identical rollouts) vs rendering every step, the
    same policy and seeds: env steps/s of each and the speed-up.

Rounds of both variants alternate and the medians are reported (the machine is shared).

    .venv/bin/python benchmarks/suite_throughput.py                          # task family "object", 16 envs
    .venv/bin/python benchmarks/suite_throughput.py --task all --num-envs 8 --vec-envs 2
    .venv/bin/python benchmarks/suite_throughput.py --policy token_vla --cameras top front
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from mmrl.config import from_dict
from mmrl.core.sampler import sampler_context
from mmrl.core.policy import Sample
from mmrl.core.weights import build_policy
from mmrl.registry import ENVS, SAMPLERS
from mmrl.train.run_config import TrainConfig
from rollout_overhead import interleaved_rates  # benchmarks/ is the script's directory

TOKEN_VLA = {
    "type": "token_vla",
    "action_bins": 32,
    "action_chunk": 4,
    "backbone": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "vision_channels": [16, 32], "patch_grid": 8},
}


class UniformChunkPolicy:
    """Uniform random action chunks [N, C, A] within the action bounds: the cheapest policy
    that takes the sampler's dict observations, so the env's cost dominates."""

    def __init__(self, spec: dict, chunk: int):
        self.low = torch.tensor(spec["action_low"], dtype=torch.float32)
        self.high = torch.tensor(spec["action_high"], dtype=torch.float32)
        self.chunk = chunk

    def sample(self, inputs, generator=None, deterministic=False) -> Sample:
        n = inputs["state"].shape[0]
        u = torch.full((n, self.chunk, len(self.low)), 0.5) if deterministic else torch.rand(n, self.chunk, len(self.low), generator=generator)
        action = self.low + (self.high - self.low) * u
        return Sample(output=action, logp=torch.zeros(n, 1), replay={"action": action.unsqueeze(1)})

    def log_prob(self, replay):
        return torch.zeros(replay["action"].shape[:2])


def policy_inputs(obs) -> dict:
    """The policy's dict input, made directly from the vector env's observations."""
    return {"image": torch.from_numpy(obs["image"]), "state": torch.from_numpy(obs["state"]), "instruction": [str(t) for t in obs["instruction"]]}


def hand_loop(env, policy, seeds, low, high) -> int:
    """One wave by hand: seeded reset, then decisions of C env steps until all episodes end."""
    obs, _ = env.reset(seed=seeds)
    alive = np.ones(env.num_envs, dtype=bool)
    steps = 0
    generator = torch.Generator().manual_seed(0)
    while alive.any():
        with torch.no_grad():
            chunk = np.clip(policy.sample(policy_inputs(obs), generator).output.numpy(), low, high)
        for j in range(chunk.shape[1]):
            obs, _, term, trunc, _ = env.step(chunk[:, j])
            alive &= ~(term | trunc)
            steps += env.num_envs
            if not alive.any():
                break
    return steps


def train_config(args, num_envs: int, vectorization: str = "sync", image_every: int = 1) -> TrainConfig:
    kwargs = {"task": args.task, "image_size": args.image_size, "cameras": args.cameras if len(args.cameras) > 1 else args.cameras[0], "image_every": image_every}
    return from_dict(
        TrainConfig,
        {
            "env": {"type": "gym", "id": "mmrl/Tabletop-v0", "num_envs": num_envs, "vectorization": vectorization, "kwargs": kwargs},
            "policy": TOKEN_VLA,
            "sampler": {"type": "env"},
            "rewards": [{"type": "success"}],
            "algo": {"group_size": args.group_size, "groups_per_step": max(1, num_envs // args.group_size)},
        },
    )


def sampler_vs_hand(args) -> tuple[float, float]:
    """Median env steps/s of EnvSampler.collect and of the hand loop, interleaved rounds."""
    cfg = train_config(args, args.num_envs)
    sampler = SAMPLERS.get("env")(cfg.sampler, sampler_context(cfg))
    spec = sampler.policy_spec()
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, spec) if args.policy == "token_vla" else UniformChunkPolicy(spec, TOKEN_VLA["action_chunk"])
    rates = interleaved_rates(sampler, policy, hand_loop, args.num_envs // args.group_size, args.group_size, args.rounds)
    sampler.close()
    return rates


def image_every_vs_dense(args) -> tuple[float, float]:
    """Median env steps/s of EnvSampler.collect with ``image_every`` = the chunk and = 1."""
    chunk = TOKEN_VLA["action_chunk"]
    samplers = {}
    for every in (chunk, 1):
        cfg = train_config(args, args.num_envs, image_every=every)
        samplers[every] = SAMPLERS.get("env")(cfg.sampler, sampler_context(cfg))
    spec = samplers[1].policy_spec()
    torch.manual_seed(0)
    policy = build_policy(train_config(args, args.num_envs).policy, spec) if args.policy == "token_vla" else UniformChunkPolicy(spec, chunk)
    groups = args.num_envs // args.group_size

    def rate(sampler, step):
        before, t0 = sampler.env_steps, time.perf_counter()
        with torch.no_grad():
            sampler.collect(policy, groups, args.group_size, step)
        return (sampler.env_steps - before) / (time.perf_counter() - t0)

    rate(samplers[chunk], 0), rate(samplers[1], 0)  # warm-up
    rates = {chunk: [], 1: []}
    for r in range(args.rounds):
        for every in (chunk, 1):
            rates[every].append(rate(samplers[every], r + 1))
    for sampler in samplers.values():
        sampler.close()
    return statistics.median(rates[chunk]), statistics.median(rates[1])


def sync_vs_async(args) -> tuple[float, float, float]:
    """Median env steps/s of sync and async vector envs of ``--vec-envs`` envs (same random
    actions, gymnasium's auto-reset), and the async envs' start-up time in seconds."""
    sync_env = ENVS.get("gym")(train_config(args, args.vec_envs, "sync").env, 0)
    t0 = time.perf_counter()
    async_env = ENVS.get("gym")(train_config(args, args.vec_envs, "async").env, 0)
    async_env.reset(seed=list(range(args.vec_envs)))
    startup = time.perf_counter() - t0
    sync_env.reset(seed=list(range(args.vec_envs)))
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (args.vec_steps, args.vec_envs, 2)).astype(np.float32)

    def run(env):
        t0 = time.perf_counter()
        for a in actions:
            env.step(a)
        return args.vec_steps * args.vec_envs / (time.perf_counter() - t0)

    run(sync_env), run(async_env)  # warm-up
    rates = {"sync": [], "async": []}
    for _ in range(args.rounds):
        rates["sync"].append(run(sync_env))
        rates["async"].append(run(async_env))
    sync_env.close(), async_env.close()
    return statistics.median(rates["sync"]), statistics.median(rates["async"]), startup


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="object", help='a task name, a family (spatial, object, goal) or "all"')
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--cameras", nargs="+", default=["top"], help="top and/or front")
    p.add_argument("--policy", choices=("uniform", "token_vla"), default="uniform", help="policy of part (a)")
    p.add_argument("--num-envs", type=int, default=16, help="vector env of part (a); one wave per round")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--vec-envs", type=int, default=4, help="envs of the sync and async vector envs of part (b)")
    p.add_argument("--vec-steps", type=int, default=200, help="vector steps per round in part (b)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    import mmrl.envs  # noqa: F401  (registers mmrl/Tabletop-v0)

    setting = f"mmrl/Tabletop-v0 task={args.task} image={args.image_size} cameras={','.join(args.cameras)}"
    print(setting)
    s, h = sampler_vs_hand(args)
    sync, asyn, startup = sync_vs_async(args)
    sparse, dense = image_every_vs_dense(args)
    rows = [
        (f"(a) EnvSampler, {args.policy} policy", args.num_envs, "sync", s),
        (f"(a) by hand, {args.policy} policy", args.num_envs, "sync", h),
        ("(b) random actions", args.vec_envs, "sync", sync),
        ("(b) random actions", args.vec_envs, "async", asyn),
        (f"(c) EnvSampler, image_every={TOKEN_VLA['action_chunk']}", args.num_envs, "sync", sparse),
        ("(c) EnvSampler, image_every=1", args.num_envs, "sync", dense),
    ]
    print(f"{'variant':<38} {'envs':>5} {'vector':>7} {'env steps/s':>12}")
    for name, n, kind, rate in rows:
        print(f"{name:<38} {n:>5} {kind:>7} {rate:>12.0f}")
    print(f"ratio EnvSampler/hand: {s / h:.3f}  (target >= 0.9)")
    print(f"ratio image_every=chunk / every step: {sparse / dense:.3f}")
    print(f"ratio async/sync: {asyn / sync:.3f}  (async start-up {startup:.1f} s; {args.vec_envs} spawn workers on {torch.multiprocessing.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
