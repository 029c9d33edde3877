"""The files an OpenVLA-OFT checkpoint directory holds beside the OpenVLA ones, read and written
as OFT's ``vla-scripts/finetune.py`` writes them and ``experiments/robot/openvla_utils.py``
reads them.

- ``action_head--{step}_checkpoint.pt`` / ``proprio_projector--{step}_checkpoint.pt``: a
  ``torch.save`` of the module's ``state_dict()`` taken from its DDP wrapper, so every key
  starts with ``module.``. The reference finds the file as the one directory entry whose name
  contains the component's name and ``checkpoint`` (exactly one), loads it with
  ``torch.load(..., weights_only=True)`` and drops the ``module.`` prefix. The same here: no
  pickled code is ever run.
- ``lora_adapter/``: the PEFT adapter ``get_peft_model(vla, LoraConfig(target_modules="all-linear"))``
  saved, i.e. over the whole VLA (language model, projector and the ViTs' linear layers), keys
  ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``. The fine-tune merges it
  into the model files it saves (``merge_lora_during_training``, default true) and the
  reference's inference never reads it; ``merge_lora_weights_and_save.py`` applies it to the
  base model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from mmrl.errors import ConfigError

ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DDP_PREFIX = "module."


def find_component(root: Path, name: str) -> Path | None:
    """The file of component ``name`` (``action_head``, ``proprio_projector``): the one entry of
    ``root`` whose name contains ``name`` and ``checkpoint`` (OFT's ``find_checkpoint_file``);
    None when there is none."""
    found = sorted(p for p in Path(root).iterdir() if p.is_file() and name in p.name and "checkpoint" in p.name)
    if len(found) > 1:
        raise ConfigError("policy.checkpoint", str(root), f"holds {len(found)} {name} checkpoints ({', '.join(p.name for p in found)}); the reference expects exactly one")
    return found[0] if found else None


def read_component(path: Path) -> tuple[dict[str, Tensor], bool]:
    """(state dict without the DDP prefix, whether the file had it), loaded with
    ``weights_only=True``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a refused pickle or a damaged file: say which file, in one line
        raise ConfigError("policy.checkpoint", str(path), f"not a plain tensor state dict that torch.load(weights_only=True) reads: {type(e).__name__}") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError("policy.checkpoint", str(path), "expected a state dict of tensors")
    prefixed = any(k.startswith(DDP_PREFIX) for k in state)
    return {(k[len(DDP_PREFIX) :] if k.startswith(DDP_PREFIX) else k): v for k, v in state.items()}, prefixed


def write_component(path: Path, state: dict[str, Tensor], like: dict[str, Tensor], prefixed: bool) -> None:
    """``torch.save`` of plain CPU tensors under the source file's names (``module.`` again
    where it had it), each in the dtype the source stored it in."""
    out = {}
    for name, tensor in state.items():
        out[(DDP_PREFIX if prefixed else "") + name] = tensor.detach().to("cpu", like[name].dtype).contiguous().clone()
    torch.save(out, path)


def adapter_deltas(root: Path, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """ΔW = s·B·A (float32) of every layer of ``root/lora_adapter``, by the name of the weight
    it adds to (s = lora_alpha / r, or / √r with rslora), as PEFT's merge computes it."""
    from safetensors.torch import load_file

    folder = Path(root) / ADAPTER_DIR
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError("policy.lora_adapter", "apply", f"{folder} holds no {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}")
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern") or config.get("fan_in_fan_out"):
        raise ConfigError("policy.lora_adapter", "apply", f"{folder / ADAPTER_CONFIG}: only a plain LoRA adapter is read (no DoRA, rank/alpha patterns, fan_in_fan_out)")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in load_file(str(folder / ADAPTER_WEIGHTS)).items():
        name = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            for tail in (f".{part}.weight", f".{part}.default.weight"):
                if name.endswith(tail):
                    pairs.setdefault(name[: -len(tail)], {})[part] = value
                    break
            else:
                continue
            break
        else:
            raise ConfigError("policy.lora_adapter", "apply", f"{folder / ADAPTER_WEIGHTS}: unexpected tensor {key} (only lora_A / lora_B of linear layers are read)")
    deltas = {}
    for module, pair in pairs.items():
        target = f"{module}.weight"
        if target not in tensors or set(pair) != {"lora_A", "lora_B"}:
            raise ConfigError("policy.lora_adapter", "apply", f"the adapter's layer {module} is not a linear layer of this checkpoint")
        deltas[target] = scale * (pair["lora_B"].float() @ pair["lora_A"].float())
    return deltas
