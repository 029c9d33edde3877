"""denoising_overhead: sampling images with per-step log-probs (the ``image_diffusion``
policy's ``sample``, which records every stochastic step's Gaussian log-prob through
``mmrl.denoising``) against the plain diffusers loop (the scheduler's own ``step``) on the
same UNet, steps, batch and initial noise (target: ≤ 1.10×).

- ``ddim``: mmrl's DDIM with η (default 1) against ``DDIMScheduler.step(..., eta=η)``
  (trailing timesteps, x̂0 clipped to ±1 in both, as the policy's default).
- ``flow_sde``: mmrl's Flow-SDE (noise level 0.7) against ``FlowMatchEulerDiscreteScheduler``
  with ``stochastic_sampling`` (it also draws fresh noise every step) on mmrl's σ grid.

Both run under ``torch.no_grad`` and draw their noise from a seeded CPU generator. Prints
images per second of both and the time ratios, of wall time and of process CPU time:
medians over interleaved repeats, so a noisy machine slows both alike (on a crowded
machine the CPU-time ratio is the steadier one). Sizes are the tiny class-conditional UNets of docs/images.md:
``16`` = 16×16 with channels (8, 16), ``32`` = 32×32 with channels (32, 64).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/denoising_overhead.py [--sizes 16 32 --transitions ddim flow_sde --batch 8 --steps 8 --repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmrl.config import from_dict
from mmrl.core.weights import build_policy
from mmrl.denoising import flow_sigmas
from mmrl.policies.image_diffusion import ImageDiffusionConfig

# resolution -> the UNet's block_out_channels (docs/images.md)
SIZES = {8: [8, 16], 16: [8, 16], 32: [32, 64], 64: [32, 64]}
NUM_CONDITIONS = 4


def interleaved(a, b, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, process CPU) seconds of ``a()`` and of ``b()``, alternating them after one
    warm-up each. On a crowded machine the wall time also counts waiting for a core; the CPU
    time counts only this process's own work (one thread with OMP_NUM_THREADS=1)."""
    a(), b()
    times: dict = {a: ([], []), b: ([], [])}
    for _ in range(repeats):
        for fn in (a, b):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[fn][0].append(time.perf_counter() - wall)
            times[fn][1].append(time.process_time() - cpu)
    return tuple((statistics.median(times[fn][0]), statistics.median(times[fn][1])) for fn in (a, b))


def denoising_options(transition: str, steps: int, eta: float) -> dict:
    if transition == "ddim":
        return {"transition": "ddim", "eta": eta, "num_inference_steps": steps}
    return {"transition": "flow_sde", "noise_level": 0.7, "num_inference_steps": steps, "min_std": 0.0}


def make_policy(size: int, transition: str, steps: int, eta: float = 1.0, **denoising):
    """The tiny class-conditional image policy of ``size`` (seeded weights)."""
    torch.manual_seed(0)
    fields = {"type": "image_diffusion", "tiny": {"conditioning": "class", "resolution": size, "block_out_channels": SIZES[size]}, "denoising": {**denoising_options(transition, steps, eta), **denoising}}
    return build_policy(from_dict(ImageDiffusionConfig, fields, "policy"), {"num_prompts": NUM_CONDITIONS})


def diffusers_scheduler(policy, transition: str):
    """The diffusers scheduler that runs the same schedule as ``policy.config.denoising``."""
    import diffusers

    options = policy.config.denoising
    if transition == "ddim":
        return diffusers.DDIMScheduler(
            num_train_timesteps=options.num_train_timesteps, beta_schedule=options.beta_schedule, beta_start=options.beta_start, beta_end=options.beta_end,
            clip_sample=options.clip_denoised is not None, clip_sample_range=options.clip_denoised or 1.0, set_alpha_to_one=True, timestep_spacing="trailing",
            prediction_type=policy.prediction_type,
        )
    return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=options.time_shift, stochastic_sampling=True)


def set_timesteps(scheduler, transition: str, steps: int, shift: float = 1.0) -> None:
    """What a pipeline does at the start of every call (it also resets a flow scheduler's step index)."""
    if transition == "ddim":
        scheduler.set_timesteps(steps)
    else:
        scheduler.set_timesteps(sigmas=flow_sigmas(steps, shift)[:-1].tolist())  # mmrl's σ grid: 1 … 1/K, then 0


def diffusers_loop(policy, scheduler, transition: str, eta: float, conditions: torch.Tensor, generator: torch.Generator, network: bool = True) -> torch.Tensor:
    """The pipeline's denoising loop: UNet, then ``scheduler.step`` at every timestep.
    ``network=False`` replaces the UNet by a trivial output (0.1·x): the scheduler's own work."""
    n = conditions.shape[0]
    set_timesteps(scheduler, transition, policy.config.denoising.num_inference_steps, policy.config.denoising.time_shift)
    x = torch.randn((n, 3, *policy.resolution), generator=generator)
    extra = {"eta": eta, "generator": generator} if transition == "ddim" else {"generator": generator}
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = policy.unet(x, t.expand(n), class_labels=conditions).sample if network else 0.1 * x
            x = scheduler.step(out, t, x, **extra).prev_sample
    return x


def mmrl_chain_without_network(policy, n: int, generator: torch.Generator) -> None:
    """The policy's chain (``DenoisingPolicy.sample_chain``: transition, stochastic mask,
    every step's Gaussian, its log-prob and entropy) with the trivial output 0.1·x in place
    of the UNet: the work of mmrl.denoising itself."""
    x_init = torch.randn((n, 3, *policy.resolution), generator=generator)
    policy.sample_chain(lambda x, t, rows: 0.1 * x, x_init, generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32], choices=sorted(SIZES), help="image sizes (tiny UNets of docs/images.md)")
    parser.add_argument("--transitions", nargs="+", default=["ddim", "flow_sde"], choices=["ddim", "flow_sde"])
    parser.add_argument("--batch", type=int, default=8, help="images per sampling call")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps, all of them stochastic")
    parser.add_argument("--eta", type=float, default=1.0, help="ddim: the stochasticity eta")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per side (medians compared)")
    args = parser.parse_args()

    print(f"batch {args.batch}, {args.steps} steps (all stochastic), class-conditional, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats")
    print("| size | transition | mmrl sample | diffusers loop | ratio (wall) | ratio (CPU) |")
    print("|---|---|---|---|---|---|")
    ratios, work = [], []
    for size in args.sizes:
        for transition in args.transitions:
            policy = make_policy(size, transition, args.steps, args.eta)
            policy.eval()
            scheduler = diffusers_scheduler(policy, transition)
            conditions = torch.arange(args.batch) % NUM_CONDITIONS

            def mmrl_sample():
                sample = policy.sample(conditions, torch.Generator().manual_seed(0))
                assert sample.logp.shape == (args.batch, args.steps)

            def diffusers_sample():
                diffusers_loop(policy, scheduler, transition, args.eta, conditions, torch.Generator().manual_seed(0))

            (mmrl_wall, mmrl_cpu), (ref_wall, ref_cpu) = interleaved(mmrl_sample, diffusers_sample, args.repeats)
            (_, chain_cpu), (_, step_cpu) = interleaved(
                lambda: mmrl_chain_without_network(policy, args.batch, torch.Generator().manual_seed(0)),
                lambda: diffusers_loop(policy, scheduler, transition, args.eta, conditions, torch.Generator().manual_seed(0), network=False),
                max(args.repeats, 20),
            )
            work.append((size, transition, chain_cpu, step_cpu))
            ratios.append((size, transition, mmrl_wall / ref_wall, mmrl_cpu / ref_cpu))
            print(
                f"| {size}×{size} {SIZES[size]} | {transition} | {args.batch / mmrl_wall:.1f} img/s ({mmrl_wall * 1e3:.0f} ms; CPU {mmrl_cpu * 1e3:.0f} ms) "
                f"| {args.batch / ref_wall:.1f} img/s ({ref_wall * 1e3:.0f} ms; CPU {ref_cpu * 1e3:.0f} ms) | {ratios[-1][2]:.3f}× | {ratios[-1][3]:.3f}× |",
                flush=True,
            )
    print("\nWithout the network (0.1·x in place of the UNet), CPU time of one chain:")
    for size, transition, chain_cpu, step_cpu in work:
        print(f"  {size}×{size} {transition}: mmrl's chain {chain_cpu * 1e3:.2f} ms, diffusers' scheduler.step loop {step_cpu * 1e3:.2f} ms")
    for size, transition, wall, cpu in ratios:
        print(f"denoising_overhead {size}x{size} {transition}: {wall:.3f}x the diffusers loop's wall time, {cpu:.3f}x its CPU time (target <= 1.10x)")

if __name__ == "__main__":
    main()
