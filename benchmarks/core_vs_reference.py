"""mmrl's GRPO loss + backward vs a straightforward reference on identical tensors.

The reference is the loss written out inline (group mean/std advantage, PPO clip,
token-mean) the way a training script would; mmrl's path is the registered functions the
trainer calls (advantage → objective → aggregation). Prints the time ratio (target ≤ 1.0)
and the largest difference of loss and gradient (target ≤ 1e-6).

    .venv/bin/python benchmarks/core_vs_reference.py [--batch 256 --length 512 --repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmrl.algo.advantage import grpo
from mmrl.algo.aggregation import token_mean
from mmrl.algo.objective import ppo_clip


def reference_loss(logp, old_logp, rewards, group_size, mask, eps_clip=0.2, eps=1e-6):
    r = rewards.view(-1, group_size)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)).view(-1, 1)
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # the same loss: log-ratio clamped as verl
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip) * adv)
    return -(surrogate * mask).sum() / mask.sum()


def mmrl_loss(logp, old_logp, rewards, group_id, mask):
    adv, _ = grpo(rewards, group_id)
    per_decision, _ = ppo_clip(logp, old_logp, adv[:, None], mask=mask)  # as the trainer passes it
    return token_mean(per_decision, mask)


def timed(fn, leaf, repeats):
    times = []
    for _ in range(repeats):
        leaf.grad = None
        t0 = time.perf_counter()
        loss = fn()
        loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), loss.detach(), leaf.grad.clone()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    B, T, G = args.batch, args.length, args.group_size
    logits = torch.randn(B, T, generator=g) * 0.1
    old_logp = -torch.rand(B, T, generator=g) * 3
    logp = (old_logp + logits).requires_grad_(True)
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    group_id = torch.arange(B) // G
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()

    for _ in range(3):  # warm-up both
        timed(lambda: reference_loss(logp, old_logp, rewards, G, mask), logp, 1)
        timed(lambda: mmrl_loss(logp, old_logp, rewards, group_id, mask), logp, 1)
    rounds_ref, rounds_mmrl = [], []
    for _ in range(5):  # interleaved rounds: machine noise hits both alike
        t_ref, loss_ref, grad_ref = timed(lambda: reference_loss(logp, old_logp, rewards, G, mask), logp, args.repeats)
        t_mmrl, loss_mmrl, grad_mmrl = timed(lambda: mmrl_loss(logp, old_logp, rewards, group_id, mask), logp, args.repeats)
        rounds_ref.append(t_ref)
        rounds_mmrl.append(t_mmrl)
    t_ref, t_mmrl = statistics.median(rounds_ref), statistics.median(rounds_mmrl)
    print(f"B={B} T={T} G={G}")
    print(f"reference loss+backward: {t_ref * 1e3:.2f} ms   mmrl: {t_mmrl * 1e3:.2f} ms")
    print(f"ratio mmrl/reference: {t_mmrl / t_ref:.3f}  (target <= 1.0)")
    print(f"max |loss diff| {abs(loss_ref - loss_mmrl).item():.2e}   max |grad diff| {(grad_ref - grad_mmrl).abs().max().item():.2e}  (target <= 1e-6)")


if __name__ == "__main__":
    main()
