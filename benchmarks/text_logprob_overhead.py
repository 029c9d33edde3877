"""text_logprob_overhead: mmrl's sampling with per-token log-probs against plain
transformers ``generate`` on the same model, prompts and lengths (target: ≤ 1.10×), and the
teacher-forced pass that recomputes ``old_logp`` (``generation.old_logp: recompute``).

Both generators sample (temperature 1, the given top-p) exactly ``--new-tokens`` tokens per
prompt (no EOS), from left-padded prompts of different lengths. Prints generated tokens per
second for both and their time ratio (medians over interleaved repeats, so a noisy machine
slows both alike), and the time of the recompute pass and of one forward + backward of
``log_prob`` as fractions of mmrl's sampling time.

    .venv/bin/python benchmarks/text_logprob_overhead.py [--batch 32 --new-tokens 64 --hidden 64 --layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.policies.text_lm import TextLMConfig


def timed(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = from_dict(
        TextLMConfig,
        {"tiny": {"hidden_size": args.hidden, "num_layers": args.layers, "intermediate_size": 2 * args.hidden}, "generation": {"max_new_tokens": args.new_tokens, "top_p": args.top_p}},
        "policy",
    )
    policy = build_policy(cfg, {})
    policy.sampling = dataclasses.replace(policy.sampling, eos_token_ids=())  # every completion runs the full budget
    prompts = [f"Question {i}: what is {i} + {i * i}?" + " Think." * (i % 4) for i in range(args.batch)]
    prompt_ids = policy.encode_prompts(prompts)
    generator = torch.Generator().manual_seed(0)
    generated = args.batch * args.new_tokens

    encoded = policy.tokenizer(prompts, return_tensors="pt", padding=True)
    lm = policy.language_model

    def mmrl_sample():
        policy.backend.generate(prompt_ids, policy.sampling, generator, False)

    def hf_generate():
        with torch.no_grad():
            lm.generate(
                **encoded, do_sample=True, top_p=args.top_p, top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                pad_token_id=policy.tokenizer.pad_token_id,
            )

    mmrl_time, hf_time = interleaved(mmrl_sample, hf_generate, args.repeats)
    sample = policy.sample(prompts, generator)
    assert int(sample.mask.sum()) == generated

    def recompute():
        with torch.no_grad():
            policy.log_prob(sample.replay)

    def train_pass():
        policy.zero_grad()
        policy.log_prob(sample.replay).sum().backward()

    recompute_time, train_time = timed(recompute, args.repeats), timed(train_pass, args.repeats)
    print(f"batch {args.batch} x {args.new_tokens} new tokens, hidden {args.hidden}, {args.layers} layers, top_p {args.top_p}, {torch.get_num_threads()} threads")
    print(f"mmrl loop:            {generated / mmrl_time:8.0f} tokens/s ({mmrl_time * 1e3:.0f} ms)")
    print(f"transformers generate: {generated / hf_time:8.0f} tokens/s ({hf_time * 1e3:.0f} ms)")
    print(f"text_logprob_overhead: {mmrl_time / hf_time:.2f}x generate's time (target <= 1.10x)")
    print(f"old_logp recompute:   {recompute_time * 1e3:8.1f} ms ({recompute_time / mmrl_time:.1%} of sampling)")
    print(f"log_prob fwd+bwd:     {train_time * 1e3:8.1f} ms ({train_time / mmrl_time:.1%} of sampling)")


if __name__ == "__main__":
    main()
