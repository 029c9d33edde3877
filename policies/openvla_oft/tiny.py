"""A tiny random OpenVLA-OFT checkpoint in the layout OFT's ``vla-scripts/finetune.py`` saves.

The OpenVLA files of :func:`mmrl.policies.openvla.tiny.write_tiny_openvla` (config.json,
bf16 safetensors, tokenizer, preprocessor_config.json, dataset_statistics.json with action
and proprio statistics), plus:

- ``action_head--{step}_checkpoint.pt``: the L1-regression head's state dict (bf16, as OFT
  casts the head), keys ``module.model.*`` (taken from its DDP wrapper);
- ``proprio_projector--{step}_checkpoint.pt``: the proprio projector's (float32), keys ``module.fc1.*``, ``module.fc2.*``;
- optionally ``lora_adapter/``: ``adapter_config.json`` + ``adapter_model.safetensors`` as
  PEFT saves a ``target_modules="all-linear"`` adapter over the whole VLA (keys
  ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, lora_alpha = min(r, 16)).

    python -m mmrl.policies.openvla_oft.tiny --out checkpoints/tiny_openvla_oft
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mmrl.policies.openvla.tiny import STATISTICS_DATA, randomize, write_tiny_openvla
from mmrl.policies.openvla_oft.checkpoint import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, DDP_PREFIX
from mmrl.policies.openvla_oft.heads import L1RegressionActionHead, ProprioProjector

# the layers PEFT's "all-linear" finds in an OpenVLA (the output layer lm_head excluded)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc1", "fc2", "fc3", "qkv", "proj", "q", "kv")


def write_tiny_openvla_oft(out, seed: int = 0, unnorm_key: str = "tabletop", statistics: dict | None = None, step: int = 150000,
                           proprio: bool = True, action_head: bool = True, lora_adapter: bool = False, lora_rank: int = 4, **openvla) -> Path:
    """Write a tiny random OpenVLA-OFT checkpoint into ``out`` (see the module docstring). The
    L1 head's action dim and the projector's proprio dim are those of ``unnorm_key``'s
    statistics (``statistics`` as for ``write_tiny_openvla``); ``openvla`` goes to that
    writer (sizes, shards)."""
    statistics = STATISTICS_DATA if statistics is None else statistics
    out = write_tiny_openvla(out, seed=seed, statistics=statistics, **openvla)
    config = json.loads((out / "config.json").read_text())
    hidden = int(config["text_config"]["hidden_size"])
    action_dim = len(statistics[unnorm_key]["action"]["q01"])
    g = torch.Generator().manual_seed(seed + 1)
    if action_head:
        head = L1RegressionActionHead(hidden * action_dim, hidden, action_dim)
        randomize(head, g, 0.2)
        state = {DDP_PREFIX + k: v.detach().to(torch.bfloat16) for k, v in head.state_dict().items()}
        torch.save(state, out / f"action_head--{step}_checkpoint.pt")
    if proprio:
        projector = ProprioProjector(hidden, len(statistics[unnorm_key]["proprio"]["q01"]))
        randomize(projector, g, 0.3)
        torch.save({DDP_PREFIX + k: v.detach().clone() for k, v in projector.state_dict().items()}, out / f"proprio_projector--{step}_checkpoint.pt")
    if lora_adapter:
        _write_adapter(out, g, lora_rank)
    return out


def _write_adapter(out: Path, g: torch.Generator, r: int) -> None:
    """A random LoRA adapter over every linear layer of the tiny model's weights, B ≠ 0 (a
    trained adapter, not a fresh one)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = out / ADAPTER_DIR
    folder.mkdir(exist_ok=True)
    tensors = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or module.rpartition(".")[2] not in ALL_LINEAR or "lm_head" in module or len(f.get_slice(name).get_shape()) != 2:
                continue
            rows, cols = f.get_slice(name).get_shape()
            tensors[f"base_model.model.{module}.lora_A.weight"] = (0.3 * torch.randn(r, cols, generator=g)).to(torch.bfloat16)
            tensors[f"base_model.model.{module}.lora_B.weight"] = (0.3 * torch.randn(rows, r, generator=g)).to(torch.bfloat16)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "alpha_pattern": {}, "auto_mapping": {"base_model_class": "OpenVLAForActionPrediction", "parent_library": "transformers_modules.openvla-7b.modeling_prismatic"},
        "base_model_name_or_path": "openvla/openvla-7b", "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": "gaussian",
        "layer_replication": None, "layers_pattern": None, "layers_to_transform": None, "loftq_config": {}, "lora_alpha": min(r, 16), "lora_dropout": 0.0,
        "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "r": r, "rank_pattern": {}, "revision": None,
        "target_modules": sorted(ALL_LINEAR), "task_type": None, "use_dora": False, "use_rslora": False,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def contract_checkpoint(directory) -> dict:
    """The contract's tiny OpenVLA-OFT (tests/policies/test_contract.py, ``prepare``): written
    under ``directory``; returns the policy overrides that name it."""
    out = write_tiny_openvla_oft(Path(directory) / "openvla_oft")
    return {"policy": {"checkpoint": str(out)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.policies.openvla_oft.tiny", description="write a tiny random OpenVLA-OFT checkpoint (the layout OFT's finetune.py saves)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-adapter", action="store_true")
    args = parser.parse_args(argv)
    print(write_tiny_openvla_oft(args.out, seed=args.seed, lora_adapter=args.lora_adapter))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
