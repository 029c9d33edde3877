import pytest
import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.data.prompts import EpochOrder, PromptRecord, clusters_by
from mmrl.rewards.consistency import ParaphraseConsistencyConfig


def rollout(completions, record_ids, question_ids):
    n = len(completions)
    return Rollout(
        group_id=torch.tensor(record_ids), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={},
        info={"completions": completions, "record_id": torch.tensor(record_ids), "metadata": [{"question_id": q} if q else {} for q in question_ids]},
    )


def score(completions, record_ids, question_ids, **options):
    reward = build_reward(from_dict(ParaphraseConsistencyConfig, options, "rewards[0]"), RewardContext())
    return reward(rollout(completions, record_ids, question_ids)).tolist()


def a(x):
    return f"<think>...</think><answer>{x}</answer>"


def test_answers_that_agree_across_paraphrases_score_higher_than_answers_that_depend_on_the_wording():
    # question q: records 0 and 1 are two wordings, two samples each; record 0 answers 5 twice,
    # record 1 answers 5 and 7. Question r: records 2, 3, every answer 9.
    completions = [a(5), a(5), a(5), a(7), a(9), a(9), a(9), a(9)]
    records = [0, 0, 1, 1, 2, 2, 3, 3]
    questions = ["q", "q", "q", "q", "r", "r", "r", "r"]
    got = score(completions, records, questions)
    # a sample's peers are the other wording's samples, never its own record's
    assert got == [0.5, 0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_samples_without_a_peer_or_an_answer_get_the_neutral_value():
    completions = [a(5), a(5), "no answer here", a(5), a(3)]
    records = [0, 0, 1, 2, 3]
    questions = ["q", "q", "q", None, "s"]  # record 2 has no question id, record 3's question has one wording
    # records 0's samples have one peer, which gives no answer: a disagreement (0); that peer
    # itself has no answer, record 2 no question and record 3 no other wording: neutral
    assert score(completions, records, questions, no_peer_value=0.25) == [0.0, 0.0, 0.25, 0.25, 0.25]
    # with the last number instead of a tag, the third completion has no answer either
    assert score(["x 5", "the sum is 5.", "5 or 6"], [0, 1, 2], ["q", "q", "q"], answer_tag=None) == [0.5, 0.5, 0.0]


def test_cluster_order_keeps_the_paraphrases_of_a_question_together_in_every_epoch():
    records = [PromptRecord(prompt=f"p{i}", metadata={"question_id": i // 3} if i < 9 else {}, record_id=i) for i in range(11)]
    clusters = clusters_by(records, "question_id")
    assert clusters == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [10]]
    order = EpochOrder(len(records), seed=3, clusters=clusters)
    for epoch in range(3):
        seen = order.indices(epoch * 11, 11)
        assert sorted(seen) == list(range(11))
        for start in [seen.index(c[0]) for c in clusters]:
            cluster = next(c for c in clusters if c[0] == seen[start])
            assert seen[start:start + len(cluster)] == cluster
    assert order.indices(0, 11) != order.indices(11, 11)  # a new cluster order each epoch


# ------------------------------------------------------------------ GRPO-CARE

TINY_LM = {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 8}}


def tiny_policy(seed=0):
    pytest.importorskip("transformers")
    from mmrl.core.weights import build_policy
    from mmrl.policies.text_lm import TextLMConfig

    torch.manual_seed(seed)
    return build_policy(from_dict(TextLMConfig, TINY_LM, "policy"), {})


def care(**options):
    from mmrl.rewards.consistency import GrpoCareConfig

    return build_reward(from_dict(GrpoCareConfig, options, "rewards[0]"), RewardContext())


def text_rollout(prompts, completions, answers, groups):
    n = len(completions)
    return Rollout(
        group_id=torch.tensor(groups), old=OldLogProbs(torch.zeros(n, 1)), mask=torch.ones(n, 1), replay={},
        info={"prompt": prompts, "completions": completions, "answer": answers, "record_id": torch.tensor(groups), "metadata": [{}] * n},
    )


@pytest.mark.numerics
def test_continuation_log_prob_is_the_teacher_forced_log_prob_of_the_continuation_tokens():
    policy = tiny_policy()
    prompt, prefix, cont = "Q: 1+2?", "<think>1+2=3</think><answer>", "3"
    ids = policy.tokenizer([prefix + cont], add_special_tokens=False)["input_ids"]
    replay = policy._replay(policy.encode_prompts([prompt]), ids)
    per_token = policy.log_prob(replay)[0]  # temperature 1, top-p 1: the model's own distribution
    n_cont = len(policy.tokenizer(cont, add_special_tokens=False)["input_ids"])
    got = policy.continuation_log_prob([prompt], [prefix], [cont], reduce="sum")
    assert torch.allclose(got, per_token[-n_cont:].sum()[None], atol=1e-5)  # another pass, same rows (measured: equal)
    assert torch.allclose(policy.continuation_log_prob([prompt], [prefix], [cont]), got / n_cont)


def test_care_gives_the_bonus_to_the_correct_sample_whose_reasoning_makes_its_answer_more_likely():
    policy = tiny_policy()
    prompts = ["What is 2 + 2?"] * 4
    completions = [
        "<think>2+2=4</think><answer>4</answer>",
        "<think>two and two</think><answer>4</answer>",
        "<think>2+2=5</think><answer>5</answer>",  # wrong: never a bonus
        "no answer tag 4",
    ]
    reward = care(bonus=0.5, ema_decay=0.9)
    got = reward(text_rollout(prompts, completions, ["4"] * 4, [0, 0, 0, 0]), policy=policy)
    c = policy.continuation_log_prob(prompts[:2], ["<think>2+2=4</think><answer>", "<think>two and two</think><answer>"], ["4", "4"])
    assert c[0] != c[1]
    winner = int(torch.argmax(c))
    assert got[winner] == 0.5 and got[1 - winner] == 0.0 and got[2:].tolist() == [0.0, 0.0]
    # a lone correct sample in its group is at its group's mean: it gets the bonus
    alone = reward(text_rollout(prompts[:2], completions[1:3], ["4", "4"], [0, 1]), policy=policy)
    assert alone.tolist() == [0.5, 0.0]


def test_care_reference_is_a_moving_average_of_the_policy_and_resumes_exactly():
    policy = tiny_policy()
    rollout = text_rollout(["Q"], ["<answer>1</answer>"], ["1"], [0])
    reward = care(ema_decay=0.9)
    reward(rollout, policy=policy)
    name = "model.model.embed_tokens.weight"
    start = policy.state_dict()[name].clone()
    with torch.no_grad():
        policy.state_dict()[name].add_(1.0)
    reward(rollout, policy=policy)
    assert torch.allclose(reward.reference.state_dict()[name], start + 0.1, atol=1e-6)  # 0.9 * start + 0.1 * (start + 1)
    saved = reward.state_dict()
    resumed = care(ema_decay=0.9)
    resumed.load_state_dict(saved)
    resumed(rollout, policy=policy)  # the restored reference, then one more average
    assert torch.allclose(resumed.reference.state_dict()[name], 0.9 * (start + 0.1) + 0.1 * (start + 1.0), atol=1e-6)
    assert resumed.calls == 3
