"""The ``prompt`` sampler: G samples per prompt record, batched calls, reproducible per
(seed, stream position, step, global group)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import from_dict, load_config
from mmrl.core.policy import Sample
from mmrl.core.reward import RewardContext, RewardSet
from mmrl.core.rollout import Rollout
from mmrl.core.sampler import group_seed, sampler_context
from mmrl.core.weights import build_policy
from mmrl.data.prompts import EpochOrder, PromptDataConfig
from mmrl.errors import ConfigError
from mmrl.policies.toy import CategoricalSequenceConfig, GaussianChainConfig
from mmrl.registry import SAMPLERS
from mmrl.rewards.toy import AnswerTargetConfig, AnswerTokenConfig, TargetDistanceConfig, TokenFractionConfig
from mmrl.samplers.prompt import PromptSampler, PromptSamplerConfig
from mmrl.train.run_config import AlgoConfig, TrainConfig
from mmrl.train.metrics import read_metrics
from mmrl.train.trainer import Trainer, train
from tests.conftest import ROOT


def train_config(policy_cfg=None, rewards=(), seed: int = 0, groups_per_step: int = 8, **sampler) -> TrainConfig:
    data = sampler.pop("data", {})
    sampler_cfg = PromptSamplerConfig(data=PromptDataConfig(**data), **sampler)
    return TrainConfig(seed=seed, policy=policy_cfg, sampler=sampler_cfg, rewards=list(rewards), algo=AlgoConfig(groups_per_step=groups_per_step))


def run_rewards(cfg: TrainConfig) -> RewardSet:
    """The reward set the trainer builds for ``cfg``."""
    return RewardSet(cfg.rewards, cfg.algo.reward_aggregation, RewardContext())


def setup(policy_cfg, rewards=(), **kwargs):
    cfg = train_config(policy_cfg, rewards, **kwargs)
    sampler = PromptSampler(cfg.sampler, sampler_context(cfg))
    sampler.rewards = run_rewards(cfg)
    torch.manual_seed(0)
    return sampler, build_policy(policy_cfg, sampler.policy_spec())


def sampler_only(**kwargs) -> PromptSampler:
    cfg = train_config(**kwargs)
    sampler = PromptSampler(cfg.sampler, sampler_context(cfg))
    sampler.rewards = run_rewards(cfg)
    return sampler


def sequence_setup(**kwargs):
    return setup(CategoricalSequenceConfig(type="categorical_sequence", eos_token=0), [TokenFractionConfig(type="token_fraction")], **kwargs)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


def assert_same_rollout(a: Rollout, b: Rollout):
    for name in ("group_id", "old_logp", "mask", "entropy", "replay", "info"):
        assert_same(getattr(a, name), getattr(b, name))


class RecordingPolicy:
    """One decision per input whose log-prob is drawn from the call's generator; remembers
    every call's inputs and generator seed. ``info["sample"]`` is the condition id (as a
    value) and ``success`` says whether it is 2."""

    def __init__(self):
        self.calls = []

    def sample(self, inputs, generator=None, deterministic=False):
        self.calls.append({"inputs": inputs, "seed": generator.initial_seed() if generator is not None else None, "deterministic": deterministic})
        n = len(inputs)
        logp = -torch.rand(n, 1, generator=generator)
        info = {"draw": logp[:, 0].clone()}
        if isinstance(inputs, torch.Tensor):
            info.update(sample=inputs.float()[:, None], success=inputs == 2)
        return Sample(output=logp, logp=logp, replay={"logp": logp}, info=info)

    def log_prob(self, replay):
        raise NotImplementedError


# ------------------------------------------------------------------ config and spec


def test_prompt_sampler_is_registered_with_its_config():
    assert SAMPLERS.entry("prompt").obj is PromptSampler and SAMPLERS.entry("prompt").config is PromptSamplerConfig
    cfg = from_dict(PromptSamplerConfig, {"type": "prompt", "batch_groups": 2, "data": {"num_prompts": 3}}, "sampler")
    assert cfg.batch_groups == 2 and cfg.data.num_prompts == 3
    for data, field in (({"batch_groups": 0}, "sampler.batch_groups"), ({"data": {"num_prompts": 0}}, "sampler.data.num_prompts"), ({"data": {"eval_fraction": 1.0}}, "sampler.data.eval_fraction")):
        with pytest.raises(ConfigError) as err:
            from_dict(PromptSamplerConfig, {"type": "prompt", **data}, "sampler")
        assert err.value.field == field


def test_a_missing_prompt_file_fails_when_the_sampler_is_built(tmp_path):
    cfg = train_config(data={"train": str(tmp_path / "none.jsonl")})
    with pytest.raises(ConfigError, match="no such file") as err:
        PromptSampler(cfg.sampler, sampler_context(cfg))
    assert err.value.field == "sampler.data.train"


def test_policy_spec_holds_the_number_of_conditions_and_their_file(tmp_path):
    sampler, policy = sequence_setup(data={"num_prompts": 3})
    assert sampler.policy_spec() == {"num_prompts": 3, "prompt_file": None}
    assert policy.prompt_embedding.num_embeddings == 3
    conditions = train_config(data={"train": write_jsonl(tmp_path / "c.jsonl", [{"prompt": 0}, {"prompt": 5}])})
    assert PromptSampler(conditions.sampler, sampler_context(conditions)).policy_spec() == {"num_prompts": 6, "prompt_file": str(tmp_path / "c.jsonl")}
    texts = train_config(data={"train": write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi"}])})
    assert PromptSampler(texts.sampler, sampler_context(texts)).policy_spec() == {}


# ------------------------------------------------------------------ collect


def test_collect_is_reproducible_and_depends_on_seed_and_step():
    sampler, policy = sequence_setup()
    a, b = sampler.collect(policy, 4, 8, step=2), sampler.collect(policy, 4, 8, step=2)
    assert_same_rollout(a, b)
    assert not torch.equal(a.replay["tokens"], sampler.collect(policy, 4, 8, step=3).replay["tokens"])
    other_seed, _ = sequence_setup(seed=1)
    assert not torch.equal(a.replay["tokens"], other_seed.collect(policy, 4, 8, step=2).replay["tokens"])


@pytest.mark.parametrize("policy_cfg", [CategoricalSequenceConfig(type="categorical_sequence", eos_token=0), GaussianChainConfig(type="gaussian_chain")])
def test_one_process_equals_two_processes_splitting_the_groups(policy_cfg):
    one, policy = setup(policy_cfg, batch_groups=4)
    two_a, _ = setup(policy_cfg, batch_groups=4)
    two_b, _ = setup(policy_cfg, batch_groups=4)
    for step in (0, 5):  # the epoch stream advances alike in every process
        whole = one.collect(policy, 8, 4, step=step)
        split = Rollout.cat([two_a.collect(policy, 4, 4, step=step, group_offset=0), two_b.collect(policy, 4, 4, step=step, group_offset=4)])
        assert_same_rollout(whole, split)


def test_one_batched_sample_call_per_batch_groups_groups_seeded_by_its_first_group():
    sampler = sampler_only(batch_groups=4, seed=3)
    policy = RecordingPolicy()
    rollout = sampler.collect(policy, 8, 3, step=1, group_offset=2)
    # calls start at global groups divisible by batch_groups: [2, 4), [4, 8), [8, 10)
    assert [len(c["inputs"]) for c in policy.calls] == [6, 12, 6]
    assert [c["seed"] for c in policy.calls] == [group_seed(3, 1, g) for g in (2, 4, 8)]
    assert not any(c["deterministic"] for c in policy.calls)
    assert torch.equal(rollout.group_id, torch.arange(2, 10).repeat_interleave(3))
    one_call = sampler_only(batch_groups=16)
    policy = RecordingPolicy()
    one_call.collect(policy, 16, 2, step=0)
    assert len(policy.calls) == 1 and len(policy.calls[0]["inputs"]) == 32


def test_groups_share_a_record_in_the_epoch_order_of_the_stream():
    sampler, policy = sequence_setup(groups_per_step=8)
    order = EpochOrder(4, seed=0)
    for step in (0, 1):
        rollout = sampler.collect(policy, 3, 8, step=step, group_offset=5)
        assert rollout.batch_size == 24 and rollout.old_logp.shape == rollout.mask.shape == (24, 6)
        assert torch.equal(rollout.group_id, torch.tensor([5, 6, 7]).repeat_interleave(8))
        expected = torch.tensor(order.indices(8 * step + 5, 3))  # integer conditions: record i is condition i
        assert torch.equal(rollout.info["prompt"], expected.repeat_interleave(8))
        assert torch.equal(rollout.info["record_id"], rollout.info["prompt"])
        assert torch.equal(rollout.replay["prompt"], rollout.info["prompt"])
        tokens = rollout.info["tokens"].view(3, 8, 6)
        assert all(len({tuple(t.tolist()) for t in group}) > 1 for group in tokens)  # G different samples per group


def test_every_record_once_per_epoch_across_steps(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(12)])
    sampler = sampler_only(groups_per_step=4, data={"train": path})
    policy = RecordingPolicy()
    seen = [sampler.collect(policy, 4, 2, step=s).info["record_id"][::2].tolist() for s in range(6)]
    first, second = sum(seen[:3], []), sum(seen[3:], [])
    assert sorted(first) == sorted(second) == list(range(12)) and first != second


def test_resume_from_state_dict_continues_the_order_exactly():
    full = sampler_only(groups_per_step=3, data={"num_prompts": 5})
    policy = RecordingPolicy()
    expected = [full.collect(policy, 3, 2, step=s) for s in range(6)]
    part = sampler_only(groups_per_step=3, data={"num_prompts": 5})
    for s in range(3):
        part.collect(policy, 3, 2, step=s)
    state = part.state_dict()
    resumed = sampler_only(groups_per_step=3, data={"num_prompts": 5})
    resumed.load_state_dict(state)
    for s in range(3, 6):
        assert_same_rollout(resumed.collect(policy, 3, 2, step=s), expected[s])
    # a resumed run with another groups_per_step starts where the stream stopped
    wider = sampler_only(groups_per_step=4, data={"num_prompts": 5})
    wider.load_state_dict(state)
    assert wider.collect(policy, 4, 1, step=3).info["record_id"].tolist() == EpochOrder(5, 0).indices(9, 4)
    assert wider.collect(policy, 4, 1, step=4).info["record_id"].tolist() == EpochOrder(5, 0).indices(13, 4)


def test_refill_groups_read_ahead_in_the_stream_without_consuming_it():
    sampler = sampler_only(groups_per_step=4, data={"num_prompts": 7})
    policy = RecordingPolicy()
    order = EpochOrder(7, 0)
    sampler.collect(policy, 4, 2, step=2)
    refill = sampler.collect(policy, 4, 2, step=2, group_offset=4)  # the trainer's first refill round
    assert refill.info["record_id"][::2].tolist() == order.indices(8 + 4, 4)
    assert torch.equal(refill.group_id, torch.arange(4, 8).repeat_interleave(2))
    assert sampler.collect(policy, 4, 2, step=3).info["record_id"][::2].tolist() == order.indices(12, 4)


def test_text_prompts_reach_the_policy_as_strings_and_records_ride_in_info(tmp_path):
    rows = [{"prompt": "a", "answer": "1", "category": "x"}, {"prompt": "b", "category": "y"}, {"prompt": "c", "answer": "3"}]
    sampler = sampler_only(groups_per_step=3, batch_groups=3, data={"train": write_jsonl(tmp_path / "p.jsonl", rows)})
    policy = RecordingPolicy()
    rollout = sampler.collect(policy, 3, 2, step=0)
    (call,) = policy.calls
    ids = rollout.info["record_id"].tolist()
    assert call["inputs"] == rollout.info["prompt"] == [rows[i]["prompt"] for i in ids]
    assert rollout.info["answer"] == [rows[i].get("answer") for i in ids]
    assert rollout.info["metadata"] == [{"category": rows[i]["category"]} if "category" in rows[i] else {} for i in ids]
    # per-sample lists are sliced and concatenated with the tensors
    idx = torch.tensor([5, 0, 3])
    part = rollout[idx]
    assert part.info["prompt"] == [rollout.info["prompt"][i] for i in idx] and part.info["answer"] == [rollout.info["answer"][i] for i in idx]
    assert part.info["metadata"] == [rollout.info["metadata"][i] for i in idx] and torch.equal(part.info["record_id"], rollout.info["record_id"][idx])
    assert_same_rollout(Rollout.cat([rollout[:2], rollout[2:]]), rollout)


def test_answers_reach_a_reward(tmp_path):
    rows = [{"prompt": i, "answer": a} for i, a in enumerate([3, 5, 1, 6])]
    sampler, policy = setup(CategoricalSequenceConfig(type="categorical_sequence"), data={"train": write_jsonl(tmp_path / "p.jsonl", rows)})
    rollout = sampler.collect(policy, 8, 4, step=0)
    rewards = RewardSet([AnswerTokenConfig(), TokenFractionConfig(type="token_fraction", token=3)], "weighted_sum", RewardContext())
    scores = rewards.score(rollout)
    answer = torch.tensor([rows[i]["answer"] for i in rollout.info["record_id"]])
    assert torch.equal(torch.tensor(rollout.info["answer"]), answer)
    assert torch.allclose(scores[:, 0], (rollout.info["tokens"] == answer[:, None]).float().mean(1))
    assert torch.equal(scores[:, 0][answer == 3], scores[:, 1][answer == 3])


def test_a_chain_reward_reads_its_target_from_the_answer(tmp_path):
    rows = [{"prompt": 0, "answer": 2.0}, {"prompt": 1, "answer": "-1.5"}]
    sampler, policy = setup(GaussianChainConfig(type="gaussian_chain"), data={"train": write_jsonl(tmp_path / "p.jsonl", rows)})
    rollout = sampler.collect(policy, 4, 4, step=0)
    target = torch.tensor([float(rows[i]["answer"]) for i in rollout.info["record_id"]])
    reward = RewardSet([AnswerTargetConfig()], "weighted_sum", RewardContext()).score(rollout)[:, 0]
    assert torch.allclose(reward, -(rollout.info["sample"][:, 0] - target).abs())


def test_an_answer_reward_names_the_record_without_an_answer():
    sampler, policy = sequence_setup()
    rollout = sampler.collect(policy, 2, 2, step=0)
    with pytest.raises(ConfigError, match=r"record \d has none \(see sampler.data.answer_field\)"):
        RewardSet([AnswerTokenConfig()], "weighted_sum", RewardContext()).score(rollout)


@pytest.mark.numerics
def test_rollout_logp_is_what_the_policy_recomputes_from_replay():
    sampler, policy = sequence_setup()
    rollout = sampler.collect(policy, 4, 8, step=0)[torch.arange(5, 20)]
    torch.testing.assert_close(policy.log_prob(rollout.replay), rollout.old_logp, atol=1e-5, rtol=0)  # one pass against the sampling loop (measured: equal)


def test_metrics_pass_the_policys_success_per_sample():
    sampler = sampler_only()
    rollout = sampler.collect(RecordingPolicy(), 4, 2, step=0)
    metrics = sampler.metrics(rollout)
    assert list(metrics) == ["success_rate"] and torch.equal(metrics["success_rate"], (rollout.info["prompt"] == 2).float())
    assert sequence_setup()[0].metrics(rollout.with_(info={})) == {}


# ------------------------------------------------------------------ evaluate


def test_evaluation_accuracy_wilson_interval_and_categories_by_hand(tmp_path):
    # the policy outputs its condition id; answer_target scores -|id - answer|, so a record is
    # right (reward 0 >= threshold 0) when its answer is its id: all but ids 4, 7 and 8 (off
    # by 5, 2 and 1), 4 of 5 "low" and 3 of 5 "high" records
    answers = [0, 1, 2, 3, 9, 5, 6, 9, 9, 9]
    rows = [{"prompt": i, "answer": a, "category": "low" if i < 5 else "high"} for i, a in enumerate(answers)]
    path = write_jsonl(tmp_path / "held_out.jsonl", rows)
    sampler = sampler_only(accuracy_threshold=0.0, eval_batch_size=4, data={"eval": path})
    rewards = RewardSet([AnswerTargetConfig()], "weighted_sum", RewardContext())
    policy = RecordingPolicy()
    metrics = sampler.evaluate(policy, episodes=10, seed=0, rewards=rewards)
    # Wilson, 7 of 10, z = 1.96: (0.7 + z²/20 ± z·sqrt(0.021 + z²/400)) / (1 + z²/10)
    assert metrics == pytest.approx(
        {
            "episodes": 10,
            "reward_mean": -(5 + 2 + 1) / 10,
            "accuracy": 0.7,
            "accuracy_ci_low": 0.39677,
            "accuracy_ci_high": 0.89221,
            "accuracy/low": 0.8,
            "accuracy/high": 0.6,
            # Wilson intervals of 4 of 5 and 3 of 5, by hand as above
            "accuracy/low/ci_low": 0.37553,
            "accuracy/low/ci_high": 0.96378,
            "accuracy/low/n": 5,
            "accuracy/high/ci_low": 0.23072,
            "accuracy/high/ci_high": 0.88238,
            "accuracy/high/n": 5,
            "success_rate": 0.1,
        },
        abs=1e-5,
    )
    assert [len(c["inputs"]) for c in policy.calls] == [4, 4, 2] and all(c["deterministic"] for c in policy.calls)
    assert [c["seed"] for c in policy.calls] == [group_seed(0, 0, i) for i in (0, 4, 8)]


def test_evaluation_uses_the_held_out_split_in_order_cycling_or_all(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": i} for i in range(20)])
    sampler = sampler_only(data={"train": path, "eval_fraction": 0.25})
    held = [r.record_id for r in sampler.data.held_out]
    assert len(held) == 5
    policy = RecordingPolicy()
    assert sampler.evaluate(policy, episodes=12, seed=0, rewards=sampler.rewards)["episodes"] == 12
    assert policy.calls[0]["inputs"].tolist() == (held * 3)[:12]
    everything = sampler_only(eval_all=True, data={"train": path, "eval_fraction": 0.25})
    policy = RecordingPolicy()
    assert everything.evaluate(policy, episodes=2, seed=0, rewards=everything.rewards)["episodes"] == 5
    assert policy.calls[0]["inputs"].tolist() == held


def test_evaluate_is_greedy_and_weights_the_reward_components():
    rewards = [TokenFractionConfig(type="token_fraction", token=3, weight=2.0), TokenFractionConfig(type="token_fraction", token=5, weight=-0.5)]
    sampler, policy = setup(CategoricalSequenceConfig(type="categorical_sequence"), rewards, accuracy_threshold=0.5)
    metrics = sampler.evaluate(policy, episodes=10, seed=0, rewards=sampler.rewards)
    tokens = policy.sample(torch.arange(10) % 4, None, deterministic=True).output
    reward = 2.0 * (tokens == 3).float().mean(1) - 0.5 * (tokens == 5).float().mean(1)
    assert metrics["episodes"] == 10
    assert metrics["reward_mean"] == pytest.approx(reward.mean().item())
    assert metrics["accuracy"] == pytest.approx((reward >= 0.5).float().mean().item())
    assert sampler.evaluate(policy, episodes=10, seed=1, rewards=sampler.rewards) == metrics  # greedy: the seed cannot matter


def test_evaluate_of_the_chain_starts_from_seeded_noise():
    sampler, policy = setup(GaussianChainConfig(type="gaussian_chain"), [TargetDistanceConfig(type="target_distance")])
    a, b, c = (sampler.evaluate(policy, episodes=16, seed=s, rewards=sampler.rewards) for s in (0, 0, 1))
    assert a == b and a["reward_mean"] != c["reward_mean"]
    assert a["episodes"] == 16 and a["reward_mean"] < 0


def test_eval_deterministic_false_evaluates_seeded_samples_drawn_as_in_training():
    rewards = [TokenFractionConfig(type="token_fraction", token=3)]
    sampler, policy = setup(CategoricalSequenceConfig(type="categorical_sequence"), rewards, eval_deterministic=False)
    a, b, c = (sampler.evaluate(policy, episodes=32, seed=s, rewards=sampler.rewards) for s in (0, 0, 1))
    assert a == b and a["reward_mean"] != c["reward_mean"]  # seeded, and the seed now matters
    greedy, _ = setup(CategoricalSequenceConfig(type="categorical_sequence"), rewards)
    assert greedy.evaluate(policy, episodes=32, seed=0, rewards=greedy.rewards) == greedy.evaluate(policy, episodes=32, seed=1, rewards=greedy.rewards)


def test_evaluate_reports_success_rate_when_the_policy_reports_success():
    cfg = train_config(rewards=[TargetDistanceConfig(type="target_distance", target=2.0)], accuracy_threshold=-0.5)
    metrics = PromptSampler(cfg.sampler, sampler_context(cfg)).evaluate(RecordingPolicy(), episodes=8, seed=0, rewards=run_rewards(cfg))
    # conditions 0 1 2 3 0 1 2 3: rewards -2 -1 0 -1 ..., correct and successful on the two 2s
    assert metrics == pytest.approx({"episodes": 8, "reward_mean": -1.0, "accuracy": 0.25, "accuracy_ci_low": 0.07148, "accuracy_ci_high": 0.59073, "success_rate": 0.25}, abs=1e-5)


# ------------------------------------------------------------------ through the trainer


def example_config(**changes) -> TrainConfig:
    """examples/prompts/toy_answers_grpo.yaml, its prompt file found from anywhere."""
    overrides = [f"sampler.data.train={ROOT / 'examples/prompts/toy_answers.jsonl'}", "log.progress=false", "log.tensorboard=false"]
    return load_config(TrainConfig, ROOT / "examples/prompts/toy_answers_grpo.yaml", overrides + [f"{k}={v}" for k, v in changes.items()])


@pytest.mark.learning
def test_the_answers_example_learns_every_records_answer(tmp_path, learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): accuracy before 0 to 0 (<= 0); reward
    before 0 to 0.229 (<= 0.4); accuracy after, worst category 1 to 1 (>= 1).
    """
    cfg = example_config(total_steps=30, seed=learning_seed)
    sampler = PromptSampler(cfg.sampler, sampler_context(cfg))
    torch.manual_seed(cfg.seed)
    before = sampler.evaluate(build_policy(cfg.policy, sampler.policy_spec()), cfg.eval.episodes, seed=1, rewards=run_rewards(cfg))
    after = train(cfg, tmp_path / "run")["eval"]
    learned(before["accuracy"], 0.0, higher=False, name="accuracy before")
    learned(before["reward_mean"], 0.4, higher=False, name="reward before")
    learned(min(after["accuracy"], after["accuracy/low"], after["accuracy/high"]), 1.0, name="accuracy after, worst category")


def test_a_resumed_prompt_run_matches_an_uninterrupted_one(tmp_path):
    changes = {"algo.groups_per_step": 3, "algo.group_size": 4, "eval.every": 0, "eval.at_end": "false"}
    train(example_config(total_steps=6, **{"checkpoint.every": 3}, **changes), tmp_path / "full")
    train(example_config(total_steps=3, **changes), tmp_path / "part")
    Trainer(example_config(total_steps=6, **changes), tmp_path / "part", resume=True).train()

    def records(run):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(tmp_path / run)}

    full, resumed = records("full"), records("part")
    assert all(full[step] == resumed[step] for step in (4, 5, 6))
    wa = load_file(str(tmp_path / "full/checkpoints/step_00000006/model.safetensors"))
    wb = load_file(str(tmp_path / "part/checkpoints/step_00000006/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


class _ScriptedText:
    """Completions of known lengths (mask) whose last one ran out of budget."""

    def sample(self, inputs, generator=None, deterministic=False):
        n, budget = len(inputs), 4
        lengths = torch.arange(n) % budget + 1
        mask = (torch.arange(budget)[None, :] < lengths[:, None]).float()
        info = {"completions": ["x" * int(k) for k in lengths], "truncated": lengths == budget}
        return Sample(output=mask, logp=-mask, replay={"mask": mask}, info=info, mask=mask)


def test_text_rollouts_report_completion_length_and_truncated_rate(tmp_path):
    rows = [{"prompt": f"{i} + {i} ="} for i in range(4)]
    sampler = sampler_only(groups_per_step=4, batch_groups=4, data={"train": write_jsonl(tmp_path / "p.jsonl", rows)})
    rollout = sampler.collect(_ScriptedText(), 4, 4, step=0)
    metrics = sampler.metrics(rollout)
    lengths = torch.tensor([float(len(c)) for c in rollout.info["completions"]])
    assert torch.equal(metrics["completion_length"], lengths) and lengths.mean() == 2.5
    assert torch.equal(metrics["truncated_rate"], (lengths == 4).float()) and metrics["truncated_rate"].mean() == 0.25
    assert "completion_length" not in sampler.metrics(sampler.collect(RecordingPolicy(), 4, 4, step=0))


def test_prompts_with_images_reach_the_policy_as_image_prompts(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    from mmrl.data.prompts import ImagePrompt

    for name, value in [("a.png", 10), ("b.png", 90)]:
        Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(tmp_path / name)
    rows = [{"prompt": "first", "image": "a.png"}, {"prompt": "second", "image": "b.png"}, {"prompt": "plain"}]
    sampler = sampler_only(groups_per_step=3, batch_groups=3, data={"train": write_jsonl(tmp_path / "p.jsonl", rows)})
    policy = RecordingPolicy()
    rollout = sampler.collect(policy, 3, 2, step=0)
    (call,) = policy.calls
    assert call["inputs"] is rollout.info["prompt"]
    for prompt, record_id in zip(call["inputs"], rollout.info["record_id"].tolist()):
        row = rows[record_id]
        if "image" in row:
            assert isinstance(prompt, ImagePrompt) and prompt.text == row["prompt"]
            assert len(prompt.images) == 1 and int(prompt.images[0][0, 0, 0]) == (10 if row["image"] == "a.png" else 90)
        else:
            assert prompt == row["prompt"]
