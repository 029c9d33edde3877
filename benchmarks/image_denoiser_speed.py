"""CPU cost of the ``image_diffusion`` policy's tiny denoisers: the pixel UNet (the baseline),
the SD3-style transformer and the DiT, in pixel space and over a tiny VAE's latents.

For each: sampling a batch of images, and recomputing their log-probs with a backward pass
(one GRPO update's work per sample), and each time's ratio to the pixel UNet of the same
conditioning measured in the same run. Times are process CPU seconds (one thread with
``OMP_NUM_THREADS=1``), the median of ``--repeats`` runs after a warm-up, so that other work
on the machine does not count. Prints a Markdown table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/image_denoiser_speed.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.policies.image_diffusion import ImageDiffusionConfig

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "three yellow circles"]

MODELS = [  # name, conditioning the UNet baseline shares, tiny section, denoising overrides
    ("UNet (8, 16), pixels", "class", {"conditioning": "class"}, {}),
    ("DiT, 1 block, pixels", "class", {"denoiser": "dit_transformer", "conditioning": "class"}, {"clip_denoised": None}),
    ("DiT, 4 blocks × 32 wide, pixels", "class", {"denoiser": "dit_transformer", "conditioning": "class", "transformer_layers": 4, "transformer_heads": 4, "attention_head_dim": 8}, {"clip_denoised": None}),
    ("DiT, 1 block, VAE latents", "class", {"denoiser": "dit_transformer", "conditioning": "class", "vae": True}, {"clip_denoised": None}),
    ("UNet (8, 16) + CLIP, pixels", "text", {"conditioning": "text"}, {}),
    ("SD3 transformer, 1 block, pixels", "text", {"denoiser": "sd3_transformer", "conditioning": "text"}, {"clip_denoised": None}),
    ("SD3 transformer, 4 blocks × 32 wide, pixels", "text", {"denoiser": "sd3_transformer", "conditioning": "text", "transformer_layers": 4, "transformer_heads": 4, "attention_head_dim": 8}, {"clip_denoised": None}),
    ("SD3 transformer, 1 block, VAE latents", "text", {"denoiser": "sd3_transformer", "conditioning": "text", "vae": True}, {"clip_denoised": None}),
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
    parser.add_argument("--resolution", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"batch {args.batch}, {args.steps} DDIM steps (eta 1), {args.resolution}x{args.resolution} images, one thread\n")
    print("| denoiser | parameters (denoiser / all) | sample | log_prob + backward | ratio to the UNet (sample, backward) |")
    print("|---|---|---|---|---|")
    baseline: dict[str, tuple[float, float]] = {}
    for name, conditioning, tiny, denoising in MODELS:
        torch.manual_seed(0)
        fields = {"type": "image_diffusion", "tiny": {**tiny, "resolution": args.resolution}, "denoising": {"num_inference_steps": args.steps, **denoising}}
        policy = build_policy(from_dict(ImageDiffusionConfig, fields, "policy"), {"num_prompts": 4} if conditioning == "class" else {})
        inputs = torch.arange(args.batch) % 4 if conditioning == "class" else [PROMPTS[i % 4] for i in range(args.batch)]
        sample = policy.sample(inputs, torch.Generator().manual_seed(0))

        def backward():
            policy.zero_grad()
            policy.log_prob(sample.replay).sum().backward()

        t_sample = _cpu_seconds(lambda: policy.sample(inputs, torch.Generator().manual_seed(0)), args.repeats)
        t_train = _cpu_seconds(backward, args.repeats)
        baseline.setdefault(conditioning, (t_sample, t_train))
        base_sample, base_train = baseline[conditioning]
        denoiser = sum(p.numel() for p in policy.denoiser_model.parameters())
        total = sum(p.numel() for p in policy.parameters())
        print(f"| {name} | {denoiser / 1e3:.1f} k / {total / 1e3:.1f} k | {t_sample:.3f} s | {t_train:.3f} s | {t_sample / base_sample:.2f}, {t_train / base_train:.2f} |")


if __name__ == "__main__":
    main()
