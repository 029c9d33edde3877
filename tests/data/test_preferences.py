"""Verifier-labelled preference pairs: the chosen item scores better, held-out prompts are
new, label noise flips exactly the asked fraction of train pairs."""

import json

import numpy as np
import pytest

from mmrl.data.preferences import read_info, read_pairs
from mmrl.commands.pairs import main
from mmrl.tasks.arithmetic.pairs import write_arithmetic_pairs
from mmrl.tasks.shapes.pairs import write_shapes_pairs
from tests.conftest import ROOT


def _partial(scene_text, image):
    from mmrl.tasks.shapes.world import parse_prompt
    from mmrl.tasks.shapes.rewards import check_criteria, detect_shapes

    met = check_criteria(parse_prompt(scene_text), detect_shapes(image, min_chroma=60, min_area=0.01, min_fill=0.8)).values()
    return sum(met) / len(met)


def test_shapes_pairs_choose_the_image_the_verifier_scores_higher_on_new_held_out_prompts(tmp_path):
    pytest.importorskip("cv2")
    info = write_shapes_pairs(tmp_path, num_train=12, num_held_out=8, seed=0)
    assert info == {**info, "kind": "image", "train": 12, "held_out": 8}
    train, held = read_pairs(tmp_path, "train"), read_pairs(tmp_path, "held_out")
    assert train.chosen.shape == (12, 32, 32, 3) and train.chosen.dtype == np.uint8
    for pairs in (train, held):
        for prompt, chosen, rejected in zip(pairs.prompts, pairs.chosen, pairs.rejected):
            assert _partial(prompt, chosen) > _partial(prompt, rejected)
    assert not set(train.prompts) & set(held.prompts)


def test_image_sets_and_label_noise(tmp_path):
    pytest.importorskip("cv2")
    write_shapes_pairs(tmp_path, num_train=10, num_held_out=4, set_size=3, flip=0.2, seed=1)
    train = read_pairs(tmp_path, "train")
    assert read_info(tmp_path)["kind"] == "image_set" and train.chosen.shape == (10, 3, 32, 32, 3)
    assert sum(m.get("flipped", False) for m in train.metadata) == 2
    assert not any(m.get("flipped", False) for m in read_pairs(tmp_path, "held_out").metadata)
    for prompt, chosen, rejected, meta in zip(train.prompts, train.chosen, train.rejected, train.metadata):
        better = np.mean([_partial(prompt, x) for x in chosen]) > np.mean([_partial(prompt, x) for x in rejected])
        assert better != meta.get("flipped", False)


def test_arithmetic_pairs_choose_the_exactly_correct_completion(tmp_path):
    from mmrl.tasks.arithmetic.world import implied_answer, stated_answer

    info = write_arithmetic_pairs(tmp_path, ROOT / "examples" / "arithmetic", flip=0.1, seed=0)
    assert info["train"] == 2000 and info["held_out"] == 200
    rows = [json.loads(line) for line in (tmp_path / "held_out.jsonl").read_text().splitlines()]
    kinds = set()
    for row in rows:
        a, b = (int(x) for x in row["metadata"]["question_id"].split("+"))
        assert stated_answer(row["chosen"]) == a + b != stated_answer(row["rejected"])
        kinds.add("inconsistent" if implied_answer(row["rejected"]) != stated_answer(row["rejected"]) else "consistent")
    assert kinds == {"inconsistent", "consistent"}  # wrong answers and wrong reasoning both occur
    train = read_pairs(tmp_path, "train")
    assert sum(m.get("flipped", False) for m in train.metadata) == 200


def test_the_command_writes_pairs_and_refuses_bad_input(tmp_path, capsys):
    assert main(["arithmetic", "--prompts", str(ROOT / "examples" / "arithmetic"), "--out", str(tmp_path / "a")]) == 0
    assert "2000 train and 200 held-out text pairs" in capsys.readouterr().out
    assert main(["arithmetic", "--prompts", str(tmp_path / "none"), "--out", str(tmp_path / "b")]) == 2
    assert main(["arithmetic", "--prompts", str(ROOT / "examples" / "arithmetic"), "--out", str(tmp_path / "c"), "--flip", "0.7"]) == 2


def test_held_out_pairs_may_come_from_the_train_prompts_with_new_images(tmp_path):
    pytest.importorskip("cv2")
    from mmrl.tasks.shapes.world import split_scenes

    write_shapes_pairs(tmp_path, num_train=4, num_held_out=6, held_out_prompts="train", render_seed=1000)
    train_prompts = {s.text() for s in split_scenes(0.2, 0)[0]}
    held = read_pairs(tmp_path, "held_out")
    assert set(held.prompts) <= train_prompts
    with pytest.raises(ValueError, match="held_out or the train"):
        write_shapes_pairs(tmp_path / "x", num_train=1, num_held_out=1, held_out_prompts="test")


def test_policy_pairs_label_a_generators_own_samples_by_the_config_rewards(tmp_path):
    pytest.importorskip("cv2")
    pytest.importorskip("diffusers")
    from mmrl.rewards.images import jpeg_kilobytes

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "metadata": {"category": "single"}}) + "\n" for p in ("a red circle", "a blue square", "two green triangles")))
    (prompts / "eval.jsonl").write_text(json.dumps({"prompt": "a cyan circle", "metadata": {"category": "single"}}) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        "policy:\n  type: image_diffusion\n  tiny: {conditioning: text, resolution: 8, block_out_channels: [8, 16], text_hidden_size: 16, text_layers: 1, text_heads: 2}\n"
        "  denoising: {transition: flow_sde, num_inference_steps: 2, noise_level: 0.7}\n"
        f"sampler: {{type: prompt, data: {{train: {prompts / 'train.jsonl'}, eval: {prompts / 'eval.jsonl'}}}}}\n"
        "rewards:\n  - {type: jpeg_incompressibility, quality: 95}\n"
    )
    out = tmp_path / "pairs"
    assert main(["policy", str(config), "--out", str(out), "--group-size", "4", "--rounds", "2", "--pairs-per-prompt", "3", "--flip", "0.25"]) == 0
    info = read_info(out)
    # 3 of the 6 pairs of each group of 4 (JPEG sizes of noisy images differ), per record and round
    assert info["kind"] == "image" and info["source"] == "policy" and (info["train"], info["held_out"]) == (3 * 3 * 2, 1 * 3 * 2)
    train, held = read_pairs(out, "train"), read_pairs(out, "held_out")
    assert train.chosen.shape == (18, 8, 8, 3) and set(held.prompts) == {"a cyan circle"} and set(train.prompts) <= {"a red circle", "a blue square", "two green triangles"}
    assert sum(m.get("flipped", False) for m in train.metadata) == round(0.25 * 18)
    for pairs in (train, held):
        for chosen, rejected, meta in zip(pairs.chosen, pairs.rejected, pairs.metadata):
            high, low = jpeg_kilobytes(np.stack([chosen, rejected]), 95)
            assert meta["scores"][0] > meta["scores"][1] and meta["category"] == "single"
            assert (high < low) if meta.get("flipped") else (high > low)  # the larger JPEG is chosen unless flipped
    # the held-out samples are new images of the held-out prompt, not copies of train images
    assert not any((h == t).all() for h in held.chosen for t in train.chosen)
    assert main(["policy", str(config), "--out", str(tmp_path / "bad"), "--group-size", "1"]) == 2
    # held-out prompts = train prompts: a held-out seed apart from the train seed draws new images
    config.write_text(config.read_text().replace("eval.jsonl", "train.jsonl"))
    assert main(["policy", str(config), "--out", str(tmp_path / "seen"), "--group-size", "2", "--pairs-per-prompt", "1", "--held-out-seed", "5"]) == 0
    seen_train, seen_held = read_pairs(tmp_path / "seen", "train"), read_pairs(tmp_path / "seen", "held_out")
    assert set(seen_held.prompts) == set(seen_train.prompts) and not any((h == t).all() for h in seen_held.chosen for t in seen_train.chosen)


def test_merge_keeps_every_train_pair_and_the_first_directorys_held_out_pairs(tmp_path):
    pytest.importorskip("cv2")
    write_shapes_pairs(tmp_path / "a", num_train=6, num_held_out=3, size=16, seed=0)
    write_shapes_pairs(tmp_path / "b", num_train=5, num_held_out=4, size=16, seed=1)
    assert main(["merge", "--out", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    merged, a, b = (read_pairs(tmp_path / d, "train") for d in ("m", "a", "b"))
    assert len(merged) == 11 and (merged.chosen == np.concatenate([a.chosen, b.chosen])).all() and (merged.rejected == np.concatenate([a.rejected, b.rejected])).all()
    assert [m["source"] for m in merged.metadata] == [str(tmp_path / "a")] * 6 + [str(tmp_path / "b")] * 5
    held = read_pairs(tmp_path / "m", "held_out")
    assert held.prompts == read_pairs(tmp_path / "a", "held_out").prompts and (held.chosen == read_pairs(tmp_path / "a", "held_out").chosen).all()
    write_shapes_pairs(tmp_path / "s", num_train=2, num_held_out=1, size=16, set_size=2)
    assert main(["merge", "--out", str(tmp_path / "bad"), str(tmp_path / "a"), str(tmp_path / "s")]) == 2
