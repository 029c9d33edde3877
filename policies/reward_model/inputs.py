"""A reward model's input kinds, as a registry: what each kind of item a reward model scores
(``input_kind``: ``image``, ``image_set``, ``text``, ``trajectory``, ``observation``) needs
from the rest of mmrl, each in one class.

- **pairs → model inputs**: how a preference directory's pair lines become items
  (:meth:`InputKind.read_pairs`, read by :mod:`mmrl.data.preferences`), what the model's
  ``score`` takes of them (:meth:`~InputKind.as_items`, the ``preferences`` data source), the
  check that they fit the model (:meth:`~InputKind.check_items`), and how a merge carries
  them (``images_file``, :meth:`~InputKind.merge_item`, ``merge_refusal``);
- **rollout → items**: which of a rollout's ``info`` entries become the items the
  ``pairwise_preference`` reward scores (:meth:`~InputKind.rollout_items`), under which
  prompts (``prompt_key``), in which batches (:meth:`~InputKind.score_rollout`: rows, or
  whole groups for set models);
- **the contract batch** of the reward models' ``contract`` (:meth:`~InputKind.contract_pair`).

A new kind is one class here or in a plugin's module (the module of its reward model: this
registry also loads the ``mmrl.policies`` entry points), registered with
:func:`register_input_kind`; nothing else in mmrl is edited (tests/policies/test_input_kinds.py
adds one). An unknown kind is a one-line ConfigError naming the field, the value and the
registered kinds (:func:`input_kind`).

It lives in the reward-model family because what a reward model scores is the family's to
say: the pair files (``mmrl/data``), the reward (``rewards/pairwise.py``) and the contract
read it from here. It is not in ``mmrl/core``, which stands alone: its hooks reach the
episodes (:mod:`mmrl.demos`) and the rewards' image helpers. It imports nothing of the
family's models, which import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from mmrl.errors import ConfigError
from mmrl.registry import POLICIES, Registry

# mmrl's own kinds register below or in a module of policies/reward_model/ (walked on the first
# lookup); a plugin's register when its policy module is imported (its mmrl.policies entry point)
INPUT_KINDS = Registry("input kinds", ("mmrl.policies.reward_model",), "mmrl.policies")


def register_input_kind(name: str):
    """Class decorator: register an :class:`InputKind` subclass as ``name`` (its ``name``)."""

    def decorator(cls):
        cls.name = name
        return INPUT_KINDS.register(name)(cls)

    return decorator


def input_kind(name: str | None, field: str = "input_kind") -> "InputKind":
    """The registered kind ``name``; a ConfigError naming ``field``, ``name`` and the
    registered kinds if there is none."""
    return INPUT_KINDS.get(name, field)()


def pair_kinds() -> list[str]:
    """The kinds whose items preference directories hold (a pairwise reward model's)."""
    return [e.name for e in INPUT_KINDS.entries() if e.obj.pairwise]


def pairwise_models() -> list[str]:
    """The registered policies that are pairwise reward models: their ``input_kind`` is a
    registered pairwise kind."""
    return [e.name for e in POLICIES.entries() if getattr(e.obj, "input_kind", None) in INPUT_KINDS and INPUT_KINDS.get(e.obj.input_kind).pairwise]


class InputKind:
    """One kind of item a reward model scores. Every hook is declared here; a kind overrides
    the ones its models use (a default either passes the items through or refuses)."""

    name: ClassVar[str] = ""
    # its models are Bradley–Terry models: trained on preference pairs (the ``preferences``
    # data source) and scored in RL by the ``pairwise_preference`` reward
    pairwise: ClassVar[bool] = True
    # what a model of a kind that is not pairwise is, named when pairwise_preference refuses it
    used_as: ClassVar[str] = ""
    # the rollout ``info`` entry of the texts its samples are scored under
    prompt_key: ClassVar[str] = "prompt"
    # its pair lines name rows of the directory's images.npz (written and merged with them)
    images_file: ClassVar[bool] = False
    # why directories of this kind cannot be merged ("": they can)
    merge_refusal: ClassVar[str] = ""

    def read_pairs(self, directory: Path, info: dict, path: Path, rows: list[dict], prompts: list[str], field: str, frames: int | None) -> tuple[Any, Any]:
        """(chosen, rejected) of the pair lines ``rows`` of ``path`` (a split of the preference
        ``directory``, whose info.json is ``info``), as the split stores them; ``frames``:
        the reward model's keyframes per episode, where its items are episodes."""
        raise ConfigError(field, str(directory), f"reward models of {self.name} items are not trained on preference pairs")

    def as_items(self, stored: Any) -> Any:
        """The items ``score`` takes, of a split's stored ``chosen`` or ``rejected``."""
        return stored

    def check_items(self, model, items: Any, field: str) -> None:
        """A ConfigError naming ``field`` unless ``items`` are what ``model`` reads."""

    def merge_item(self, item: Any, shift: int) -> Any:
        """A pair line's ``chosen`` or ``rejected`` after a merge that puts ``shift`` rows of
        images before this directory's."""
        return item

    def rollout_items(self, model, rollout) -> Any:
        """The items of a rollout's samples, one per sample, that ``model`` scores."""
        raise ConfigError("rewards", "pairwise_preference", f"reward models of {self.name} items do not score a rollout's samples")

    def score_rollout(self, model, prompts: list[str], items: Any, group_id: Tensor, batch_size: int) -> Tensor:
        """s_i of every sample, on the CPU: ``model.score`` on ``batch_size`` rows at a time."""
        parts = []
        for start in range(0, len(prompts), batch_size):
            rows = slice(start, start + batch_size)
            parts.append(model.score(prompts[rows], items[rows]).float().cpu())
        return torch.cat(parts)

    def contract_pair(self, config, generator: torch.Generator) -> tuple[Any, Any]:
        """Two chosen and two rejected random items for a model of ``config``: the items of
        the reward models' contract batch (model.py's ``contract_pairs``)."""
        raise NotImplementedError(f"no contract batch for reward models of {self.name!r} items")


def _random_images(generator: torch.Generator, *shape: int) -> Tensor:
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)


@register_input_kind("text")
class TextItems(InputKind):
    """A completion: a string (``bt_text``); pair lines hold the strings themselves."""

    def read_pairs(self, directory, info, path, rows, prompts, field, frames):
        return [str(r["chosen"]) for r in rows], [str(r["rejected"]) for r in rows]

    def as_items(self, stored):
        return list(stored)

    def rollout_items(self, model, rollout):
        if "completions" not in rollout.info:
            raise ConfigError("rewards", "pairwise_preference", f"a text reward model reads info['completions'] (policy.type: text_lm); the rollout info has {sorted(rollout.info)}")
        return list(rollout.info["completions"])

    def contract_pair(self, config, generator):
        words = ["seven", "7", "the answer is 12", "no"]
        return words[:2], words[2:]


@register_input_kind("image")
class ImageItems(InputKind):
    """One uint8 RGB image [H, W, 3] (``bt_image``); pair lines name rows of images.npz."""

    images_file = True
    ndim = 4  # of a split's items: [N, H, W, 3]
    per_item = "one row"
    or_lists = ""

    def read_pairs(self, directory, info, path, rows, prompts, field, frames):
        with np.load(directory / "images.npz") as f:
            images = f["images"]
        try:
            chosen = images[np.asarray([r["chosen"] for r in rows], dtype=np.int64)]
            rejected = images[np.asarray([r["rejected"] for r in rows], dtype=np.int64)]
        except (IndexError, ValueError) as e:
            raise ConfigError(field, str(path), f"chosen/rejected must be rows of images.npz ({len(images)} images){self.or_lists}: {e}") from None
        if chosen.ndim != self.ndim:
            raise ConfigError(field, str(path), f"kind {self.name} needs {self.per_item} per item, got items of shape {chosen.shape[1:]}")
        return chosen, rejected

    def as_items(self, stored):
        return torch.from_numpy(stored)

    def merge_item(self, item, shift):
        return [i + shift for i in item] if isinstance(item, list) else item + shift

    def rollout_items(self, model, rollout):
        from mmrl.rewards.images import rollout_images

        return torch.from_numpy(rollout_images(rollout, "pairwise_preference"))

    def contract_pair(self, config, generator):
        size = config.image_size
        return _random_images(generator, 2, size, size, 3), _random_images(generator, 2, size, size, 3)


@register_input_kind("image_set")
class ImageSetItems(ImageItems):
    """K uint8 RGB images for one prompt [K, H, W, 3] (``bt_image_set``); pair lines name K
    rows of images.npz each. In RL a sample is one image and its set is its group: the model
    scores whole groups (``group_scores``)."""

    ndim = 5
    per_item = "a list of rows"
    or_lists = " or equally long lists of rows"

    def score_rollout(self, model, prompts, items, group_id, batch_size):
        # pairs live within a group: batch whole groups
        out = torch.zeros(len(prompts))
        groups = group_id.unique()
        per = max(1, batch_size // max(1, len(prompts) // max(1, len(groups))))
        for k in range(0, len(groups), per):
            rows = torch.isin(group_id, groups[k : k + per]).nonzero().flatten()
            out[rows] = model.group_scores([prompts[i] for i in rows], items[rows], group_id[rows]).float().cpu()
        return out

    def contract_pair(self, config, generator):
        size = config.image_size
        return _random_images(generator, 2, 2, size, size, 3), _random_images(generator, 2, 2, size, size, 3)


@register_input_kind("trajectory")
class TrajectoryItems(InputKind):
    """A robot episode read as the model's ``frames`` keyframes, :class:`~mmrl.demos.Trajectories`
    (``bt_trajectory``), scored under its instruction; pair lines name episodes of the saved
    episodes info.json's ``episodes`` names, or their first steps."""

    prompt_key = "instruction"
    merge_refusal = "trajectory pairs name the episodes of their own episodes directory; write pairs of all the episodes at once (python -m mmrl pairs episodes)"

    def read_pairs(self, directory, info, path, rows, prompts, field, frames):
        """Episode indices of the episodes ``info["episodes"]`` names, checked (every index
        exists, both episodes and the prompt share an instruction), as rows of one
        :class:`~mmrl.demos.Trajectories` store of ``frames`` keyframes per episode."""
        from mmrl.demos import Trajectories, read_demos

        d = directory
        if frames is None:
            raise ValueError("trajectory pairs are read as keyframes: pass frames (the reward model's)")
        if not info.get("episodes"):
            raise ConfigError(field, str(d / "info.json"), "a trajectory preference directory names its episodes directory in info.json's 'episodes'")
        source = Path(info["episodes"]) if Path(info["episodes"]).is_absolute() else d / info["episodes"]
        if not source.is_dir():
            raise ConfigError(field, str(source), f"the episodes directory that {d / 'info.json'} names does not exist")
        episodes = read_demos(source)
        prefixes: dict[tuple[int, int], int] = {}  # (episode, steps) -> row of the store after the whole episodes

        def item(i: int, side: str) -> tuple[int, int]:
            """(row of the store, episode) of one side of pair line i."""
            value = rows[i][side]
            e, steps = (value.get("episode"), value.get("steps")) if isinstance(value, dict) else (value, None)
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < len(episodes):
                raise ConfigError(field, str(path), f"line {i + 1}: {side} episode {e!r} is not in {source} ({len(episodes)} episodes, indices 0..{len(episodes) - 1})")
            if steps is None:
                return e, e
            if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= len(episodes[e]) or episodes[e].step_success is None:
                raise ConfigError(field, str(path), f"line {i + 1}: {side} is a prefix of {steps!r} steps of episode {e}, which has {len(episodes[e])} steps{'' if episodes[e].step_success is not None else ' and no step_success'}; a prefix has 2..{len(episodes[e])} steps")
            return prefixes.setdefault((e, steps), len(episodes) + len(prefixes)), e

        index = {side: [] for side in ("chosen", "rejected")}
        for i in range(len(rows)):
            (row_w, e_w), (row_l, e_l) = item(i, "chosen"), item(i, "rejected")
            index["chosen"].append(row_w)
            index["rejected"].append(row_l)
            texts = {prompts[i], episodes[e_w].instruction, episodes[e_l].instruction}
            if len(texts) > 1:
                raise ConfigError(field, str(path), f"line {i + 1}: a pair compares episodes of one instruction; prompt {prompts[i]!r}, chosen episode {e_w} {episodes[e_w].instruction!r}, rejected episode {e_l} {episodes[e_l].instruction!r}")
        trajectories = Trajectories.from_episodes(episodes + [episodes[e].prefix(steps) for e, steps in prefixes], frames)
        chosen = trajectories[torch.tensor(index["chosen"], dtype=torch.long)]
        rejected = trajectories[torch.tensor(index["rejected"], dtype=torch.long)]
        return chosen, rejected

    def check_items(self, model, items, field):
        model.check_shapes(items.store, field)  # the episodes must be what the model reads: both shapes named

    def rollout_items(self, model, rollout):
        from mmrl.demos import Trajectories

        if "trajectory" not in rollout.info:
            raise ConfigError("sampler.keep_frames", 0, f"a trajectory reward model reads each episode's keyframes: set sampler.keep_frames: {model.config.frames} (the model's frames) with sampler.type: env")
        store = rollout.info["trajectory"]
        model.check_shapes(store, "rewards.pairwise_preference (the env's episodes)")
        return Trajectories(store)

    def contract_pair(self, config, generator):
        from mmrl.demos import Trajectories

        c = config
        camera = (c.cameras,) if c.cameras > 1 else ()
        store = {
            "image": _random_images(generator, 4, c.frames, *camera, c.image_size, c.image_size, 3),
            "state": torch.randn(4, c.frames, c.state_dim, generator=generator),
            "action": torch.randn(4, c.frames, c.action_dim + 1, generator=generator),
            "length": torch.tensor([5, 9, 7, 12]),
        }
        episodes = Trajectories(store)
        return episodes[torch.tensor([0, 1])], episodes[torch.tensor([2, 3])]


@register_input_kind("observation")
class ObservationItems(InputKind):
    """One observation of an image env, {"image", "state"} under its instruction, as the env
    sampler gives it (``learned_success``). Not pairwise: the model is trained on labelled
    frames (the ``success_frames`` data source) and read by the env sampler."""

    pairwise = False
    used_as = "a success classifier (it is read as env.success_model)"
