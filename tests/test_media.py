"""Sample media written as files: image grids, videos as mp4 and as a PNG of frames."""

from __future__ import annotations

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from mmrl.media import tile, write_media  # noqa: E402


def _videos(n=3, f=5, h=6, w=7, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, f, h, w, 3)).astype(np.uint8)


def test_tile_places_each_image_row_by_row_with_padding():
    images = np.stack([np.full((2, 3, 3), i * 50, dtype=np.uint8) for i in range(1, 6)])
    grid = tile(images, columns=2, pad=1)
    assert grid.shape == (3 * 3 + 1, 2 * 4 + 1, 3)
    assert (grid[1:3, 1:4] == 50).all() and (grid[1:3, 5:8] == 100).all() and (grid[7:9, 1:4] == 250).all()
    assert (grid[7:9, 5:8] == 0).all()  # the sixth cell is empty
    assert (grid[0] == 0).all() and (grid[:, 4] == 0).all()


def test_write_media_writes_videos_as_an_mp4_of_every_frame_and_a_png_row_per_video(tmp_path):
    videos = _videos()
    paths = write_media(tmp_path / "samples", {"videos": videos}, scale=2)
    assert sorted(p.name for p in paths) == ["videos.mp4", "videos.png"]
    png = cv2.cvtColor(cv2.imread(str(tmp_path / "samples" / "videos.png")), cv2.COLOR_BGR2RGB)
    assert png.shape == (2 * (3 * 7 + 1), 2 * (5 * 8 + 1), 3)  # 3 rows of 5 frames, 1-pixel gaps, ×2
    # frame 2 of video 1 sits at row 1, column 2, exactly (PNG is lossless)
    assert np.array_equal(png[2 * (1 + 7) : 2 * (1 + 7) + 12 : 2, 2 * (1 + 2 * 8) : 2 * (1 + 2 * 8) + 14 : 2], videos[1, 2])
    capture = cv2.VideoCapture(str(tmp_path / "samples" / "videos.mp4"))
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(frame)
    capture.release()
    assert len(frames) == 5 and frames[0].shape[:2] == (2 * (2 * 7 + 1), 2 * (2 * 8 + 1))  # a 2×2 grid per frame


def test_write_media_writes_images_as_one_grid_and_keeps_the_first_max_items(tmp_path):
    images = _videos(n=20)[:, 0]
    (path,) = write_media(tmp_path, {"images": images}, max_items=4, scale=1)
    png = cv2.imread(str(path))
    assert path.name == "images.png" and png.shape == (2 * 7 + 1, 2 * 8 + 1, 3)  # 4 images: 2×2


def test_media_of_another_shape_or_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="images"):
        write_media(tmp_path, {"x": np.zeros((2, 4, 4), dtype=np.uint8)})
    with pytest.raises(ValueError, match="uint8"):
        write_media(tmp_path, {"videos": np.zeros((1, 2, 4, 4, 3), dtype=np.float32)})
