"""LeRobot policy directories (LeRobot ≥ 0.4 layout), read and written by mmrl.

A directory that ``PreTrainedPolicy.save_pretrained`` and the processor pipelines write holds:

- ``config.json``: the policy config as draccus dumps it: ``type`` (``smolvla``, ``pi0``,
  …), ``input_features`` / ``output_features`` (``{key: {"type": "STATE", "shape": [D]}}``),
  ``normalization_mapping`` (feature type → ``MEAN_STD`` / ``MIN_MAX`` / ``IDENTITY`` /
  ``QUANTILES`` / ``QUANTILE10``) and the architecture's own fields;
- ``model.safetensors``: the policy module's state dict;
- ``policy_preprocessor.json`` / ``policy_postprocessor.json``: ``{"name", "steps": [...]}``,
  each step ``{"registry_name" (or "class"), "config", "state_file"?}``; a step with state
  (the normalizers) keeps it in ``<pipeline>_step_<i>_<registry_name>.safetensors`` with
  tensors named ``<feature key>.<stat>`` (``observation.state.mean``, ``action.std``, …).

:func:`read_lerobot_policy` parses that (safetensors only, never pickle) and keeps every
file's content, so :func:`write_lerobot_policy` writes the same layout back with the
fields it was read with (unknown ones verbatim) and new weights. What the architecture's
fields mean is its policy's business (``mmrl.policies.smolvla``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mmrl.errors import ConfigError
from mmrl.hub import CONFIG_FILES, pretrained_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"
NORMALIZATION_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
# the statistics each mode reads
MODE_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}
# the files a policy needs of the VLM it names (its weights are in model.safetensors)
VLM_FILES = ("config.json", "tokenizer_config.json")


@dataclass
class Feature:
    """A LeRobot ``PolicyFeature``: its type (``VISUAL``, ``STATE``, ``ACTION``, …) and shape."""

    type: str
    shape: tuple[int, ...]


@dataclass
class Normalizer:
    """A normalizer step (pre- or post-processor): per feature type its mode, per feature
    key its statistics, and the ε of the divisions."""

    modes: dict[str, str]
    features: dict[str, Feature]
    stats: dict[str, dict[str, Tensor]]
    eps: float = 1e-8

    def mode(self, key: str) -> str:
        feature = self.features.get(key)
        return "IDENTITY" if feature is None else self.modes.get(feature.type, "IDENTITY")

    def normalize(self, key: str, x: Tensor) -> Tensor:
        return normalize(x, self.mode(key), self._stats(key, x), self.eps)

    def unnormalize(self, key: str, x: Tensor) -> Tensor:
        return unnormalize(x, self.mode(key), self._stats(key, x), self.eps)

    def _stats(self, key: str, x: Tensor) -> dict[str, Tensor]:
        return {name: t.to(x.device, x.dtype) for name, t in self.stats.get(key, {}).items()}


def normalize(x: Tensor, mode: str, stats: dict[str, Tensor], eps: float) -> Tensor:
    """LeRobot's normalization of ``x`` by ``mode``:

    - MEAN_STD: (x − mean) / (std + ε)
    - MIN_MAX (QUANTILES, QUANTILE10 with q01/q99, q10/q90 as lo/hi): 2 (x − lo) / d − 1,
      d = hi − lo, or ε where hi = lo
    - IDENTITY: x
    """
    if mode == "IDENTITY":
        return x
    if mode == "MEAN_STD":
        return (x - stats["mean"]) / (stats["std"] + eps)
    lo, hi = (stats[name] for name in MODE_STATS[mode])
    return 2 * (x - lo) / _span(lo, hi, eps) - 1


def unnormalize(x: Tensor, mode: str, stats: dict[str, Tensor], eps: float) -> Tensor:
    """The inverse of :func:`normalize` as LeRobot computes it (MEAN_STD: x·std + mean,
    without ε; MIN_MAX: (x + 1) / 2 · d + lo; quantiles: (x + 1) · d / 2 + lo)."""
    if mode == "IDENTITY":
        return x
    if mode == "MEAN_STD":
        return x * stats["std"] + stats["mean"]
    lo, hi = (stats[name] for name in MODE_STATS[mode])
    if mode == "MIN_MAX":
        return (x + 1) / 2 * _span(lo, hi, eps) + lo
    return (x + 1.0) * _span(lo, hi, eps) / 2.0 + lo


def _span(lo: Tensor, hi: Tensor, eps: float) -> Tensor:
    span = hi - lo
    return torch.where(span == 0, torch.tensor(eps, device=span.device, dtype=span.dtype), span)


@dataclass
class LeRobotPolicyDir:
    """The files of a LeRobot policy directory, as read (weights apart: :func:`read_lerobot_weights`)."""

    path: Path
    config: dict  # config.json, every field as written
    preprocessor: dict  # policy_preprocessor.json
    postprocessor: dict  # policy_postprocessor.json
    step_states: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # state file name → its tensors

    @property
    def type(self) -> str:
        return self.config["type"]

    def features(self, which: str) -> dict[str, Feature]:
        """``input_features`` or ``output_features`` of config.json, in their order."""
        raw = self.config.get(which) or {}
        return {key: Feature(str(f["type"]), tuple(int(s) for s in f["shape"])) for key, f in raw.items()}

    def field(self, name: str):
        """A config.json field that must be there."""
        if name not in self.config:
            raise ConfigError(f"{self.path / CONFIG_FILE}: {name}", None, f"missing; a {self.type} config.json has it")
        return self.config[name]

    def step(self, pipeline: str, registry_name: str) -> dict | None:
        """The step of ``pipeline`` ("preprocessor" / "postprocessor") registered as ``registry_name``, or None."""
        for entry in getattr(self, pipeline).get("steps", []):
            if entry.get("registry_name") == registry_name:
                return entry
        return None

    def normalizer(self, pipeline: str, registry_name: str) -> Normalizer:
        """The (un)normalizer step of a pipeline, with its statistics."""
        file = PREPROCESSOR_FILE if pipeline == "preprocessor" else POSTPROCESSOR_FILE
        entry = self.step(pipeline, registry_name)
        if entry is None:
            raise ConfigError(f"{self.path / file}: steps", [s.get("registry_name", s.get("class")) for s in getattr(self, pipeline).get("steps", [])], f"no {registry_name} step")
        cfg = entry.get("config", {})
        features = {key: Feature(str(f["type"]), tuple(int(s) for s in f["shape"])) for key, f in cfg.get("features", {}).items()}
        modes = {str(k): str(v) for k, v in cfg.get("norm_map", {}).items()}
        for kind, mode in modes.items():
            if mode not in NORMALIZATION_MODES:
                raise ConfigError(f"{self.path / file}: {registry_name}.norm_map.{kind}", mode, f"allowed: {', '.join(NORMALIZATION_MODES)}")
        stats: dict[str, dict[str, Tensor]] = {}
        for flat, tensor in self.step_states.get(entry.get("state_file", ""), {}).items():
            key, _, stat = flat.rpartition(".")
            stats.setdefault(key, {})[stat] = tensor.to(torch.float32)
        normalizer = Normalizer(modes, features, stats, float(cfg.get("eps", 1e-8)))
        for key in features:
            needed = MODE_STATS.get(normalizer.mode(key), ())
            missing = [s for s in needed if s not in stats.get(key, {})]
            if missing:
                where = entry.get("state_file") or f"{file} (no state_file)"
                raise ConfigError(f"{self.path / where}", f"{key}: {sorted(stats.get(key, {}))}", f"{normalizer.mode(key)} normalization of {key} needs its {' and '.join(missing)}")
        return normalizer


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), None, "missing; a LeRobot (>= 0.4) policy directory has config.json, model.safetensors, policy_preprocessor.json and policy_postprocessor.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), None, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), type(data).__name__, "expected a JSON object")
    return data


def read_lerobot_policy(directory: str | os.PathLike, field: str = "policy.checkpoint", types: tuple[str, ...] | None = None) -> LeRobotPolicyDir:
    """Read a LeRobot policy directory (everything but its weights); ``types``: the policy
    types the caller implements (others are refused with a ConfigError naming ``field``).
    ``directory`` may be a hub id (``org/name[@revision]``, :func:`mmrl.hub.pretrained_dir`)."""
    path = pretrained_dir(directory, field)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(field, str(directory), f"not a LeRobot policy directory: no {CONFIG_FILE} (save_pretrained of a LeRobot policy writes it beside {WEIGHTS_FILE})")
    config = _read_json(path / CONFIG_FILE)
    kind = config.get("type")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{path / CONFIG_FILE}: type", kind, "a LeRobot policy config names its type (smolvla, pi0, act, ...)")
    if types is not None and kind not in types:
        raise ConfigError(f"{path / CONFIG_FILE}: type", kind, f"mmrl loads LeRobot policies of type {', '.join(types)}")
    if not (path / WEIGHTS_FILE).is_file():
        raise ConfigError(field, str(directory), f"no {WEIGHTS_FILE} (mmrl reads safetensors weights only)")
    pre, post = _read_json(path / PREPROCESSOR_FILE), _read_json(path / POSTPROCESSOR_FILE)
    states: dict[str, dict[str, Tensor]] = {}
    for pipeline, file in ((pre, PREPROCESSOR_FILE), (post, POSTPROCESSOR_FILE)):
        for entry in pipeline.get("steps", []):
            name = entry.get("state_file")
            if name is None:
                continue
            if not (path / name).is_file():
                raise ConfigError(f"{path / file}: state_file", name, f"missing from {path}: the {entry.get('registry_name', 'step')}'s statistics are in it")
            states[name] = _load_safetensors(path / name)
    return LeRobotPolicyDir(path, config, pre, post, states)


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ConfigError(str(path), None, f"not a readable safetensors file ({e})") from None


def read_lerobot_weights(directory: str | os.PathLike) -> dict[str, Tensor]:
    """``model.safetensors`` of a LeRobot policy directory (name → tensor, as stored)."""
    return _load_safetensors(Path(directory).expanduser() / WEIGHTS_FILE)


def write_lerobot_policy(files: LeRobotPolicyDir, state_dict: dict[str, Tensor], out: str | os.PathLike) -> Path:
    """Write ``files`` (config and processors as read, statistics tensor for tensor) with
    ``state_dict`` as model.safetensors into ``out``, atomically: everything goes to a
    temporary sibling directory that is then renamed to ``out`` (an existing ``out`` is
    replaced). Tensors sharing memory are written once, under the first name in sorted
    order, as ``safetensors.torch.save_model`` (LeRobot's writer) does."""
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    if out.exists() and not (out / CONFIG_FILE).is_file() and any(out.iterdir()):
        raise ConfigError("out", str(out), "exists and is not a LeRobot policy directory; name a new or empty directory (an old export is replaced)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / CONFIG_FILE).write_text(json.dumps(files.config, indent=4))
    save_file(_without_aliases(state_dict), str(tmp / WEIGHTS_FILE))
    for data, file in ((files.preprocessor, PREPROCESSOR_FILE), (files.postprocessor, POSTPROCESSOR_FILE)):
        (tmp / file).write_text(json.dumps(data, indent=2))
    for name, tensors in files.step_states.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _without_aliases(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """CPU copies of the tensors, each storage once (the first of its names, sorted)."""
    kept: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.device.type != "meta" else (id(tensor), 0)
        if key in seen:
            continue
        seen.add(key)
        kept[name] = tensor.detach().cpu().contiguous()
    return {name: kept[name] for name in state_dict if name in kept}


def resolve_vlm(name: str, vlm_dir: str | None, field: str = "policy.vlm_dir") -> Path:
    """The local directory of the VLM a policy names (its config and tokenizer; the weights
    are the policy's): ``vlm_dir`` when given (a directory or a hub id), else ``name`` if it is
    a directory, else the hub id ``name``'s config and tokenizer files, from the Hugging Face
    cache or downloaded (:func:`mmrl.hub.pretrained_dir`; its weights are never fetched)."""
    if vlm_dir is not None:
        directory = pretrained_dir(vlm_dir, field, only=CONFIG_FILES)
    elif Path(name).expanduser().is_dir():
        directory = Path(name).expanduser()
    else:
        try:
            directory = pretrained_dir(name, field, only=CONFIG_FILES)
        except ConfigError as e:
            raise ConfigError(field, None, f"the checkpoint's VLM {name!r}: {e.allowed}. Set {field} to a directory with its {', '.join(VLM_FILES)}") from None
    missing = [f for f in VLM_FILES if not (directory / f).is_file()]
    if missing:
        raise ConfigError(field, vlm_dir or name, f"expected the VLM's save_pretrained directory with {', '.join(VLM_FILES)}; {directory} is missing {', '.join(missing)}")
    return directory
