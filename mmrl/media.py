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
    video (:func:`tile`), written by :func:`write_video` (an H.264 mp4 through
    imageio-ffmpeg when installed, else OpenCV's MPEG-4 ``mp4v``)."""
    videos = _uint8(videos, "videos", 5)
    frames = np.stack([tile(videos[:, t]) for t in range(videos.shape[1])])
    return write_video(path, frames, fps=fps, scale=scale)


def write_video(path: Path, frames, fps: int = 10, scale: int = 4) -> Path:
    """Write uint8 frames [T, H, W, 3] as an H.264 mp4 (imageio-ffmpeg), each pixel
    enlarged ``scale`` times (nearest neighbour, so 64×64 observations stay sharp)."""
    frames = np.asarray(frames, dtype=np.uint8)
    if scale > 1:
        frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        import imageio.v2 as imageio

        imageio.mimwrite(tmp, list(frames), fps=fps, macro_block_size=1)
    except ImportError:  # OpenCV only: MPEG-4 part 2 instead of H.264
        import cv2

        writer = cv2.VideoWriter(str(tmp), cv2.VideoWriter_fourcc(*"mp4v"), fps, (frames.shape[2], frames.shape[1]))
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
    tmp.replace(path)
    return path


# RGB; the outcome is read by its colour before its word
OUTCOME_COLOURS = {True: (40, 220, 40), False: (235, 40, 40)}


def annotate_episode(frames, instruction: str | None, success: bool, min_width: int = 256, max_lines: int = 2):
    """The frames [T, H, W, 3] (uint8) of one evaluation episode with its instruction on a
    dark band at the top (wrapped to ``max_lines`` lines, the rest cut to "...") and its
    outcome, "success" in green or "failure" in red, on a dark band at the bottom, as
    evaluation videos of ManiSkill and LeRobot let a reader see at a glance which episode
    failed at what. The outcome is known when the video is written and is on every frame,
    so any frame of a paused video says it. Frames narrower than ``min_width`` are first
    enlarged by a whole factor (nearest neighbour: 64×64 observations stay sharp and the
    text gets enough pixels to be read). Returns new frames [T, H·k, W·k, 3]."""
    try:
        import cv2
    except ImportError:
        raise MissingExtraError("opencv-python", "vla", "evaluation videos with their instruction and outcome") from None
    frames = np.asarray(frames, dtype=np.uint8)
    k = max(1, math.ceil(min_width / frames.shape[2]))
    frames = frames.repeat(k, axis=1).repeat(k, axis=2)
    height, width = frames.shape[1:3]
    font, font_scale, thickness = cv2.FONT_HERSHEY_SIMPLEX, width / 560, max(1, round(width / 400))
    (_, text_height), baseline = cv2.getTextSize("Ag", font, font_scale, thickness)
    pad = max(2, text_height // 3)
    line_height = text_height + baseline + pad

    def fits(text: str) -> bool:
        return cv2.getTextSize(text, font, font_scale, thickness)[0][0] <= width - 2 * pad

    # the text is drawn once, as coverage (anti-aliased, 0..255) and colour, then blended
    # into every frame over the darkened bands
    coverage = np.zeros((height, width), np.uint8)
    colour = np.zeros((height, width, 3), np.uint8)
    bands = np.zeros(height, bool)
    lines = _wrap(instruction, fits, max_lines) if instruction else []
    for i, line in enumerate(lines):
        cv2.putText(coverage, line, (pad, pad + text_height + i * line_height), font, font_scale, 255, thickness, cv2.LINE_AA)
    top = len(lines) * line_height + pad if lines else 0
    bands[:top] = True
    colour[:top] = 255
    bottom = height - line_height - pad
    # bold: the outcome is what a reader scans a grid of videos for
    cv2.putText(coverage, "success" if success else "failure", (pad, height - pad - baseline), font, font_scale, 255, thickness + 1, cv2.LINE_AA)
    bands[bottom:] = True
    colour[bottom:] = OUTCOME_COLOURS[bool(success)]

    alpha = coverage[bands, :, None].astype(np.float32) / 255
    backed = frames[:, bands].astype(np.float32) * 0.25  # the dark backing of both bands
    frames[:, bands] = (backed * (1 - alpha) + colour[bands] * alpha).round().astype(np.uint8)
    return frames


def _wrap(text: str, fits, max_lines: int) -> list[str]:
    """Greedy word wrap of ``text`` into at most ``max_lines`` lines that ``fits``; a line
    that does not fit (the words left over, a word too long) is cut and ends in "..." (the
    video fonts are ASCII only)."""
    lines: list[str] = []
    words = text.split()
    while words and len(lines) < max_lines:
        line = words.pop(0)
        while words and fits(f"{line} {words[0]}"):
            line = f"{line} {words.pop(0)}"
        lines.append(line)
    if words:  # what is left goes on the last line, to be cut
        lines[-1] = f"{lines[-1]} {' '.join(words)}"
    return [line if fits(line) else _cut(line, fits) for line in lines]


def _cut(line: str, fits) -> str:
    while line and not fits(line + "..."):
        line = line[:-1]
    return line.rstrip() + "..."


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
