"""vlm_sampling_speed: the ``text_vlm`` policy's sampling with per-token log-probs against plain
transformers ``generate`` on the same tiny LLaVA, prompts, images and lengths, and the cost of
the teacher-forced passes (``old_logp`` recompute; ``log_prob`` forward + backward).

Prompts are shapes questions with one rendered 32×32 image each (16 image tokens at patch 8),
through the chat template, left-padded. Both generators sample (temperature 1) exactly
``--new-tokens`` tokens per prompt (no EOS). Prints generated tokens per second for both and
their time ratio (medians over interleaved repeats, so a noisy machine slows both alike), and
the recompute and training passes as fractions of mmrl's sampling time.

    .venv/bin/python benchmarks/vlm_sampling_speed.py [--batch 32 --new-tokens 16 --hidden 64 --layers 2 --repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.data.prompts import ImagePrompt
from mmrl.tasks.shapes.world import all_scenes, render_scene
from mmrl.tasks.shapes_qa.world import questions
from mmrl.policies.text_vlm import TextVLMConfig


def interleaved(a, b, repeats: int) -> tuple[float, float]:
    """Median wall times of ``a()`` and ``b()``, alternating them after one warm-up each."""
    a(), b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    width = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": 4, "intermediate_size": 2 * args.hidden}
    cfg = from_dict(TextVLMConfig, {"tiny": width, "vision": width, "generation": {"max_new_tokens": args.new_tokens, "chat_template": True}}, "policy")
    policy = build_policy(cfg, {})
    policy.sampling = dataclasses.replace(policy.sampling, eos_token_ids=())  # every completion runs the full budget
    every = list(all_scenes())
    scenes = every[:: max(1, len(every) // args.batch)][: args.batch]  # spread over the categories
    prompts = [ImagePrompt(questions(s)[-1]["question"], (render_scene(s, 32, seed=i),)) for i, s in enumerate(scenes)]
    prompt_ids, model_inputs = policy._encode_inputs(prompts)
    generator = torch.Generator().manual_seed(0)
    generated = args.batch * args.new_tokens

    texts = [policy._prompt_text(p.text, 1) for p in prompts]
    encoded = policy.processor(text=texts, images=[p.images[0] for p in prompts], padding=True, return_tensors="pt", add_special_tokens=False)
    model = policy.language_model

    def mmrl_sample():
        policy.backend.generate(prompt_ids, policy.sampling, generator, False, model_inputs=model_inputs)

    def hf_generate():
        with torch.no_grad():
            model.generate(**encoded, do_sample=True, top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=policy.tokenizer.pad_token_id)

    mmrl_time, hf_time = interleaved(mmrl_sample, hf_generate, args.repeats)
    sample = policy.sample(prompts, generator)
    assert int(sample.mask.sum()) == generated and torch.equal(policy.log_prob(sample.replay), sample.logp)

    def recompute():
        with torch.no_grad():
            policy.log_prob(sample.replay)

    def train_pass():
        policy.zero_grad()
        policy.log_prob(sample.replay).sum().backward()

    recompute_time, train_time = timed(recompute, args.repeats), timed(train_pass, args.repeats)
    prompt_tokens = sample.replay["prompt_mask"].sum(1).float().mean().item()
    params = sum(p.numel() for p in policy.parameters())
    print(f"batch {args.batch} x {args.new_tokens} new tokens, prompts {prompt_tokens:.0f} tokens on average (16 image tokens), hidden {args.hidden}, {args.layers} layers, {params / 1e6:.2f} M parameters, {torch.get_num_threads()} threads")
    print(f"mmrl loop:             {generated / mmrl_time:8.0f} tokens/s ({mmrl_time * 1e3:.0f} ms)")
    print(f"transformers generate: {generated / hf_time:8.0f} tokens/s ({hf_time * 1e3:.0f} ms)")
    print(f"vlm_sampling_speed:    {mmrl_time / hf_time:.2f}x generate's time")
    print(f"old_logp recompute:    {recompute_time * 1e3:8.1f} ms ({recompute_time / mmrl_time:.1%} of sampling)")
    print(f"log_prob fwd+bwd:      {train_time * 1e3:8.1f} ms ({train_time / mmrl_time:.1%} of sampling)")


if __name__ == "__main__":
    main()
