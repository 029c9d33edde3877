"""CPU cost of the ``video_diffusion`` policy: sampling a batch of videos, and recomputing
their log-probs with a backward pass (one GRPO update's work per sample), at a few sizes.

Times are process CPU seconds (one thread with ``OMP_NUM_THREADS=1``), the median of
``--repeats`` runs after a warm-up, so that other work on the machine does not count.
Prints a Markdown table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/video_policy_speed.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.policies.video_diffusion import VideoDiffusionConfig

SIZES = [  # frames, resolution, block_out_channels
    (4, 8, [8, 16]),
    (8, 8, [8, 16]),
    (4, 16, [8, 16]),
    (8, 16, [16, 32]),
]


def _cpu_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="DDIM steps, all of them decisions")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"batch {args.batch}, {args.steps} DDIM steps (eta 1), class-conditional, one thread\n")
    print("| frames × size | channels | parameters | sample | log_prob + backward |")
    print("|---|---|---|---|---|")
    for frames, resolution, channels in SIZES:
        torch.manual_seed(0)
        cfg = from_dict(VideoDiffusionConfig, {"type": "video_diffusion", "tiny": {"frames": frames, "resolution": resolution, "block_out_channels": channels}, "denoising": {"num_inference_steps": args.steps}}, "policy")
        policy = build_policy(cfg, {"num_prompts": 4})
        inputs = torch.arange(args.batch) % 4
        sample = policy.sample(inputs, torch.Generator().manual_seed(0))

        def backward():
            policy.zero_grad()
            policy.log_prob(sample.replay).sum().backward()

        t_sample = _cpu_seconds(lambda: policy.sample(inputs, torch.Generator().manual_seed(0)), args.repeats)
        t_train = _cpu_seconds(backward, args.repeats)
        params = sum(p.numel() for p in policy.parameters()) / 1e6
        print(f"| {frames} × {resolution}×{resolution} | {tuple(channels)} | {params:.2f} M | {t_sample:.2f} s | {t_train:.2f} s |")


if __name__ == "__main__":
    main()
