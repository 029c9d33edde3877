"""Learned pairwise rewards and visual consistency across a group's images.

``pairwise_preference``: a Bradley–Terry reward model trained by ``mmrl train-reward``
(:mod:`mmrl.policies.reward_model`), loaded once per run from ``model`` — a run directory
(its latest checkpoint) or a checkpoint / weights directory — and called on the whole
rollout in batches of ``batch_size``. Each sample's score s_i is the model's score of its
(prompt, item): the image (``info["images"]``) or the completion (``info["completions"]``);
for an image-set model, the mean of its pair scores with its group peers (the group is the
set of images generated for one prompt); for a trajectory model (``bt_trajectory``), the
robot episode given its instruction, read from the keyframes the env sampler keeps
(``sampler.keep_frames`` set to the model's ``frames``: ``info["trajectory"]`` and
``info["instruction"]``). Then, by ``mode``:

- ``pointwise``: r_i = s_i, the raw score (an unbounded logit: differences are log-odds);
- ``sigmoid``: r_i = σ(s_i), in (0, 1) (what ``log_tamed`` needs: it takes log(1 + r));
- ``win_rate``: r_i = mean_{j ∈ group(i), j ≠ i} σ(s_i − s_j), the probability under the
  Bradley–Terry model that sample i beats a peer, averaged over its peers. In [0, 1], and
  since σ(d) + σ(−d) = 1 the values of a group of G sum to G/2; a group of one scores 1/2.
  Invariant to any shift of the scores, so only how the group's samples compare matters.

``visual_consistency`` (PaCo-RL's consistent generation, with a fixed feature in place of a
learned consistency model): sample i's reward is its mean similarity to its group peers,
r_i = mean_{j ≠ i} sim(x_i, x_j), where sim is the histogram intersection Σ_b min(h_i,b, h_j,b)
of the images' hue histograms (``bins`` hues, each object pixel weighted by its chroma,
pixels of chroma below ``min_chroma`` — grey background — left out, normalised to sum 1),
optionally averaged with the intersection of their chroma-mask coverage histograms over a
``grid`` × ``grid`` layout (``layout_weight``). In [0, 1]; a group of identical images
scores 1, a group whose images share no hue 0. An image without coloured pixels has an
empty histogram and scores 0 against every peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import Reward, RewardContext
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.images import opencv, rollout_images


def win_rate(scores: Tensor, group_id: Tensor) -> Tensor:
    """w_i = mean_{j in group(i), j != i} σ(s_i − s_j); 1/2 for a group of one."""
    scores = scores.float()
    same = group_id[:, None] == group_id[None, :]
    peers = same & ~torch.eye(len(scores), dtype=torch.bool, device=scores.device)
    wins = torch.sigmoid(scores[:, None] - scores[None, :]) * peers
    count = peers.sum(1)
    return torch.where(count > 0, wins.sum(1) / count.clamp_min(1), torch.full_like(scores, 0.5))


def peer_mean(similarity: Tensor, group_id: Tensor) -> Tensor:
    """r_i = mean_{j in group(i), j != i} S_ij of a [B, B] similarity; 0 for a group of one."""
    peers = (group_id[:, None] == group_id[None, :]) & ~torch.eye(len(group_id), dtype=torch.bool)
    count = peers.sum(1)
    return torch.where(count > 0, (similarity * peers).sum(1) / count.clamp_min(1), torch.zeros(len(group_id)))


@dataclass
class PairwisePreferenceConfig(RewardConfig):
    """A trained Bradley–Terry reward model's score of each sample, pointwise or as its win rate in its group."""

    type: str = option("pairwise_preference", "registered name of this component (see `mmrl list`)")
    model: str = option("", "the reward model: a run directory of `mmrl train-reward` (its latest checkpoint) or a checkpoint / weights directory")
    mode: Literal["pointwise", "sigmoid", "win_rate"] = option(
        "win_rate", "pointwise: the raw score s_i; sigmoid: sigma(s_i); win_rate: mean over group peers j of sigma(s_i - s_j), in [0, 1], summing to G/2 per group"
    )
    batch_size: int = option(256, "samples scored per forward pass", ge=1)

    def validate(self, path: str) -> None:
        if not self.model:
            raise ConfigError(f"{path}.model" if path else "model", self.model, "required: a run directory of `mmrl train-reward` or a checkpoint directory")


@REWARDS.register("pairwise_preference", config=PairwisePreferenceConfig)
class PairwisePreference(Reward):
    """A trained pairwise (Bradley–Terry) reward model as a reward component."""

    def __init__(self, cfg: PairwisePreferenceConfig, context: RewardContext):
        from mmrl.core.weights import load_pretrained
        from mmrl.policies.reward_model import RewardModel
        from mmrl.policies.reward_model.inputs import INPUT_KINDS, input_kind, pairwise_models

        super().__init__(cfg, context)
        path = Path(cfg.model)
        if not path.is_dir():
            raise ConfigError("rewards", cfg.model, "pairwise_preference.model: no such run or checkpoint directory")
        self.model = load_pretrained(path)
        name = getattr(self.model, "input_kind", None)
        self.kind = input_kind(name) if name in INPUT_KINDS else None
        if not isinstance(self.model, RewardModel) or self.kind is None or not self.kind.pairwise:
            what = self.kind.used_as if self.kind is not None and self.kind.used_as else "not a pairwise reward model"
            raise ConfigError("rewards", cfg.model, f"pairwise_preference.model holds a {self.model.config.type!r} model, {what}; expected one of {', '.join(pairwise_models())}")
        self.model.to(context.device_for(cfg)).eval().requires_grad_(False)

    @torch.no_grad()
    def scores(self, rollout: Rollout) -> Tensor:
        """s_i of every sample (see the module docstring), on the CPU: the model's input kind
        says which items and prompts of the rollout it scores, and in which batches."""
        items = self.kind.rollout_items(self.model, rollout)
        key = self.kind.prompt_key
        if key not in rollout.info:
            raise ConfigError("rewards", "pairwise_preference", "scores (prompt, sample) pairs and needs info['prompt']: use it with sampler.type: prompt")
        prompts = [str(p) for p in rollout.info[key]]
        return self.kind.score_rollout(self.model, prompts, items, rollout.group_id.cpu(), self.config.batch_size)

    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        s = self.scores(rollout)
        if self.config.mode == "pointwise":
            return s
        if self.config.mode == "sigmoid":
            return torch.sigmoid(s)
        return win_rate(s, rollout.group_id.cpu())


@dataclass
class VisualConsistencyConfig(RewardConfig):
    """Mean similarity of each image to the other images of its group (hue and layout histograms)."""

    type: str = option("visual_consistency", "registered name of this component (see `mmrl list`)")
    bins: int = option(36, "hue histogram bins over 360 degrees", ge=2)
    min_chroma: int = option(40, "pixels with max(R,G,B) - min(R,G,B) below this (grey) are left out", ge=0, le=255)
    grid: int = option(4, "cells per side of the layout histogram (where the coloured pixels lie)", ge=1)
    layout_weight: float = option(0.0, "weight of the layout similarity: sim = (1 - w) hue + w layout (0 = same colours in any place)", ge=0, le=1)


def colour_features(images, bins: int, min_chroma: int, grid: int) -> tuple[Tensor, Tensor]:
    """(hue histograms [B, bins], layout histograms [B, grid²]) of uint8 RGB images
    [B, H, W, 3], each chroma-weighted over pixels of chroma ≥ ``min_chroma`` and normalised
    to sum 1 (all zero for an image without such pixels)."""
    import numpy as np

    cv2 = opencv("the visual_consistency reward")
    hues, layouts = [], []
    for image in images:
        chroma = image.max(-1).astype(np.float32) - image.min(-1)
        weight = np.where(chroma >= min_chroma, chroma, 0.0)
        hue = cv2.cvtColor(image, cv2.COLOR_RGB2HSV_FULL)[..., 0].astype(np.int64) * bins // 256
        hist = np.bincount(hue.ravel(), weights=weight.ravel(), minlength=bins)
        h, w = weight.shape
        cells = (np.arange(h)[:, None] * grid // h) * grid + np.arange(w)[None, :] * grid // w
        layout = np.bincount(cells.ravel(), weights=weight.ravel(), minlength=grid * grid)
        total = weight.sum()
        hues.append(hist / total if total > 0 else hist)
        layouts.append(layout / total if total > 0 else layout)
    return torch.tensor(np.stack(hues), dtype=torch.float32), torch.tensor(np.stack(layouts), dtype=torch.float32)


def intersection(a: Tensor) -> Tensor:
    """Histogram intersection [B, B]: S_ij = Σ_b min(a_i,b, a_j,b)."""
    return torch.minimum(a[:, None], a[None, :]).sum(-1)


@REWARDS.register("visual_consistency", config=VisualConsistencyConfig)
def visual_consistency(rollout: Rollout, cfg: VisualConsistencyConfig) -> Tensor:
    """Each image's mean colour-histogram similarity to its group peers:
    r_i = mean_{j in group(i), j != i} [(1 − w)·∩(hue_i, hue_j) + w·∩(layout_i, layout_j)]."""
    images = rollout_images(rollout, "visual_consistency")
    hue, layout = colour_features(images, cfg.bins, cfg.min_chroma, cfg.grid)
    similarity = (1 - cfg.layout_weight) * intersection(hue) + cfg.layout_weight * intersection(layout)
    return peer_mean(similarity, rollout.group_id.cpu())
