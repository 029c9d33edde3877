"""Rollout and training cost of mmrl's VLA policy families at the tabletop demo size.

``token_vla`` (binned action tokens, decoded one by one), ``flow_vla`` (flow-matching action
expert, ``denoising.num_inference_steps`` Euler steps) and ``diffusion_policy`` (DDIM chain,
the last ``denoising.window_size`` steps trained; no language input) are built from their config classes with
the backbone of configs/tabletop_token_vla_sft.yaml (hidden 64, 2 layers, 4 heads, CNN
[16, 32], 8x8 patch grid), action chunks of 4 and the spec the env sampler gives for
``mmrl/Tabletop-v0`` (64x64 top camera, state dim 4, action dim 2, the suite's instructions).
Inputs are real observations of the suite (seeded resets over all its tasks).

Beside them, ``token_vla`` and ``flow_vla`` on a pretrained transformers VLM of each family
(``--vlm-families``; ``policy.backbone.vlm_path``): tiny random models of the real
architectures (``mmrl.policies.vla.tiny_vlm``: 64x64 images in 8x8 patches, a 2-layer decoder
of width 64 like the miniature's, a 2-layer vision tower of width 32), written to a temporary
directory and loaded as a user's checkpoint is. Their rows show what the family's own image
pipeline (its image processor on every call, its vision tower and projector) costs against the
miniature's CNN at the same decoder size.

Per family: decisions/s of ``policy.sample`` (no grad) at each batch size, and the training
pass ``log_prob(replay)`` + backward on the replay of ``--replay-decisions`` decisions per
sample (as the env sampler concatenates it), in ms per decision. A decision is one action
chunk, i.e. 4 env steps; the single env's steps/s are printed for scale. Rounds of all
families alternate and the medians are reported (the machine is shared).

On a GPU, ``--devices cpu cuda`` repeats every row on each device and ``--vlm-dtypes float32
bfloat16`` each pretrained row in each dtype of the VLM's weights (``policy.backbone.vlm_dtype``);
``--vlm-size base`` builds the VLMs at a size where a GPU has work to do (decoder 1024 wide, 12
layers; vision tower 256 wide). Every row also reports how far a recomputed log-prob is from
the sampled one (``max |ratio - 1|`` over the training batch: 0 on the CPU in float32, the
PPO ratio's error elsewhere).

    .venv/bin/python benchmarks/vla_rollout_cost.py                  # batch 32 and 1
    .venv/bin/python benchmarks/vla_rollout_cost.py --batch-sizes 64 16 1 --rounds 3
    python benchmarks/vla_rollout_cost.py --devices cpu cuda --vlm-families smolvlm qwen2_vl --rounds 3
    python benchmarks/vla_rollout_cost.py --devices cuda --vlm-dtypes float32 bfloat16 --vlm-size base --no-miniatures
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import gymnasium
import numpy as np
import torch

from mmrl.core.weights import build_policy
from mmrl.policies.diffusion_policy import DiffusionPolicyConfig
from mmrl.policies.flow_vla import FlowVLAConfig
from mmrl.policies.token_vla import TokenVLAConfig
from mmrl.policies.vla import VLABackboneConfig
from mmrl.policies.vla.tiny_vlm import FAMILIES, TinyVLMSize, save_tiny_vlm

CHUNK = 4
VLM_SIZES = {
    "tiny": TinyVLMSize(image_size=64, patch_size=8, vision_hidden_size=32, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128),
    "base": TinyVLMSize(image_size=64, patch_size=8, vision_hidden_size=256, hidden_size=1024, num_layers=12, num_heads=16, intermediate_size=4096),
}
BACKBONE = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vision_channels=[16, 32], patch_grid=8)


def configs() -> dict:
    """Each family's config at the demo size (its own defaults otherwise)."""
    return {
        "token_vla": TokenVLAConfig(backbone=VLABackboneConfig(**BACKBONE), action_bins=32, action_chunk=CHUNK),
        "flow_vla": FlowVLAConfig(backbone=VLABackboneConfig(**BACKBONE), action_chunk=CHUNK),
        "diffusion_policy": DiffusionPolicyConfig(hidden_size=64, num_layers=2, vision_channels=[16, 32], image_grid=8, action_chunk=CHUNK),
    }


def pretrained_configs(families: list[str], directory: Path, size: str = "tiny", dtypes=("float32",)) -> dict:
    """token_vla and flow_vla on a random VLM of each family at ``size``, saved under
    ``directory``, with the VLM's weights in each of ``dtypes``."""
    out = {}
    for family in families:
        path = str(save_tiny_vlm(family, directory / family, VLM_SIZES[size]))
        for dtype in dtypes:
            tag = "" if dtype == "float32" else "@bf16"
            backbone = VLABackboneConfig(vlm_path=path, vlm_dtype=dtype)
            out[f"token_vla/{family}{tag}"] = TokenVLAConfig(backbone=backbone, action_bins=32, action_chunk=CHUNK)
            out[f"flow_vla/{family}{tag}"] = FlowVLAConfig(backbone=backbone, action_chunk=CHUNK, expert_hidden_size=64, expert_intermediate_size=128)
    return out


def on_device(inputs: dict, device: str) -> dict:
    """The observations as the env sampler hands them to a policy on ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def synchronize(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def env_observations(env, n: int) -> dict:
    """n observations of seeded resets, as the env sampler hands them to the policy."""
    obs = [env.reset(seed=i)[0] for i in range(n)]
    return {
        "image": torch.from_numpy(np.stack([o["image"] for o in obs])),
        "state": torch.from_numpy(np.stack([o["state"] for o in obs])),
        "instruction": [o["instruction"] for o in obs],
    }


def env_steps_per_second(env, steps: int) -> float:
    """Random-action steps/s of one env (rendering included), resets at episode ends."""
    env.reset(seed=0)
    t0 = time.perf_counter()
    for i in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset(seed=i)
    return steps / (time.perf_counter() - t0)


def time_sampling(policy, inputs, calls: int) -> float:
    """Decisions/s of ``calls`` sample calls on the batch ``inputs``."""
    n = inputs["state"].shape[0]
    generator = torch.Generator().manual_seed(0)
    device = str(next(policy.parameters()).device)
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(calls):
            policy.sample(inputs, generator)
    synchronize(device)
    return calls * n / (time.perf_counter() - t0)


def make_replay(policy, inputs, decisions: int) -> tuple[dict, float]:
    """The replay of ``decisions`` sample calls per input, concatenated along dim 1 (nested
    sections such as a denoising chain's too), as the env sampler does, and the largest
    |exp(recomputed log-prob - sampled log-prob) - 1| over them (the PPO ratio's error at
    the sampling weights)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        samples = [policy.sample(inputs, generator) for _ in range(decisions)]
        replay = concat_calls([s.replay for s in samples])
        sampled = torch.cat([s.logp.reshape(s.logp.shape[0], -1) for s in samples], 1)
        recomputed = policy.log_prob(replay).reshape(sampled.shape)
    return replay, float((recomputed - sampled).exp().sub(1).abs().max())


def concat_calls(replays: list[dict]) -> dict:
    return {key: concat_calls([r[key] for r in replays]) if isinstance(value, dict) else torch.cat([r[key] for r in replays], 1) for key, value in replays[0].items()}


def time_training(policy, replay, decisions: int) -> float:
    """Milliseconds per decision of one log_prob(replay) + backward pass."""
    policy.zero_grad(set_to_none=True)
    device = str(next(policy.parameters()).device)
    synchronize(device)
    t0 = time.perf_counter()
    policy.log_prob(replay).sum().backward()
    synchronize(device)
    return (time.perf_counter() - t0) * 1000 / decisions


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 1], help="inputs per sample call")
    p.add_argument("--calls", type=int, default=0, help="sample calls per round and batch size (0: about 64 decisions, at least 8 calls)")
    p.add_argument("--train-batch", type=int, default=32, help="samples of the training pass")
    p.add_argument("--replay-decisions", type=int, default=4, help="decisions per sample in the training pass")
    p.add_argument("--env-steps", type=int, default=300, help="env steps per round for the env's steps/s")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--vlm-families", nargs="*", default=list(FAMILIES), choices=FAMILIES, help="pretrained-VLM families to add rows for (none: the miniatures only)")
    p.add_argument("--vlm-size", default="tiny", choices=list(VLM_SIZES), help="size of the pretrained-family VLMs")
    p.add_argument("--vlm-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"], help="dtypes of the VLMs' weights (one row each)")
    p.add_argument("--devices", nargs="+", default=["cpu"], help="devices to repeat every row on (cpu, cuda, cuda:N)")
    p.add_argument("--no-miniatures", action="store_true", help="leave out the from-config miniatures and diffusion_policy")
    args = p.parse_args()
    torch.set_num_threads(1)
    import mmrl.envs  # noqa: F401  (registers mmrl/Tabletop-v0)

    env = gymnasium.make("mmrl/Tabletop-v0", task="all", image_size=64, cameras="top")
    env.action_space.seed(0)
    largest = max(args.batch_sizes + [args.train_batch])
    obs = env_observations(env, largest)
    spec = {
        "action_dim": 2,
        "action_low": [-1.0, -1.0],
        "action_high": [1.0, 1.0],
        "state_dim": 4,
        "obs_dim": 4,
        "image_shape": [64, 64, 3],
        "instructions": list(env.unwrapped.instructions),
    }
    policies, devices = {}, {}
    vlm_dir = tempfile.TemporaryDirectory()
    built = {} if args.no_miniatures else configs()
    built.update(pretrained_configs(args.vlm_families, Path(vlm_dir.name), args.vlm_size, args.vlm_dtypes))
    for device in args.devices:
        for name, cfg in built.items():
            torch.manual_seed(0)
            key = name if len(args.devices) == 1 else f"{name} {device}"
            policies[key], devices[key] = build_policy(cfg, spec).to(device), device
    batches = {b: {"image": obs["image"][:b], "state": obs["state"][:b], "instruction": obs["instruction"][:b]} for b in args.batch_sizes}
    train_inputs = {"image": obs["image"][: args.train_batch], "state": obs["state"][: args.train_batch], "instruction": obs["instruction"][: args.train_batch]}
    batches = {(b, d): on_device(batch, d) for b, batch in batches.items() for d in args.devices}
    made = {name: make_replay(policy, on_device(train_inputs, devices[name]), args.replay_decisions) for name, policy in policies.items()}
    replays = {name: replay for name, (replay, _) in made.items()}
    ratio_error = {name: error for name, (_, error) in made.items()}
    calls = {b: args.calls or max(8, 64 // b) for b in args.batch_sizes}
    train_decisions = args.train_batch * args.replay_decisions

    sample_rates = {(n, b): [] for n in policies for b in args.batch_sizes}
    train_ms = {n: [] for n in policies}
    env_rates = []
    for name, policy in policies.items():  # warm-up
        time_sampling(policy, batches[args.batch_sizes[0], devices[name]], 1), time_training(policy, replays[name], train_decisions)
    for _ in range(args.rounds):
        env_rates.append(env_steps_per_second(env, args.env_steps))
        for name, policy in policies.items():
            for b in args.batch_sizes:
                sample_rates[name, b].append(time_sampling(policy, batches[b, devices[name]], calls[b]))
            train_ms[name].append(time_training(policy, replays[name], train_decisions))
    env.close()
    vlm_dir.cleanup()

    env_rate = statistics.median(env_rates)
    print(f"tabletop (one env, 64x64 top camera): {env_rate:.0f} env steps/s = {env_rate / CHUNK:.0f} decisions/s of {CHUNK} steps")
    cols = "".join(f"{f'sample B={b}':>14}" for b in args.batch_sizes)
    width = max(22, 2 + max(map(len, policies)))
    print(f"{'policy':<{width}}{'params':>9}{cols}{'train ms/dec':>14}{'train dec/s':>13}{'pol/env B=' + str(args.batch_sizes[0]):>13}{'max|ratio-1|':>14}")
    for name, policy in policies.items():
        params = sum(p.numel() for p in policy.parameters())
        rates = [statistics.median(sample_rates[name, b]) for b in args.batch_sizes]
        ms = statistics.median(train_ms[name])
        cells = "".join(f"{r:>14.0f}" for r in rates)
        print(f"{name:<{width}}{params / 1e3:>8.0f}k{cells}{ms:>14.3f}{1000 / ms:>13.0f}{env_rate / CHUNK / rates[0]:>13.2f}{ratio_error[name]:>14.2e}")
    print("sample columns: decisions/s of policy.sample (no grad); train: log_prob(replay) + backward on")
    print(f"{args.train_batch} samples x {args.replay_decisions} decisions; pol/env: policy time per decision / one env's time for its steps")
    diffusion, flow = configs()["diffusion_policy"].denoising, configs()["flow_vla"].denoising
    print(f"(diffusion_policy trains {diffusion.window_size} of its {diffusion.num_inference_steps} denoising steps per decision; flow_vla integrates {flow.num_inference_steps})")


if __name__ == "__main__":
    main()
