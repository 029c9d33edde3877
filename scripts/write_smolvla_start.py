"""Write a fresh SmolVLA policy directory in LeRobot's (0.4) layout, sized for the
demonstrations' env: the start of the SmolVLA pipeline on the tabletop (a checkpoint that mmrl
itself writes, then SFT → export → load through the ``smolvla`` loader → RL).

The directory holds what ``lerobot-train`` saves (config.json, model.safetensors,
policy_{pre,post}processor.json and their normalizer statistics) with random weights: a small
SmolVLM (its config and tokenizer written to ``--vlm-dir``, named by ``vlm_model_name``) and
SmolVLA's action expert on it. From the demonstrations (``mmrl collect``) it takes the state
and action dims, the camera and its image size, the statistics of the states, actions and
images (mean, std, min, max over every recorded step; states and actions are normalized
MEAN_STD as in LeRobot's SmolVLA, images IDENTITY) and the tokenizer length that holds the
longest instruction. What trains is set in config.json (``train_expert_only``,
``freeze_vision_encoder``): the VLM is random, so by default everything trains.

    mmrl collect --task tabletop_spatial_nominal --episodes-per-task 5 --out demos/spatial_nominal
    python scripts/write_smolvla_start.py --demos demos/spatial_nominal --out runs/smolvla_start/policy

Then configs/tabletop_spatial_smolvla_sft.yaml (its header lists the whole pipeline).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def demo_features(demos: str | Path) -> dict:
    """What the policy directory must fit, read from a demonstrations directory: the state
    and action dims, the camera names and frame shape, the statistics, the instructions."""
    from mmrl.demos import read_demos, read_index

    episodes = read_demos(demos)
    if not episodes:
        raise SystemExit(f"write_smolvla_start: {demos} holds no demonstrations")
    try:
        cameras = read_index(demos).get("env_kwargs", {}).get("cameras", "top")
    except Exception:  # a LeRobotDataset layout: no index.json
        cameras = "top"
    cameras = [cameras] if isinstance(cameras, str) else list(cameras)
    image = episodes[0].image  # [T, H, W, 3] or [T, K, H, W, 3]
    if image.ndim == 4:
        image = image[:, None]
    if image.shape[1] != len(cameras):
        cameras = [f"camera{k}" for k in range(image.shape[1])]
    states = np.concatenate([e.state for e in episodes]).astype(np.float64)
    actions = np.concatenate([e.action for e in episodes]).astype(np.float64)

    def stats(x: np.ndarray) -> dict[str, list]:
        return {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(), "min": x.min(0).tolist(), "max": x.max(0).tolist()}

    all_stats = {"observation.state": stats(states), "action": stats(actions)}
    for k, name in enumerate(cameras):
        pixels = np.concatenate([(e.image if e.image.ndim == 5 else e.image[:, None])[:, k].reshape(-1, 3) for e in episodes]).astype(np.float64) / 255.0
        all_stats[f"observation.images.{name}"] = {s: [[[v]] for v in values] for s, values in stats(pixels).items()}  # [3, 1, 1], LeRobot's image stats
    return {
        "state_dim": states.shape[1], "action_dim": actions.shape[1], "cameras": cameras, "image_hw": tuple(image.shape[2:4]),
        "stats": all_stats, "instructions": sorted({e.instruction for e in episodes}), "episodes": len(episodes), "steps": len(states),
    }


def write_start(
    demos: str | Path, out: str | Path, vlm_dir: str | Path | None = None, *, chunk_size: int = 4, n_action_steps: int | None = None, num_steps: int = 5,
    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 128, vision_hidden_size: int = 32, patch_size: int = 8,
    vlm_image_size: int | None = None, max_state_dim: int | None = None, max_action_dim: int | None = None, expert_width_multiplier: float = 0.75,
    train_expert_only: bool = False, freeze_vision_encoder: bool = False, seed: int = 0,
) -> Path:
    """Write the SmolVLM (unless ``vlm_dir`` holds one of these sizes) and the SmolVLA policy
    directory ``out`` for the demonstrations in ``demos``; returns ``out``."""
    from transformers import AutoConfig, AutoTokenizer

    from mmrl.policies.smolvla import write_tiny_smolvla
    from mmrl.policies.vla.tiny_vlm import TinyVLMSize, save_tiny_vlm

    out = Path(out)
    vlm_dir = Path(vlm_dir) if vlm_dir is not None else out.parent / "smolvlm"
    features = demo_features(demos)
    h, w = features["image_hw"]
    side = vlm_image_size or max(h, w)
    size = TinyVLMSize(image_size=side, patch_size=patch_size, vision_hidden_size=vision_hidden_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, intermediate_size=intermediate_size)
    if (vlm_dir / "config.json").is_file():
        config = AutoConfig.from_pretrained(vlm_dir, local_files_only=True)
        have = (config.vision_config.image_size, config.vision_config.patch_size, config.vision_config.hidden_size, config.text_config.hidden_size, config.text_config.num_hidden_layers, config.text_config.num_attention_heads, config.text_config.intermediate_size)
        want = (size.image_size, size.patch_size, size.vision_hidden_size, size.hidden_size, size.num_layers, size.num_heads, size.intermediate_size)
        if have != want:
            raise SystemExit(f"write_smolvla_start: {vlm_dir} holds a SmolVLM of other sizes {have} (image, patch, vision width, width, layers, heads, MLP); want {want}: name another --vlm-dir")
    else:
        save_tiny_vlm("smolvlm", vlm_dir, size, seed)
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir, local_files_only=True)
    longest = max(len(tokenizer(text + "\n")["input_ids"]) for text in features["instructions"])
    cameras = {name: (3, h, w) for name in features["cameras"]}
    return write_tiny_smolvla(
        out, vlm_dir, state_dim=features["state_dim"], action_dim=features["action_dim"], cameras=cameras, chunk_size=chunk_size,
        n_action_steps=n_action_steps or chunk_size, stats=features["stats"], seed=seed,
        max_state_dim=max_state_dim or features["state_dim"], max_action_dim=max_action_dim or features["action_dim"],
        resize_imgs_with_padding=[side, side], tokenizer_max_length=8 * math.ceil(longest / 8), num_steps=num_steps,
        num_vlm_layers=num_layers, expert_width_multiplier=expert_width_multiplier,
        train_expert_only=train_expert_only, freeze_vision_encoder=freeze_vision_encoder,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python scripts/write_smolvla_start.py",
        description="Write a fresh (random) SmolVLA policy directory in LeRobot's layout, sized and normalized for a demonstrations directory's env.",
    )
    p.add_argument("--demos", required=True, help="demonstrations (mmrl collect): dims, camera, statistics, instruction length")
    p.add_argument("--out", required=True, help="the LeRobot SmolVLA directory to write (replaced if it is one)")
    p.add_argument("--vlm-dir", default=None, help="where the SmolVLM's config, tokenizer go (default: OUT/../smolvlm; reused if it holds these sizes)")
    p.add_argument("--chunk-size", type=int, default=4, help="actions per predicted chunk (chunk_size)")
    p.add_argument("--n-action-steps", type=int, default=None, help="actions of a chunk the env executes (default: the chunk size)")
    p.add_argument("--num-steps", type=int, default=5, help="Euler denoising steps of the action expert (num_steps)")
    p.add_argument("--hidden-size", type=int, default=64, help="width of the SmolVLM decoder (the expert is 0.75 of it)")
    p.add_argument("--num-layers", type=int, default=2, help="layers of the SmolVLM decoder, its vision encoder and the expert")
    p.add_argument("--num-heads", type=int, default=4, help="attention heads of the decoder and the vision encoder")
    p.add_argument("--intermediate-size", type=int, default=128, help="MLP width of the SmolVLM decoder")
    p.add_argument("--vision-hidden-size", type=int, default=32, help="width of the vision encoder")
    p.add_argument("--patch-size", type=int, default=8, help="vision patch side in pixels")
    p.add_argument("--vlm-image-size", type=int, default=None, help="image side the VLM reads (resize_imgs_with_padding; default: the demos' frame side)")
    p.add_argument("--max-state-dim", type=int, default=None, help="state dims the model pads to (default: the env's state dim)")
    p.add_argument("--max-action-dim", type=int, default=None, help="action dims the chunk latent has (default: the env's action dim)")
    p.add_argument("--train-expert-only", action="store_true", help="set train_expert_only: freeze the (random) SmolVLM")
    p.add_argument("--freeze-vision-encoder", action="store_true", help="set freeze_vision_encoder: freeze the vision encoder")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(argv)
    out = write_start(
        args.demos, args.out, args.vlm_dir, chunk_size=args.chunk_size, n_action_steps=args.n_action_steps, num_steps=args.num_steps,
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads, intermediate_size=args.intermediate_size,
        vision_hidden_size=args.vision_hidden_size, patch_size=args.patch_size, vlm_image_size=args.vlm_image_size,
        max_state_dim=args.max_state_dim, max_action_dim=args.max_action_dim, train_expert_only=args.train_expert_only,
        freeze_vision_encoder=args.freeze_vision_encoder, seed=args.seed,
    )
    config = json.loads((out / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    print(f"wrote {out} ({params / 1e6:.2f} M parameters; VLM {config['vlm_model_name']}; chunk {config['chunk_size']}, {config['num_steps']} Euler steps, tokenizer length {config['tokenizer_max_length']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
