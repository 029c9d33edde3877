"""Pretrained sources by local directory or Hugging Face hub id, as transformers, diffusers and
LeRobot take them.

Every loader of a pretrained thing (text LMs and VLMs, VLM backbones, the LeRobot and OpenVLA
formats, diffusers pipelines, reward models) turns its config field into a directory with
:func:`pretrained_dir`:

- a local directory of that name wins (as in transformers);
- otherwise ``org/name`` or ``org/name@revision`` is a hub id: ``huggingface_hub`` resolves it,
  downloading when online (honouring ``HF_HOME``, ``HF_TOKEN`` and ``HF_ENDPOINT``) and taking
  the cache when ``HF_HUB_OFFLINE=1`` or when the revision is already cached. A download that
  stops mid-way leaves the cache as it was (files land under ``.incomplete`` names first);
- a miss is one line: the id, the revision and where it looked.

Only weights mmrl reads are fetched: pickled, TensorFlow, Flax and ONNX weight files are left on
the hub (mmrl loads safetensors), and so are GGUF files unless the loader names one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mmrl.errors import ConfigError

# org/name (or a bare name, as transformers allows for canonical repos), optionally @revision
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*(?:/[\w.\-]+)?)(?:@(?P<revision>[\w.\-/]+))?$")
# a repository's config, tokenizer and processor files: what a loader that needs no weights fetches
CONFIG_FILES = ["*.json", "*.txt", "*.model", "*.jinja"]
# what a snapshot of a model repository leaves out: weight formats mmrl never reads
SKIPPED = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.msgpack", "*.h5", "*.tflite", "*.onnx", "*.onnx_data", "*.ot", "*.gguf", "*.mlmodel", "*.mlpackage/*"]


def split_hub_id(value: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of ``org/name[@revision]``, or None if ``value`` is not one."""
    match = _HUB_ID.match(value)
    return None if match is None else (match.group("repo"), match.group("revision"))


def cache_dir() -> str:
    """Where huggingface_hub keeps downloaded repositories (``HF_HUB_CACHE`` / ``HF_HOME``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    """Whether hub ids resolve from the cache only (``HF_HUB_OFFLINE=1``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    """The hub a download asks (``HF_ENDPOINT``, default https://huggingface.co)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def pretrained_dir(
    value: str | os.PathLike, field: str, *, revision: str | None = None, files: list[str] | None = None, only: list[str] | None = None
) -> Path:
    """The local directory of a pretrained source named by config ``field``: ``value`` itself
    when it is a directory, else the cached or downloaded snapshot of the hub id ``value``
    (``org/name``, optionally ``@revision``; ``revision`` gives one where the id has none).
    ``files``: glob patterns to fetch on top of the default (a GGUF file the loader names);
    ``only``: fetch just the files these patterns match (a tokenizer without its model)."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    text = str(value)
    parsed = split_hub_id(text)
    if parsed is None:
        raise ConfigError(field, text, "no such directory, and not a hub id (org/name, optionally @revision)")
    repo_id, at = parsed
    revision = at or revision
    return snapshot(repo_id, revision, field, text, files, only)


def pipeline_dir(value: str | os.PathLike, field: str) -> Path:
    """A diffusers pipeline named by ``field``: a directory, or a hub id of which only
    ``model_index.json`` and the folders of the components it lists are fetched (a repository
    that also holds single-file checkpoints keeps them on the hub), as diffusers does."""
    path = Path(value).expanduser()
    if path.is_dir() or split_hub_id(str(value)) is None:
        return pretrained_dir(value, field)
    index_dir = pretrained_dir(value, field, only=["model_index.json"])
    try:
        index = json.loads((index_dir / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(field, str(value), f"is a hub id without a readable model_index.json ({_reason(e)}): not a diffusers pipeline") from None
    components = [name for name, entry in index.items() if not name.startswith("_") and isinstance(entry, list) and entry[:1] != [None]]
    return pretrained_dir(value, field, only=["model_index.json", *(f"{name}/*" for name in components)])


def snapshot(repo_id: str, revision: str | None, field: str, value: str, files: list[str] | None = None, only: list[str] | None = None) -> Path:
    """``repo_id`` at ``revision`` (default main) from the cache, or downloaded (see the module)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError as e:  # pragma: no cover - a dependency of transformers and diffusers
        raise ConfigError(field, value, "is a hub id, and huggingface_hub is not installed (pip install huggingface_hub)") from e
    ignore = [p for p in SKIPPED if not any(p.endswith(f.rsplit(".", 1)[-1]) for f in (files or []))]
    rev = revision or "main"
    where = f"the Hugging Face cache {cache_dir()}" + (" (HF_HUB_OFFLINE=1)" if offline() else f" and {endpoint()}")
    try:
        out = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=only, ignore_patterns=ignore, endpoint=None if offline() else endpoint()
        )
    except (errors.RevisionNotFoundError, errors.RepositoryNotFoundError, errors.GatedRepoError, errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        raise ConfigError(field, value, f"hub id {repo_id!r} at revision {rev!r} was not found; looked in {where} ({_reason(e)})") from e
    except Exception as e:  # a dropped connection, a refused one, a full disk: one line, with the cause
        raise ConfigError(field, value, f"hub id {repo_id!r} at revision {rev!r} could not be fetched; looked in {where} ({_reason(e)})") from e
    return Path(out)


def _reason(error: BaseException) -> str:
    """The first sentence of a hub error's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    return first.split(". ")[0].rstrip(".")[:160]
