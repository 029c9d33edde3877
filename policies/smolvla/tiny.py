"""Tiny random SmolVLA directories in LeRobot's layout, for tests and demos: a tiny SmolVLM
(``save_tiny_vlm``) and a policy directory naming it, written by mmrl's own writer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mmrl.policies.smolvla.model import SmolVLAArch, SmolVLAModel, _transformers
from mmrl.policies.vla.lerobot_format import LeRobotPolicyDir, write_lerobot_policy
from mmrl.policies.vla.tiny_vlm import TinyVLMSize, save_tiny_vlm


def _default_stats(dim: int, offset: float) -> dict[str, list[float]]:
    return {
        "mean": [offset + 0.1 * i for i in range(dim)],
        "std": [1.0 + 0.2 * i for i in range(dim)],
        "min": [-2.0 - 0.1 * i for i in range(dim)],
        "max": [2.0 + 0.1 * i for i in range(dim)],
    }


def tiny_smolvla_config(vlm_model_name: str, state_dim: int, action_dim: int, cameras: dict[str, tuple[int, int, int]], chunk_size: int, n_action_steps: int, **fields) -> dict:
    """A SmolVLA config.json (LeRobot 0.4's fields and defaults, in its order) for a tiny policy."""
    images = {f"observation.images.{name}": {"type": "VISUAL", "shape": list(shape)} for name, shape in cameras.items()}
    config = {
        "type": "smolvla", "n_obs_steps": 1,
        "input_features": {**images, "observation.state": {"type": "STATE", "shape": [state_dim]}},
        "output_features": {"action": {"type": "ACTION", "shape": [action_dim]}},
        "device": "cpu", "use_amp": False, "use_peft": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None, "license": None, "pretrained_path": None,
        "chunk_size": chunk_size, "n_action_steps": n_action_steps,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
        "max_state_dim": 8, "max_action_dim": 8, "resize_imgs_with_padding": [32, 32], "empty_cameras": 0,
        "adapt_to_pi_aloha": False, "use_delta_joint_actions_aloha": False, "tokenizer_max_length": 16, "num_steps": 4, "use_cache": True,
        "freeze_vision_encoder": True, "train_expert_only": True, "train_state_proj": True,
        "optimizer_lr": 0.0001, "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08, "optimizer_weight_decay": 1e-10, "optimizer_grad_clip_norm": 10.0,
        "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000, "scheduler_decay_lr": 2.5e-06,
        "vlm_model_name": vlm_model_name, "load_vlm_weights": True, "add_image_special_tokens": False, "attention_mode": "cross_attn", "prefix_length": -1,
        "pad_language_to": "max_length", "num_expert_layers": -1, "num_vlm_layers": 2, "self_attn_every_n_layers": 2, "expert_width_multiplier": 0.75,
        "min_period": 0.004, "max_period": 4.0, "rtc_config": None, "compile_model": False, "compile_mode": "max-autotune",
    }
    unknown = set(fields) - set(config)
    if unknown:
        raise TypeError(f"unknown SmolVLA config fields {sorted(unknown)}")
    config.update(fields)
    return config


def tiny_processors(config: dict, stats: dict[str, dict[str, torch.Tensor]]) -> tuple[dict, dict, dict[str, dict[str, torch.Tensor]]]:
    """The pre/post-processor JSONs LeRobot's ``make_smolvla_pre_post_processors`` saves for
    ``config``, and their normalizer state files (every statistic as ``<key>.<stat>``)."""
    flat = {f"{key}.{stat}": value.to(torch.float32).contiguous() for key, per in stats.items() for stat, value in per.items()}
    norm_map = dict(config["normalization_mapping"])
    features = {**config["input_features"], **config["output_features"]}
    pre_state, post_state = "policy_preprocessor_step_5_normalizer_processor.safetensors", "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    tokenizer = {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right", "padding": config["pad_language_to"], "truncation": True, "tokenizer_name": config["vlm_model_name"]}
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "smolvla_new_line_processor", "config": {}},
        {"registry_name": "tokenizer_processor", "config": tokenizer},
        {"registry_name": "device_processor", "config": {"device": config["device"], "float_dtype": None}},
        {"registry_name": "normalizer_processor", "config": {"eps": 1e-08, "features": features, "norm_map": norm_map}, "state_file": pre_state},
    ]}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {"eps": 1e-08, "features": dict(config["output_features"]), "norm_map": norm_map}, "state_file": post_state},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
    ]}
    return pre, post, {pre_state: dict(flat), post_state: dict(flat)}


def write_tiny_smolvla(
    out: str | os.PathLike,
    vlm_dir: str | os.PathLike,
    *,
    state_dim: int,
    action_dim: int,
    cameras: dict[str, tuple[int, int, int]],
    chunk_size: int = 4,
    n_action_steps: int | None = None,
    stats: dict[str, dict[str, list[float]]] | None = None,
    seed: int = 0,
    vlm_size: TinyVLMSize | None = None,
    **fields,
) -> Path:
    """Write a tiny random SmolVLM into ``vlm_dir`` (unless it holds one) and a SmolVLA
    policy directory on it into ``out``: config.json (``fields`` override LeRobot's
    defaults), model.safetensors (random weights from ``seed``), the processors and
    their statistics (``stats``: {feature key: {stat: values}}; defaults for the state
    and the action, mean/std/min/max)."""
    tf = _transformers()
    vlm_dir = Path(vlm_dir)
    if not (vlm_dir / "config.json").is_file():
        save_tiny_vlm("smolvlm", vlm_dir, vlm_size, seed)
    config = tiny_smolvla_config(str(vlm_dir), state_dim, action_dim, cameras, chunk_size, n_action_steps or chunk_size, **fields)
    all_stats = {"observation.state": _default_stats(state_dim, 0.5), "action": _default_stats(action_dim, -0.25)}
    for name, shape in cameras.items():
        all_stats[f"observation.images.{name}"] = {s: [[[v]] for v in values[: shape[0]]] for s, values in _default_stats(3, 0.4).items()}
    all_stats.update(stats or {})
    tensors = {key: {stat: torch.tensor(values, dtype=torch.float32) for stat, values in per.items()} for key, per in all_stats.items()}
    pre, post, states = tiny_processors(config, tensors)
    files = LeRobotPolicyDir(Path(out), config, pre, post, states)
    torch.manual_seed(seed)
    model = SmolVLAModel(tf.AutoConfig.from_pretrained(vlm_dir, local_files_only=True), SmolVLAArch.of(files), "tiny SmolVLA config: ")
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    return write_lerobot_policy(files, state, out)


def contract_checkpoint(directory: str | os.PathLike) -> dict:
    """The contract's tiny SmolVLA for the Tabletop (one 16 px camera, state 4, actions 2):
    written under ``directory``; returns the policy overrides that name it."""
    directory = Path(directory)
    out = write_tiny_smolvla(directory / "smolvla", directory / "smolvlm", state_dim=4, action_dim=2, cameras={"image": (3, 16, 16)}, chunk_size=4, n_action_steps=2)
    return {"policy": {"checkpoint": str(out), "vlm_dir": str(directory / "smolvlm")}}
