"""The replay buffer: transitions cut from env episodes (rewards, n-step sums, chunk
discounts, terminated apart from truncated, the bootstrap observation), the ring, its draws
and its saved state."""

import pytest
import torch

from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.train.replay_buffer import ReplayBuffer, transitions


def _episodes(truncated: list[bool], lengths: list[int], steps: float = 1.0, final: bool = True) -> Rollout:
    """B episodes padded to T decisions: observation of decision t of episode b is 10 b + t,
    its reward (t + 1) · (b + 1), each decision ``steps`` env steps long; the final
    observation of episode b is 10 b + 9."""
    b, t = len(lengths), max(lengths)
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).float()
    obs = (10 * torch.arange(b)[:, None] + torch.arange(t)[None]).float()[..., None] * mask[..., None]
    reward = (torch.arange(t)[None] + 1.0) * (torch.arange(b)[:, None] + 1.0) * mask
    info = {"decision_steps": mask * steps, "truncated": torch.tensor(truncated)}
    if final:
        info["final_replay"] = {"obs": (10 * torch.arange(b) + 9).float()[:, None, None], "action": torch.zeros(b, 1, 2)}
    return Rollout(group_id=torch.arange(b), old=OldLogProbs(torch.zeros(b, t)), mask=mask,
                   replay={"obs": obs, "action": obs.expand(b, t, 2).clone()}, step_rewards=reward, info=info)


def test_one_step_transitions_bootstrap_from_the_next_decision_and_a_cut_episode_from_its_final_observation():
    out = transitions(_episodes(truncated=[False, True], lengths=[3, 2]), gamma=0.9)
    assert out["replay"]["obs"][:, 0, 0].tolist() == [0, 1, 2, 10, 11]
    assert out["next"]["obs"][:, 0, 0].tolist() == [1, 2, 9, 11, 19]  # episode 0's end is terminal: its next observation is never read
    assert "action" not in out["next"]
    assert out["reward"].tolist() == [1, 2, 3, 2, 4]
    assert out["discount"].tolist() == pytest.approx([0.9] * 5)
    assert out["terminated"].tolist() == [False, False, True, False, False]  # a time limit is not the task's end


def test_n_step_transitions_sum_the_next_n_rewards_and_stop_at_the_episodes_end():
    g = 0.5
    out = transitions(_episodes(truncated=[False, True], lengths=[4, 3]), gamma=g, n_step=3)
    r0 = [1, 2, 3, 4]
    assert out["reward"].tolist() == pytest.approx([r0[0] + g * r0[1] + g**2 * r0[2], r0[1] + g * r0[2] + g**2 * r0[3], r0[2] + g * r0[3], r0[3], 2 + g * 4 + g**2 * 6, 4 + g * 6, 6])
    assert out["discount"].tolist() == pytest.approx([g**3, g**3, g**2, g, g**3, g**2, g])
    assert out["next"]["obs"][:, 0, 0].tolist() == [3, 9, 9, 9, 19, 19, 19]
    assert out["terminated"].tolist() == [False, True, True, True, False, False, False]


def test_a_chunk_of_several_env_steps_is_discounted_by_gamma_to_its_length():
    out = transitions(_episodes(truncated=[True], lengths=[3], steps=4.0), gamma=0.9, n_step=2)
    assert out["discount"].tolist() == pytest.approx([0.9**8, 0.9**8, 0.9**4])
    assert out["reward"].tolist() == pytest.approx([1 + 0.9**4 * 2, 2 + 0.9**4 * 3, 3])


def test_a_truncated_episode_without_its_final_observation_is_an_error():
    with pytest.raises(ValueError, match="final observation"):
        transitions(_episodes(truncated=[True], lengths=[2], final=False), gamma=0.9)
    assert transitions(_episodes(truncated=[False], lengths=[2], final=False), gamma=0.9)["terminated"].tolist() == [False, True]


def _batch(start: int, n: int) -> dict:
    x = torch.arange(start, start + n).float()
    return {"replay": {"obs": x[:, None, None]}, "next": {"obs": x[:, None, None] + 1}, "reward": x, "discount": torch.ones(n), "terminated": torch.zeros(n, dtype=torch.bool)}


def test_the_ring_overwrites_its_oldest_transitions_past_the_capacity():
    buffer = ReplayBuffer(5, "cpu", seed=0)
    assert buffer.add(_batch(0, 3)) == 3 and len(buffer) == 3
    buffer.add(_batch(3, 4))
    assert len(buffer) == 5 and buffer.added == 7
    assert sorted(buffer.storage["reward"].tolist()) == [2, 3, 4, 5, 6]
    buffer.add(_batch(7, 9))  # more than the capacity at once: the last five stay
    assert sorted(buffer.storage["reward"].tolist()) == [11, 12, 13, 14, 15]


def test_draws_are_uniform_over_the_filled_rows_and_keep_each_transition_whole():
    buffer = ReplayBuffer(100, "cpu", seed=0)
    buffer.add(_batch(0, 10))
    batch = buffer.sample(2000)
    assert set(batch["reward"].long().tolist()) == set(range(10))
    assert torch.equal(batch["next"]["obs"][:, 0, 0], batch["reward"] + 1)
    counts = torch.bincount(batch["reward"].long(), minlength=10).float()
    assert counts.min() > 150 and counts.max() < 250  # 200 each expected


def test_a_buffer_loaded_from_its_state_draws_what_the_original_draws_next():
    buffer = ReplayBuffer(8, "cpu", seed=3)
    buffer.add(_batch(0, 11))
    buffer.sample(4)
    restored = ReplayBuffer(8, "cpu", seed=99)
    restored.load_state_dict(buffer.state_dict())
    for _ in range(3):
        a, b = buffer.sample(5), restored.sample(5)
        assert all(torch.equal(a[k], b[k]) for k in ("reward", "discount", "terminated")) and torch.equal(a["replay"]["obs"], b["replay"]["obs"])
    buffer.add(_batch(20, 3))
    restored.add(_batch(20, 3))
    assert all(torch.equal(buffer.storage[k], restored.storage[k]) for k in buffer.storage)
    with pytest.raises(ValueError, match="buffer_size"):
        ReplayBuffer(9, "cpu", seed=0).load_state_dict(buffer.state_dict())


def test_transitions_of_another_kind_cannot_join_the_buffer():
    buffer = ReplayBuffer(8, "cpu", seed=0)
    buffer.add(_batch(0, 2))
    with pytest.raises(ValueError, match="cannot join"):
        buffer.add({**_batch(0, 2), "extra": torch.zeros(2)})


def test_the_saved_state_holds_the_filled_rows_alone_not_the_whole_ring(tmp_path):
    """A checkpoint's size follows the transitions held, not the capacity: the saved rows are
    a copy, not a view that would save the preallocated storage behind it."""
    buffer = ReplayBuffer(100_000, "cpu", seed=0)
    buffer.add(_batch(0, 10))
    torch.save(buffer.state_dict(), tmp_path / "state.pt")
    assert (tmp_path / "state.pt").stat().st_size < 50_000
