import json
import math
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import from_dict, option
from mmrl.denoising.policy import DenoisingPolicy
from mmrl.errors import NonFiniteError
from mmrl.registry import REWARDS
from mmrl.train.run_config import RewardConfig, TrainConfig
from mmrl.train.metrics import read_metrics
from mmrl.train.trainer import Trainer, _postfix, train
from tests.conftest import ROOT, point_reach_config
from tests.train.test_critic import GAE, gae_config

_TOY = {
    "sequence": {"policy": {"type": "categorical_sequence"}, "rewards": [{"type": "token_fraction", "token": 3}]},
    "denoising": {"policy": {"type": "gaussian_chain"}, "rewards": [{"type": "target_distance", "target": 2.0}]},
}


def toy_config(kind: str, **changes) -> TrainConfig:
    data = {
        "name": kind,
        "seed": 0,
        "total_steps": 20,
        "sampler": {"type": "prompt"},
        "algo": {"group_size": 8, "groups_per_step": 4},
        "optim": {"lr": 0.01},
        "eval": {"episodes": 32},
        "log": {"progress": False, "tensorboard": False},
        **_TOY[kind],
    }
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return from_dict(TrainConfig, data)


def env_config(**changes) -> TrainConfig:
    return from_dict(TrainConfig, point_reach_config(**changes))


def _first_last(records, key):
    values = [r[key] for r in records if key in r]
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


@pytest.mark.learning
def test_one_loop_one_preset_trains_tokens_denoising_steps_and_actions(tmp_path, learning_seed, learned):
    """The core is modality-agnostic: the GRPO preset, unchanged but for a smaller KL
    coefficient, and the same Trainer raise the reward of a token policy and of a Gaussian
    denoising chain (both fed by the prompt-dataset sampler; the chain through
    mmrl/denoising) and of an env policy.

    Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): sequence: reward gain beyond 10% of the
    start 0.578 to 0.694 (>= 0.05); denoising: reward gain beyond 10% of the start 0.942 to 1.4 (>= 0.05); env: reward
    gain beyond 10% of the start 1.27 to 1.61 (>= 0.05)."""
    from mmrl.config import resolve_defaults

    runs = {
        "sequence": {**_TOY["sequence"], "sampler": {"type": "prompt"}, "optim": {"lr": 0.01}},
        "denoising": {**_TOY["denoising"], "sampler": {"type": "prompt", "data": {"num_prompts": 4}}, "optim": {"lr": 0.01}},
        "env": {**point_reach_config(), "optim": {"lr": 0.003}},
    }
    for kind, data in runs.items():
        data = {**data, "defaults": "presets/grpo", "seed": learning_seed, "total_steps": 25, "log": {"progress": False, "tensorboard": False}, "eval": {"episodes": 8}}
        data["algo"] = {"group_size": 8, "groups_per_step": 4, "ppo_epochs": 4 if kind == "env" else 1, "kl": {"coef": 0.01}}
        cfg = from_dict(TrainConfig, resolve_defaults(data, None))
        assert (cfg.algo.objective.type, cfg.algo.aggregation.type, cfg.algo.kl.type) == ("ppo_clip", "seq_mean_token_mean", "k3")
        trainer = Trainer(cfg, tmp_path / kind)
        if kind == "denoising":
            assert isinstance(trainer.policy, DenoisingPolicy)  # schedule, transitions and log-probs of mmrl/denoising
        trainer.train()
        first, last = _first_last(read_metrics(tmp_path / kind), "reward/total")
        learned(last - first - 0.1 * abs(first), 0.05, name=f"{kind}: reward gain beyond 10% of the start")


STATEFUL_POLICY = {"type": "gaussian_mlp", "hidden_sizes": [16, 16], "obs_norm": True, "final_log_std": -1.5, "log_std_anneal_decisions": 300}


@pytest.mark.parametrize("policy", [None, STATEFUL_POLICY], ids=["plain", "running_statistics"])
def test_resume_matches_an_uninterrupted_run_exactly(tmp_path, policy):
    """Also with running statistics (observation normalizer, noise clock): they are saved
    with the weights and continue exactly."""
    extra = {"policy": policy} if policy else {}
    full = env_config(total_steps=6, checkpoint={"every": 3}, **extra)
    train(full, tmp_path / "full")
    part = env_config(total_steps=3, **extra)
    train(part, tmp_path / "part")
    rest = env_config(total_steps=6, **extra)
    Trainer(rest, tmp_path / "part", resume=True).train()

    def records(run):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(tmp_path / run)}

    a, b = records("full"), records("part")
    for step in (4, 5, 6):
        assert a[step] == b[step], step
    wa = load_file(str(tmp_path / "full/checkpoints/step_00000006/model.safetensors"))
    wb = load_file(str(tmp_path / "part/checkpoints/step_00000006/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_fresh_run_refuses_to_overwrite_an_existing_run(tmp_path):
    from mmrl.errors import ConfigError

    train(env_config(total_steps=1), tmp_path / "run")
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(env_config(total_steps=1), tmp_path / "run")


@dataclass
class _NanAfter(RewardConfig):
    after: int = option(2, "calls before the reward turns NaN", ge=0)


_calls = {"n": 0}


@REWARDS.register("_test_nan_after", config=_NanAfter)
def _nan_after(rollout, cfg):
    """Test-only: the success reward until ``after`` calls, then NaN."""
    _calls["n"] += 1
    r = rollout.info["success"].float().clone()
    if _calls["n"] > cfg.after:
        r[0] = math.nan
    return r


def test_nan_reward_stops_naming_step_and_component_and_keeps_last_checkpoint(tmp_path):
    _calls["n"] = 0
    cfg = env_config(total_steps=10, rewards=[{"type": "_test_nan_after", "after": 2}], checkpoint={"every": 1})
    with pytest.raises(NonFiniteError, match=r"step 3: reward '_test_nan_after' is nan"):
        train(cfg, tmp_path / "run")
    latest = (tmp_path / "run/checkpoints/latest").read_text()
    assert latest == "step_00000002"
    load_file(str(tmp_path / "run/checkpoints" / latest / "model.safetensors"))  # intact


# What each preset must apply: (advantage type, its options), (objective type, options),
# aggregation, filters, KL coefficient. Checked against the calls the trainer makes.
PRESETS = {
    "grpo": (("grpo", {"std": "group", "ddof": 0, "eps": 1e-6}), ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}), "seq_mean_token_mean", [], 0.04),
    "dapo": (("grpo", {"std": "group", "ddof": 0, "eps": 1e-6}), ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}), "token_mean", ["zero_variance"], 0.0),
    "dr_grpo": (("grpo", {"std": "none", "ddof": 0, "eps": 1e-6}), ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}), "const_norm", [], 0.0),
    "lite_ppo": (("grpo", {"std": "batch", "ddof": 0, "eps": 1e-6}), ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}), "token_mean", [], 0.0),
    "gspo": (("grpo", {"std": "group", "ddof": 0, "eps": 1e-6}), ("gspo", {"eps_low": 3e-4, "eps_high": 4e-4}), "seq_mean_token_mean", [], 0.0),
    "cispo": (("grpo", {"std": "group", "ddof": 0, "eps": 1e-6}), ("cispo", {"eps_high": 5.0, "eps_low": None}), "token_mean", [], 0.0),
    "mc_grpo": (("median", {"std": "group", "ddof": 0, "eps": 1e-6}), ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}), "token_mean", [], 0.0),
    "w_reinforce": (("psr_nsr", {"psr_weight": 0.1, "nsr_weight": 1.0}), ("reinforce", {}), "token_mean", [], 0.0),
}


def test_every_shipped_preset_is_in_the_table():
    assert sorted(PRESETS) == sorted(p.stem for p in (ROOT / "configs" / "presets").glob("*.yaml"))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_applies_its_options_in_the_loop(tmp_path, preset, monkeypatch):
    """The trainer calls each axis's function with exactly the preset's options (spied
    calls, not the config object), and the run's metrics are finite."""
    from mmrl.config import load_config

    (adv_type, adv_options), (objective_type, objective_options), aggregation, filters, kl_coef = PRESETS[preset]
    cfg = load_config(TrainConfig, ROOT / "configs" / "toy_sequence_grpo.yaml", [f"defaults=presets/{preset}", "total_steps=2", "algo.group_size=5", "log.progress=false", "log.tensorboard=false", "eval.episodes=4", "policy.seq_len=1", "policy.vocab_size=4"])
    cfg.algo.kl.coef = kl_coef  # the toy config sets its own; the preset's value is checked below
    trainer = Trainer(cfg, tmp_path / preset)
    calls = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.setdefault(name, kwargs)
            return fn(*args, **kwargs)
        wrapped.needs_proximal = getattr(fn, "needs_proximal", False)
        return wrapped

    trainer.learner.advantage_stage.advantage_fn = spy(adv_type, trainer.learner.advantage_stage.advantage_fn)
    trainer.learner.loss.objective_fn = spy(objective_type, trainer.learner.loss.objective_fn)
    trainer.learner.loss.aggregate_fn = spy(aggregation, trainer.learner.loss.aggregate_fn)
    from mmrl.registry import FILTERS

    for name in filters:  # the worker looks its filters up by name (mmrl.algo.filters.apply_filters)
        monkeypatch.setattr(FILTERS.entry(name), "obj", spy(name, FILTERS.entry(name).obj))
    summary = trainer.train()
    assert summary["step"] == 2
    assert calls[adv_type] == adv_options
    assert {k: v for k, v in calls[objective_type].items() if k not in ("mask", "log_ratio_clamp")} == objective_options
    assert aggregation in calls
    assert set(calls) >= set(filters)
    records = read_metrics(tmp_path / preset)
    assert any("loss/policy" in r for r in records)
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    from mmrl.config import load_yaml

    preset_kl = load_yaml(ROOT / "configs" / "presets" / f"{preset}.yaml")["algo"]["kl"]["coef"]
    assert preset_kl == kl_coef


def test_metrics_tensorboard_and_checkpoint_layout(tmp_path):
    cfg = env_config(total_steps=2, log={"tensorboard": True, "progress": False})
    train(cfg, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "reward/total" in r] == [1, 2]
    assert any("eval/success_rate" in r for r in records)
    assert list((tmp_path / "run/tensorboard").glob("events.out.tfevents.*"))
    ckpt = tmp_path / "run/checkpoints/step_00000002"
    assert {p.name for p in ckpt.iterdir()} >= {"model.safetensors", "optimizer.pt", "state.pt", "config.yaml"}
    assert json.loads(json.dumps(read_metrics(tmp_path / "run")))  # plain JSON


def test_lr_schedules_warm_up_then_decay_to_the_final_ratio():
    from mmrl.train.optimization import lr_factor

    assert [lr_factor(s, 10, "constant", 2) for s in (0, 1, 2, 9)] == [1 / 3, 2 / 3, 1.0, 1.0]
    linear = [lr_factor(s, 6, "linear", 1, 0.2) for s in range(6)]
    assert linear[:2] == [0.5, 1.0] and linear[-1] == pytest.approx(0.2) and linear[3] == pytest.approx(0.6)
    cosine = [lr_factor(s, 5, "cosine", 0, 0.0) for s in range(5)]
    assert cosine == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0.0])


def test_a_scheduled_run_logs_its_lr_and_resumes_the_schedule_exactly(tmp_path):
    import shutil

    optim = {"lr": 0.01, "lr_schedule": "linear", "warmup_steps": 1, "final_lr_ratio": 0.1}
    train(env_config(total_steps=6, optim=optim, checkpoint={"every": 3, "keep": 5}), tmp_path / "full")
    lrs = {r["step"]: r["optim/lr"] for r in read_metrics(tmp_path / "full") if "optim/lr" in r}
    assert [lrs[s] for s in range(1, 7)] == pytest.approx([0.005, 0.01, 0.00775, 0.0055, 0.00325, 0.001])
    # a run stopped after step 3 (its checkpoint) and resumed continues the same schedule
    shutil.copytree(tmp_path / "full", tmp_path / "part")
    shutil.rmtree(tmp_path / "part/checkpoints/step_00000006")
    (tmp_path / "part/checkpoints/latest").write_text("step_00000003")
    Trainer(env_config(total_steps=6, optim=optim), tmp_path / "part", resume=True).train()
    wa = load_file(str(tmp_path / "full/checkpoints/step_00000006/model.safetensors"))
    wb = load_file(str(tmp_path / "part/checkpoints/step_00000006/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resumed_run_takes_a_new_learning_rate_and_records_it(tmp_path):
    # `mmrl train RUN --resume optim.lr=X`: the optimizer state carries on, the new lr applies
    # from the next update on, metrics.jsonl logs it and the run's config.yaml says it
    import yaml

    run = tmp_path / "run"
    train(env_config(total_steps=3, optim={"lr": 0.01}, checkpoint={"every": 3, "keep": 2}), run)
    resumed = Trainer(env_config(total_steps=5, optim={"lr": 0.003}), run, resume=True)
    resumed.train()
    assert all(g["lr"] == pytest.approx(0.003) for g in resumed.learner.optimizer.param_groups)
    lrs = {r["step"]: r["optim/lr"] for r in read_metrics(run) if "optim/lr" in r}
    assert [lrs[s] for s in range(1, 6)] == pytest.approx([0.01, 0.01, 0.01, 0.003, 0.003])
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optim"]["lr"] == pytest.approx(0.003) and saved["total_steps"] == 5


def test_frozen_parameters_stay_fixed_while_the_others_train(tmp_path):
    cfg = env_config(total_steps=2, optim={"lr": 0.01, "frozen": ["net.0", "log_std"]})
    trainer = Trainer(cfg, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}
    trainer.train()
    after = dict(trainer.learner.model.named_parameters())
    for name, value in before.items():
        frozen = name.startswith("net.0.") or name == "log_std"
        assert torch.equal(value, after[name]) == frozen, name


def test_a_frozen_prefix_matching_no_parameter_is_a_config_error(tmp_path):
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"optim\.frozen\[1\].*'?net\.9'?.*matches no parameter"):
        Trainer(env_config(optim={"frozen": ["net.0", "net.9"]}), tmp_path / "run")


def test_metrics_log_the_sampling_policys_entropy_per_decision(tmp_path):
    train(toy_config("sequence", total_steps=2), tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run") if "loss/policy" in r]
    trainer = Trainer(toy_config("sequence"), tmp_path / "fresh")
    vocab = trainer.learner.model.config.vocab_size
    assert len(rows) == 2 and all(0 < r["entropy"] <= math.log(vocab) + 1e-6 for r in rows)


@pytest.mark.numerics
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_accumulate_to_the_same_update(tmp_path, aggregation):
    """Gradient accumulation changes memory, not the update: the weights after two steps and
    the logged statistics match those of whole minibatches."""
    results = {}
    for k in (1, 3):
        cfg = env_config(total_steps=2, algo={"group_size": 4, "groups_per_step": 4, "ppo_epochs": 2, "num_minibatches": 2, "micro_batches": k, "aggregation": aggregation})
        trainer = Trainer(cfg, tmp_path / f"run{k}")
        calls = []
        forward = trainer.learner.model.forward
        trainer.learner.model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
        trainer.train()
        assert len(calls) == 2 * 2 * 2 * k  # steps x epochs x minibatches x pieces
        results[k] = ({n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}, [r for r in read_metrics(tmp_path / f"run{k}") if "loss/policy" in r])
    (w1, m1), (w3, m3) = results[1], results[3]
    # pieces reorder the float32 sums; Adam could turn a rounding difference in a gradient entry
    # near 0 into a step of up to lr = 3e-4, which a tanh MLP's dense gradients do not have here
    # (measured: at most 3e-8 apart after 8 optimizer steps, under ATEN_CPU_CAPABILITY default,
    # avx2 and avx512)
    for name in w1:
        torch.testing.assert_close(w3[name], w1[name], atol=1e-5, rtol=1e-4)
    assert not torch.equal(w1["net.0.weight"], Trainer(env_config(), tmp_path / "fresh").learner.model.net[0].weight)  # training moved it
    for a, b in zip(m1, m3):
        for key in ("loss/policy", "approx_kl", "objective/clipped", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.numerics
@pytest.mark.skipif(torch.cuda.is_available(), reason="the estimate cuts pieces on a CPU only, and accelerate keeps the process's first device (CUDA here)")
def test_micro_batches_null_cuts_minibatches_by_the_policys_activation_estimate(tmp_path, monkeypatch):
    """The default (null): one piece for a policy without an activation estimate; with one,
    on a CPU, as many pieces as keep each under micro_batch_mb — the same update."""
    results = {}
    for name, algo, estimate, pieces in [
        ("one", {"micro_batches": 1}, None, 1),
        ("none", {}, None, 1),
        ("estimated", {"micro_batch_mb": 1.5}, 0.5 * 2**20, 3),  # 8 rows x 0.5 MiB / 1.5 MiB -> 3 pieces
    ]:
        cfg = env_config(total_steps=2, device="cpu", algo={"group_size": 4, "groups_per_step": 4, "ppo_epochs": 1, "num_minibatches": 2, **algo})
        trainer = Trainer(cfg, tmp_path / name)
        if estimate is not None:  # the policy class implements the hook
            monkeypatch.setattr(type(trainer.policy), "activation_bytes", lambda self, replay, estimate=estimate: estimate, raising=False)
        calls = []
        forward = trainer.learner.model.forward
        trainer.learner.model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
        trainer.train()
        assert len(calls) == 2 * 2 * pieces, name  # steps x minibatches x pieces
        results[name] = {n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}
    for name in results["one"]:
        torch.testing.assert_close(results["none"][name], results["one"][name], atol=0, rtol=0)
        torch.testing.assert_close(results["estimated"][name], results["one"][name], atol=1e-5, rtol=1e-4)  # pieces: as above


@pytest.mark.learning
def test_exact_kl_of_a_denoising_chain_pulls_the_policy_back_to_its_reference(tmp_path, learning_seed, learned):
    """kl.type: exact takes the policy's closed-form per-step KL (through the distributed
    forward); a large coefficient holds the chain near its reference while the reward
    alone moves it away.

    Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): reward change without KL 1.16 to 1.42
    (>= 0.8); |reward change| with KL coef 50 0.0852 to 0.121 (<= 0.2)."""
    free = toy_config("denoising", seed=learning_seed, total_steps=16)
    held = toy_config("denoising", seed=learning_seed, total_steps=16, algo={"group_size": 8, "groups_per_step": 4, "kl": {"type": "exact", "coef": 50.0}})
    train(free, tmp_path / "free")
    train(held, tmp_path / "held")
    kl = [r["kl/ref"] for r in read_metrics(tmp_path / "held") if "kl/ref" in r]
    assert kl and all(v >= 0 for v in kl) and max(v for v in kl) > 0
    moved = lambda run: _first_last(read_metrics(tmp_path / run), "reward/total")  # noqa: E731
    (free_first, free_last), (held_first, held_last) = moved("free"), moved("held")
    learned(free_last - free_first, 0.8, name="reward change without KL")
    learned(abs(held_last - held_first), 0.2, higher=False, name="|reward change| with KL coef 50")


def test_exact_kl_on_a_policy_without_one_is_a_config_error(tmp_path):
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match="algo.kl.type"):
        Trainer(toy_config("sequence", algo={"group_size": 8, "groups_per_step": 4, "kl": {"type": "exact", "coef": 0.1}}), tmp_path / "run")


def test_a_minibatch_whose_decisions_are_all_masked_gives_a_zero_loss_not_nan(tmp_path):
    trainer = Trainer(toy_config("sequence", algo={"group_size": 8, "groups_per_step": 4, "aggregation": "token_mean"}), tmp_path / "run")
    rollout = trainer.engine.worker.collect(0).rollout
    masked = rollout.with_(mask=torch.zeros_like(rollout.mask))
    from mmrl.algo.losses import Targets

    out = trainer.learner.loss(trainer.learner.model, masked, Targets(torch.ones(rollout.batch_size, 1, device=rollout.mask.device)), trainer.learner.normalizers(masked))
    assert out.loss.item() == 0.0


def test_every_evaluation_is_logged_even_between_log_steps(tmp_path):
    train(env_config(total_steps=4, log={"every": 3}, eval={"every": 2, "episodes": 4}), tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "eval/success_rate" in r] == [0, 2, 4]  # 0: before training
    assert [r["step"] for r in records if "loss/policy" in r] == [2, 3, 4]


def test_the_evaluation_before_training_leaves_the_run_as_it_would_be_without_it(tmp_path):
    """``eval.at_start`` logs the starting point at step 0 and restores every random stream,
    so the trained weights and the training metrics are those of a run without it."""
    for at_start in (True, False):
        train(env_config(total_steps=2, eval={"at_start": at_start, "at_end": False, "episodes": 4}), tmp_path / str(at_start))
    with_start, without = read_metrics(tmp_path / "True"), read_metrics(tmp_path / "False")
    assert [r["step"] for r in with_start if "eval/success_rate" in r] == [0] and not any("eval/success_rate" in r for r in without)
    assert with_start[0]["eval/episodes"] == 4 and "eval/success_rate_ci_high" in with_start[0]
    untimed = lambda records: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records if r["step"] > 0]  # noqa: E731
    assert untimed(with_start) == untimed(without)
    weights = [load_file(str(tmp_path / run / "checkpoints" / "step_00000002" / "model.safetensors")) for run in ("True", "False")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_every_sample_carries_the_version_of_the_weights_that_sampled_it_and_resume_keeps_the_count(tmp_path):
    """Each update publishes a version of the learner's weights (0: the initial ones); the
    worker tags what it samples with the version it holds; checkpoints keep the count."""
    trainer = Trainer(env_config(total_steps=2, checkpoint={"every": 2}), tmp_path / "run")
    assert trainer.learner.version == 0 and trainer.engine.worker.collect(0).rollout.policy_version.unique().tolist() == [0]
    trainer.train()
    assert trainer.learner.version == trainer.engine.worker.version == 2
    assert trainer.engine.worker.collect(2).rollout.policy_version.unique().tolist() == [2]
    resumed = Trainer(env_config(total_steps=3), tmp_path / "run", resume=True)
    assert resumed.learner.version == resumed.engine.worker.version == 2


def test_read_metrics_of_a_run_still_writing_leaves_out_a_half_written_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ValueError):  # a broken line before the last is corruption, not a write in progress
        read_metrics(tmp_path)


def test_the_training_mask_is_made_on_the_rollouts_device_whatever_device_the_advantages_are_on(tmp_path):
    """The learner works out advantages and the keep mask on the CPU while the rollout stays on
    the policy's device (a GPU in use). The training mask must be made there: the "meta" device
    stands in for a GPU on a CPU-only machine (mixing it with CPU tensors fails as CUDA does)."""
    trainer = Trainer(env_config(algo={"mask_truncated": True}), tmp_path / "run")
    rollout = trainer.engine.worker.collect(0).rollout
    adv, keep = trainer.learner.advantages(rollout)
    assert keep.device.type == "cpu" and "truncated" in rollout.info
    on_meta = rollout.with_(mask=rollout.mask.to("meta"))
    mask = trainer.learner.train_mask(on_meta, keep)
    assert mask.device.type == "meta" and mask.shape == rollout.mask.shape
    torch.testing.assert_close(trainer.learner.train_mask(rollout, keep), rollout.mask * keep[:, None].to(rollout.mask.dtype) * ~torch.as_tensor(rollout.info["truncated"], dtype=torch.bool)[:, None])


def _first_step_and_bar(cfg: TrainConfig, run_dir) -> tuple[dict, dict]:
    """The metrics of a run's first training step and the progress bar's numbers for them."""
    trainer = Trainer(cfg, run_dir)
    metrics = trainer.rl_step(0)
    return metrics, _postfix(metrics, trainer.sampler.progress_metrics)


@pytest.mark.parametrize(("success_weight", "step_reward_weight"), [(0.0, 1.0), (1.0, 0.5)])
def test_the_bar_of_a_run_on_step_rewards_shows_the_return_it_trains_on_and_success_beside_it(tmp_path, success_weight, step_reward_weight):
    """GAE on PointReach's dense step reward (-distance), as `make train`'s config on PushCube:
    the bar shows ``trained_return`` — the combined reward plus the weighted step rewards of
    the episode (one env step per decision: the weighted env return) — never the combined
    reward, which with ``success`` at weight 0 is 0 the whole run; success stays beside it."""
    data = gae_config(total_steps=1, rewards=[{"type": "success", "weight": success_weight}], algo={"advantage": {**GAE["advantage"], "step_reward_weight": step_reward_weight}})
    metrics, bar = _first_step_and_bar(from_dict(TrainConfig, data), tmp_path / "run")
    expected = metrics["reward/total"] + step_reward_weight * metrics["episode_return"]
    assert metrics["trained_return"] == pytest.approx(expected, abs=1e-4) and metrics["episode_return"] < 0
    assert list(bar)[:2] == ["return", "success"] and "reward" not in bar
    assert bar["return"] == f"{metrics['trained_return']:.3f}" and bar["success"] == f"{metrics['success_rate']:.3f}"
    if success_weight == 0:
        assert metrics["reward/total"] == 0.0


@pytest.mark.parametrize("kind", ["env", "sequence"])
def test_the_bar_of_a_run_on_reward_components_shows_the_combined_reward(tmp_path, kind):
    """An env run that does not train on step rewards (GRPO on success and the return
    component, the sequence level) and a token run show the combined reward, as before."""
    cfg = env_config(total_steps=1) if kind == "env" else toy_config(kind, total_steps=1)
    metrics, bar = _first_step_and_bar(cfg, tmp_path / "run")
    assert "trained_return" not in metrics and "return" not in bar
    assert list(bar)[0] == "reward" and bar["reward"] == f"{metrics['reward/total']:.3f}"


def test_the_reward_is_combined_once_filters_and_advantages_read_the_same_values(tmp_path, monkeypatch):
    """log_tamed depends on the batch it is computed over: the worker combines each scored
    round once (Rollout.reward) and the dynamic-sampling filter and the advantage both read
    that, rather than the learner recombining the filtered batch."""
    from mmrl.config import load_config
    from mmrl.registry import FILTERS

    cfg = load_config(TrainConfig, ROOT / "configs" / "toy_sequence_grpo.yaml", [
        "total_steps=2", "algo.group_size=2", "algo.groups_per_step=4", "log.progress=false", "log.tensorboard=false", "eval.episodes=4",
        "policy.seq_len=1", "policy.vocab_size=4", "algo.reward_aggregation=log_tamed", "algo.resample_rounds=2",
        "rewards=[{type: token_fraction, token: 3}, {type: token_fraction, token: 1, weight: 0.5}]", "algo.filters=[{type: zero_variance}]",
    ])
    trainer = Trainer(cfg, tmp_path / "run")
    seen_by_filter, seen_by_advantage, scored = [], [], []
    entry = FILTERS.entry("zero_variance")
    original = entry.obj

    def spy_filter(reward, group_id, **kwargs):
        seen_by_filter.append(reward.clone())
        return original(reward, group_id, **kwargs)

    monkeypatch.setattr(entry, "obj", spy_filter)
    advantage_fn = trainer.learner.advantage_stage.advantage_fn

    def spy_advantage(reward, group_id, **kwargs):
        seen_by_advantage.append(reward.clone())
        return advantage_fn(reward, group_id, **kwargs)

    trainer.learner.advantage_stage.advantage_fn = spy_advantage
    score = trainer.engine.worker.score

    def spy_score(rollout, step):
        out = score(rollout, step)
        scored.append((out.rewards.clone(), out.reward.clone()))
        return out

    trainer.engine.worker.score = spy_score
    trainer.train()
    assert seen_by_filter and seen_by_advantage
    for columns, combined in scored:  # each scored round, combined over that round
        torch.testing.assert_close(combined, trainer.rewards.combine(columns, torch.zeros(len(columns), dtype=torch.long)), rtol=0, atol=0)
    assert sum(len(r) for r in seen_by_advantage) < sum(len(r) for _, r in scored)  # the filter dropped groups
    kept_values = torch.cat([r for _, r in scored])
    for reward in seen_by_advantage:  # every value trained on is, exactly, one the filter saw
        assert all(bool((kept_values == v).any()) for v in reward)


def test_the_learner_trains_on_the_stored_combined_reward_and_does_not_recombine(tmp_path):
    cfg = env_config(total_steps=1, log={"tensorboard": False, "progress": False})
    trainer = Trainer(cfg, tmp_path / "run")
    collected = trainer.engine.collect(0, trainer.learner.version)
    rollout = collected.rollout
    stored = torch.arange(rollout.batch_size, dtype=torch.float32) * 0.25 - 1.0  # not what the columns combine to
    assert not torch.equal(stored, trainer.rewards.combine(rollout.rewards, rollout.group_id))
    received = []
    advantage_fn = trainer.learner.advantage_stage.advantage_fn
    trainer.learner.advantage_stage.advantage_fn = lambda reward, group_id, **kw: received.append(reward.clone()) or advantage_fn(reward, group_id, **kw)
    trainer.learner.advantage_stage(rollout.with_(reward=stored), trainer.learner.model)
    torch.testing.assert_close(received[0], stored, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unscored"):
        trainer.learner.advantage_stage(rollout.with_(reward=None), trainer.learner.model)
