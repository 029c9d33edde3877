"""agent_turns: ``text_agent``'s turns per second with the key/value cache carried across turns
(``policy.turn_cache: true``) against re-encoding the whole conversation every turn, on the
same episodes in one run, and the share of the wall time spent in the env (``env.step``:
the task and the tools) against the policy.

Two envs under the env sampler: ``mmrl/GuessNumber-v0`` (a random LM never guesses right, so
every episode runs ``--turns`` turns) and the tool env around ``mmrl/LongArithmetic-v0`` with
the calculator (the LM is first fine-tuned for ``--sft-steps`` on episodes whose every turn
is the same calculator call, and samples at ``--tool-temperature``, so its turns call the
tool until ``max_calls`` runs out: ``--turns`` turns, the last one truncated; the first
observation is the task's alone, ``instructions: false``, which keeps that SFT short). Each round collects one wave of each env with
the cache and without it, from the same env seeds and sampling seeds (the rollouts' tokens
are checked equal); rounds alternate the two, after one warm-up each, and the table gives
medians. Turns per second = turns played (all episodes) / wall time of the wave; "env" is
the time inside the env's ``step`` (task + tools), "policy" inside ``policy.sample``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agent_turns.py [--hidden 128 --layers 4 --envs 8 --turns 10 --rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmrl.config import from_dict
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer

CALL = '{"tool": "calculator", "arguments": {"expression": "1+1"}}'


def make_trainer(args, env: dict, generation: dict, max_context: int, root: Path) -> Trainer:
    tiny = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads, "intermediate_size": 4 * args.hidden}
    cfg = {
        "name": "agent_turns", "seed": 0, "total_steps": 1, "device": "cpu",
        "env": {"num_envs": args.envs, **env},
        "sampler": {"type": "env"},
        "policy": {"type": "text_agent", "tiny": tiny, "generation": generation, "max_context_tokens": max_context},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": args.envs // 2, "kl": {"coef": 0.0}},
        "eval": {"at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    }
    return Trainer(from_dict(TrainConfig, cfg), root)


def teach_the_call(t: Trainer, steps: int) -> None:
    """A few steps of SFT on episodes whose every turn is ``CALL`` (the first observations
    are the tool env's own), so the random LM's turns become calculator calls."""
    seeds = list(range(1000, 1000 + t.sampler.num_envs))
    first, _ = t.sampler.env_call("reset", seeds, seed=seeds)
    episodes = [[[obs, CALL], ["Result of calculator:\n2", CALL]] for obs in first]
    optimizer = torch.optim.AdamW(t.policy.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = t.policy.sft_loss({"turns": episodes})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class Timers:
    """Wall time inside the policy's ``sample`` and the env's ``step`` (wrapped on the instances)."""

    def __init__(self, t: Trainer):
        self.policy = self.env = 0.0
        sample, env_call = t.policy.sample, t.sampler.env_call

        def timed_sample(*a, **k):
            start = time.perf_counter()
            try:
                return sample(*a, **k)
            finally:
                self.policy += time.perf_counter() - start

        def timed_env_call(method, *a, **k):
            start = time.perf_counter()
            try:
                return env_call(method, *a, **k)
            finally:
                if method == "step":
                    self.env += time.perf_counter() - start

        t.policy.sample, t.sampler.env_call = timed_sample, timed_env_call


def wave(t: Trainer, timers: Timers, cache: bool) -> dict:
    t.policy.config.turn_cache = cache
    timers.policy = timers.env = 0.0
    start = time.perf_counter()
    rollout = t.engine.collect(0, t.learner.version).rollout  # step 0: the same env and sampling seeds every time
    wall = time.perf_counter() - start
    turns = int(rollout.info["length"].sum())
    return {"wall": wall, "turns": turns, "env": timers.env, "policy": timers.policy, "tokens": rollout.replay["completion_ids"], "rollout": rollout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--tool-temperature", type=float, default=0.2)
    args = parser.parse_args()
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="agent_turns_"))
    setups = {
        "GuessNumber": make_trainer(
            args, {"type": "gym", "id": "mmrl/GuessNumber-v0", "max_episode_steps": args.turns},
            {"max_new_tokens": 8}, 96 + 48 * args.turns, root / "guess",
        ),
        "tools: LongArithmetic + calculator": make_trainer(
            args, {"type": "tools", "id": "mmrl/LongArithmetic-v0", "tools": ["calculator"], "instructions": False, "max_calls": args.turns - 1, "max_episode_steps": args.turns + 2},
            {"max_new_tokens": 64, "temperature": args.tool_temperature}, 128 + 128 * args.turns, root / "tools",
        ),
    }
    start = time.perf_counter()
    teach_the_call(setups["tools: LongArithmetic + calculator"], args.sft_steps)
    print(f"SFT of the call: {args.sft_steps} steps, {time.perf_counter() - start:.1f} s")
    results = {}
    for name, t in setups.items():
        timers = Timers(t)
        runs = {True: [], False: []}
        for cache in (True, False):  # warm-up
            wave(t, timers, cache)
        for _ in range(args.rounds):
            for cache in (True, False):
                runs[cache].append(wave(t, timers, cache))
        same = all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(runs[True], runs[False]))
        results[name] = (runs, same)
        rollout = runs[True][0]["rollout"]
        calls = rollout.info.get("costs", {}).get("tool_calls")
        extra = f", tool calls per episode {torch.as_tensor(calls).float().mean().item():.1f}" if calls is not None else ""
        first_turn = rollout.replay["completion_ids"][0, 0][rollout.replay["completion_mask"][0, 0].bool()].tolist()
        extra += f", a first turn: {t.policy.tokenizer.decode(first_turn)!r}"
        print(f"{name}: {args.envs} episodes, {runs[True][0]['turns'] / args.envs:.1f} turns per episode, "
              f"{int(rollout.mask.sum())} agent tokens{extra}; same tokens with and without the cache: {same}")

    print(f"\ntiny LM hidden {args.hidden}, {args.layers} layers, CPU, {torch.get_num_threads()} threads; medians of {args.rounds} interleaved rounds")
    header = f"{'env':<36} {'turn cache':<11} {'turns/s':>8} {'wave s':>7} {'env.step':>9} {'policy':>7} {'other':>6}"
    print(header)
    print("-" * len(header))
    for name, (runs, _) in results.items():
        rates = {}
        for cache in (True, False):
            rs = runs[cache]
            wall = statistics.median(r["wall"] for r in rs)
            rates[cache] = statistics.median(r["turns"] / r["wall"] for r in rs)
            env_share = statistics.median(r["env"] / r["wall"] for r in rs)
            policy_share = statistics.median(r["policy"] / r["wall"] for r in rs)
            print(f"{name:<36} {'carried' if cache else 're-encode':<11} {rates[cache]:>8.1f} {wall:>7.2f} {env_share:>9.1%} {policy_share:>7.1%} {1 - env_share - policy_share:>6.1%}")
        print(f"{'':<36} {'ratio':<11} {rates[True] / rates[False]:>7.2f}x")
    for t in setups.values():
        t.metrics.close()
        t.engine.close()
        t.sampler.close()


if __name__ == "__main__":
    main()
