"""Data sources for supervised fine-tuning (``algo.type: sft``), chosen by ``data.type``.

A data source yields batches; the policy scores them with ``policy.sft_loss(batch)``. The
trainer knows nothing else about them. Every source draws its step's batch with replacement,
seeded by (run seed, step), over all processes at once, and each process takes its slice of
it: one process and N train on the same samples.

- ``demonstrations``: episodes recorded by ``mmrl collect``; every time step is one sample
  (observation, the next C actions, their mask), C = the policy's action chunk.
- ``completions``: (prompt, completion) text pairs from a JSONL or CSV file or a saved
  ``datasets`` directory; a batch is ``{"prompt": [...], "completion": [...]}``. A record with
  images (``image_field``) gives an :class:`~mmrl.data.prompts.ImagePrompt` as its prompt.
- ``conversations``: demonstrated episodes of a language agent, (observation, action) turns
  from a JSONL file (a VLM agent's observations with PNG files beside it); a batch is
  ``{"turns": [...]}``.
- ``preferences``: preference pairs (:mod:`mmrl.data.preferences`) for pairwise reward
  models; a batch is ``{"prompt": [...], "chosen": ..., "rejected": ...}``.

- ``images``: (image file, prompt) pairs from a JSONL or CSV file; a batch is
  ``{"images": uint8 [B, H, W, 3], "prompt": [...]}`` (or ``"condition"``: LongTensor [B]
  when every prompt is an integer class id), what image generators' ``sft_loss`` takes.
- ``shapes`` (:mod:`mmrl.tasks.shapes.sft`): the same batches, rendered from a shapes prompt set.

A source may also hold out data of its own: ``evaluate(policy)`` returns metrics on it
(the ``preferences`` source: held-out pairwise accuracy), which the trainer adds to each
evaluation and ``mmrl eval`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from mmrl.config import Component, option
from mmrl.core.sampler import group_seed
from mmrl.errors import ConfigError
from mmrl.registry import DATA_SOURCES

_SFT_STREAM = 1 << 40  # group index reserved for the draws of a step's SFT batch


@dataclass
class DataSourceConfig(Component):
    """``data``: where ``algo.type: sft`` takes its batches (``mmrl list data``)."""

    type: str = option("demonstrations", "data source (mmrl list data)")
    path: str | None = option(None, "where the data lives (a directory or file; see the source's type)")
    batch_size: int = option(64, "samples per optimizer step (over all processes)", ge=1)


class DataSource:
    """Samples held as a dict of equally long tensors / lists; ``batch`` draws from them."""

    samples: dict[str, Any]

    def __init__(self, cfg: DataSourceConfig, seed: int, world: int, rank: int):
        if cfg.path is None:
            raise ConfigError("data.path", None, f"algo.type sft needs data: the {cfg.type} source reads data.path")
        if cfg.batch_size % world:
            raise ConfigError("data.batch_size", cfg.batch_size, f"must be divisible by the number of processes ({world})")
        self.config, self.seed, self.world, self.rank = cfg, seed, world, rank

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.samples.values())))

    def batch(self, step: int, device) -> dict[str, Any]:
        """This process's share of step ``step``'s batch of ``data.batch_size`` samples."""
        gen = torch.Generator().manual_seed(group_seed(self.seed, step, _SFT_STREAM))
        idx = torch.randint(self.num_samples, (self.config.batch_size,), generator=gen).chunk(self.world)[self.rank]
        return {k: ([v[i] for i in idx.tolist()] if isinstance(v, list) else v[idx].to(device)) for k, v in self.samples.items()}

    def evaluate(self, policy) -> dict[str, float]:
        """Metrics of ``policy`` on the source's held-out data; none by default."""
        return {}


@dataclass
class DemonstrationsConfig(DataSourceConfig):
    path: str | None = option(None, "directory of demonstrations written by `mmrl collect`")
    max_episodes_per_task: int | None = option(None, "use only the first N demonstrations of each task (few-shot SFT)", ge=1)


@DATA_SOURCES.register("demonstrations", config=DemonstrationsConfig)
class Demonstrations(DataSource):
    """Recorded episodes: one sample per time step (observation, next C actions, mask)."""

    def __init__(self, cfg: DemonstrationsConfig, policy, seed: int, world: int, rank: int):
        from mmrl.demos import chunk_samples, read_demos

        super().__init__(cfg, seed, world, rank)
        episodes = read_demos(cfg.path)
        if cfg.max_episodes_per_task is not None:
            per_task: dict[str, int] = {}
            kept = []
            for ep in episodes:
                per_task[ep.task] = per_task.get(ep.task, 0) + 1
                if per_task[ep.task] <= cfg.max_episodes_per_task:
                    kept.append(ep)
            episodes = kept
        if not episodes:
            raise ConfigError("data.path", cfg.path, "holds no demonstrations")
        chunk = int(getattr(policy.config, "action_chunk", 1) or 1)
        samples = chunk_samples(episodes, chunk)
        self.samples = {k: (v if isinstance(v, list) else torch.as_tensor(np.asarray(v))) for k, v in samples.items()}
        self.info = {"episodes": len(episodes), "samples": self.num_samples}


@dataclass
class CompletionsConfig(DataSourceConfig):
    type: str = option("completions", "data source (mmrl list data)")
    path: str | None = option(None, "a .jsonl or .csv file, or a directory saved by datasets' save_to_disk")
    prompt_field: str = option("prompt", "field holding each record's prompt")
    completion_field: str = option("completion", "field holding the completion to learn")
    image_field: str | None = option("image", "field holding the path of the prompt's image or a list of paths, relative to the file's folder (null = no images)")


@DATA_SOURCES.register("completions", config=CompletionsConfig)
class Completions(DataSource):
    """(prompt, completion) text pairs: supervised fine-tuning of a text policy."""

    def __init__(self, cfg: CompletionsConfig, policy, seed: int, world: int, rank: int):
        from mmrl.data.prompts import PromptDataConfig, prompt_input, read_records

        super().__init__(cfg, seed, world, rank)
        source = PromptDataConfig(train=cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.completion_field, image_field=cfg.image_field, prompt_kind="text")
        records = read_records(source, "train", "data")
        missing = [r.record_id for r in records if r.answer is None]
        if missing:
            raise ConfigError("data.completion_field", cfg.completion_field, f"missing in {len(missing)} records (first: record {missing[0]})")
        self.samples = {"prompt": [prompt_input(replace(r, prompt=str(r.prompt))) for r in records], "completion": [str(r.answer) for r in records]}
        self.info = {"samples": self.num_samples}


@dataclass
class ConversationsConfig(DataSourceConfig):
    type: str = option("conversations", "data source (mmrl list data)")
    path: str | None = option(None, "a .jsonl file, one demonstrated episode per line: {\"turns\": [[observation, action], ...]}; an observation is a text or {\"text\": ..., \"image\": PNG path(s) relative to the file} (a VLM agent's)")
    successful_only: bool = option(False, "keep only the lines whose \"success\" is true (episodes saved by mmrl eval --save-episodes: SFT on the solved ones, rejection sampling)")


def _is_observation(x) -> bool:
    """A turn's observation: a text, or {"text": str, "image": a path or a list of paths}."""
    if isinstance(x, str):
        return True
    if not isinstance(x, dict) or set(x) != {"text", "image"} or not isinstance(x["text"], str):
        return False
    image = x["image"]
    return isinstance(image, str) or (isinstance(image, list) and bool(image) and all(isinstance(i, str) for i in image))


def _load_observation(x, path, number: int):
    """A text as it is; ``{"text", "image"}`` with its image file(s) (relative to the .jsonl)
    read as uint8 RGB [H, W, 3] (several: [K, H, W, 3]), what a VLM agent's sft_loss takes."""
    if isinstance(x, str):
        return x
    import cv2

    files = [x["image"]] if isinstance(x["image"], str) else x["image"]
    images = []
    for name in files:
        bgr = cv2.imread(str(path.parent / name), cv2.IMREAD_COLOR)
        if bgr is None:
            raise ConfigError("data.path", str(path), f"line {number}: cannot read the image {path.parent / name}")
        images.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    if len({im.shape for im in images}) > 1:
        raise ConfigError("data.path", str(path), f"line {number}: the images of one observation differ in size")
    return {"text": x["text"], "image": images[0] if isinstance(x["image"], str) else np.stack(images)}


@DATA_SOURCES.register("conversations", config=ConversationsConfig)
class Conversations(DataSource):
    """Demonstrated episodes of a language agent in a text env: each a list of (observation,
    action) turns; a batch is ``{"turns": [...]}``, what ``text_agent``'s ``sft_loss`` takes."""

    def __init__(self, cfg: ConversationsConfig, policy, seed: int, world: int, rank: int):
        import json
        from pathlib import Path

        super().__init__(cfg, seed, world, rank)
        path = Path(cfg.path)
        if not path.is_file():
            raise ConfigError("data.path", cfg.path, "no such file (a .jsonl of {\"turns\": [[observation, action], ...]} lines)")
        episodes = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = record["turns"]
                if not turns or not all(isinstance(t, list) and len(t) == 2 and isinstance(t[1], str) and _is_observation(t[0]) for t in turns):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    "data.path", cfg.path,
                    f"line {number} is not {{\"turns\": [[observation, action], ...]}} with string actions and observations that are strings or {{\"text\": ..., \"image\": path(s)}}",
                ) from None
            turns = [[_load_observation(t[0], path, number), t[1]] for t in turns]
            if cfg.successful_only:
                if not isinstance(record.get("success"), bool):
                    raise ConfigError("data.successful_only", True, f"line {number} of {cfg.path} has no boolean \"success\" (episodes saved by mmrl eval --save-episodes have one)")
                if not record["success"]:
                    continue
            episodes.append([tuple(t) for t in turns])
        if not episodes:
            raise ConfigError("data.path", cfg.path, "holds no successful episodes" if cfg.successful_only else "holds no episodes")
        self.samples = {"turns": episodes}
        self.info = {"episodes": len(episodes), "turns": sum(len(e) for e in episodes)}


@dataclass
class PreferencesConfig(DataSourceConfig):
    type: str = option("preferences", "data source (mmrl list data)")
    path: str | None = option(None, "a preference directory (info.json, train.jsonl, held_out.jsonl; images.npz or saved episodes) written by python -m mmrl pairs")
    eval_batch_size: int = option(256, "held-out pairs scored per forward pass at evaluation", ge=1)
    category_key: str | None = option("category", "metadata key whose values get their own held-out accuracy pairwise_accuracy/<value> (null = none)")


@DATA_SOURCES.register("preferences", config=PreferencesConfig)
class Preferences(DataSource):
    """Preference pairs (prompt, chosen, rejected): Bradley–Terry reward models (mmrl train-reward)."""

    def __init__(self, cfg: PreferencesConfig, policy, seed: int, world: int, rank: int):
        from mmrl.data.preferences import read_info, read_pairs
        from mmrl.policies.reward_model.inputs import input_kind, pairwise_models

        super().__init__(cfg, seed, world, rank)
        kind = read_info(cfg.path)["kind"]
        wanted = policy.input_kind
        if wanted != kind:
            what = f"scores {wanted} items" if wanted else f"is not a pairwise reward model ({', '.join(pairwise_models())})"
            raise ConfigError("data.path", cfg.path, f"holds {kind} pairs, but policy {policy.config.type!r} {what}")
        frames = getattr(policy.config, "frames", None)  # keyframes per episode, of a model that scores episodes
        self.samples = self._samples(read_pairs(cfg.path, "train", frames=frames))
        self.held_out = read_pairs(cfg.path, "held_out", frames=frames)
        input_kind(kind, "data.path").check_items(policy, self.samples["chosen"], "data.path")
        self.info = {"samples": self.num_samples, "held_out": len(self.held_out)}

    @staticmethod
    def _samples(pairs) -> dict[str, Any]:
        """The items ``score`` takes, as the pairs' input kind makes them (mmrl.policies.reward_model.inputs)."""
        from mmrl.policies.reward_model.inputs import input_kind

        as_items = input_kind(pairs.kind, "data.path").as_items
        return {"prompt": pairs.prompts, "chosen": as_items(pairs.chosen), "rejected": as_items(pairs.rejected)}

    @torch.no_grad()
    def evaluate(self, policy) -> dict[str, float]:
        """Held-out pairwise accuracy: the fraction of held-out pairs whose chosen item scores
        higher (s_w > s_l; a tie counts as wrong), with its 95% Wilson interval (pairs taken
        as independent), and the mean Bradley–Terry loss; per value of the metadata key
        ``category_key``, its accuracy, interval and count (``pairwise_accuracy/<value>``,
        ``/ci_low``, ``/ci_high``, ``/n``)."""
        from mmrl.core.statistics import wilson_interval
        from mmrl.policies.reward_model import bradley_terry_loss

        n = len(self.held_out)
        if n == 0:
            return {}
        samples = self._samples(self.held_out)
        was_training = policy.training
        policy.eval()
        correct, loss = [], 0.0
        for start in range(0, n, self.config.eval_batch_size):
            rows = slice(start, min(n, start + self.config.eval_batch_size))
            prompts = samples["prompt"][rows]
            s_w = policy.score(prompts, samples["chosen"][rows])
            s_l = policy.score(prompts, samples["rejected"][rows])
            correct += (s_w > s_l).tolist()
            loss += float(bradley_terry_loss(s_w, s_l)) * len(prompts)
        policy.train(was_training)
        low, high = wilson_interval(sum(correct), n)
        out = {"pairwise_accuracy": sum(correct) / n, "pairwise_accuracy_ci_low": low, "pairwise_accuracy_ci_high": high, "pairs": n, "loss/bt": loss / n}
        key = self.config.category_key
        if key is not None:
            categories: dict[str, list[bool]] = {}
            for hit, metadata in zip(correct, self.held_out.metadata):
                if metadata.get(key) is not None:
                    categories.setdefault(str(metadata[key]), []).append(hit)
            for category, hits in sorted(categories.items()):
                low, high = wilson_interval(sum(hits), len(hits))
                name = f"pairwise_accuracy/{category}"
                out.update({name: sum(hits) / len(hits), f"{name}/ci_low": low, f"{name}/ci_high": high, f"{name}/n": len(hits)})
        return out

def policy_resolution(policy, field: str, value) -> tuple[int, int] | None:
    """The (H, W) of the images ``policy`` generates, or None for a policy without a resolution."""
    res = policy.resolution
    if res is None:
        return None
    res = tuple(int(r) for r in res) if isinstance(res, (list, tuple)) else (int(res), int(res))
    if len(res) != 2:
        raise ConfigError(field, value, f"the policy's resolution {res} is not an image's (H, W)")
    return res


class RenderedPrompts(DataSource):
    """Ground-truth images a task renders for each record of a prompt set (``cfg.path``):
    ``cfg.images_per_prompt`` seeded renderings per record at ``cfg.resolution`` (null = the
    policy's, square), drawn once when the run starts, seeded by ``cfg.render_seed`` and not
    by the run seed (every run trains on the same images). A batch is ``{"images": uint8
    [B, H, W, 3], "prompt": [...]}``, what image generators' ``sft_loss`` takes. A task says
    how to draw a record (:meth:`renderer`) and names its renderer (``what``)."""

    what = "renderer"

    def renderer(self, record):
        """``draw(size, seed) -> uint8 [size, size, 3]`` of one record; ValueError for a record
        it cannot draw (the message says why)."""
        raise NotImplementedError

    def __init__(self, cfg, policy, seed: int, world: int, rank: int):
        from mmrl.data.prompts import PromptDataConfig, read_records

        super().__init__(cfg, seed, world, rank)
        records = read_records(PromptDataConfig(train=cfg.path, prompt_kind="text", image_field=None), "train", "data")
        if not records:
            raise ConfigError("data.path", cfg.path, "holds no records")
        size = cfg.resolution
        policy_size = policy_resolution(policy, "data.resolution", cfg.resolution)
        if size is None:
            if policy_size is None:
                raise ConfigError("data.resolution", None, f"policy {type(policy).__name__} has no resolution; set one")
            if policy_size[0] != policy_size[1]:
                raise ConfigError("data.resolution", None, f"the {self.what} draws square images; the policy generates {policy_size}")
            size = policy_size[0]
        elif policy_size is not None and policy_size != (size, size):
            raise ConfigError("data.resolution", size, f"the policy generates {policy_size[0]}x{policy_size[1]} images")
        n = cfg.images_per_prompt
        images = np.empty((len(records) * n, size, size, 3), dtype=np.uint8)
        prompts: list[str] = []
        for i, r in enumerate(records):
            try:
                draw = self.renderer(r)
            except ValueError as e:
                raise ConfigError("data.path", cfg.path, f"record {r.record_id}: {e}") from None
            for k in range(n):
                # one seed per (render_seed, record, copy), within numpy's 32-bit seeds
                images[i * n + k] = draw(size, (cfg.render_seed * 1_000_003 + i * n + k) % 2**32)
            prompts.extend([str(r.prompt)] * n)
        self.samples = {"images": torch.from_numpy(images), "prompt": prompts}
        self.info = {"prompts": len(records), "samples": self.num_samples}


@dataclass
class ImagesConfig(DataSourceConfig):
    type: str = option("images", "data source (mmrl list data)")
    path: str | None = option(None, "a .jsonl or .csv file of records naming an image file (relative to the file's directory) and its prompt")
    image_field: str = option("image", "field holding each record's image file (PNG or JPEG, RGB)")
    prompt_field: str = option("prompt", "field holding each record's prompt (a text, or an integer class id)")


@DATA_SOURCES.register("images", config=ImagesConfig)
class Images(DataSource):
    """(image, prompt) pairs from files: supervised pretraining of an image generator. Every
    image must have the policy's resolution (when the policy has one)."""

    def __init__(self, cfg: ImagesConfig, policy, seed: int, world: int, rank: int):
        from pathlib import Path

        from mmrl.data.prompts import PromptDataConfig, read_records

        try:
            import cv2
        except ImportError:
            from mmrl.errors import MissingExtraError

            raise MissingExtraError("opencv-python", "image", "the images data source") from None
        super().__init__(cfg, seed, world, rank)
        source = PromptDataConfig(train=cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.image_field, image_field=None)
        records = read_records(source, "train", "data")
        if not records:
            raise ConfigError("data.path", cfg.path, "holds no records")
        root = Path(cfg.path).parent
        size = policy_resolution(policy, "data.path", cfg.path)
        images = []
        for r in records:
            if r.answer is None:
                raise ConfigError("data.image_field", cfg.image_field, f"missing in record {r.record_id}")
            file = root / str(r.answer)
            bgr = cv2.imread(str(file), cv2.IMREAD_COLOR)
            if bgr is None:
                raise ConfigError("data.path", cfg.path, f"record {r.record_id}: cannot read the image {file}")
            if size is not None and bgr.shape[:2] != size:
                raise ConfigError("data.path", cfg.path, f"record {r.record_id}: image {file} is {bgr.shape[0]}x{bgr.shape[1]}, the policy generates {size[0]}x{size[1]}")
            images.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        shapes = {im.shape for im in images}
        if len(shapes) > 1:
            raise ConfigError("data.path", cfg.path, f"the images differ in size: {sorted(shapes)}")
        self.samples = {"images": torch.from_numpy(np.stack(images))}
        prompts = [r.prompt for r in records]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            self.samples["condition"] = torch.tensor(prompts, dtype=torch.long)
        else:
            self.samples["prompt"] = [str(p) for p in prompts]
        self.info = {"samples": self.num_samples}
