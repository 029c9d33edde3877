"""Prompt datasets: sources, fields, prompt kinds, the held-out split and the epoch order."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest

from mmrl.config import from_dict
from mmrl.data.prompts import EpochOrder, PromptData, PromptDataConfig, PromptRecord, epoch_order, split_held_out
from mmrl.errors import ConfigError, MissingExtraError

ROWS = [
    {"prompt": "What is 2 + 3?", "answer": "5", "category": "add", "level": "1"},
    {"prompt": "What is 7 - 4?", "answer": "3", "category": "sub", "level": "2"},
    {"prompt": "Name a prime.", "category": "open", "level": "1"},  # no answer
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_csv(path, rows):
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_saved_dataset(path, rows):
    datasets = pytest.importorskip("datasets")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    datasets.Dataset.from_list([{c: row.get(c) for c in columns} for row in rows]).save_to_disk(str(path))
    return str(path)


def load(**data) -> PromptData:
    return PromptData.load(from_dict(PromptDataConfig, data, "sampler.data"), "sampler.data")


@pytest.mark.parametrize("write, name", [(write_jsonl, "p.jsonl"), (write_csv, "p.csv"), (write_saved_dataset, "saved")])
def test_jsonl_csv_and_saved_datasets_give_the_same_records(tmp_path, write, name):
    data = load(train=write(tmp_path / name, ROWS))
    assert data.kind == "text" and data.held_out == [] and data.num_conditions is None
    assert data.train == [
        PromptRecord("What is 2 + 3?", "5", {"category": "add", "level": "1"}, 0),
        PromptRecord("What is 7 - 4?", "3", {"category": "sub", "level": "2"}, 1),
        PromptRecord("Name a prime.", None, {"category": "open", "level": "1"}, 2),
    ]


def test_field_names_pick_the_prompt_answer_and_metadata(tmp_path):
    rows = [{"question": "q0", "solution": 4, "level": 2, "source": "x"}, {"question": "q1", "solution": 9, "level": 5, "source": "y"}]
    data = load(train=write_jsonl(tmp_path / "p.jsonl", rows), prompt_field="question", answer_field="solution", metadata_fields=["level"])
    assert [(r.prompt, r.answer, r.metadata) for r in data.train] == [("q0", 4, {"level": 2}), ("q1", 9, {"level": 5})]
    no_answers = load(train=write_jsonl(tmp_path / "p.jsonl", rows), prompt_field="question", answer_field=None)
    assert [(r.answer, r.metadata) for r in no_answers.train] == [(None, {"solution": 4, "level": 2, "source": "x"}), (None, {"solution": 9, "level": 5, "source": "y"})]
    # a source without the answer field has no answers
    assert [r.answer for r in load(train=write_jsonl(tmp_path / "p.jsonl", rows), prompt_field="question").train] == [None, None]


def test_a_metadata_mapping_contributes_its_keys(tmp_path):
    rows = [{"prompt": "a", "answer": 1, "metadata": {"category": "add", "hard": True}, "id": 7}]
    (record,) = load(train=write_jsonl(tmp_path / "p.jsonl", rows)).train
    assert record.metadata == {"category": "add", "hard": True, "id": 7}


def test_integer_prompts_are_conditions_and_size_the_embedding_table(tmp_path):
    data = load(train=write_jsonl(tmp_path / "p.jsonl", [{"prompt": 3, "answer": 1}, {"prompt": 0}]), eval=write_jsonl(tmp_path / "e.jsonl", [{"prompt": 5}]))
    assert data.kind == "condition" and [r.prompt for r in data.train] == [3, 0] and data.num_conditions == 6
    # a CSV holds strings: integer strings become conditions when asked
    csv_data = load(train=write_csv(tmp_path / "p.csv", [{"prompt": "2"}, {"prompt": " 7"}]), prompt_kind="condition")
    assert [r.prompt for r in csv_data.train] == [2, 7] and csv_data.num_conditions == 8
    assert load(train=write_csv(tmp_path / "p.csv", [{"prompt": "2"}])).kind == "text"
    as_text = load(train=write_jsonl(tmp_path / "p.jsonl", [{"prompt": 3}]), prompt_kind="text")
    assert as_text.kind == "text" and as_text.train[0].prompt == "3"


def test_without_a_source_the_records_are_the_integer_conditions():
    data = load(num_prompts=3)
    assert data.kind == "condition" and data.num_conditions == 3
    assert data.train == [PromptRecord(0, None, {}, 0), PromptRecord(1, None, {}, 1), PromptRecord(2, None, {}, 2)]


def test_the_held_out_split_is_seeded_disjoint_complete_and_in_source_order(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": i} for i in range(20)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    data = load(train=path, eval_fraction=0.25)
    train_ids, held_ids = [r.record_id for r in data.train], [r.record_id for r in data.held_out]
    assert len(held_ids) == 5 and len(train_ids) == 15
    assert sorted(train_ids + held_ids) == list(range(20)) and not set(train_ids) & set(held_ids)
    assert train_ids == sorted(train_ids) and held_ids == sorted(held_ids)
    # the documented rule: the records at the first k positions of RandomState(split_seed)'s permutation
    assert set(held_ids) == set(np.random.RandomState([0, 0]).permutation(20)[:5].tolist())
    assert load(train=path, eval_fraction=0.25) == data
    other = load(train=path, eval_fraction=0.25, split_seed=1)
    assert {r.record_id for r in other.held_out} != set(held_ids)
    # k = floor(fraction * n + 1/2)
    assert [len(split_held_out(data.train[:n], 0.1, 0)[1]) for n in (4, 5, 14, 15)] == [0, 1, 1, 2]


def test_epoch_order_visits_every_record_once_per_epoch_and_reshuffles():
    order = EpochOrder(10, seed=3)
    stream = order.indices(0, 40)
    epochs = [stream[i : i + 10] for i in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4
    assert epochs[2] == epoch_order(10, 3, 2).tolist()
    assert order.indices(7, 25) == stream[7:32]  # any window of the stream, e.g. one process's groups
    assert EpochOrder(10, seed=4).indices(0, 10) != epochs[0]


def test_a_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "saved"
    path.mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingExtraError, match=r"mmrl\[data\]"):
        load(train=str(path))


@pytest.mark.parametrize(
    "data, field, message",
    [
        ({"train": "nowhere.jsonl"}, "sampler.data.train", "no such file"),
        ({"eval": "nowhere.csv"}, "sampler.data.eval", "no such file"),
        ({"train": "{tmp}/p.txt"}, "sampler.data.train", "unknown format"),
        ({"train": "{tmp}/bad.jsonl"}, "sampler.data.train", "line 2 is not JSON"),
        ({"train": "{tmp}/empty.jsonl"}, "sampler.data.train", "holds no records"),
        ({"train": "{tmp}/p.jsonl", "prompt_field": "question"}, "sampler.data.prompt_field", "no such field .* its fields: prompt, answer, category"),
        ({"train": "{tmp}/p.jsonl", "metadata_fields": ["topic"]}, "sampler.data.metadata_fields", "no such field"),
        ({"train": "{tmp}/mixed.jsonl"}, "sampler.data.prompt_kind", "neither all integers nor all strings"),
        ({"train": "{tmp}/p.jsonl", "prompt_kind": "condition"}, "sampler.data.prompt_kind", "is not an integer"),
        ({"eval_fraction": 1.5}, "sampler.data.eval_fraction", "must be >= 0 and < 1"),
        ({"eval_fraction": -0.1}, "sampler.data.eval_fraction", "must be >= 0 and < 1"),
        ({"train": "{tmp}/p.jsonl", "eval_fraction": 0.1}, "sampler.data.eval_fraction", "holds out 0 of 3 records"),
        ({"train": "{tmp}/p.jsonl", "eval": "{tmp}/p.jsonl", "eval_fraction": 0.5}, "sampler.data.eval_fraction", "must be 0 when eval names"),
        ({"prompt_kind": "image"}, "sampler.data.prompt_kind", "allowed: auto, text, condition"),
    ],
)
def test_bad_data_config_names_the_field_and_value(tmp_path, data, field, message):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1", "category": "x"}] * 3)
    (tmp_path / "p.txt").write_text("a\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "empty.jsonl").write_text("\n")
    write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": 1}])
    data = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in data.items()}
    with pytest.raises(ConfigError, match=message) as err:
        load(**data)
    assert err.value.field == field


def test_a_saved_dataset_dict_points_at_its_split_directories(tmp_path):
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_list([{"prompt": "a"}])
    datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"splits train, test; point at one split's directory") as err:
        load(train=str(tmp_path / "dd"))
    assert err.value.field == "sampler.data.train"
    assert load(train=str(tmp_path / "dd" / "test"), answer_field=None).train == [PromptRecord("a", None, {}, 0)]
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="not a saved dataset"):
        load(train=str(tmp_path / "plain"))


# ------------------------------------------------------------------ images with the prompt


def write_png(path, rgb):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 6, 3), rgb, dtype=np.uint8)).save(path)


def test_records_carry_images_relative_to_the_source_file_and_prompts_become_image_prompts(tmp_path):
    pytest.importorskip("PIL")
    from mmrl.data.prompts import ImagePrompt, prompt_input

    write_png(tmp_path / "data" / "img" / "red.png", (200, 0, 0))
    write_png(tmp_path / "data" / "img" / "blue.png", (0, 0, 200))
    rows = [
        {"prompt": "Colour?", "answer": "red", "image": "img/red.png", "category": "c"},
        {"prompt": "Which came first?", "answer": "blue", "image": ["img/blue.png", "img/red.png"]},  # a clip's frames
        {"prompt": "No picture.", "answer": "ok"},
    ]
    data = PromptData.load(PromptDataConfig(train=write_jsonl(tmp_path / "data" / "p.jsonl", rows)))
    first, clip, plain = data.train
    assert first.images == (str(tmp_path / "data" / "img" / "red.png"),) and first.metadata == {"category": "c"}  # not metadata
    assert [p.rsplit("/", 1)[1] for p in clip.images] == ["blue.png", "red.png"] and plain.images == ()
    image_prompt = prompt_input(first)
    assert isinstance(image_prompt, ImagePrompt) and image_prompt.text == "Colour?"
    (pixels,) = image_prompt.images
    assert pixels.shape == (4, 6, 3) and pixels.dtype == np.uint8 and tuple(pixels[0, 0]) == (200, 0, 0)
    assert not pixels.flags.writeable  # cached and shared: read-only
    assert [tuple(im[0, 0]) for im in prompt_input(clip).images] == [(0, 0, 200), (200, 0, 0)]
    assert prompt_input(plain) == "No picture."
    # image_field: null reads no images (the field is then metadata like any other)
    no_images = PromptData.load(PromptDataConfig(train=str(tmp_path / "data" / "p.jsonl"), image_field=None))
    assert all(r.images == () for r in no_images.train) and no_images.train[0].metadata["image"] == "img/red.png"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "a", "image": "missing.png"}], "does not exist"),
        ([{"prompt": "a", "image": 3}], "expected an image path or a list of paths"),
        ([{"prompt": 1, "image": "x.png"}], "images come with text prompts"),
    ],
)
def test_bad_images_name_the_image_field(tmp_path, rows, message):
    pytest.importorskip("PIL")
    write_png(tmp_path / "x.png", (1, 2, 3))
    with pytest.raises(ConfigError, match=rf"sampler\.data\.image_field.*{message}"):
        PromptData.load(PromptDataConfig(train=write_jsonl(tmp_path / "p.jsonl", rows)), "sampler.data")
