"""The ``Policy`` protocol: the only contract the core relies on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@dataclass
class Sample:
    """What one ``Policy.sample`` call returns for N inputs and T decisions each."""

    output: Any  # what the caller consumes: actions [N, C, A], token ids, final latents ...
    logp: Tensor  # [N, T] log-prob of each decision under the sampling parameters
    replay: dict[str, Any]  # enough to recompute ``logp`` with ``log_prob(replay)``
    mask: Tensor | None = None  # [N, T] valid decisions (None = all valid)
    entropy: Tensor | None = None  # [N, T] per-decision entropy, if the policy can tell
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    def sample(self, inputs: Any, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample: ...

    def log_prob(self, replay: dict[str, Any]) -> Tensor: ...


class PolicyModule(nn.Module):
    """Base class for mmrl's own policies: ``forward`` is ``log_prob`` so that the
    distributed wrapper (DDP/FSDP) sees the training pass and synchronises its gradients."""

    config: Any = None

    def sample(self, inputs: Any, generator: torch.Generator | None = None, deterministic: bool = False) -> Sample:
        raise NotImplementedError

    def log_prob(self, replay: dict[str, Any]) -> Tensor:
        raise NotImplementedError

    def sft_loss(self, batch: dict[str, Any]) -> Tensor:
        """Behaviour-cloning loss on demonstrations (``algo.type: sft``); ``batch`` holds the
        observations ("image", "state", "instruction" or "obs"), "actions" [B, C, A] in env
        units and "action_mask" [B, C]."""
        raise NotImplementedError(f"{type(self).__name__} has no sft_loss (behaviour cloning)")

    def imitation_batch(self, replay: dict[str, Any]) -> dict[str, Any]:
        """The decisions of a replay ([N, T, ...] tensors) as a ``sft_loss`` batch of N·T
        samples: their observations and the action chunks that were executed (env units),
        so that the policy's own behaviour can be imitated with its supervised loss
        (``algo.replay_loss: sft``). Only reshapes and decodes: it touches no parameter."""
        raise NotImplementedError(f"{type(self).__name__} cannot turn its replay into a sft_loss batch (algo.replay_loss: sft)")

    def exact_kl(self, replay: dict[str, Any], reference: "PolicyModule") -> Tensor:
        """KL(πθ ‖ πref) [B, T] of each replayed decision in closed form (``kl.type: exact``),
        where the policy can compute it (the Gaussian steps of a denoising chain), with
        gradient w.r.t. this policy's parameters only; ``reference`` is the frozen
        reference policy."""
        raise NotImplementedError(
            f"{type(self).__name__} has no closed-form KL to its reference (kl.type: exact); use a sampled estimator (k1, k2, k3) instead"
        )

    def forward(self, replay: dict[str, Any], mode: str = "log_prob") -> Tensor:
        # the distributed wrapper syncs gradients of what goes through forward: both the RL
        # pass (log_prob) and supervised fine-tuning (sft) do
        return self.sft_loss(replay) if mode == "sft" else self.log_prob(replay)

    def save_extra(self, directory) -> None:
        """Write files the weights do not hold (e.g. a tokenizer) next to them; called by
        ``save_pretrained`` and by checkpoints."""

    def load_extra(self, directory) -> None:
        """Read what ``save_extra`` wrote; called before the weights are loaded."""

    def reference(self) -> "nn.Module | None":
        """A frozen model for KL terms; ``None`` lets the trainer keep a frozen copy of the
        initial weights."""
        return None


def save_pretrained(policy: PolicyModule, directory, spec: dict | None = None) -> None:
    """Write ``config.yaml`` (type, fields, spec) and ``model.safetensors`` into ``directory``."""
    import os
    from pathlib import Path

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


def resolve_weights_dir(directory):
    """A weights directory as given, or a run directory's latest checkpoint (so that
    ``policy.pretrained: runs/my_sft_run`` starts RL from where that run ended)."""
    from pathlib import Path

    from mmrl.train.checkpoint import Checkpointer  # imports this module

    d = Path(directory)
    if not (d / "model.safetensors").is_file():
        latest = Checkpointer(d).latest()
        if latest is not None:
            return latest
    return d


def load_state(policy: nn.Module, directory, field: str = "policy.pretrained") -> None:
    """Load ``model.safetensors`` from ``directory`` into ``policy`` (strict)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from mmrl.errors import ConfigError

    directory = resolve_weights_dir(directory)
    path = Path(directory) / "model.safetensors"
    if not path.is_file():
        raise ConfigError(field, str(directory), "expected a directory holding model.safetensors (written by mmrl or save_pretrained)")
    if hasattr(policy, "load_extra"):
        policy.load_extra(Path(directory))
    state = load_file(str(path))
    missing, unexpected = policy.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(field, str(directory), f"weights do not fit this policy (missing {missing[:3]}, unexpected {unexpected[:3]})")


def load_pretrained(directory, **overrides) -> PolicyModule:
    """Rebuild a policy from ``save_pretrained``'s directory: config + spec + weights."""
    from pathlib import Path

    from mmrl import registry
    from mmrl.config import from_dict, load_yaml

    directory = resolve_weights_dir(directory)
    meta = load_yaml(Path(directory) / "config.yaml", "policy.pretrained")
    data = dict(meta["policy"], **overrides)
    data["pretrained"] = None
    entry = registry.POLICIES.entry(data["type"], "policy.type")
    cfg = from_dict(entry.config, data, "policy")
    policy = entry.obj(cfg, meta.get("spec") or {})
    load_state(policy, directory)
    return policy


def build_policy(cfg, spec: dict) -> PolicyModule:
    """Build the policy named by ``cfg.type`` from its config and the sampler's spec;
    ``cfg.pretrained`` loads local weights on top."""
    from mmrl import registry

    policy = registry.POLICIES.get(cfg.type, "policy.type")(cfg, spec)
    if cfg.pretrained:
        load_state(policy, cfg.pretrained)
    return policy
