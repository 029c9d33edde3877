"""``adversarial``: a discriminator trained during RL as the image reward (Adv-GRPO).

Adv-GRPO ("The Image as Its Own Reward") trains its reward model adversarially while the
generator learns: reference images are the positives, the generator's current samples the
negatives, and the generator is rewarded by how real the discriminator finds its samples.
Here the discriminator D(x, y) is small and trained from scratch, on

- ``features: pixels``: the image itself, x/127.5 − 1, through a CNN (3×3 convolution of
  ``width`` channels, two stride-2 4×4 convolutions of 2·``width``, LeakyReLU 0.2, average
  pooling to 3×3, a linear map to ``hidden`` units);
- ``features: encoder``: the 64 features of the frozen shapes encoder (``encoder``, shipped
  in assets/shapes_encoder, :mod:`mmrl.tasks.shapes.encoder`; it stands in for Adv-GRPO's
  DINO), layer-normalised, through an MLP of two ``hidden``-unit LeakyReLU layers.

Either body gives φ(x) ∈ R^hidden and the logit is D(x, y) = w·φ(x) + b, plus, when
``conditional``, the projection term e(y)·φ(x) (Miyato and Koyama's projection
discriminator), where e(y) is the mean of learned embeddings of the prompt's words (hashed
into ``buckets``): D then judges whether the image is a real image *of that prompt*.

References (``references``): ``shapes`` renders, for every sample, a new ground-truth image
of its prompt's scene (:func:`mmrl.tasks.shapes.world.render_scene` at the sample's size,
seeded by the run seed, the update count and the sample's global index); a directory path
draws PNG/JPEG images from it instead (resized to the samples' size, unconditional only).

Each step, after the samples are scored (:meth:`Reward.update`), D takes
``steps_per_update`` Adam steps (β = (0.5, 0.999), as GAN discriminators usually do) on

    L = Σ_real BCE(D(x_r, y), 1 − ε) + Σ_fake BCE(D(x_g, y), 0) + γ/2 Σ_real ‖∇_x D(x_r, y)‖²

over the step's samples of every process and as many references, divided by their number
(ε = ``label_smoothing``, one-sided; γ = ``r1``, Mescheder et al.'s R1 penalty on the
references). Both keep D from growing confident without bound when references and samples
are easy to tell apart: a saturated D's logits grow with its weights and its ranking of the
samples turns into noise, which is the only thing GRPO's group-standardised advantage reads.
Each process computes its own rows' terms and the gradients are summed over processes
(``dist.sum``), so N processes take one process's steps.

The reward (``score``): ``logit``, r = D(x, y) = log D − log(1 − D), the non-saturating
generator objective's signal (the default: it keeps ranking samples that D rejects with
confidence), or ``probability``, r = σ(D(x, y)) ∈ (0, 1). Until D's first update every
sample scores 0, so the first step's advantages are 0 rather than the noise of an untrained
discriminator. Metrics (``reward_update/adversarial/...``): ``loss`` (mean BCE per image,
before the step's update), ``accuracy_real`` / ``accuracy_fake`` (references with a positive
logit, samples with a negative one), ``logit_real`` / ``logit_fake`` and ``r1``.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.config import option
from mmrl.core.component_config import RewardConfig
from mmrl.core.reward import Reward, RewardContext
from mmrl.core.rollout import Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.images import opencv, rollout_images

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass
class AdversarialConfig(RewardConfig):
    """How real a discriminator trained during RL finds each image (references vs the policy's samples)."""

    type: str = option("adversarial", "registered name of this component (see `mmrl list`)")
    features: Literal["pixels", "encoder"] = option("encoder", "what the discriminator reads: pixels (a small CNN) or the frozen encoder's features (an MLP)")
    encoder: str = option("assets/shapes_encoder", "directory of the frozen image encoder (features: encoder), written by python -m mmrl.tasks.shapes.encoder")
    references: str = option("shapes", "positives: shapes (a new ground-truth render of each sample's prompt) or a directory of PNG/JPEG images")
    conditional: bool = option(True, "projection discriminator on the prompt's words: D judges image and prompt together (references: shapes only)")
    score: Literal["logit", "probability"] = option("logit", "the reward: logit D(x, y), or probability sigma(D(x, y))")
    lr: float = option(1e-3, "Adam learning rate of the discriminator", gt=0)
    steps_per_update: int = option(1, "discriminator Adam steps on each RL step's samples", ge=1)
    label_smoothing: float = option(0.1, "one-sided: references are labelled 1 - this", ge=0, lt=0.5)
    r1: float = option(1.0, "gamma of the R1 gradient penalty on the references (0: none)", ge=0)
    hidden: int = option(128, "units of the discriminator's feature phi(x) and the prompt embedding", ge=1)
    width: int = option(32, "channels of the pixel CNN's first convolution (features: pixels)", ge=1)
    buckets: int = option(1024, "hash buckets of the prompt's words (conditional)", ge=1)
    dtype: Literal["float32", "float64"] = option("float32", "the discriminator's dtype (float64 makes N processes = 1 process exact to rounding)")

    def validate(self, path: str) -> None:
        # paths are checked when the reward is built (they are relative to where it runs)
        if self.references != "shapes" and self.conditional:
            raise ConfigError(f"{path}.conditional" if path else "conditional", self.conditional, "a directory of reference images has no prompts: set conditional: false (or references: shapes)")


def word_buckets(prompts: list[str], buckets: int) -> tuple[Tensor, Tensor]:
    """(bucket ids, offsets) of the prompts' lower-case words for ``nn.EmbeddingBag``; a word's
    bucket is crc32(word) mod ``buckets`` (stable across processes and runs, unlike hash())."""
    ids, offsets = [], []
    for prompt in prompts:
        offsets.append(len(ids))
        ids.extend(zlib.crc32(word.encode()) % buckets for word in re.findall(r"[a-z0-9]+", prompt.lower()))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


class Discriminator(nn.Module):
    """D(x, y) = w·φ(x) + b [+ e(y)·φ(x)] on pixels (a CNN) or encoder features (an MLP)."""

    def __init__(self, cfg: AdversarialConfig, in_features: int | None):
        super().__init__()
        act = nn.LeakyReLU(0.2)
        if in_features is None:
            w = cfg.width
            self.body = nn.Sequential(
                nn.Conv2d(3, w, 3, padding=1), act,
                nn.Conv2d(w, 2 * w, 4, stride=2, padding=1), act,
                nn.Conv2d(2 * w, 2 * w, 4, stride=2, padding=1), act,
                nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(2 * w * 9, cfg.hidden), act,
            )
        else:
            # the encoder's ReLU features are large (norm ~160 on shapes renders): normalised,
            # Adam's steps move the logits by about lr, not by the features' scale
            self.body = nn.Sequential(nn.LayerNorm(in_features), nn.Linear(in_features, cfg.hidden), act, nn.Linear(cfg.hidden, cfg.hidden), act)
        self.head = nn.Linear(cfg.hidden, 1)
        self.embed = nn.EmbeddingBag(cfg.buckets, cfg.hidden, mode="mean") if cfg.conditional else None
        if self.embed is not None:
            nn.init.normal_(self.embed.weight, std=0.02)  # starts as the unconditional D

    def forward(self, x: Tensor, words: tuple[Tensor, Tensor] | None) -> Tensor:
        phi = self.body(x)
        logit = self.head(phi).squeeze(1)
        if self.embed is not None:
            logit = logit + (self.embed(*words) * phi).sum(1)
        return logit


@REWARDS.register("adversarial", config=AdversarialConfig)
class Adversarial(Reward):
    """Adv-GRPO's adversarial reward: a discriminator of references against the policy's
    current samples, trained after each step's scoring (see the module docstring)."""

    learns = True

    def __init__(self, cfg: AdversarialConfig, context: RewardContext):
        super().__init__(cfg, context)
        self.device = context.device_for(cfg)
        self.dtype = getattr(torch, cfg.dtype)
        self.encoder = None
        if cfg.features == "encoder":
            from mmrl.tasks.shapes.encoder import load_shapes_encoder

            self.encoder = load_shapes_encoder(cfg.encoder, "rewards.adversarial.encoder").to(self.device, self.dtype)
        if cfg.references != "shapes" and not Path(cfg.references).is_dir():
            raise ConfigError("rewards.adversarial.references", cfg.references, "shapes, or a directory of PNG/JPEG reference images")
        self.reference_images = None if cfg.references == "shapes" else self._read_directory(Path(cfg.references))
        with torch.random.fork_rng(devices=[]):  # D's initialisation follows the run seed and leaves the global stream alone
            torch.manual_seed(context.seed)
            self.discriminator = Discriminator(cfg, None if self.encoder is None else self.encoder.feature_dim).to(self.device, self.dtype)
        self.optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=cfg.lr, betas=(0.5, 0.999))
        self.updates = 0

    @staticmethod
    def _read_directory(directory: Path) -> list[np.ndarray]:
        cv2 = opencv("the adversarial reward's reference images")
        images = []
        for path in sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)
            if image is None:
                raise ConfigError("rewards.adversarial.references", str(path), "not a readable PNG/JPEG image")
            images.append(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))
        if not images:
            raise ConfigError("rewards.adversarial.references", str(directory), f"holds no reference images ({', '.join(IMAGE_SUFFIXES)})")
        return images

    # ------------------------------------------------------------------ inputs

    def _inputs(self, images: np.ndarray) -> Tensor:
        """D's input of uint8 images [B, H, W, 3]: encoder features or pixels in [−1, 1]."""
        x = torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
        if self.encoder is not None:
            with torch.no_grad():
                return self.encoder(x)
        return x.permute(0, 3, 1, 2).to(self.dtype) / 127.5 - 1.0

    def _words(self, rollout: Rollout) -> tuple[Tensor, Tensor] | None:
        if not self.config.conditional:
            return None
        if "prompt" not in rollout.info:
            raise ConfigError("rewards", "adversarial", "conditional: true reads each sample's prompt (info['prompt']): use sampler.type: prompt, or set conditional: false")
        ids, offsets = word_buckets([str(p) for p in rollout.info["prompt"]], self.config.buckets)
        return ids.to(self.device), offsets.to(self.device)

    def _references(self, rollout: Rollout, size: tuple[int, int], offset: int, total: int) -> np.ndarray:
        """One reference per sample of this process (global rows offset … offset + B − 1 of
        ``total``), drawn from the run seed and the update count."""
        rng = np.random.RandomState(np.random.SeedSequence([self.context.seed, self.updates]).generate_state(1)[0])
        draws = rng.randint(1 << 30, size=total)[offset : offset + rollout.batch_size]
        if self.reference_images is not None:
            cv2 = opencv("the adversarial reward's reference images")
            picked = [self.reference_images[int(d) % len(self.reference_images)] for d in draws]
            return np.stack([im if im.shape[:2] == size else cv2.resize(im, (size[1], size[0]), interpolation=cv2.INTER_AREA) for im in picked])
        from mmrl.tasks.shapes.world import Scene, parse_prompt, render_scene

        if size[0] != size[1]:
            raise ConfigError("rewards", "adversarial", f"references: shapes renders square images; the samples are {size[0]}x{size[1]}")
        out = np.empty((rollout.batch_size, *size, 3), dtype=np.uint8)
        for i, draw in enumerate(draws):
            metadata = (rollout.info["metadata"][i] if "metadata" in rollout.info else None) or {}
            try:
                scene = Scene.from_dict(metadata["scene"]) if "scene" in metadata else parse_prompt(str(rollout.info["prompt"][i]))
            except (ValueError, KeyError) as e:
                raise ConfigError("rewards", "adversarial", f"references: shapes renders each sample's prompt, and sample {offset + i}'s is not a shapes scene: {e}") from None
            out[i] = render_scene(scene, size[0], int(draw))
        return out

    # ------------------------------------------------------------------ scoring and learning

    def __call__(self, rollout: Rollout, *, policy: Any = None, reference: Any = None) -> Tensor:
        images = rollout_images(rollout, "adversarial")
        if self.updates == 0:
            return torch.zeros(len(images))
        with torch.no_grad():
            logit = self.discriminator(self._inputs(images), self._words(rollout)).float().cpu()
        return logit if self.config.score == "logit" else torch.sigmoid(logit)

    def update(self, rollout: Rollout, scores: Tensor, *, step: int, dist: Any) -> dict[str, float]:
        cfg = self.config
        fake_images = rollout_images(rollout, "adversarial")
        sizes = dist.sizes(len(fake_images))
        total = sum(sizes)
        real_images = self._references(rollout, fake_images.shape[1:3], dist.offset(sizes), total)
        fake, real = self._inputs(fake_images), self._inputs(real_images)
        words = self._words(rollout)
        bce = nn.functional.binary_cross_entropy_with_logits
        metrics: dict[str, float] = {}
        for k in range(cfg.steps_per_update):
            real = real.detach().requires_grad_(cfg.r1 > 0)
            real_logit = self.discriminator(real, words)
            fake_logit = self.discriminator(fake, words)
            terms = bce(real_logit, torch.full_like(real_logit, 1.0 - cfg.label_smoothing), reduction="sum") + bce(fake_logit, torch.zeros_like(fake_logit), reduction="sum")
            penalty = torch.zeros((), dtype=self.dtype, device=self.device)
            if cfg.r1 > 0:
                (grad,) = torch.autograd.grad(real_logit.sum(), real, create_graph=True)
                penalty = grad.pow(2).flatten(1).sum(1).sum()
            loss = (terms + cfg.r1 / 2 * penalty) / total
            self.optimizer.zero_grad()
            loss.backward()
            for p in self.discriminator.parameters():  # all-reduce: the gradient of the whole batch's loss
                p.grad = dist.sum(p.grad if p.grad is not None else torch.zeros_like(p)).to(p)
            self.optimizer.step()
            if k == 0:  # D as it scored this step's samples
                summed = dist.sum(torch.stack([
                    terms.detach(), (real_logit > 0).sum(), (fake_logit < 0).sum(), real_logit.detach().sum(), fake_logit.detach().sum(), penalty.detach(),
                ]).double().cpu())
                metrics = {
                    "loss": summed[0].item() / (2 * total), "accuracy_real": summed[1].item() / total, "accuracy_fake": summed[2].item() / total,
                    "logit_real": summed[3].item() / total, "logit_fake": summed[4].item() / total, "r1": summed[5].item() / total,
                }
        self.updates += 1
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"discriminator": self.discriminator.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.discriminator.load_state_dict(state["discriminator"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates = int(state["updates"])
