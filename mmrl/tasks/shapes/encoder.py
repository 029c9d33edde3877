"""A frozen image encoder of the shapes world, trained by mmrl on rendered scenes.

Adv-GRPO ("The Image as Its Own Reward") trains its discriminator on DINO features. No
network model reaches this machine, so the shapes demo ships its own encoder in its place:
a small CNN trained to read a rendered scene's attributes, whose penultimate layer is the
feature the ``adversarial`` reward (``features: encoder``) discriminates on.

Architecture (:class:`ShapesEncoder`, 0.13 M parameters, 0.5 MB of float32): the image in
[−1, 1] at ``resolution`` (24: the demo generator's; other sizes are resized bilinearly),
four 3×3 convolutions (32, 64, 64, 64 channels; the second and third of stride 2, ReLU),
average-pooled to a 3×3 grid (which keeps where things are), a linear map to
``feature_dim`` (64) and a ReLU: the feature f(x) ∈ R^64. Three linear heads read it:

- ``colours``: for each of the 6 colours, how many objects of it (0–3), a 4-way
  classification per colour;
- ``shapes``: the same for each of the 3 shapes;
- ``grid``: for each cell of a 3×3 grid over the image, whether an object's centre lies in
  it (position).

Colours and shapes are counted apart rather than per (colour, shape) pair so that a
held-out combination ("a cyan square", never rendered) is a colour and a shape the heads
know; which colour goes with which shape is left to the features.

Training (:func:`train_encoder`): scenes of every category from the shapes world's train
split (:func:`~mmrl.tasks.shapes.world.split_scenes`, held-out fraction 0.2, seed 0), each
rendered several times with seeded layouts; loss = mean cross-entropy of the 9 count heads
+ mean binary cross-entropy of the 9 grid cells; Adam with a cosine schedule. Held-out figures (in the saved
``config.yaml`` and benchmarks/results/images.md) are measured on renders of the held-out split,
whose (colour, shape, count) combinations the encoder never saw:
``python -m mmrl.tasks.shapes.encoder --out assets/shapes_encoder --seed 0`` reproduces the
shipped weights. :func:`load_shapes_encoder` loads them (frozen, eval mode).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.errors import ConfigError
from mmrl.tasks.shapes.world import COLOURS, MAX_OBJECTS, SHAPES, Scene, draw, layout, split_scenes

ATTRIBUTES: tuple[str, ...] = (*COLOURS, *SHAPES)  # one count head each
GRID = 3


class ShapesEncoder(nn.Module):
    """f(x) ∈ R^feature_dim of an RGB image, and the attribute heads trained on it."""

    def __init__(self, resolution: int = 24, channels: tuple[int, int, int] = (32, 64, 64), feature_dim: int = 64):
        super().__init__()
        self.resolution, self.channels, self.feature_dim = resolution, tuple(channels), feature_dim
        c1, c2, c3 = channels
        self.convs = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(c2, c3, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(c3, c3, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(GRID),
        )
        self.project = nn.Linear(c3 * GRID * GRID, feature_dim)
        self.counts = nn.Linear(feature_dim, len(ATTRIBUTES) * (MAX_OBJECTS + 1))
        self.grid = nn.Linear(feature_dim, GRID * GRID)

    def pixels(self, images: Tensor) -> Tensor:
        """uint8 RGB [B, H, W, 3] → float [B, 3, resolution, resolution] in [−1, 1], in the
        encoder's dtype."""
        x = images.permute(0, 3, 1, 2).to(self.project.weight.dtype) / 127.5 - 1.0
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = nn.functional.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear", align_corners=False, antialias=True)
        return x

    def features_of(self, x: Tensor) -> Tensor:
        """f(x) [B, feature_dim] of images already in :meth:`pixels`' form."""
        return torch.relu(self.project(self.convs(x).flatten(1)))

    def forward(self, images: Tensor) -> Tensor:
        """f(x) [B, feature_dim] of uint8 RGB images [B, H, W, 3]."""
        return self.features_of(self.pixels(images))

    def heads(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """(count logits [B, 9, 4]: objects of each colour, then of each shape; grid logits [B, 9])."""
        return self.counts(features).view(-1, len(ATTRIBUTES), MAX_OBJECTS + 1), self.grid(features)


def scene_targets(scene: Scene, placed, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(objects of each colour and of each shape [9], 0/1 occupancy of the 3×3 grid by
    object centres [9]) of a scene as drawn."""
    counts = np.zeros(len(ATTRIBUTES), dtype=np.int64)
    for colour, shape in scene.objects():
        counts[ATTRIBUTES.index(colour)] += 1
        counts[ATTRIBUTES.index(shape)] += 1
    grid = np.zeros(GRID * GRID, dtype=np.float32)
    for p in placed:
        col = min(int(p.centre[0] * GRID / size), GRID - 1)
        row = min(int(p.centre[1] * GRID / size), GRID - 1)
        grid[row * GRID + col] = 1.0
    return counts, grid


def render_dataset(scenes: list[Scene], per_scene: int, size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """``per_scene`` seeded renders of each scene: (images uint8 [N, size, size, 3],
    counts [N, 9], grid [N, 9]); the render of scene i, copy k uses seed
    (seed · 1,000,003 + i · per_scene + k) mod 2³², as :func:`render_scene` would."""
    n = len(scenes) * per_scene
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    counts = np.empty((n, len(ATTRIBUTES)), dtype=np.int64)
    grid = np.empty((n, GRID * GRID), dtype=np.float32)
    for i, scene in enumerate(scenes):
        for k in range(per_scene):
            j = i * per_scene + k
            rng = np.random.RandomState((seed * 1_000_003 + j) % 2**32)
            background = int(rng.randint(20, 236))  # render_scene's order of draws
            placed = layout(scene, size, rng)
            images[j] = draw(placed, size, background)
            counts[j], grid[j] = scene_targets(scene, placed, size)
    return torch.from_numpy(images), torch.from_numpy(counts), torch.from_numpy(grid)


@torch.no_grad()
def attribute_accuracy(encoder: ShapesEncoder, images: Tensor, counts: Tensor, grid: Tensor, batch: int = 512) -> dict[str, float]:
    """Held-out figures: ``colour_count`` and ``shape_count`` (the fraction of the per-colour
    and per-shape counts predicted right), ``scene`` (images whose 9 counts are all right),
    ``grid`` (cells of the 3×3 occupancy right) and ``grid_scene`` (images whose 9 cells are
    all right)."""
    encoder.eval()
    right_colours = right_shapes = right_scenes = right_cells = right_grids = 0
    colours = len(COLOURS)
    for start in range(0, len(images), batch):
        rows = slice(start, start + batch)
        count_logits, grid_logits = encoder.heads(encoder(images[rows]))
        count_ok = count_logits.argmax(-1) == counts[rows]
        cell_ok = (grid_logits > 0).float() == grid[rows]
        right_colours += int(count_ok[:, :colours].sum())
        right_shapes += int(count_ok[:, colours:].sum())
        right_scenes += int(count_ok.all(1).sum())
        right_cells += int(cell_ok.sum())
        right_grids += int(cell_ok.all(1).sum())
    n = len(images)
    return {"colour_count": right_colours / (n * colours), "shape_count": right_shapes / (n * len(SHAPES)), "scene": right_scenes / n, "grid": right_cells / (n * GRID * GRID), "grid_scene": right_grids / n}


def train_encoder(
    *, seed: int = 0, size: int = 24, steps: int = 3000, batch_size: int = 128, lr: float = 2e-3,
    renders_per_scene: int = 8, held_out_renders: int = 2, log=print,
) -> tuple[ShapesEncoder, dict]:
    """Train a :class:`ShapesEncoder` on renders of the train split's scenes (see the module
    docstring); returns it with its held-out figures and training settings."""
    torch.manual_seed(seed)
    train_scenes, held_scenes = split_scenes(0.2, 0)
    started = time.time()
    images, counts, grid = render_dataset(train_scenes, renders_per_scene, size, seed)
    # the held-out split's combinations are new to the encoder; new renders of train scenes
    # tell how much of the gap is the combinations and how much the layouts
    held = render_dataset(held_scenes, held_out_renders, size, seed + 1)
    seen = render_dataset(train_scenes[:1000], 1, size, seed + 2)
    log(f"rendered {len(images)} training and {len(held[0])} held-out images in {time.time() - started:.0f} s")
    encoder = ShapesEncoder(resolution=size)
    optimizer = torch.optim.Adam(encoder.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    order = torch.Generator().manual_seed(seed)
    x_all = encoder.pixels(images)
    for step in range(1, steps + 1):
        encoder.train()
        rows = torch.randint(len(images), (batch_size,), generator=order)
        count_logits, grid_logits = encoder.heads(encoder.features_of(x_all[rows]))
        loss = nn.functional.cross_entropy(count_logits.flatten(0, 1), counts[rows].flatten()) + nn.functional.binary_cross_entropy_with_logits(grid_logits, grid[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 500 == 0 or step == steps:
            figures = attribute_accuracy(encoder, *held)
            log(f"step {step}: loss {loss.item():.4f}, held-out " + ", ".join(f"{k} {v:.4f}" for k, v in figures.items()))
    info = {
        "seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "renders_per_scene": renders_per_scene,
        "train_images": len(images), "held_out_images": len(held[0]),
        "held_out": attribute_accuracy(encoder, *held), "train_scenes_new_renders": attribute_accuracy(encoder, *seen),
        "seconds": round(time.time() - started),
    }
    return encoder.eval().requires_grad_(False), info


def save_encoder(encoder: ShapesEncoder, directory: str | Path, info: dict) -> None:
    """``config.yaml`` (architecture and training figures) and ``model.safetensors``, each
    written atomically."""
    import yaml
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"type": "shapes_encoder", "resolution": encoder.resolution, "channels": list(encoder.channels), "feature_dim": encoder.feature_dim, "training": info}
    tmp = d / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(meta, sort_keys=False))
    os.replace(tmp, d / "config.yaml")
    tmp = d / ".model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(tmp))
    os.replace(tmp, d / "model.safetensors")


def load_shapes_encoder(directory: str | Path, field: str = "encoder") -> ShapesEncoder:
    """The encoder saved by :func:`save_encoder`, frozen and in eval mode; a missing or
    foreign directory is a :class:`~mmrl.errors.ConfigError` naming ``field``. A relative
    ``assets/...`` path that does not exist where mmrl runs is looked up among the assets
    installed with mmrl."""
    from safetensors.torch import load_file

    import mmrl.assets
    from mmrl.config import load_yaml

    d = Path(directory)
    if not d.exists() and not d.is_absolute() and d.parts[:1] == ("assets",):
        d = Path(mmrl.assets.__file__).parent.joinpath(*d.parts[1:])
    if not (d / "config.yaml").is_file() or not (d / "model.safetensors").is_file():
        raise ConfigError(field, str(directory), "expected a shapes encoder directory (config.yaml + model.safetensors, written by python -m mmrl.tasks.shapes.encoder)")
    meta = load_yaml(d / "config.yaml", field)
    if meta.get("type") != "shapes_encoder":
        raise ConfigError(field, str(directory), f"config.yaml describes a {meta.get('type')!r}, not a shapes_encoder")
    encoder = ShapesEncoder(int(meta["resolution"]), tuple(meta["channels"]), int(meta["feature_dim"]))
    try:
        encoder.load_state_dict(load_file(str(d / "model.safetensors")))
    except RuntimeError as e:
        raise ConfigError(field, str(directory), f"weights do not fit the encoder its config.yaml describes ({str(e).splitlines()[0]})") from None
    return encoder.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.tasks.shapes.encoder", description="Train the frozen shapes image encoder (the adversarial reward's features).")
    parser.add_argument("--out", required=True, help="output directory (config.yaml, model.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the renders, the initialisation and the batches")
    parser.add_argument("--size", type=int, default=24, help="image side the encoder is trained at")
    parser.add_argument("--steps", type=int, default=3000, help="Adam steps")
    parser.add_argument("--renders-per-scene", type=int, default=8, help="seeded renders of each train scene")
    args = parser.parse_args(argv)
    encoder, info = train_encoder(seed=args.seed, size=args.size, steps=args.steps, renders_per_scene=args.renders_per_scene)
    save_encoder(encoder, args.out, info)
    print(f"wrote {args.out}: held-out {info['held_out']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
