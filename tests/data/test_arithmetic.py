import json

import pytest

from mmrl.tasks.arithmetic.world import TEMPLATES, completion, has_carry, implied_answer, is_consistent, main, make_splits, stated_answer


def test_completions_work_the_sum_column_by_column_and_state_it():
    assert completion(47, 38) == "<think>7+8=15 4+3+1=8</think><answer>85</answer>"
    assert completion(99, 99) == "<think>9+9=18 9+9+1=19</think><answer>198</answer>"
    for a in range(0, 1000, 7):
        for b in range(0, 1000, 13):
            text = completion(a, b)
            assert implied_answer(text) == stated_answer(text) == a + b and is_consistent(text)


def test_consistency_reads_what_the_reasoning_computes_right_or_wrong():
    wrong_step = "<think>7+8=15 4+3+1=9</think><answer>95</answer>"  # bad arithmetic, answer follows from it
    assert implied_answer(wrong_step) == 95 and is_consistent(wrong_step)
    unfaithful = "<think>7+8=15 4+3+1=8</think><answer>86</answer>"  # right steps, an answer they do not give
    assert implied_answer(unfaithful) == 85 and not is_consistent(unfaithful)
    assert implied_answer("<answer>85</answer>") is None and not is_consistent("<answer>85</answer>")
    assert stated_answer("<think>1+1=2</think>") is None


def test_splits_are_disjoint_deterministic_and_paraphrases_share_a_question_id():
    train, held_out = make_splits(digits=2, n_train=300, n_held_out=50, paraphrases=3, seed=1)
    assert len(train) == 900 and len(held_out) == 150
    assert not {r["question_id"] for r in train} & {r["question_id"] for r in held_out}
    assert make_splits(digits=2, n_train=300, n_held_out=50, paraphrases=3, seed=1) == (train, held_out)
    assert make_splits(digits=2, n_train=300, n_held_out=50, paraphrases=3, seed=2)[0] != train
    for r in train[:30]:
        assert r["prompt"] == TEMPLATES[r["paraphrase"]].format(a=r["a"], b=r["b"]) and r["answer"] == str(r["a"] + r["b"])
        assert 10 <= r["a"] < 100 and r["category"] == ("carry" if has_carry(r["a"], r["b"]) else "no_carry")
    assert has_carry(15, 5) and has_carry(95, 10) and not has_carry(11, 11)


def test_cli_writes_jsonl_splits_and_rejects_impossible_requests(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--train", "20", "--held-out", "5"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "held_out.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[0]["split"] == "held_out"
    assert main(["--out", str(tmp_path), "--digits", "1", "--train", "100", "--held-out", "1"]) == 2
    assert "1-digit operands give 100 problems" in capsys.readouterr().err
    with pytest.raises(ValueError, match="paraphrases"):
        make_splits(digits=2, n_train=1, n_held_out=1, paraphrases=9, seed=0)
