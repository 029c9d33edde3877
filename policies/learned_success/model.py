"""A success classifier: one observation → the logit s of P(success) = σ(s).

The observation is what a policy of an image env reads (``EnvSampler.observation``): uint8
images [N, H, W, 3] or [N, K, H, W, 3] (K cameras), proprio state [N, D] and the
instruction. Each camera goes through one shared FiLM-conditioned CNN (the image tower of
``bt_image``, conditioned on the instruction read by its hashed-word GRU); the head is an MLP
on [camera features in camera order, instruction vector, state].

Training minimises the class-balanced binary cross-entropy of labelled frames y ∈ {0, 1}
(:func:`balanced_bce`):

    L = ½ · mean_{y=1} softplus(−s) + ½ · mean_{y=0} softplus(s)

so that successes and failures weigh alike whatever their ratio in the batch (a batch of one
class is the plain mean). Training images are shifted by up to ``shift`` pixels (edge
padding, then a random crop back to size: DrQ, Kostrikov et al. 2020), which the few dozen
labelled episodes a success detector is trained from need against over-fitting.

Like the Bradley–Terry models it generates nothing: it is a ``PolicyModule`` so that
``mmrl train-reward`` trains and saves it; the env sampler reads it (``env.success_model``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.errors import ConfigError
from mmrl.policies.learned_success.config import LearnedSuccessConfig
from mmrl.policies.reward_model.model import ImageTower, PromptEncoder, RewardModel, random_shift
from mmrl.registry import POLICIES


def balanced_bce(logits: Tensor, labels: Tensor) -> Tensor:
    """L = ½·mean_{y=1} softplus(−s) + ½·mean_{y=0} softplus(s); the plain mean of the
    binary cross-entropy when the batch holds one class only."""
    labels = labels.to(logits.dtype)
    losses = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    positive = labels > 0.5
    if positive.all() or not positive.any():
        return losses.mean()
    return 0.5 * losses[positive].mean() + 0.5 * losses[~positive].mean()


def contract_frames(model: "LearnedSuccessModel", generator: torch.Generator) -> dict[str, Any]:
    """Four labelled random observations, as the ``success_frames`` data source gives them
    ({"image", "state", "instruction", "label"}, two of each class): the supervised batch of
    this model's ``contract`` (tests/policies/test_contract.py)."""
    cfg = model.config
    return {
        "image": torch.randint(0, 256, (4, *cfg.image_shape), generator=generator, dtype=torch.uint8),
        "state": torch.randn(4, cfg.state_dim, generator=generator),
        "instruction": ["push the red block left", "push the blue block up"] * 2,
        "label": torch.tensor([1.0, 0.0, 0.0, 1.0]),
    }


# The tiny example of itself that every policy declares (``contract``): tests/policies/test_contract.py
# builds it, computes its supervised loss on the batch ``sft_batch`` names and round-trips its weights.
CONTRACT = {
    "policy": {"type": "learned_success", "image_size": 16, "state_dim": 2, "channels": [8, 16], "strides": [1, 2], "hidden": 16, "shift": 1,
               "prompt": {"dim": 8, "buckets": 64}},
    "sft_batch": "mmrl.policies.learned_success.model:contract_frames",
}


@POLICIES.register("learned_success", config=LearnedSuccessConfig, contract=CONTRACT)
class LearnedSuccessModel(RewardModel):
    """P(success) of one observation (images of every camera, state, instruction)."""

    input_kind = "observation"

    def __init__(self, config: LearnedSuccessConfig, spec: dict | None = None):
        super().__init__()
        config.validate("policy")
        self.config, self.spec = config, dict(spec or {})
        self.prompt = PromptEncoder(config.prompt)
        self.tower = ImageTower(config, self.prompt.out_dim)
        width = config.cameras * self.tower.out_dim + self.prompt.out_dim + config.state_dim
        self.head = nn.Sequential(nn.Linear(width, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))

    def check_observations(self, image_shape, state_dim: int, field: str, value: Any, where: str) -> None:
        """A ConfigError naming ``field`` / ``value`` unless observations with images of
        ``image_shape`` (None: no images) and a state of ``state_dim`` fit this model; the
        message names both shapes."""
        wanted, state = self.config.image_shape, self.config.state_dim
        got = None if image_shape is None else [int(d) for d in image_shape]
        if got != wanted or (state and state_dim != state):
            theirs = f"images {got} and state [{state_dim}]" if got is not None else f"no images and state [{state_dim}]"
            ours = f"images {wanted}" + (f" and state [{state}]" if state else "")
            raise ConfigError(field, value, f"{where} {theirs}; the learned_success model reads {ours} (policy.image_size, cameras, state_dim of its config)")

    def logits(self, observation: dict[str, Any]) -> Tensor:
        """s [N] of a batch of observations {"image", "state", "instruction"}."""
        cfg = self.config
        images = observation["image"]
        if tuple(images.shape[1:]) != tuple(cfg.image_shape):
            raise ValueError(f"learned_success reads images [N, {', '.join(map(str, cfg.image_shape))}]; got {tuple(images.shape)}")
        n = images.shape[0]
        instruction = self.prompt(list(observation["instruction"]))
        flat = images.reshape(n * cfg.cameras, *images.shape[-3:])
        features = self.tower(flat, instruction.repeat_interleave(cfg.cameras, dim=0)).reshape(n, -1)
        parts = [features, instruction]
        if cfg.state_dim:
            parts.append(observation["state"].to(features.device, torch.float32).reshape(n, cfg.state_dim))
        return self.head(torch.cat(parts, dim=1)).squeeze(-1)

    @torch.no_grad()
    def success_probability(self, observation: dict[str, Any]) -> Tensor:
        """P(success) = σ(s) [N] of a batch of observations."""
        return torch.sigmoid(self.logits(observation).float())

    def score(self, prompts: list[str], items: dict[str, Tensor]) -> Tensor:
        """s of observations ``items`` ({"image", "state"}) under instructions ``prompts``."""
        return self.logits({**items, "instruction": list(prompts)})

    def augment_images(self, images: Tensor) -> Tensor:
        """Each image (each camera apart) shifted by up to ``shift`` pixels (DrQ): :func:`random_shift`."""
        return random_shift(images, self.config.shift)

    def sft_loss(self, batch: dict[str, Any]) -> Tensor:
        """Class-balanced binary cross-entropy of a batch of labelled frames {"image",
        "state", "instruction", "label"} (the ``success_frames`` data source)."""
        images = batch["image"]
        if self.training:
            images = self.augment_images(images)
        logits = self.logits({"image": images.to(self.device), "state": batch["state"], "instruction": batch["instruction"]})
        return balanced_bce(logits, batch["label"].to(logits.device))

    def sample(self, inputs, generator=None, deterministic: bool = False):
        raise ConfigError("policy.type", self.config.type, "is a success classifier: it acts in no env; train it with `mmrl train-reward` and read it through env.success_model")
