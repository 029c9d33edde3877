"""Weight I/O: a pretrained-policy directory is ``config.yaml`` (policy config + sampler spec)
plus ``model.safetensors``; a run directory points at its newest checkpoint, which is also
such a directory.

This module is the one place that knows both layouts, so that ``policy.pretrained`` may
name either, and so that loading weights never needs the training package.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from mmrl.errors import ConfigError

CHECKPOINTS = "checkpoints"
LATEST = "latest"  # file in checkpoints/ naming the newest complete checkpoint
CHECKPOINT_STATE = "state.pt"  # written last: its presence marks a complete checkpoint


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    directory = Path(run_dir) / CHECKPOINTS
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text().strip()
    return path if (path / CHECKPOINT_STATE).is_file() else None


def resolve_weights_dir(directory: str | os.PathLike) -> Path:
    """A weights directory as given, or a run directory's latest checkpoint (so that
    ``policy.pretrained: runs/my_sft_run`` starts RL from where that run ended), or the
    checkpoint a ``checkpoints/latest`` pointer file names."""
    d = Path(directory)
    if d.is_file() and d.name == LATEST and d.parent.name == CHECKPOINTS:
        named = latest_checkpoint(d.parent.parent)
        if named is not None:
            return named
    if not (d / "model.safetensors").is_file():
        latest = latest_checkpoint(d)
        if latest is not None:
            return latest
    return d


def _plain(obj):
    """Spec values as YAML-safe python (lists instead of arrays/tensors)."""
    import numpy as np

    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def save_pretrained(policy: nn.Module, directory: str | os.PathLike, spec: dict | None = None) -> None:
    """Write ``config.yaml`` (type, fields, spec) and ``model.safetensors`` into ``directory``,
    each atomically (temporary file, then rename)."""
    import yaml
    from safetensors.torch import save_file

    from mmrl.config import to_dict

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"policy": to_dict(policy.config), "spec": _plain(spec if spec is not None else getattr(policy, "spec", {}))}
    tmp = d / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(meta, sort_keys=False))
    os.replace(tmp, d / "config.yaml")
    state = {k: v.detach().contiguous().cpu() for k, v in policy.state_dict().items()}
    tmp = d / ".model.safetensors.tmp"
    save_file(state, str(tmp))
    os.replace(tmp, d / "model.safetensors")
    if hasattr(policy, "save_extra"):
        policy.save_extra(d)


def load_state(policy: nn.Module, directory: str | os.PathLike, field: str = "policy.pretrained") -> None:
    """Load ``model.safetensors`` from ``directory`` (or a run directory's latest checkpoint)
    into ``policy``, strictly: every tensor must fit."""
    from safetensors.torch import load_file

    directory = resolve_weights_dir(directory)
    path = directory / "model.safetensors"
    if not path.is_file():
        raise ConfigError(field, str(directory), "expected a directory holding model.safetensors (written by mmrl or save_pretrained)")
    if hasattr(policy, "load_extra"):
        policy.load_extra(directory)
    missing, unexpected = policy.load_state_dict(load_file(str(path)), strict=False)
    if missing or unexpected:
        raise ConfigError(field, str(directory), f"weights do not fit this policy (missing {missing[:3]}, unexpected {unexpected[:3]})")


def load_pretrained(directory: str | os.PathLike, **overrides) -> nn.Module:
    """Rebuild a policy from ``save_pretrained``'s directory: config + spec + weights."""
    from mmrl import registry
    from mmrl.config import from_dict, load_yaml

    directory = resolve_weights_dir(directory)
    meta = load_yaml(directory / "config.yaml", "policy.pretrained")
    data = dict(meta["policy"], **overrides)
    data["pretrained"] = None
    entry = registry.POLICIES.entry(data["type"], "policy.type")
    cfg = from_dict(entry.config, data, "policy")
    policy = entry.obj(cfg, meta.get("spec") or {})
    load_state(policy, directory)
    return policy


# what samplers tell a policy about its inputs and outputs (``Sampler.policy_spec``)
SPEC_KEYS = ("obs_dim", "action_dim", "action_low", "action_high", "state_dim", "image_shape", "instructions", "privileged_dim", "num_prompts", "prompt_file", "action_space", "observation_space", "max_action_length")


def build_policy(cfg, spec: dict) -> nn.Module:
    """Build the policy named by ``cfg.type`` from its config and the sampler's spec;
    ``cfg.pretrained`` loads local weights on top."""
    from mmrl import registry

    try:
        policy = registry.POLICIES.get(cfg.type, "policy.type")(cfg, spec)
    except KeyError as e:  # a spec entry the sampler does not offer: the policy and the env do not fit
        key = e.args[0] if e.args else None
        if key not in SPEC_KEYS or key in spec:
            raise
        offered = ", ".join(sorted(spec)) or "nothing"
        raise ConfigError("policy.type", cfg.type, f"reads {key!r} from the sampler's spec, which this env and sampler do not give (they give: {offered}); pick a policy for this env") from None
    if cfg.pretrained:
        load_state(policy, cfg.pretrained)
    return policy
