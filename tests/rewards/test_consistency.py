import torch

from mmrl.config import from_dict
from mmrl.core.reward import RewardContext, build_reward
from mmrl.core.rollout import Rollout
from mmrl.data.prompts import EpochOrder, PromptRecord, clusters_by
from mmrl.rewards.consistency import ParaphraseConsistencyConfig


def rollout(completions, record_ids, question_ids):
    n = len(completions)
    return Rollout(
        group_id=torch.tensor(record_ids), old_logp=torch.zeros(n, 1), mask=torch.ones(n, 1), replay={},
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
