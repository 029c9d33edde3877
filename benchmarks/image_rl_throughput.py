"""image_rl_throughput: images per second of one RL update of the ``image_diffusion`` policy
through mmrl's trainer, against a straightforward reference written here (target: ≥ 1.0×).

**mmrl** runs ``Trainer.rl_step`` on a config built in-process: the prompt sampler draws
``--groups`` groups of ``--group-size`` images (``policy.sample``: a chain with every step's
log-prob), the JPEG-compressibility reward scores them, GRPO advantages, then one optimizer
step of the PPO-clip loss (token mean over every (image, step) decision), gradient
clipping and AdamW. The update is one on-policy pass, so by default
(``algo.reuse_sampling_graph`` true here) sampling runs the UNet with grad on every step
(latents detached between steps) and the loss backpropagates through the sampling pass's
own log-probs: 8 UNet forwards and 8 backwards, no recompute forward (the same gradient;
``tests/train/test_reuse_sampling_graph.py``). ``--recompute`` is the previous path:
sampling without grad, then the log-probs that ``policy.log_prob`` recomputes with grad in
one UNet call over all stochastic steps of a piece (``denoising.chunk_steps`` null) — with
``algo.micro_batches`` null the trainer splits the minibatch into pieces whose activations
fit the CPU's cache by the policy's estimate (at 32×32: 4 pieces of 4 images; at 16×16:
one) and accumulates their gradients.

**The reference** does the same update the way DDPO's and Flow-GRPO's reference
implementations do: the diffusers scheduler's timesteps (``DDIMScheduler``) or sigmas
(``FlowMatchEulerDiscreteScheduler``) and ᾱ, a hand-written step that samples and returns
its Gaussian log-prob (DDIM with η, x̂0 clipped to ±1; the Flow-GRPO SDE), the latents kept
in a list, the same reward and group-normalised advantage written inline, then one step
at a time: UNet on that step's latents, the hand-written log-prob, the PPO-clip loss
divided by the number of steps, ``backward``; then gradient clipping and AdamW. Both use
the same options (every step a decision, log-probs averaged over pixels as DDPO, std
floored at 0.01 for DDIM, lr, clip range, grad-norm clip), on copies of the same UNet.

Each side runs in its own spawned process (both build the same seeded UNet), so neither
inherits the other's allocator state: in one process the side that ran second reused
memory the first had freed, and the other paid the page faults of fresh memory. Prints
images per second of both and mmrl's throughput over the reference's, by wall time and by
each process's CPU time: medians over interleaved repeats (a noisy machine slows both
alike; on a crowded machine the CPU-time ratio is the steadier one).

``--rss CONFIG`` instead runs ``mmrl train CONFIG`` in a subprocess (any config; extra
``key=value`` overrides after it) and prints its peak resident set size
(``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``) against the 4 GB target.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/image_rl_throughput.py [--sizes 16 32 --transitions ddim flow_sde --groups 4 --group-size 4 --steps 8 --repeats 3] [--recompute [--chunk-steps 1 --keep-chunks] [--micro-batches 1]]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/image_rl_throughput.py --rss configs/image_ddpo_jpeg.yaml [total_steps=10]
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mmrl.config import from_dict

# resolution -> the UNet's block_out_channels (docs/images.md)
SIZES = {8: [8, 16], 16: [8, 16], 32: [32, 64], 64: [32, 64]}
NUM_CONDITIONS = 4
CLIP = 0.2  # PPO clip range (speed does not depend on it)
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def interleaved(a, b, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, process CPU) seconds of ``a()`` and of ``b()`` — each runs one update in
    its side's process and returns that process's seconds — alternating them after one
    warm-up each. On a crowded machine the wall time also counts waiting for a core; the CPU
    time counts only that process's own work (one thread)."""
    a(), b()
    times: dict = {a: ([], []), b: ([], [])}
    for _ in range(repeats):
        for fn in (a, b):
            wall, cpu = fn()
            times[fn][0].append(wall)
            times[fn][1].append(cpu)
    return tuple((statistics.median(times[fn][0]), statistics.median(times[fn][1])) for fn in (a, b))


def train_config(size: int, transition: str, args, run_dir: str):
    from mmrl.train.run_config import TrainConfig

    if transition == "ddim":
        denoising = {"transition": "ddim", "eta": 1.0, "min_std": 0.01}
    else:
        denoising = {"transition": "flow_sde", "noise_level": 0.7, "min_std": 0.0}
    denoising.update(num_inference_steps=args.steps, logp_reduction="mean", stochastic_steps="all", chunk_steps=args.chunk_steps, checkpoint_chunks=not args.keep_chunks)
    return from_dict(TrainConfig, {
        "name": "image_rl_throughput", "seed": 0, "total_steps": 1_000_000, "run_dir": run_dir,
        "policy": {"type": "image_diffusion", "tiny": {"conditioning": "class", "resolution": size, "block_out_channels": SIZES[size]}, "denoising": denoising},
        "sampler": {"type": "prompt", "data": {"num_prompts": NUM_CONDITIONS}, "batch_groups": args.groups},
        "rewards": [{"type": "jpeg_compressibility", "quality": 95}],
        "algo": {
            "group_size": args.group_size, "groups_per_step": args.groups, "ppo_epochs": 1, "num_minibatches": 1,
            "advantage": {"type": "grpo", "std": "group"}, "objective": {"type": "ppo_clip", "eps_low": CLIP, "eps_high": CLIP},
            "aggregation": "token_mean", "kl": {"coef": 0.0}, "micro_batches": args.micro_batches, "reuse_sampling_graph": not args.recompute,
        },
        "optim": {"lr": 1e-3, "max_grad_norm": 1.0},
        "eval": {"every": 0, "at_end": False}, "checkpoint": {"every": 0},
        "log": {"progress": False, "tensorboard": False},
    })


# ------------------------------------------------------------------ the reference


class Reference:
    """One RL update the way DDPO / Flow-GRPO's reference code writes it, on its own copy of the UNet."""

    def __init__(self, unet: torch.nn.Module, transition: str, steps: int, groups: int, group_size: int, resolution: int, optim_cfg):
        import diffusers

        self.unet, self.transition, self.steps = unet, transition, steps
        self.groups, self.group_size, self.resolution = groups, group_size, resolution
        self.optimizer = torch.optim.AdamW(unet.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.adam_eps, weight_decay=optim_cfg.weight_decay)
        self.max_grad_norm = optim_cfg.max_grad_norm
        if transition == "ddim":
            scheduler = diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=True, set_alpha_to_one=True, timestep_spacing="trailing")
            scheduler.set_timesteps(steps)
            ab = scheduler.alphas_cumprod
            self.timesteps = scheduler.timesteps.tolist()
            prev = [t - 1000 // steps for t in self.timesteps]
            self.alpha = [float(ab[t]) for t in self.timesteps]
            self.alpha_prev = [float(ab[t]) if t >= 0 else 1.0 for t in prev]
        else:
            scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1].tolist())
            self.sigmas = scheduler.sigmas.tolist()  # K + 1 values, the last 0
            self.timesteps = scheduler.timesteps.tolist()
            self.sigma_max = self.sigmas[1]
        self.generator = torch.Generator().manual_seed(1)

    def step(self, out: torch.Tensor, k: int, x: torch.Tensor, x_next: torch.Tensor | None = None):
        """Hand-written step k: (x_next, its log-prob averaged over pixels); draws x_next if not given."""
        if self.transition == "ddim":
            ab, ab_prev = self.alpha[k], self.alpha_prev[k]
            x0 = ((x - math.sqrt(1 - ab) * out) / math.sqrt(ab)).clamp(-1, 1)
            eps = (x - math.sqrt(ab) * x0) / math.sqrt(1 - ab)
            std = math.sqrt((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev))  # eta = 1
            mean = math.sqrt(ab_prev) * x0 + math.sqrt(max(1 - ab_prev - std**2, 0.0)) * eps
            std = max(std, 0.01)
        else:
            sigma, sigma_next = self.sigmas[k], self.sigmas[k + 1]
            sigma_t = 0.7 * math.sqrt(sigma / (1 - (self.sigma_max if sigma >= 1 else sigma)))
            dt = sigma_next - sigma
            mean = x + (out + sigma_t**2 / (2 * sigma) * (x + (1 - sigma) * out)) * dt
            std = sigma_t * math.sqrt(-dt)
        if x_next is None:
            x_next = mean + std * torch.randn(x.shape, generator=self.generator)
        logp = (-((x_next.detach() - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI).mean(dim=(1, 2, 3))
        return x_next, logp

    def unet_time(self, k: int, n: int) -> torch.Tensor:
        return torch.full((n,), float(self.timesteps[k]))

    def update(self) -> None:
        n = self.groups * self.group_size
        conditions = torch.arange(self.groups).repeat_interleave(self.group_size) % NUM_CONDITIONS
        with torch.no_grad():
            x = torch.randn((n, 3, self.resolution, self.resolution), generator=self.generator)
            latents, old_logp = [x], []
            for k in range(self.steps):
                out = self.unet(x, self.unet_time(k, n), class_labels=conditions).sample
                x, logp = self.step(out, k, x)
                latents.append(x)
                old_logp.append(logp)
        images = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        rewards = torch.tensor([-len(cv2_jpeg(img)) / 1000 for img in images])
        grouped = rewards.view(self.groups, self.group_size)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(self.steps):
            out = self.unet(latents[k], self.unet_time(k, n), class_labels=conditions).sample
            _, logp = self.step(out, k, latents[k], latents[k + 1])
            ratio = torch.exp(logp - old_logp[k])
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)).mean() / self.steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.unet.parameters(), self.max_grad_norm)
        self.optimizer.step()


def check_agreement(policy, reference: Reference, groups: int, group_size: int) -> float:
    """The reference's hand-written log-probs of a chain mmrl sampled, against mmrl's own:
    both sides compute the same update. Returns the largest difference (raises above 1e-3)."""
    n = groups * group_size
    conditions = torch.arange(groups).repeat_interleave(group_size) % NUM_CONDITIONS
    sample = policy.sample(conditions, torch.Generator().manual_seed(2))
    latents = sample.replay["chain"]["latents"]
    with torch.no_grad():
        theirs = torch.stack([
            reference.step(reference.unet(latents[:, k], reference.unet_time(k, n), class_labels=conditions).sample, k, latents[:, k], latents[:, k + 1])[1]
            for k in range(reference.steps)
        ], 1)
    difference = float((theirs - sample.logp).abs().max())
    if difference > 1e-3:
        raise AssertionError(f"the reference's log-probs differ from mmrl's by {difference:.2e} on the same chain")
    return difference


def cv2_jpeg(image: np.ndarray) -> bytes:
    import cv2

    ok, buffer = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    return buffer.tobytes()


# ------------------------------------------------------------------ peak RSS of a training run


def peak_rss(config: str, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "mmrl", "train", config, "--run-dir", str(Path(run_dir) / "run"), "log.progress=false", *overrides]
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
    rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux
    print(f"mmrl train {config} {' '.join(overrides)}".rstrip() + f": {seconds:.0f} s")
    print(f"peak RSS: {rss_gb:.2f} GB (target <= 4 GB): {rss_gb / 4:.3f}x the target")


# ------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32], choices=sorted(SIZES), help="image sizes (tiny UNets of docs/images.md)")
    parser.add_argument("--transitions", nargs="+", default=["ddim", "flow_sde"], choices=["ddim", "flow_sde"])
    parser.add_argument("--groups", type=int, default=4, help="groups (prompts) per update")
    parser.add_argument("--group-size", type=int, default=4, help="images per group")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps, all of them decisions")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per side (medians compared)")
    parser.add_argument("--chunk-steps", type=int, default=None, help="mmrl: policy.denoising.chunk_steps (default null: every step in one UNet call)")
    parser.add_argument("--keep-chunks", action="store_true", help="mmrl: policy.denoising.checkpoint_chunks false (chunks keep their activations instead of recomputing them)")
    parser.add_argument("--micro-batches", type=int, default=None, help="mmrl with --recompute: algo.micro_batches (default null, mmrl's default: pieces from the policy's activation estimate on a CPU)")
    parser.add_argument("--recompute", action="store_true", help="mmrl: algo.reuse_sampling_graph false (sample without grad, recompute the log-probs with grad in the update)")
    parser.add_argument("--rss", metavar="CONFIG", help="instead: run `mmrl train CONFIG` in a subprocess and print its peak RSS")
    parser.add_argument("overrides", nargs="*", help="with --rss: key=value overrides of the config")
    args = parser.parse_args()
    if args.rss:
        peak_rss(args.rss, args.overrides)
        return
    if args.overrides:
        parser.error("key=value overrides go with --rss")

    n = args.groups * args.group_size
    print(f"{args.groups} groups x {args.group_size} images, {args.steps} steps (all decisions), class-conditional, 1 thread per side, {args.repeats} interleaved repeats, each side in its own process")
    print(f"mmrl: algo.reuse_sampling_graph {not args.recompute}, denoising.chunk_steps {args.chunk_steps}, checkpoint_chunks {not args.keep_chunks}, algo.micro_batches {args.micro_batches}")
    print("| size | transition | pieces | mmrl (Trainer.rl_step) | reference | ratio (wall) | ratio (CPU) |")
    print("|---|---|---|---|---|---|---|")
    ratios, agreements = [], []
    for size in args.sizes:
        for transition in args.transitions:
            with Side("mmrl", size, transition, args) as mmrl, Side("reference", size, transition, args) as reference:
                agreements.append(reference.info)
                (mmrl_wall, mmrl_cpu), (ref_wall, ref_cpu) = interleaved(mmrl.update, reference.update, args.repeats)
                pieces = mmrl.finish() // (args.repeats + 1)
            ratios.append((size, transition, ref_wall / mmrl_wall, ref_cpu / mmrl_cpu))
            print(
                f"| {size}×{size} {SIZES[size]} | {transition} | {pieces} | {n / mmrl_wall:.1f} img/s ({mmrl_wall:.2f} s; CPU {mmrl_cpu:.2f} s) "
                f"| {n / ref_wall:.1f} img/s ({ref_wall:.2f} s; CPU {ref_cpu:.2f} s) | {ratios[-1][2]:.3f}× | {ratios[-1][3]:.3f}× |",
                flush=True,
            )
    print(f"the reference's log-probs of mmrl's chains: largest difference {max(agreements):.1e} (mean over pixels)")
    for size, transition, wall, cpu in ratios:
        print(f"image_rl_throughput {size}x{size} {transition}: {wall:.3f}x the reference's images/s by wall time, {cpu:.3f}x by CPU time (target >= 1.0x)")


# ------------------------------------------------------------------ one side per process


class Side:
    """One side of the comparison in its own process (spawned), so that neither side's
    memory allocator state (freed blocks kept or returned to the system) is the other's.
    ``update()`` runs one update there and returns its (wall, process CPU) seconds."""

    def __init__(self, side: str, size: int, transition: str, args):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(side, size, transition, args, child), daemon=True)
        self.process.start()
        child.close()
        self.info = self._receive()  # the reference: the agreement of its log-probs with mmrl's

    def _receive(self):
        message = self.conn.recv()
        if isinstance(message, BaseException):
            raise message
        return message

    def update(self) -> tuple[float, float]:
        self.conn.send("update")
        return self._receive()

    def finish(self):
        self.conn.send("finish")
        return self._receive()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.process.is_alive():
            self.conn.send("stop")
        self.process.join(timeout=60)
        self.conn.close()


def _serve(side: str, size: int, transition: str, args, conn) -> None:
    """The worker of :class:`Side`: builds its side, then runs updates on request."""
    torch.set_num_threads(1)
    from mmrl.train.trainer import Trainer

    try:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = train_config(size, transition, args, str(Path(run_dir) / "run"))
            trainer = Trainer(cfg)  # both sides build it: the same initial UNet from the seed
            passes = []  # mmrl: forward/backward pieces of its updates (algo.micro_batches)
            if side == "reference":
                reference = Reference(copy.deepcopy(trainer.policy.unet), transition, args.steps, args.groups, args.group_size, size, cfg.optim)
                info = check_agreement(trainer.policy, reference, args.groups, args.group_size)
                trainer.metrics.close()
                del trainer
                update = reference.update
            else:
                info = None
                step = iter(range(1_000_000))
                forward = trainer.learner.model.forward
                trainer.learner.model.forward = lambda *a, **kw: passes.append(1) or forward(*a, **kw)

                def update():
                    metrics = trainer.rl_step(next(step))
                    assert math.isfinite(metrics["loss/policy"])

            conn.send(info)
            while True:
                command = conn.recv()
                if command == "update":
                    wall, cpu = time.perf_counter(), time.process_time()
                    update()
                    conn.send((time.perf_counter() - wall, time.process_time() - cpu))
                elif command == "finish":
                    conn.send(len(passes))
                else:
                    break
            if side == "mmrl":
                trainer.metrics.close()
    except BaseException as error:  # reported to the parent, which raises it
        conn.send(RuntimeError(f"{side} side: {type(error).__name__}: {error}"))
    finally:
        conn.close()


if __name__ == "__main__":
    main()
