"""Partial rollouts (``rollout.over_provision``, APRIL): over-provisioned groups, the
unfinished ones paused and continued in the next step, each decision tagged with its version."""

import string
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.core.weights import build_policy  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.text_lm import TextLMConfig, TextLMPolicy  # noqa: E402
from mmrl.registry import POLICIES, REWARDS, SAMPLERS  # noqa: E402
from mmrl.core.sampler import sampler_context  # noqa: E402
from mmrl.samplers.env import EnvSampler, EnvSamplerConfig  # noqa: E402
from mmrl.samplers.prompt import PromptSampler  # noqa: E402
from mmrl.train.metrics import read_metrics  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import train  # noqa: E402
from tests.conftest import point_reach_config, run_mmrl  # noqa: E402
from tests.rollout.test_engine import _same, _steps, toy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PER_TOKEN_ATOL = 1e-4  # a teacher-forced pass against the decoding loop's numbers (docs/text.md)


@POLICIES.register("_test_eos_text_lm", config=TextLMConfig)
class EosTextLM(TextLMPolicy):
    """Test-only: a random tiny text_lm whose EOS logit is raised by 3, so completion lengths
    spread from 1 to the budget (a long tail, as real generations have)."""

    def forward_logits(self, ids, mask, cache=None, logits_to_keep: int = 0, **model_inputs):
        logits = super().forward_logits(ids, mask, cache=cache, logits_to_keep=logits_to_keep, **model_inputs)
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[list(self.sampling.eos_token_ids)] = 3.0
        return logits + bias


@REWARDS.register("_test_letter_fraction", config=RewardConfig)
def _letter_fraction(rollout, cfg):
    """Test-only: the fraction of a completion's characters that are ASCII letters."""
    texts = rollout.info["completions"]
    return torch.tensor([sum(c in string.ascii_letters for c in t) / max(len(t), 1) for t in texts])


def text(**sections) -> dict:
    cfg = {
        "name": "text", "seed": 0, "total_steps": 4,
        "policy": {"type": "_test_eos_text_lm", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 24}},
        "sampler": {"type": "prompt", "data": {"train": str(ROOT / "examples/arithmetic/train.jsonl")}},
        "rewards": [{"type": "_test_letter_fraction"}],
        "algo": {"group_size": 4, "groups_per_step": 4}, "optim": {"lr": 0.01},
        "rollout": {"over_provision": 2.0},
        "eval": {"at_start": False, "at_end": False}, "log": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def _policy(cfg: TrainConfig):
    torch.manual_seed(cfg.seed)
    return build_policy(cfg.policy, {})


def test_a_paused_completion_continues_from_its_prefix():
    """``sample_partial`` stops when ``stop`` says so, the running rows pause with their
    tokens so far, and continuing them conditions on that prefix: the log-probs of the whole
    completion, first call's tokens and second's, are the teacher-forced ones of the result."""
    cfg = from_dict(TrainConfig, text())
    policy = _policy(cfg)
    prompts = [f"{a} + {a} =" for a in range(8)]
    calls = []
    first = policy.sample_partial(prompts, [None] * 8, torch.Generator().manual_seed(0), lambda ended: calls.append(list(ended)) or len(ended) >= 3)
    paused = [k for k, st in enumerate(first) if st["reason"] == "paused"]
    done = [k for k, st in enumerate(first) if st["reason"] != "paused"]
    assert len(done) >= 3 and paused and set(done) == set(calls[-1])
    assert len({len(first[k]["token_ids"]) for k in paused}) == 1  # they ran until the same step
    second = policy.sample_partial([prompts[k] for k in paused], [first[k] for k in paused], torch.Generator().manual_seed(1), None)
    assert all(st["reason"] in ("eos", "length") for st in second)
    for k, st in zip(paused, second):
        prefix = first[k]["token_ids"]
        assert st["token_ids"][: len(prefix)] == prefix and len(prefix) < len(st["token_ids"]) <= 24
        assert st["logp"][: len(prefix)] == first[k]["logp"]
    finished = [first[k] for k in done] + second
    sample = policy.sample_of_states([prompts[k] for k in done + paused], finished)
    recomputed = policy.log_prob(sample.replay)
    assert (recomputed - sample.logp).abs().max().item() <= PER_TOKEN_ATOL
    assert sample.info["truncated"].tolist() == [st["reason"] == "length" for st in finished]


def test_the_sampler_trains_on_finished_groups_and_carries_the_rest_with_their_versions():
    cfg = from_dict(TrainConfig, text())
    policy, sampler = _policy(cfg), PromptSampler(cfg.sampler, sampler_context(cfg))
    records, resumed_seen = [], 0
    for step in range(4):
        before = {g["record"]: [list(st["token_ids"]) if st else [] for st in g["rows"]] for g in sampler.in_flight}
        rollout = sampler.collect(policy, 4, 4, step, 0, version=step)
        assert rollout.batch_size == 16 and rollout.group_id.tolist() == [g for g in range(4) for _ in range(4)]
        assert len(sampler.in_flight) == 4  # 2 x 4 in flight, 4 out
        tags, mask = rollout.info["decision_version"], rollout.mask > 0
        for row in range(16):
            v = tags[row][mask[row]]
            assert v.min() == rollout.policy_version[row] and v.max() <= step and bool((v[1:] >= v[:-1]).all())
        ids = rollout.info["record_id"].tolist()
        records += ids[::4]
        for g in range(4):
            key = next((r for r in before if sampler.data.train[r].record_id == ids[4 * g]), None)
            if key is not None and step > 0:  # a group that was in flight: each row starts with the tokens it had
                for r in range(4):
                    prefix = before[key][r]
                    width = int(rollout.mask[4 * g + r].sum())
                    assert rollout.replay["completion_ids"][4 * g + r, : len(prefix)].tolist() == prefix and len(prefix) <= width
        resumed_seen += int((rollout.policy_version < step).sum())
    assert resumed_seen > 0  # some samples hold tokens of two versions
    assert len(records) == len(set(records))  # no record trained twice within the epoch
    state = sampler.state_dict()
    again = PromptSampler(cfg.sampler, sampler_context(cfg))
    again.load_state_dict(state)
    assert again.in_flight == sampler.in_flight and again.provisioned


def test_partial_rollouts_through_the_trainer_log_their_metrics_and_resume_exactly(tmp_path):
    """Three steps, ``--resume`` with the groups in flight in the checkpoint, two more: the
    five steps of a straight run, metrics and weights, bit for bit."""
    from safetensors.torch import load_file

    data = text(total_steps=5, checkpoint={"every": 3})
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 3}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    straight, split = _steps(read_metrics(tmp_path / "straight")), _steps(read_metrics(tmp_path / "split"))
    _same(split, straight)
    assert max(r["partial/resumed_rate"] for r in straight) > 0 and max(r["staleness/lag_max"] for r in straight) >= 1
    a = load_file(str(tmp_path / "straight/checkpoints/step_00000005/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_00000005/model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_partial_rollouts_in_a_worker_process(tmp_path):
    """The groups in flight live in the worker's sampler: one-step-off with a worker runs,
    and its samples lag by the step they waited as well as by the schedule."""
    data = text(total_steps=4, rollout={"over_provision": 1.5, "mode": "async", "workers": 1}, checkpoint={"every": 4})
    train(from_dict(TrainConfig, data), tmp_path / "run")
    records = _steps(read_metrics(tmp_path / "run"))
    assert len(records) == 4 and all(r["staleness/lag_max"] >= 1 for r in records[1:])


@SAMPLERS.register("_test_no_partial_env", config=EnvSamplerConfig)
class NoPartialEnvSampler(EnvSampler):
    """Test-only: an env sampler that cannot keep episodes in flight."""

    partial_rollouts = False


def _env_episodes_by_step(cfg, steps):
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, sampler.policy_spec())
    try:
        return sampler, [sampler.collect(policy, 2, 4, step, 0, version=step) for step in range(steps)]
    finally:
        sampler.close()


def test_env_episodes_in_flight_keep_stepping_into_the_next_step():
    """Over-provisioned groups of PointReach episodes (which end when the point reaches its
    target, or at the time limit): each step trains on 2 finished groups, 2 stay in flight on
    their envs, and a carried episode's decisions carry two versions."""
    cfg = from_dict(TrainConfig, point_reach_config(env={"num_envs": 16}, rollout={"over_provision": 2.0}))
    sampler, rollouts = _env_episodes_by_step(cfg, 5)
    carried = 0
    for step, rollout in enumerate(rollouts):
        assert rollout.batch_size == 8 and rollout.group_id.tolist() == [0] * 4 + [1] * 4
        first_obs = rollout.replay["obs"][:, 0]
        for g in range(2):  # a group's copies share their initial state, whenever they started
            assert torch.equal(first_obs[4 * g], first_obs[4 * g + 3])
        tags, mask = rollout.info["decision_version"], rollout.mask > 0
        for row in range(8):
            v = tags[row][mask[row]]
            assert v.numel() == int(rollout.info["length"][row]) or bool(rollout.info["truncated"][row])
            assert v[0] == rollout.policy_version[row] and v.max() <= step and bool((v[1:] >= v[:-1]).all())
        carried += int((rollout.policy_version < step).sum())
        assert len(sampler.partial.groups) == 2
    assert carried > 0
    assert sampler.env_steps > 0


def test_env_partial_rollouts_train_through_the_loop_and_evaluation_restarts_the_groups_in_flight(tmp_path):
    data = point_reach_config(env={"num_envs": 12}, total_steps=4, rollout={"over_provision": 1.5}, eval={"every": 2, "episodes": 4, "at_start": False})
    train(from_dict(TrainConfig, data), tmp_path / "run")
    records = _steps(read_metrics(tmp_path / "run"))
    assert len(records) == 4 and all("partial/resumed_rate" in r for r in records)
    assert records[-1]["partial/restarted"] >= 1  # the evaluation at step 2 reset the envs in flight


def test_too_few_envs_for_the_groups_in_flight_names_num_envs():
    cfg = from_dict(TrainConfig, point_reach_config(env={"num_envs": 8}, rollout={"over_provision": 2.0}))
    with pytest.raises(ConfigError, match=r"^env.num_envs: got 8; partial rollouts \(rollout.over_provision 2\) keep 4 groups x 4 episodes in flight, one env each: use at least 16$"):
        _env_episodes_by_step(cfg, 1)


@pytest.mark.parametrize(
    "data, message",
    [
        (toy(rollout={"over_provision": 2.0}), "policy.type 'categorical_sequence' cannot pause a sample"),
        (point_reach_config(sampler={"type": "_test_no_partial_env"}, rollout={"over_provision": 2.0}), "sampler.type '_test_no_partial_env' cannot carry unfinished samples"),
        (text(algo={"filters": [{"type": "zero_variance"}], "resample_rounds": 2}), "refill rounds"),
    ],
)
def test_partial_rollouts_where_they_cannot_run_are_one_line_errors(data, message):
    with pytest.raises(ConfigError, match=r"^rollout.over_provision: got 2(\.0)?; " + message) as e:
        from_dict(TrainConfig, data)
    assert "\n" not in str(e.value)


def test_over_provision_below_one_exits_2_with_one_line(tmp_path, write_config):
    proc = run_mmrl("train", write_config(toy()), "--run-dir", tmp_path / "run", "rollout.over_provision=0.5")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.splitlines() == [err] and "rollout.over_provision" in err and "0.5" in err
