"""Image data sources for algo.type: sft — ``shapes`` (ground truth rendered from a shapes
prompt set) and ``images`` (image files named by a JSONL/CSV) — and pretraining an image
generator on them through the trainer."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
cv2 = pytest.importorskip("cv2")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.weights import build_policy  # noqa: E402
from mmrl.tasks.shapes.world import parse_prompt, render_scene, write_prompt_sets  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.image_diffusion import ImageDiffusionConfig  # noqa: E402
from mmrl.registry import DATA_SOURCES  # noqa: E402
from mmrl.tasks.shapes.rewards import check_criteria, detect_shapes  # noqa: E402

TEXT_POLICY = {"type": "image_diffusion", "tiny": {"conditioning": "text", "text_injection": "pooled", "resolution": 16, "max_prompt_tokens": 24}}


def _policy(resolution: int = 16, **tiny):
    torch.manual_seed(0)
    cfg = from_dict(ImageDiffusionConfig, {**TEXT_POLICY, "tiny": {**TEXT_POLICY["tiny"], "resolution": resolution, **tiny}}, "policy")
    return build_policy(cfg, {})


def _source(kind: str, policy, seed: int = 0, world: int = 1, rank: int = 0, **fields):
    entry = DATA_SOURCES.entry(kind)
    cfg = from_dict(entry.config, {"type": kind, **fields}, "data")
    return entry.obj(cfg, policy, seed, world, rank)


@pytest.fixture(scope="module")
def prompt_sets(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    counts = write_prompt_sets(out, categories=["single", "count"])
    assert counts == {"train": 43, "eval": 11}
    return out


def test_the_categories_option_keeps_only_those_scenes_and_the_same_split(prompt_sets, tmp_path):
    write_prompt_sets(tmp_path)
    full = {json.loads(line)["prompt"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()}
    records = [json.loads(line) for line in (prompt_sets / "eval.jsonl").read_text().splitlines()]
    assert {r["metadata"]["category"] for r in records} == {"single", "count"}
    assert {r["prompt"] for r in records} <= full  # the same combinations are held out
    with pytest.raises(ValueError, match="categories"):
        write_prompt_sets(tmp_path, categories=["colours"])


def test_shapes_source_renders_every_prompt_as_ground_truth_the_verifier_accepts(prompt_sets):
    policy = _policy(32)
    source = _source("shapes", policy, path=str(prompt_sets / "train.jsonl"), images_per_prompt=2, batch_size=8)
    assert source.num_samples == 43 * 2 and source.samples["images"].shape == (86, 32, 32, 3)
    images, prompts = source.samples["images"].numpy(), source.samples["prompt"]
    for image, prompt in zip(images, prompts):
        detections = detect_shapes(image, min_chroma=60, min_area=0.01, min_fill=0.8)
        assert all(check_criteria(parse_prompt(prompt), detections).values()), prompt
    # the copies of one prompt are different renderings; a second source draws the same ones
    assert not np.array_equal(images[0], images[1])
    again = _source("shapes", policy, path=str(prompt_sets / "train.jsonl"), images_per_prompt=2, batch_size=8)
    assert torch.equal(again.samples["images"], source.samples["images"])
    batch = source.batch(0, torch.device("cpu"))
    assert batch["images"].dtype == torch.uint8 and batch["images"].shape == (8, 32, 32, 3) and len(batch["prompt"]) == 8
    # two processes take the halves of the one-process batch
    halves = [_source("shapes", policy, world=2, rank=r, path=str(prompt_sets / "train.jsonl"), images_per_prompt=2, batch_size=8).batch(0, torch.device("cpu")) for r in (0, 1)]
    assert torch.equal(torch.cat([h["images"] for h in halves]), batch["images"])
    assert policy.sft_loss(batch).isfinite()


def test_shapes_source_resolution_must_match_the_policy(prompt_sets):
    with pytest.raises(ConfigError, match="data.resolution"):
        _source("shapes", _policy(16), path=str(prompt_sets / "train.jsonl"), resolution=32)
    with pytest.raises(ConfigError, match="data.path"):
        _source("shapes", _policy(16))


def test_images_source_reads_image_files_with_text_or_class_prompts(tmp_path):
    scenes = ["a red circle", "two blue squares", "three green triangles"]
    rows = []
    for i, prompt in enumerate(scenes):
        image = render_scene(parse_prompt(prompt), 16, seed=i)
        cv2.imwrite(str(tmp_path / f"{i}.png"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        rows.append({"file": f"{i}.png", "prompt": prompt, "label": i})
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"image": r["file"], "prompt": r["prompt"]}) + "\n" for r in rows))
    (tmp_path / "class.jsonl").write_text("".join(json.dumps({"image": r["file"], "prompt": r["label"]}) + "\n" for r in rows))
    text = _source("images", _policy(16), path=str(tmp_path / "text.jsonl"), batch_size=4)
    assert text.samples["prompt"] == scenes
    for i, prompt in enumerate(scenes):  # PNG is lossless: the very pixels come back, RGB
        assert np.array_equal(text.samples["images"][i].numpy(), render_scene(parse_prompt(prompt), 16, seed=i))
    classes = _source("images", _policy(16), path=str(tmp_path / "class.jsonl"), batch_size=4)
    assert classes.samples["condition"].tolist() == [0, 1, 2] and "prompt" not in classes.samples
    with pytest.raises(ConfigError, match="the policy generates 32x32"):
        _source("images", _policy(32), path=str(tmp_path / "text.jsonl"))
    (tmp_path / "missing.jsonl").write_text(json.dumps({"image": "nope.png", "prompt": "a red circle"}) + "\n")
    with pytest.raises(ConfigError, match="cannot read the image"):
        _source("images", _policy(16), path=str(tmp_path / "missing.jsonl"))
