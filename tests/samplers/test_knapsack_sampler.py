"""Knapsack rollout budgets through the prompt sampler and the loop: groups of the sizes the
allocation gives, the pass rates they come from, more samples with a non-zero advantage,
exact resume, partial rollouts, and one-line refusals where they cannot work."""

import json
import statistics

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import from_dict
from mmrl.core.component_config import RewardConfig
from mmrl.core.sampler import sampler_context
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.samplers.budgets import allocate
from mmrl.samplers.prompt import PromptSampler
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import train
from mmrl.core.weights import build_policy
from tests.rollout.test_engine import toy
from tests.rollout.test_partial import text

KNAPSACK = {"type": "knapsack"}


@REWARDS.register("_test_prompt_pass", config=RewardConfig)
def _prompt_pass(rollout, cfg):
    """Test-only, on conditions with a one-token categorical policy of 8 tokens: prompts
    c % 3 == 0 pass when the token is 0 (about 1 in 8), c % 3 == 1 always pass, c % 3 == 2
    pass when the token is below 4 (about 1 in 2)."""
    cond, tok = torch.as_tensor(rollout.info["prompt"]).cpu(), rollout.info["tokens"][:, 0].cpu()
    kind = cond % 3
    return torch.where(kind == 0, (tok == 0).float(), torch.where(kind == 1, torch.ones(len(tok)), (tok < 4).float()))


def _toy(budget, **sections):
    base = {
        "sampler": {"type": "prompt", "data": {"num_prompts": 6}, "budget": budget, "batch_groups": 6},
        "policy": {"type": "categorical_sequence", "dtype": "float64", "seq_len": 1, "vocab_size": 8},
        "rewards": [{"type": "_test_prompt_pass"}],
        "algo": {"group_size": 8, "groups_per_step": 6, "ppo_epochs": 1, "num_minibatches": 1},
        "eval": {"at_start": False, "at_end": False},
    }
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return toy(**base)


def test_a_step_shares_its_samples_by_the_pass_rates_and_keeps_its_total():
    cfg = from_dict(TrainConfig, _toy(KNAPSACK))
    sampler = PromptSampler(cfg.sampler, sampler_context(cfg))
    rates = {0: 0.0, 1: 1.0, 2: 0.5, 3: 0.125, 4: None, 5: 0.25}
    for record, p in rates.items():
        if p is not None:
            sampler.history.add([record] * 16, [1.0] * round(16 * p) + [0.0] * (16 - round(16 * p)))
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, sampler.policy_spec())
    rollout = sampler.collect(policy, 6, 8, step=0)
    order = sampler.order.indices(0, 6)
    expected = allocate([rates[i] for i in order], 48, 8, 2, 32)
    assert rollout.batch_size == 48 and sorted(expected) != [8] * 6
    sizes = torch.bincount(rollout.group_id, minlength=6).tolist()
    assert sizes == expected
    assert torch.equal(rollout.group_id, torch.arange(6).repeat_interleave(torch.tensor(expected)))  # groups stay contiguous
    assert rollout.info["train_index"].tolist() == [i for i, n in zip(order, expected) for _ in range(n)]
    assert rollout.info["prompt"].tolist() == rollout.info["train_index"].tolist()  # conditions are their own records
    # the records at pass rate 0 or 1 got the minimum (the surplus rule aside), the one without a rate its group_size
    assert sizes[order.index(1)] == 2 and sizes[order.index(4)] == 8
    # observe adds each sample's outcome to its record, through the gather it is given
    seen = []
    sampler.observe(rollout, torch.ones(48), gather=lambda t: seen.append(len(t)) or t)
    assert seen == [48, 48]
    assert sampler.history.rate(1) == 1.0 and len(sampler.history.outcomes[4]) == 8


def test_without_pass_rates_the_budget_is_fixed():
    cfg = from_dict(TrainConfig, _toy(KNAPSACK))
    sampler = PromptSampler(cfg.sampler, sampler_context(cfg))
    torch.manual_seed(0)
    rollout = sampler.collect(build_policy(cfg.policy, sampler.policy_spec()), 6, 8, step=0)
    assert torch.bincount(rollout.group_id).tolist() == [8] * 6


def _nonzero_share(tmp_path, budget, seed):
    # lr ~ 0: the policy stays as it starts, so the share measures the budgets alone
    out = tmp_path / f"{budget['type']}_{seed}"
    train(from_dict(TrainConfig, _toy(budget, seed=seed, total_steps=8, optim={"lr": 1e-9})), out)
    steps = [r for r in read_metrics(out) if "adv/nonzero_fraction" in r]
    return statistics.mean(r["adv/nonzero_fraction"] for r in steps[2:]), steps


def test_knapsack_budgets_raise_the_share_of_samples_with_a_non_zero_advantage(tmp_path):
    """Two prompts that always pass give fixed groups nothing to learn from; knapsack gives them
    2 samples each and the rest to the open prompts. Measured over steps 3-8 (the rates exist
    after step 1), seeds 0 and 1: fixed 0.42 / 0.56, knapsack 0.76 / 0.66."""
    fixed, fixed_runs = zip(*[_nonzero_share(tmp_path, {"type": "fixed"}, s) for s in (0, 1)])
    knapsack, runs = zip(*[_nonzero_share(tmp_path, KNAPSACK, s) for s in (0, 1)])
    assert statistics.mean(knapsack) >= statistics.mean(fixed) + 0.1, (fixed, knapsack)
    # the prompts a step learns from: with fixed groups of 8 a mixed group's samples are all
    # non-zero (pass/fail rewards), so 8 per informative group; knapsack's are among its 6
    assert all(r["adv/informative_groups"] * 8 == round(r["adv/nonzero_fraction"] * 48) for run in fixed_runs for r in run)
    assert all(0 <= r["adv/informative_groups"] <= 6 for run in runs for r in run)
    assert any(r["adv/informative_groups"] > 0 for run in runs for r in run)
    # the groups were uneven, and each step still drew its 48 samples
    assert max(r["budget/group_size"] for r in runs[0]) > 8
    assert all(r["decisions"] == 48 for run in runs for r in run)


def test_knapsack_budgets_resume_exactly(tmp_path):
    data = _toy(KNAPSACK, total_steps=5, checkpoint={"every": 3})
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 3}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    steps = lambda d: [r for r in read_metrics(tmp_path / d) if "budget/group_size" in r]  # noqa: E731
    straight, split = steps("straight"), steps("split")
    assert [r["budget/group_size"] for r in split] == [r["budget/group_size"] for r in straight]
    assert max(r["budget/group_size"] for r in straight) > 8
    a = load_file(str(tmp_path / "straight/checkpoints/step_00000005/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_00000005/model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_knapsack_with_dynamic_sampling_keeps_whole_groups(tmp_path):
    """DAPO's refill rounds with uneven groups: each round is shared from its own records'
    rates, the kept batch ends at a group's end (never inside a group)."""
    data = _toy(KNAPSACK, total_steps=5, algo={"group_size": 8, "groups_per_step": 6, "resample_rounds": 2, "filters": [{"type": "zero_variance"}]})
    train(from_dict(TrainConfig, data), tmp_path / "run")
    steps = [r for r in read_metrics(tmp_path / "run") if "filter/kept_fraction" in r]
    assert any(r["filter/kept_fraction"] < 1 for r in steps)
    assert max(r["budget/group_size"] for r in steps) > 8
    assert all(r["adv/nonzero_fraction"] == 1.0 for r in steps)  # only mixed groups were kept, whole


def test_knapsack_with_partial_rollouts_trains_and_resumes_exactly(tmp_path):
    """Fresh records get their share when they join the batch; groups of different sizes stay
    in flight and finish; resume continues them and the rates, bit for bit."""
    prompts = tmp_path / "prompts.jsonl"  # 8 records: each comes back every other step or so
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    sampler = {"type": "prompt", "data": {"train": str(prompts)}, "budget": {"type": "knapsack", "min_history": 4}, "accuracy_threshold": 0.5}
    data = text(total_steps=5, checkpoint={"every": 3}, sampler=sampler)
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 3}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    steps = lambda d: [r for r in read_metrics(tmp_path / d) if "budget/group_size" in r]  # noqa: E731
    straight, split = steps("straight"), steps("split")
    assert len(straight) == 5 and [r["reward/total"] for r in split] == [r["reward/total"] for r in straight]
    assert max(r["budget/group_size"] for r in straight) > 4  # uneven groups finished
    a = load_file(str(tmp_path / "straight/checkpoints/step_00000005/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_00000005/model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "sections, field, message",
    [
        ({"sampler": {"shared_noise": True}}, "sampler.budget.type", "shared_noise"),
        ({"sampler": {"budget": {"type": "knapsack", "min_size": 9}}}, "sampler.budget.min_size", "algo.group_size"),
        ({"sampler": {"budget": {"type": "knapsack", "max_size": 4}}}, "sampler.budget.max_size", "algo.group_size"),
        ({"rollout": {"mode": "async", "workers": 2}}, "sampler.budget.type", "2 worker processes"),
        ({"rollout": {"mode": "async", "workers": 1, "score_on": "learner"}}, "sampler.budget.type", "score_on: learner"),
    ],
)
def test_where_knapsack_budgets_cannot_work_is_a_one_line_error(tmp_path, sections, field, message):
    data = _toy(KNAPSACK)
    for key, value in sections.items():
        data[key] = {**data[key], **value} if key in data else value
    if "budget" not in data["sampler"] or data["sampler"]["budget"].get("type") != "knapsack":
        data["sampler"]["budget"] = KNAPSACK
    with pytest.raises(ConfigError, match=message) as info:
        train(from_dict(TrainConfig, data), tmp_path / "run")
    assert info.value.field == field and "\n" not in str(info.value)


def test_budget_options_are_checked():
    with pytest.raises(ConfigError, match="max_size"):
        from_dict(TrainConfig, _toy({"type": "knapsack", "min_size": 40}))
    with pytest.raises(ConfigError, match="history"):
        from_dict(TrainConfig, _toy({"type": "knapsack", "min_history": 20}))


def test_knapsack_budgets_in_one_worker_process(tmp_path):
    """The pass histories live in the worker's sampler, which scores its own samples: one-step-off
    with a worker process shares the samples unevenly too."""
    data = _toy(KNAPSACK, total_steps=4, rollout={"mode": "async", "workers": 1})
    train(from_dict(TrainConfig, data), tmp_path / "run")
    steps = [r for r in read_metrics(tmp_path / "run") if "budget/group_size" in r]
    assert len(steps) == 4 and max(r["budget/group_size"] for r in steps) > 8
    assert all(r["decisions"] == 48 for r in steps)


def test_group_weight_reweights_uneven_groups_only(tmp_path):
    """``algo.advantage.group_weight: group`` changes the update when knapsack budgets make
    the groups uneven, and leaves fixed groups bit for bit as they train by default."""

    def weights(budget, mode):
        out = tmp_path / f"{budget['type']}_{mode}"
        train(from_dict(TrainConfig, _toy(budget, total_steps=4, algo={"advantage": {"group_weight": mode}})), out)
        return load_file(str(out / "checkpoints/step_00000004/model.safetensors"))

    same, other = weights({"type": "fixed"}, "sample"), weights({"type": "fixed"}, "group")
    assert all(torch.equal(same[k], other[k]) for k in same)
    same, other = weights(KNAPSACK, "sample"), weights(KNAPSACK, "group")
    assert any(not torch.equal(same[k], other[k]) for k in same)
