"""Prompt datasets: records of a prompt, an optional answer and metadata, split into a train
and a held-out part, and visited in a seeded order of epochs.

A record (:class:`PromptRecord`) holds
- ``prompt``: a text (``str``) or a condition (``int``, e.g. a class id);
- ``answer``: the reference answer that verifiable rewards check, or None;
- ``metadata``: a dict of anything else (a category, a difficulty, a source id);
- ``images``: the paths of the images that come with the prompt (none, one, or a video's
  frames), from the field ``image_field``: a path or a list of paths, relative to the folder
  of the source file (of the saved dataset's directory);
- ``record_id``: the record's row in its source (0-based), to trace a sample to its data.

A text prompt with images reaches the policy as an :class:`ImagePrompt` (its text and the
images as RGB uint8 arrays, read once and cached), a text prompt without images as its string
(:func:`prompt_input`).

Sources (:func:`read_records`):
- a ``.jsonl`` file, one JSON object per line (blank lines are skipped);
- a ``.csv`` file with a header row; every cell is a string, and an empty cell is missing;
- a directory written by ``datasets.Dataset.save_to_disk`` (the ``data`` extra). A saved
  ``DatasetDict`` holds one sub-directory per split: point at ``<dir>/<split>``;
- :func:`integer_records`: the conditions 0 … n−1 without answers, the toy configs' source.

Which field is the prompt, the answer and the metadata is configurable
(:class:`PromptDataConfig`). With ``metadata_fields`` null the metadata is every field but
the prompt, the answer and the images. A field whose value is a mapping (a JSON object, a ``datasets``
struct) contributes its keys rather than itself, so ``{"metadata": {"category": "add"}}``
in JSONL and a CSV column ``category`` both give ``metadata["category"]``. Missing values
are left out of the metadata.

Prompt kinds: all prompts of a run are conditions (ints) or all are texts. ``prompt_kind:
auto`` picks conditions when every prompt of the train and held-out sources is an integer
(JSON or Arrow), texts when every one is a string; ``condition`` also reads integer strings
(a CSV column of class ids); ``text`` turns numbers into strings.

Held-out split: either a second source (``eval``) or ``eval_fraction`` of the train source:
k = ⌊fraction·n + ½⌋ records, those at the first k positions of a permutation of 0 … n−1
drawn from ``split_seed`` alone — not the run seed, the number of processes or the rank — so
every run and every process holds out the same records. Both parts keep the source order.

Epoch order (:func:`epoch_order`, :class:`EpochOrder`): the train records are visited in
epochs, each a permutation drawn from (run seed, epoch) alone: every record once per epoch,
in a new order each epoch. Permutations come from numpy's legacy ``RandomState``, whose
streams numpy keeps fixed across versions, so a split or a data order survives upgrades.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mmrl.config import option
from mmrl.errors import ConfigError, MissingExtraError

_FORMATS = "expected a .jsonl or .csv file or a directory written by datasets' save_to_disk"
_INTEGER = re.compile(r"\s*[+-]?\d+\s*")


@dataclass
class PromptDataConfig:
    """Prompt records: the train and held-out sources, their fields and the split."""

    train: str | None = option(None, "train prompts: a .jsonl or .csv file or a directory saved by datasets' save_to_disk (null = the integer conditions 0 .. num_prompts-1)")
    eval: str | None = option(None, "held-out prompts, same formats (null = hold out eval_fraction of train; if that is 0, evaluate on train)")
    num_prompts: int = option(4, "number of integer conditions when train is null", ge=1)
    prompt_field: str = option("prompt", "field holding each record's prompt (a text or an integer condition)")
    answer_field: str | None = option("answer", "field holding the reference answer (null = none); a record without it has none")
    image_field: str | None = option("image", "field holding the path of an image that comes with the prompt, or a list of paths (a video's frames), relative to the source file's folder (null = no images); a record without it has none")
    metadata_fields: list[str] | None = option(None, "fields gathered into each record's metadata (null = all but the prompt and answer); a mapping contributes its keys")
    prompt_kind: Literal["auto", "text", "condition"] = option("auto", "prompts are texts or integer conditions (auto: conditions if every prompt is an integer)")
    eval_fraction: float = option(0.0, "fraction of train held out for evaluation when eval is null", ge=0, lt=1)
    split_seed: int = option(0, "seed of the held-out split (not the run seed, so every run holds out the same records)", ge=0)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.eval is not None and self.eval_fraction > 0:
            raise ConfigError(p + "eval_fraction", self.eval_fraction, f"must be 0 when eval names a held-out source ({self.eval})")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer (None if it has none) and metadata."""

    prompt: str | int
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    record_id: int = 0  # row in the source, 0-based
    images: tuple[str, ...] = ()  # paths of the images that come with the prompt


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """A text prompt with images (a video is its frames): what a policy receives for a record
    with images. Each image is an RGB uint8 array [H, W, 3], read-only (shared by a group's
    samples and cached across calls)."""

    text: str
    images: tuple[np.ndarray, ...]


@lru_cache(maxsize=4096)
def read_image(path: str) -> np.ndarray:
    """The image file at ``path`` as a read-only RGB uint8 array [H, W, 3] (Pillow)."""
    from PIL import Image

    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    array.setflags(write=False)
    return array


def prompt_input(record: PromptRecord) -> str | int | ImagePrompt:
    """What a policy receives for ``record``: its prompt, or an :class:`ImagePrompt` when
    images come with it."""
    if not record.images:
        return record.prompt
    return ImagePrompt(str(record.prompt), tuple(read_image(p) for p in record.images))


def require_text_prompts(spec: dict, policy: str) -> None:
    """Refuse a prompt sampler whose records are integer conditions (its policy spec holds
    ``num_prompts``; ``prompt_file``, its train source) for a ``policy`` that reads prompt
    strings, naming the field that chose the conditions."""
    n = spec.get("num_prompts")
    if n is None:
        return
    source = spec.get("prompt_file")
    if source is None:
        given = f"gives the integer conditions 0 .. {n - 1} (sampler.data.num_prompts)"
        fix = "set it to a .jsonl or .csv file of text prompts (or a directory saved by datasets' save_to_disk)"
    else:
        given = "holds integer prompts, read as conditions (sampler.data.prompt_kind auto)"
        fix = "give it text prompts, or set sampler.data.prompt_kind: text to read these as texts"
    raise ConfigError("sampler.data.train", source, f"{given}, but {policy} takes prompt strings; {fix}")


def integer_records(num_prompts: int) -> list[PromptRecord]:
    """The conditions 0 … n−1, without answers or metadata."""
    return [PromptRecord(prompt=i, record_id=i) for i in range(num_prompts)]


def read_records(cfg: PromptDataConfig, key: Literal["train", "eval"], path: str = "sampler.data") -> list[PromptRecord]:
    """The records of the source ``cfg.<key>`` with their prompts as read (strings or
    integers; :func:`resolve_prompt_kind` settles them). Errors name ``<path>.<option>``."""
    source = getattr(cfg, key)
    rows, columns = _read_rows(Path(source), f"{path}.{key}")
    if not rows:
        raise ConfigError(f"{path}.{key}", source, "holds no records")
    # a source without the answer field simply has no answers (a reward that needs them says
    # so, naming answer_field); the prompt and metadata fields must exist
    for option_name, name in [("prompt_field", cfg.prompt_field)] + [("metadata_fields", name) for name in cfg.metadata_fields or []]:
        if name not in columns:
            raise ConfigError(f"{path}.{option_name}", name, f"no such field in {source}; its fields: {', '.join(columns)}")
    metadata_fields = cfg.metadata_fields if cfg.metadata_fields is not None else [c for c in columns if c not in (cfg.prompt_field, cfg.answer_field, cfg.image_field)]
    # image paths are relative to the file's folder (a saved dataset: its directory)
    image_root = Path(source) if Path(source).is_dir() else Path(source).parent
    records = []
    for i, row in enumerate(rows):
        prompt = row.get(cfg.prompt_field)
        if prompt is None:
            raise ConfigError(f"{path}.prompt_field", cfg.prompt_field, f"record {i} of {source} has no prompt")
        answer = row.get(cfg.answer_field) if cfg.answer_field is not None else None
        images = _image_paths(row.get(cfg.image_field) if cfg.image_field is not None else None, image_root, f"{path}.image_field", cfg.image_field, i, source)
        records.append(PromptRecord(prompt, answer, _metadata(row, metadata_fields), i, images))
    return records


def _image_paths(value, root: Path, field_name: str, image_field: str, row: int, source: str) -> tuple[str, ...]:
    """The record's image paths (a path or a list of them), resolved against ``root``; each must exist."""
    if value is None:
        return ()
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(field_name, image_field, f"record {row} of {source} holds {value!r}; expected an image path or a list of paths")
    resolved = tuple(str(root / p) for p in paths)
    for p in resolved:
        if not Path(p).is_file():
            raise ConfigError(field_name, image_field, f"record {row} of {source} names the image {p}, which does not exist (paths are relative to the source file's folder)")
    return resolved


def _metadata(row: dict, fields: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in fields:
        value = row.get(name)
        if isinstance(value, Mapping):
            out.update((k, v) for k, v in value.items() if v is not None)
        elif value is not None:
            out[name] = value
    return out


def _read_rows(path: Path, field_name: str) -> tuple[list[dict], list[str]]:
    """The rows of a source as dicts, and its field names in order."""
    if not path.exists():
        raise ConfigError(field_name, str(path), f"no such file or directory; {_FORMATS}")
    if path.is_dir():
        return _saved_dataset_rows(path, field_name)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(field_name, str(path), f"line {line_no} is not JSON: {e.msg}") from None
                if not isinstance(row, dict):
                    raise ConfigError(field_name, str(path), f"line {line_no} is not a JSON object")
                rows.append(row)
        return rows, list(dict.fromkeys(k for row in rows for k in row))
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            # a short row gives None for its missing cells, a long one puts the extra cells under None
            rows = [{k: v for k, v in row.items() if k is not None and v not in (None, "")} for row in reader]
            return rows, list(reader.fieldnames or [])
    raise ConfigError(field_name, str(path), f"unknown format; {_FORMATS}")


def _saved_dataset_rows(path: Path, field_name: str) -> tuple[list[dict], list[str]]:
    try:
        import datasets
    except ImportError:
        raise MissingExtraError("datasets", "data", f"reading a saved dataset ({field_name})") from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ConfigError(field_name, str(path), f"is a directory but not a saved dataset; {_FORMATS}") from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        raise ConfigError(field_name, str(path), f"holds a DatasetDict with splits {', '.join(splits)}; point at one split's directory, e.g. {path / splits[0]}")
    return dataset.to_list(), list(dataset.column_names)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_prompt_kind(parts: list[list[PromptRecord]], kind: str, path: str = "sampler.data") -> tuple[str, list[list[PromptRecord]]]:
    """("condition" | "text", the parts with every prompt an int | a str), decided over all
    parts together (train and held-out prompts must be of one kind)."""
    prompts = [r.prompt for part in parts for r in part]
    if kind == "auto":
        if all(_is_integer(p) for p in prompts):
            kind = "condition"
        elif all(isinstance(p, str) for p in prompts):
            kind = "text"
        else:
            example = next(p for p in prompts if not isinstance(p, str))
            raise ConfigError(f"{path}.prompt_kind", "auto", f"the prompts are neither all integers nor all strings (e.g. {example!r}); set prompt_kind: text or condition")

    def convert(record: PromptRecord) -> PromptRecord:
        p = record.prompt
        if kind == "condition":
            if not (_is_integer(p) or (isinstance(p, str) and _INTEGER.fullmatch(p))):
                raise ConfigError(f"{path}.prompt_kind", kind, f"record {record.record_id}'s prompt {p!r} is not an integer")
            if int(p) < 0:
                raise ConfigError(f"{path}.prompt_kind", kind, f"record {record.record_id}'s condition {int(p)} is negative; conditions are ids >= 0")
            return replace(record, prompt=int(p))
        if not isinstance(p, (str, int, float)) or isinstance(p, bool):
            raise ConfigError(f"{path}.prompt_kind", kind, f"record {record.record_id}'s prompt {p!r} is not a text")
        return replace(record, prompt=str(p))

    return kind, [[convert(r) for r in part] for part in parts]


def _seed_words(*values: int) -> list[int]:
    """Non-negative ints as the 32-bit words ``RandomState`` is seeded with."""
    return [w for v in values for w in (v & 0xFFFFFFFF, v >> 32)]


def split_held_out(records: list[PromptRecord], fraction: float, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, held-out). k = ⌊fraction·n + ½⌋ records are held out: those at the first k
    positions of ``RandomState(seed).permutation(n)``. Both keep the source order."""
    n = len(records)
    held = np.zeros(n, dtype=bool)
    held[np.random.RandomState(_seed_words(seed)).permutation(n)[: math.floor(fraction * n + 0.5)]] = True
    return [r for r, h in zip(records, held) if not h], [r for r, h in zip(records, held) if h]


def clusters_by(records: list["PromptRecord"], key: str) -> list[list[int]]:
    """Record indices grouped by the value of metadata ``key`` (first appearance order); a
    record without the key is a cluster of its own."""
    clusters: dict[Any, list[int]] = {}
    for i, record in enumerate(records):
        clusters.setdefault(("value", str(record.metadata[key])) if key in record.metadata else ("alone", i), []).append(i)
    return list(clusters.values())


def epoch_order(num_records: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of 0 … n−1 that epoch ``epoch`` visits the records in, drawn from
    (seed, epoch) alone."""
    return np.random.RandomState(_seed_words(seed, epoch)).permutation(num_records)


class EpochOrder:
    """The stream of epochs over n records: position p is record ``epoch_order(n, seed,
    p // n)[p % n]``. Positions are global (shared by all processes), so the record at a
    position does not depend on which process asks."""

    _CACHED_EPOCHS = 4  # a call's positions span one or two epochs unless n is tiny

    def __init__(self, num_records: int, seed: int, clusters: list[list[int]] | None = None):
        """``clusters`` (a partition of the records, e.g. the paraphrases of each question):
        an epoch then visits the clusters in a random order, each cluster's records one after
        another in source order."""
        self.num_records, self.seed, self.clusters = num_records, seed, clusters
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= self._CACHED_EPOCHS:
                self._orders.pop(next(iter(self._orders)))
            if self.clusters is None:
                self._orders[epoch] = epoch_order(self.num_records, self.seed, epoch)
            else:
                perm = epoch_order(len(self.clusters), self.seed, epoch)
                self._orders[epoch] = np.array([i for c in perm for i in self.clusters[c]], dtype=np.int64)
        return self._orders[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """Record indices at positions start … start + count − 1."""
        n = self.num_records
        return [int(self._order(p // n)[p % n]) for p in range(start, start + count)]


@dataclass
class PromptData:
    """What a prompt sampler draws from: the train split, the held-out split (empty when there
    is none) and the kind of every prompt."""

    train: list[PromptRecord]
    held_out: list[PromptRecord]
    kind: Literal["text", "condition"]

    @classmethod
    def load(cls, cfg: PromptDataConfig, path: str = "sampler.data") -> "PromptData":
        """Read the sources of ``cfg`` and split them; errors name ``<path>.<option>``."""
        cfg.validate(path)
        train = read_records(cfg, "train", path) if cfg.train is not None else integer_records(cfg.num_prompts)
        held_out = read_records(cfg, "eval", path) if cfg.eval is not None else []
        kind, (train, held_out) = resolve_prompt_kind([train, held_out], cfg.prompt_kind, path)
        if kind == "condition" and any(r.images for r in train + held_out):
            raise ConfigError(f"{path}.image_field", cfg.image_field, "images come with text prompts; these prompts are integer conditions (set prompt_kind: text, or image_field: null)")
        if cfg.eval_fraction > 0:
            n = len(train)
            train, held_out = split_held_out(train, cfg.eval_fraction, cfg.split_seed)
            if not train or not held_out:
                raise ConfigError(f"{path}.eval_fraction", cfg.eval_fraction, f"holds out {len(held_out)} of {n} records; each split needs at least one")
        return cls(train, held_out, kind)

    @property
    def num_conditions(self) -> int | None:
        """1 + the largest condition of either split (the size of a condition embedding
        table), or None for texts."""
        if self.kind != "condition":
            return None
        return 1 + max(r.prompt for r in self.train + self.held_out)
