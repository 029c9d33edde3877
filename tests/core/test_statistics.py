"""Running statistics committed over processes equal those of one process seeing it all."""

import torch

from mmrl.core.statistics import RunningCount, RunningMoments, commit_statistics


def test_moments_committed_from_two_processes_equal_one_process_seeing_every_row():
    rows = torch.randn(96, 3, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 5.0, 0.1]) + 2
    one = RunningMoments(3)
    one.observe(rows[:50])
    one.observe(rows[50:])
    one.commit(lambda t: t)
    a, b = RunningMoments(3), RunningMoments(3)
    a.observe(rows[:17])
    a.observe(rows[60:])
    b.observe(rows[17:60])
    pending = [a._pending.clone(), b._pending.clone()]
    a.commit(lambda t: pending[0] + pending[1])
    b.commit(lambda t: pending[0] + pending[1])
    for m in (a, b):
        torch.testing.assert_close(m.mean, one.mean)
        torch.testing.assert_close(m.var, one.var)
        assert m.count.item() == one.count.item()
    torch.testing.assert_close(one.mean, rows.mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one.var, rows.var(0, unbiased=False), atol=1e-4, rtol=1e-4)


def test_an_empty_commit_changes_nothing_and_statistics_are_saved_but_pending_sums_are_not():
    m = RunningMoments(2)
    m.commit(lambda t: t)
    assert m.count.item() == 1e-4 and torch.equal(m.mean, torch.zeros(2))
    m.observe(torch.ones(4, 2))
    assert set(m.state_dict()) == {"mean", "var", "count"}


def test_counts_add_over_processes_and_commit_finds_nested_statistics():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.clock = RunningCount()
    model.clock.add(5)
    commit_statistics(model, lambda t: 2 * t)  # two processes that each counted 5
    assert model.clock.value.item() == 10
