"""Writing generated samples as files: image grids (PNG) and videos (mp4 and a PNG of frames).

A policy that generates media says what to write with ``media(rollout) -> {name: array}``
(:class:`~mmrl.core.policy.PolicyModule`); the prompt sampler's evaluation returns it under
``"media"`` and the trainer writes it with :func:`write_media` into
``<run>/samples/step_<N>/`` at every evaluation (``mmrl eval`` into ``<out>/samples/``).
Arrays are uint8 RGB: ``[N, H, W, 3]`` images or ``[N, F, H, W, 3]`` videos. Writing needs
OpenCV (the ``image`` extra).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mmrl.errors import MissingExtraError


def _cv2():
    try:
        import cv2
    except ImportError:
        raise MissingExtraError("opencv-python", "image", "writing sample media") from None
    return cv2


def _uint8(array, what: str, ndim: int) -> np.ndarray:
    a = np.asarray(array.detach().cpu() if hasattr(array, "detach") else array)
    if a.dtype != np.uint8 or a.ndim != ndim or a.shape[-1] != 3:
        raise ValueError(f"{what} must be uint8 RGB with {ndim} dims (..., 3), got {a.dtype} of shape {a.shape}")
    return a


def tile(images: np.ndarray, columns: int | None = None, pad: int = 1) -> np.ndarray:
    """Images [N, H, W, 3] → one grid image, row by row, ``columns`` wide (default: the
    smallest c with c² ≥ N), ``pad`` black pixels between and around the tiles."""
    n, h, w, _ = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    grid = np.zeros((rows * (h + pad) + pad, columns * (w + pad) + pad, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = image
    return grid


def write_png(path: Path, image: np.ndarray, scale: int = 1) -> Path:
    """One RGB uint8 image [H, W, 3] as a PNG, each pixel enlarged ``scale`` times."""
    cv2 = _cv2()
    if scale > 1:
        image = image.repeat(scale, axis=0).repeat(scale, axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)):
        raise RuntimeError(f"OpenCV could not write {path}")
    return path


def write_image_grid(path: Path, images, scale: int = 4) -> Path:
    """A batch of images [N, H, W, 3] as one PNG grid."""
    return write_png(path, tile(_uint8(images, "images", 4)), scale)


def write_frame_grid(path: Path, videos, scale: int = 4) -> Path:
    """A batch of videos [N, F, H, W, 3] as one PNG: a row per video, a column per frame."""
    videos = _uint8(videos, "videos", 5)
    n, f = videos.shape[:2]
    return write_png(path, tile(videos.reshape(n * f, *videos.shape[2:]), columns=f), scale)


def write_video_batch(path: Path, videos, fps: int = 4, scale: int = 4) -> Path:
    """A batch of videos [N, F, H, W, 3] as one mp4 whose frame t tiles frame t of every
    video (:func:`tile`), written by :func:`mmrl.evaluate.write_video` (an H.264 mp4 through
    imageio-ffmpeg when installed, else OpenCV's MPEG-4 ``mp4v``)."""
    from mmrl.evaluate import write_video

    videos = _uint8(videos, "videos", 5)
    frames = np.stack([tile(videos[:, t]) for t in range(videos.shape[1])])
    return write_video(path, frames, fps=fps, scale=scale)


def media_grid(array, max_items: int = 16) -> np.ndarray:
    """One uint8 image [H, W, 3] of the first ``max_items`` samples: a grid of images
    [N, H, W, 3], or of videos [N, F, H, W, 3] with a row of frames per video."""
    a = np.asarray(array.detach().cpu() if hasattr(array, "detach") else array)[:max_items]
    if a.ndim == 4:
        return tile(_uint8(a, "images", 4))
    if a.ndim == 5:
        videos = _uint8(a, "videos", 5)
        return tile(videos.reshape(-1, *videos.shape[2:]), columns=videos.shape[1])
    raise ValueError(f"media must be images [N, H, W, 3] or videos [N, F, H, W, 3], got shape {a.shape}")


def write_media(directory: Path, media: dict, max_items: int = 16, fps: int = 4, scale: int = 4) -> list[Path]:
    """Write each ``name: array`` of ``media`` (the first ``max_items`` samples) into
    ``directory``: images [N, H, W, 3] as ``name.png`` (a grid); videos [N, F, H, W, 3] as
    ``name.mp4`` (tiled) and ``name.png`` (a row of frames per video). Returns the paths."""
    written = []
    for name, array in media.items():
        a = np.asarray(array.detach().cpu() if hasattr(array, "detach") else array)[:max_items]
        if a.ndim == 4:
            written.append(write_image_grid(directory / f"{name}.png", a, scale))
        elif a.ndim == 5:
            written.append(write_video_batch(directory / f"{name}.mp4", a, fps, scale))
            written.append(write_frame_grid(directory / f"{name}.png", a, scale))
        else:
            raise ValueError(f"media {name!r} must be images [N, H, W, 3] or videos [N, F, H, W, 3], got shape {a.shape}")
    return written
