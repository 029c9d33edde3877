"""Tiny random π0 / π0.5 directories in LeRobot's layout, for tests and demos: a tiny PaliGemma
directory (``save_tiny_vlm``; only its tokenizer is read) and a policy directory naming it as
its tokenizer, written by mmrl's own writer. The sizes are mmrl's test variants
(``mmrl_tiny_vlm`` / ``mmrl_tiny_expert``): LeRobot builds only gemma_2b / gemma_300m."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mmrl.policies.pi0.model import PI0Arch, PI0Model
from mmrl.policies.vla.lerobot_format import LeRobotPolicyDir, write_lerobot_policy
from mmrl.policies.vla.tiny_vlm import save_tiny_vlm


def _default_stats(dim: int, offset: float) -> dict[str, list[float]]:
    return {
        "mean": [offset + 0.1 * i for i in range(dim)],
        "std": [1.0 + 0.2 * i for i in range(dim)],
        "min": [-2.0 - 0.1 * i for i in range(dim)],
        "max": [2.0 + 0.1 * i for i in range(dim)],
        "q01": [-1.5 - 0.1 * i for i in range(dim)],
        "q99": [1.5 + 0.1 * i for i in range(dim)],
    }


def tiny_pi0_config(kind: str, state_dim: int, action_dim: int, cameras: dict[str, tuple[int, int, int]], chunk_size: int, n_action_steps: int, **fields) -> dict:
    """A π0 (``kind`` "pi0") or π0.5 ("pi05") config.json with LeRobot 0.4.4's fields and
    defaults (in its order) for a tiny policy."""
    images = {f"observation.images.{name}": {"type": "VISUAL", "shape": list(shape)} for name, shape in cameras.items()}
    quantiles = kind == "pi05"
    config = {
        "type": kind, "n_obs_steps": 1,
        "input_features": {**images, "observation.state": {"type": "STATE", "shape": [state_dim]}},
        "output_features": {"action": {"type": "ACTION", "shape": [action_dim]}},
        "device": "cpu", "use_amp": False, "use_peft": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None, "license": None, "pretrained_path": None,
        "paligemma_variant": "mmrl_tiny_vlm", "action_expert_variant": "mmrl_tiny_expert", "dtype": "float32",
        "chunk_size": chunk_size, "n_action_steps": n_action_steps, "max_state_dim": 8, "max_action_dim": 8,
        "num_inference_steps": 4, "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0, "time_sampling_scale": 0.999, "time_sampling_offset": 0.001,
        "min_period": 0.004, "max_period": 4.0, "rtc_config": None, "image_resolution": [32, 32], "empty_cameras": 0,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES" if quantiles else "MEAN_STD", "ACTION": "QUANTILES" if quantiles else "MEAN_STD"},
        "gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
        "freeze_vision_encoder": False, "train_expert_only": False,
        "optimizer_lr": 2.5e-05, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08, "optimizer_weight_decay": 0.01, "optimizer_grad_clip_norm": 1.0,
        "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000, "scheduler_decay_lr": 2.5e-06,
        "tokenizer_max_length": 96 if quantiles else 16,
    }
    unknown = set(fields) - set(config)
    if unknown:
        raise TypeError(f"unknown {kind} config fields {sorted(unknown)}")
    config.update(fields)
    return config


def tiny_processors(config: dict, stats: dict[str, dict[str, torch.Tensor]], tokenizer_name: str) -> tuple[dict, dict, dict[str, dict[str, torch.Tensor]]]:
    """The pre/post-processor JSONs LeRobot 0.4.4's ``make_pi0_pre_post_processors`` /
    ``make_pi05_pre_post_processors`` save for ``config``, and their normalizer state files."""
    flat = {f"{key}.{stat}": value.to(torch.float32).contiguous() for key, per in stats.items() for stat, value in per.items()}
    norm_map = dict(config["normalization_mapping"])
    features = {**config["input_features"], **config["output_features"]}
    tokenizer = {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right", "padding": "max_length", "truncation": True, "tokenizer_name": tokenizer_name}
    rename = {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}}
    batch = {"registry_name": "to_batch_processor", "config": {}}
    device = {"registry_name": "device_processor", "config": {"device": config["device"], "float_dtype": None}}
    normalizer = {"registry_name": "normalizer_processor", "config": {"eps": 1e-08, "features": features, "norm_map": norm_map}}
    if config["type"] == "pi05":
        state_step = {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {"max_state_dim": config["max_state_dim"], "task_key": "task"}}
        steps = [rename, batch, normalizer, state_step, {"registry_name": "tokenizer_processor", "config": tokenizer}, device]
    else:
        steps = [rename, batch, {"registry_name": "pi0_new_line_processor", "config": {}}, {"registry_name": "tokenizer_processor", "config": tokenizer}, device, normalizer]
    index = steps.index(normalizer)
    pre_state, post_state = f"policy_preprocessor_step_{index}_normalizer_processor.safetensors", "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    steps[index] = {**normalizer, "state_file": pre_state}
    pre = {"name": "policy_preprocessor", "steps": steps}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {"eps": 1e-08, "features": dict(config["output_features"]), "norm_map": norm_map}, "state_file": post_state},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
    ]}
    return pre, post, {pre_state: dict(flat), post_state: dict(flat)}


def write_tiny_pi0(
    out: str | os.PathLike,
    vlm_dir: str | os.PathLike,
    *,
    state_dim: int,
    action_dim: int,
    cameras: dict[str, tuple[int, int, int]],
    kind: str = "pi0",
    chunk_size: int = 4,
    n_action_steps: int | None = None,
    stats: dict[str, dict[str, list[float]]] | None = None,
    seed: int = 0,
    **fields,
) -> Path:
    """Write a tiny PaliGemma (its tokenizer is what the policy reads) into ``vlm_dir`` unless
    it holds one, and a π0 (``kind="pi0"``) or π0.5 (``"pi05"``) policy directory naming it
    into ``out``: config.json (``fields`` override LeRobot's defaults), model.safetensors
    (random weights from ``seed``; π0.5's adaptive norms too), the processors and their
    statistics (``stats``: {feature key: {stat: values}}; defaults for the state and the
    action: mean/std/min/max/q01/q99)."""
    vlm_dir = Path(vlm_dir)
    if not (vlm_dir / "config.json").is_file():
        save_tiny_vlm("paligemma", vlm_dir, None, seed)
    config = tiny_pi0_config(kind, state_dim, action_dim, cameras, chunk_size, n_action_steps or chunk_size, **fields)
    all_stats = {"observation.state": _default_stats(state_dim, 0.5), "action": _default_stats(action_dim, -0.25)}
    all_stats.update(stats or {})
    tensors = {key: {stat: torch.tensor(values, dtype=torch.float32) for stat, values in per.items()} for key, per in all_stats.items()}
    pre, post, states = tiny_processors(config, tensors, str(vlm_dir))
    files = LeRobotPolicyDir(Path(out), config, pre, post, states)
    torch.manual_seed(seed)
    model = PI0Model(PI0Arch.of(files))
    with torch.no_grad():  # random adaptive norms (openpi initializes them to zero: no conditioning)
        for name, param in model.named_parameters():
            if ".dense." in name:
                param.normal_(0.0, 0.05)
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    return write_lerobot_policy(files, state, out)


def _contract(directory: str | os.PathLike, kind: str) -> dict:
    directory = Path(directory)
    out = write_tiny_pi0(directory / kind, directory / "paligemma", state_dim=4, action_dim=2, cameras={"image": (3, 16, 16)}, kind=kind, chunk_size=4, n_action_steps=2)
    return {"policy": {"checkpoint": str(out), "vlm_dir": str(directory / "paligemma")}}


def contract_pi0(directory: str | os.PathLike) -> dict:
    """The contract's tiny π0 for the Tabletop (one 16 px camera, state 4, actions 2):
    written under ``directory``; returns the policy overrides that name it."""
    return _contract(directory, "pi0")


def contract_pi05(directory: str | os.PathLike) -> dict:
    """The contract's tiny π0.5 for the Tabletop (one 16 px camera, state 4, actions 2)."""
    return _contract(directory, "pi05")
