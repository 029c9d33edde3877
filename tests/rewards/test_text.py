import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards.text import ExactMatchConfig, FormatConfig, MathAnswerConfig, tagged_answer


def rollout(completions, answers):
    n = len(completions)
    return Rollout(
        group_id=torch.arange(n),
        old=OldLogProbs(torch.zeros(n, 1)),
        mask=torch.ones(n, 1),
        replay={},
        info={"completions": list(completions), "answer": list(answers), "record_id": torch.arange(n)},
    )


def score(data: dict, completions, answers) -> list[float]:
    entry = REWARDS.entry(data["type"])
    reward = build_reward(from_dict(entry.config, data, "rewards[0]"), RewardContext())
    return reward(rollout(completions, answers)).tolist()


def test_text_rewards_are_registered_with_their_configs():
    assert REWARDS.entry("math_answer").config is MathAnswerConfig
    assert REWARDS.entry("exact_match").config is ExactMatchConfig
    assert REWARDS.entry("format").config is FormatConfig


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("So the total is \\boxed{42}.", "42", 1.0),
        ("The answer is $\\frac{3}{4}$.", "0.75", 1.0),  # LaTeX fraction against a decimal gold
        ("3 apples and 4 pears make 7", "7", 1.0),  # the last number
        ("half of it: 1/2", "\\frac{1}{2}", 1.0),  # a bare LaTeX gold answer
        ("first 12, then \\boxed{5}", "5", 1.0),  # \boxed{} wins over a later plain number
        ("we get \\boxed{x^2 + 1}", "1 + x^2", 1.0),  # symbolic equality
        ("In total 1,000 apples", "1000", 1.0),
        ("So the total is \\boxed{41}.", "42", 0.0),
        ("42 at first, but finally 41", "42", 0.0),  # only the final answer counts
        ("I do not know.", "42", 0.0),
        ("", 7, 0.0),
    ],
)
def test_math_answer_reads_boxed_latex_and_last_number_forms(completion, answer, expected):
    pytest.importorskip("math_verify")
    assert score({"type": "math_answer"}, [completion], [answer]) == [expected]


def test_math_answer_extraction_forms_and_answer_tag():
    pytest.importorskip("math_verify")
    plain = "the sum is 7"
    boxed = "the sum is $\\boxed{7}$"
    assert score({"type": "math_answer", "extraction": ["latex"]}, [plain, boxed], ["7", "7"]) == [0.0, 1.0]
    assert score({"type": "math_answer", "extraction": ["expr"]}, [plain], ["7"]) == [1.0]
    tagged = ["<think>maybe 5</think><answer>7</answer>", "<think>it is 7</think><answer>5</answer>", "it is 7"]
    assert score({"type": "math_answer", "answer_tag": "answer"}, tagged, ["7"] * 3) == [1.0, 0.0, 0.0]


def test_exact_match_normalizes_whitespace_and_optionally_case():
    completions = ["  Paris ", "paris", "Par is", "Paris, France", "New\n  York"]
    answers = ["Paris", "Paris", "Paris", "Paris", "New York"]
    assert score({"type": "exact_match"}, completions, answers) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert score({"type": "exact_match", "ignore_case": True}, completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_exact_match_inside_the_last_answer_tag():
    completions = ["<answer>a</answer> then <answer> 12 </answer>", "<answer>13</answer>", "12"]
    assert score({"type": "exact_match", "answer_tag": "answer"}, completions, [12, 12, 12]) == [1.0, 0.0, 0.0]
    assert tagged_answer("x <a>1</a> <a>2\n3</a>", "a") == "2\n3" and tagged_answer("none", "a") is None


def test_format_reward_wants_each_tag_once_in_order_and_nothing_else():
    completions = [
        "<think>2 + 2 is 4</think>\n<answer>4</answer>",
        "  <think>\nlines\n</think> <answer>4</answer>\n",
        "<answer>4</answer><think>late</think>",  # wrong order
        "<think>x</think><answer>4</answer> and more",  # text outside the blocks
        "<think>x</think><answer>4</answer><answer>5</answer>",  # a tag twice
        "<think>x</think>",  # a tag missing
        "<think><answer>4</answer></think>",  # nested
    ]
    assert score({"type": "format"}, completions, [None] * len(completions)) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert score({"type": "format", "tags": ["answer"]}, ["<answer>4</answer>", completions[0]], [None, None]) == [1.0, 0.0]


def test_answer_rewards_name_the_record_without_an_answer_and_an_unreadable_gold():
    with pytest.raises(ConfigError, match="record 1 has none"):
        score({"type": "exact_match"}, ["a", "b"], ["a", None])
    pytest.importorskip("math_verify")
    with pytest.raises(ConfigError, match="record 0's answer"):
        score({"type": "math_answer"}, ["7"], ["  "])


def test_text_rewards_need_decoded_completions():
    no_text = Rollout(group_id=torch.zeros(1, dtype=torch.long), old=OldLogProbs(torch.zeros(1, 1)), mask=torch.ones(1, 1), replay={}, info={"answer": ["1"]})
    with pytest.raises(ConfigError, match="text_lm"):
        build_reward(FormatConfig(), RewardContext())(no_text)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"type": "format", "tags": []}, r"rewards\[0\]\.tags"),
        ({"type": "format", "tags": ["<answer>"]}, r"rewards\[0\]\.tags\[0\]"),
        ({"type": "exact_match", "answer_tag": "a b"}, r"rewards\[0\]\.answer_tag"),
        ({"type": "math_answer", "extraction": ["boxed"]}, r"rewards\[0\]\.extraction\[0\]"),
        ({"type": "math_answer", "extraction": []}, r"rewards\[0\]\.extraction"),
    ],
)
def test_bad_reward_config_names_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        from_dict(REWARDS.entry(data["type"]).config, data, "rewards[0]")


def test_arithmetic_consistency_scores_answers_that_follow_from_the_reasoning_right_or_wrong():
    completions = [
        "<think>7+8=15 4+3+1=8</think><answer>85</answer>",  # right and consistent
        "<think>7+8=15 4+3+1=9</think><answer>95</answer>",  # wrong, but follows from its steps
        "<think>7+8=15 4+3+1=8</think><answer>86</answer>",  # steps give 85, states 86
        "<answer>85</answer>",  # no reasoning to follow from
    ]
    assert score({"type": "arithmetic_consistency"}, completions, ["85"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert score({"type": "exact_match", "answer_tag": "answer"}, completions, ["85"] * 4) == [1.0, 0.0, 0.0, 1.0]
