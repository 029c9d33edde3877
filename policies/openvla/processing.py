"""OpenVLA's inputs without torchvision: the image processor's transform (Pillow + torch) and
the prompt.

``preprocessor_config.json`` (``PrismaticImageProcessor``) names a resize strategy and, per
featurizer, an input size, an interpolation and a mean/std. Its saved ``tvf_*`` fields are
what the reference applies (they are restored as attributes when it loads), so they win over
``means``/``stds`` where present — the released files hold the DINOv2 mean/std rounded to
bf16 there (0.484375, …), which is what the released models were run with.

Per image: ``letterbox`` pads to a square with the mean colour, ``resize-naive`` resizes to
S×S, ``resize-crop`` resizes the short side to S and centre-crops; then ``/255`` and
``(x - mean) / std`` per featurizer, stacked along channels. The reference does this with
torchvision's functional ops on a PIL image, which call Pillow's own ``Image.resize`` (bicubic,
Pillow's antialiasing): done here with the same Pillow call the result is equal to the bit
for the same Pillow version; padding and crop offsets follow torchvision's rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mmrl.errors import ConfigError

# PIL resampling codes (torchvision's pil_modes_mapping)
_INTERPOLATIONS = {"nearest": 0, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5, "lanczos": 1}
STRATEGIES = ("resize-naive", "resize-crop", "letterbox")


class PrismaticImageTransform:
    """uint8 [H, W, 3] frames → pixel values [3·F, S, S] for F featurizers."""

    def __init__(self, processor: dict, num_featurizers: int):
        self.strategy = processor.get("image_resize_strategy", "letterbox")
        if self.strategy not in STRATEGIES:
            raise ConfigError("policy.checkpoint", self.strategy, f"preprocessor_config.json: image_resize_strategy must be one of {', '.join(STRATEGIES)}")
        sizes = processor.get("input_sizes") or [[3, 224, 224]] * num_featurizers
        interpolations = processor.get("interpolations") or ["bicubic"] * num_featurizers
        means = processor.get("means") or [[0.5, 0.5, 0.5]] * num_featurizers
        stds = processor.get("stds") or [[0.5, 0.5, 0.5]] * num_featurizers
        normalize = processor.get("tvf_normalize_params")
        resize = processor.get("tvf_resize_params")
        if len(sizes) != num_featurizers:
            raise ConfigError("policy.checkpoint", len(sizes), f"preprocessor_config.json: input_sizes lists {len(sizes)} featurizers, the model has {num_featurizers}")
        self.sizes = [int(s[-1]) for s in sizes]
        self.resamples = [int(resize[i]["interpolation"]) if resize else _INTERPOLATIONS[interpolations[i]] for i in range(num_featurizers)]
        self.means = [torch.tensor(normalize[i]["mean"] if normalize else means[i], dtype=torch.float32) for i in range(num_featurizers)]
        self.stds = [torch.tensor(normalize[i]["std"] if normalize else stds[i], dtype=torch.float32) for i in range(num_featurizers)]
        # the reference keeps the last featurizer's mean as the letterbox fill
        fill = processor.get("tvf_letterbox_fill")
        self.fill = tuple(int(v) for v in fill) if fill else tuple(int(x * 255) for x in means[-1])

    @classmethod
    def from_directory(cls, path: Path, num_featurizers: int) -> "PrismaticImageTransform":
        file = Path(path) / "preprocessor_config.json"
        processor = json.loads(file.read_text()) if file.is_file() else {}
        return cls(processor, num_featurizers)

    def _letterbox(self, image):
        from PIL import Image

        w, h = image.size
        side = max(w, h)
        left, top = int((side - w) / 2), int((side - h) / 2)
        # torchvision pads (left, top, right, bottom) = (left, top, left, top): an odd
        # difference leaves the padded image one pixel short of square, as there
        canvas = Image.new("RGB", (w + 2 * left, h + 2 * top), self.fill)
        canvas.paste(image, (left, top))
        return canvas

    def _resize(self, image, size: int, resample: int):
        if self.strategy == "resize-crop":
            w, h = image.size
            short, long = min(w, h), max(w, h)
            new_long = int(size * long / short)
            new_w, new_h = (size, new_long) if w <= h else (new_long, size)
            image = image.resize((new_w, new_h), resample)
            left, top = int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))
            return image.crop((left, top, left + size, top + size))
        return image.resize((size, size), resample)

    def __call__(self, frame: np.ndarray) -> Tensor:
        from PIL import Image

        image = Image.fromarray(np.ascontiguousarray(frame, dtype=np.uint8)).convert("RGB")
        if self.strategy == "letterbox":
            image = self._letterbox(image)
        channels = []
        for size, resample, mean, std in zip(self.sizes, self.resamples, self.means, self.stds):
            pixels = np.asarray(self._resize(image, size, resample), dtype=np.uint8)
            x = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div(255)
            channels.append(x.sub(mean[:, None, None]).div(std[:, None, None]))
        return torch.cat(channels, dim=0)

    def batch(self, images: Tensor) -> Tensor:
        """uint8 [N, K, H, W, 3] (K cameras) → [N, K·3·F, S, S]."""
        frames = images.cpu().numpy()
        return torch.stack([torch.cat([self(camera) for camera in sample]) for sample in frames])


def openvla_prompt(instruction: str) -> str:
    """OpenVLA's prompt (its eval and deploy scripts lower-case the instruction)."""
    return f"In: What action should the robot take to {instruction.lower()}?\nOut:"
