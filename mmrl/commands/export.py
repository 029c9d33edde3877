"""``mmrl export``: a trained policy written in the layout of the stack it came from.

mmrl's own checkpoints (``config.yaml`` + ``model.safetensors``) load back into mmrl; a user
who brought a LeRobot policy, a diffusers pipeline or a transformers VLM wants the trained
weights back in *that* layout, to run with their usual code. Each policy says which formats
it writes as it is configured (``PolicyModule.export_formats``) and writes them
(``PolicyModule.export``); this module finds the weights (a run directory's latest
checkpoint, a checkpoint, or a ``save_pretrained`` directory), loads the policy and writes
the export under a temporary name that is renamed into place, so an interrupted export
leaves no half directory.

    mmrl export runs/my_run --format lerobot --out exported/my_policy
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mmrl.errors import ConfigError


def layouts() -> dict[str, dict[str, str]]:
    """Every format a registered policy can write, from each policy class's
    ``export_layouts``: ``{format: {policy type: what is written}}``, sorted by format."""
    from mmrl.registry import POLICIES

    found: dict[str, dict[str, str]] = {}
    for entry in POLICIES.entries():
        for name, doc in entry.obj.export_layouts.items():
            found.setdefault(name, {})[entry.name] = doc
    return dict(sorted(found.items()))


def layouts_help() -> str:
    """The formats of :func:`layouts` as ``mmrl export --help`` lists them: each format, then
    the policies that write it, those writing the same thing on one line."""
    lines = ["formats (--format), each with the policies that write it; which ones a policy writes depends on its configuration:"]
    for name, policies in layouts().items():
        lines.append(f"  {name}")
        by_doc: dict[str, list[str]] = {}
        for policy, doc in policies.items():
            by_doc.setdefault(doc, []).append(policy)
        lines += [f"    {', '.join(names)}: {doc}" for doc, names in by_doc.items()]
    return "\n".join(lines)


def export_policy(source: str | os.PathLike, fmt: str, out: str | os.PathLike) -> Path:
    """Load the policy of ``source`` (run directory, checkpoint or weights directory) and
    write it in format ``fmt`` into the new directory ``out``; returns ``out``."""
    from mmrl.core.weights import load_pretrained, resolve_weights_dir

    weights = resolve_weights_dir(source)
    if not (weights / "model.safetensors").is_file() or not (weights / "config.yaml").is_file():
        raise ConfigError("source", str(source), "expected a run directory with a checkpoint, a checkpoint directory or a save_pretrained directory (config.yaml + model.safetensors)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", str(out), "exists and is not an empty directory: name a new one")
    policy = load_pretrained(weights)
    formats = policy.export_formats()
    if fmt not in formats:
        kind = type(policy).__name__
        allowed = ", ".join(f"{name} ({doc})" for name, doc in formats.items()) if formats else "none: its checkpoint (config.yaml + model.safetensors) is its only layout"
        raise ConfigError("--format", fmt, f"this {kind} writes: {allowed}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        policy.export(fmt, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out
