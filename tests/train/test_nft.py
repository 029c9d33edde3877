"""DiffusionNFT (``algo.loss: nft``): the formulas against the reference's definitions
written out here, the loss's two promises (r = ½ is stationary at θ = θ_old; r > ½ moves the
velocity toward the sample, r < ½ away), and the run-level guarantees (exact resume with the
EMA, N processes = 1 process)."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.algo.losses import Targets
from mmrl.algo.losses.nft import ema_decay, nft_terms, optimality
from mmrl.config import from_dict
from mmrl.core.component_config import RewardConfig
from mmrl.errors import ConfigError
from mmrl.registry import REWARDS
from mmrl.train.metrics import read_metrics
from mmrl.train.run_config import TrainConfig
from mmrl.train.trainer import Trainer, train
from tests.rollout.test_engine import _same, _steps
from tests.train.test_distributed_and_cli_runs import _one_and_two_processes

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[2]


def nft_config(**algo) -> dict:
    return {
        "name": "nft", "seed": 0, "total_steps": 2,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "denoising": {"transition": "flow_ode", "logp_granularity": "chain", "num_inference_steps": 4}},
        "sampler": {"type": "prompt", "data": {"num_prompts": 3}, "batch_groups": 2},
        "rewards": [{"type": "jpeg_compressibility"}],
        "algo": {"group_size": 2, "groups_per_step": 4, "advantage": {"type": "grpo", "std": "batch", "eps": 1e-4}, "loss": {"type": "nft", "ref_coef": 0.0}, **algo},
        "optim": {"lr": 1e-3}, "eval": {"every": 0, "at_start": False, "at_end": False},
        "log": {"progress": False, "tensorboard": False},
    }


# ---------------------------------------------------------------- the formulas, written out


def test_the_loss_terms_are_the_references_definitions():
    """DiffusionNFT's loss as its reference code defines it (read there, written out here):
    v⁺ = β v + (1 − β) v_old, v⁻ = (1 + β) v_old − β v, x̂0 = x_t − t v, per-sample weights
    mean|x̂0 − x0| (double, floored at 1e-5, no gradient), the mean squared error over the
    latent divided by them, r·pos/β + (1 − r)·neg/β."""
    g = torch.Generator().manual_seed(0)
    v, v_old, x0, eps = (torch.randn(5, 3, 4, 4, generator=g) for _ in range(4))
    t = torch.rand(5, generator=g)
    r = torch.rand(5, generator=g)
    for beta in (1.0, 0.1):
        tt = t.view(-1, 1, 1, 1)
        x_t = (1 - tt) * x0 + tt * eps
        pos_pred = x_t - tt * (beta * v + (1 - beta) * v_old)
        neg_pred = x_t - tt * ((1 + beta) * v_old - beta * v)
        w_pos = (pos_pred.double() - x0.double()).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5)
        w_neg = (neg_pred.double() - x0.double()).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5)
        pos = ((pos_pred - x0) ** 2 / w_pos).mean(dim=(1, 2, 3))
        neg = ((neg_pred - x0) ** 2 / w_neg).mean(dim=(1, 2, 3))
        expected = r * pos / beta + (1 - r) * neg / beta
        torch.testing.assert_close(nft_terms(v, v_old, x_t, x0, t, r, beta), expected.float(), rtol=1e-6, atol=0)


def test_the_optimality_probability_and_the_old_policys_schedules():
    adv = torch.tensor([-9.0, -5.0, -1.0, 0.0, 2.5, 5.0, 7.0])
    # r = clamp(clip(A, ±5) / 5 / 2 + 0.5, 0, 1)
    assert optimality(adv, 5.0).tolist() == pytest.approx([0.0, 0.0, 0.4, 0.5, 0.75, 1.0, 1.0])
    # schedule 1: d = min(0.001 step, 0.5); schedule 2 (OCR): 0 for 75 steps, then min(0.0075 (step − 75), 0.999)
    assert [ema_decay(s, 0.001, 0.5, 0) for s in (0, 100, 499, 500, 2000)] == pytest.approx([0.0, 0.1, 0.499, 0.5, 0.5])
    assert [ema_decay(s, 0.0075, 0.999, 75) for s in (0, 74, 75, 175, 300)] == pytest.approx([0.0, 0.0, 0.0, 0.75, 0.999])


# ---------------------------------------------------------------- the loss on a real flow policy


def _batch(tmp_path, **loss):
    data = nft_config()
    data["algo"]["loss"].update(loss)
    trainer = Trainer(from_dict(TrainConfig, data), tmp_path / "run")
    rollout = trainer.engine.collect(0, trainer.learner.version).rollout
    return trainer, rollout


def _loss(trainer, rollout, adv: float):
    n = rollout.batch_size
    targets = Targets(torch.full((n, 1), adv), index=torch.arange(n))
    trainer.learner.loss.begin_update(0)
    return trainer.learner.loss(trainer.learner.model, rollout, targets, trainer.learner.normalizers(rollout))


@pytest.mark.numerics
def test_r_one_half_gives_zero_gradient_at_the_old_weights_and_r_one_does_not(tmp_path):
    trainer, rollout = _batch(tmp_path)
    model = trainer.learner.model

    def gradient(adv: float) -> float:
        model.zero_grad(set_to_none=True)
        _loss(trainer, rollout, adv).loss.backward()
        return sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)

    # A = 0: r = 1/2, v⁺ − v⁻ ∝ v_θ − v_old = 0 at the old weights. v_θ (with grad) and v_old (without)
    # are two passes whose matrix products may fold differently, so zero up to float32 rounding
    # (exactly 0 here; 1e-9-sized entries under tests/kernel_emulation)
    assert gradient(0.0) <= 1e-6 * gradient(5.0)  # r = 1
    assert gradient(5.0) > 0


@pytest.mark.parametrize(("adv", "closer"), [(5.0, True), (-5.0, False)])
def test_a_positive_advantage_moves_the_velocity_toward_the_sample_and_a_negative_one_away(tmp_path, adv, closer):
    """Steps of the loss alone (θ_old fixed): the x0 the velocity predicts at fixed noisy
    latents, x_t − σ v_θ, moves toward the samples for r = 1 and away for r = 0."""
    trainer, rollout = _batch(tmp_path)
    learner, loss = trainer.learner, trainer.learner.loss
    x0 = learner.policy.final_samples(rollout.replay)
    n = x0.shape[0]
    sigma = torch.full((n,), float(loss.sigmas[1]))
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))

    def error() -> float:
        with torch.no_grad():
            v = learner.policy.velocity(rollout.replay, x_t, sigma, torch.arange(n))
        return float(((x_t - sigma.view(-1, 1, 1, 1) * v - x0) ** 2).mean())

    before = error()
    opt = torch.optim.SGD(learner.model.parameters(), lr=0.05)
    for _ in range(5):
        opt.zero_grad()
        _loss(trainer, rollout, adv).loss.backward()
        opt.step()
    assert (error() < before) if closer else (error() > before), (before, error())


@pytest.mark.numerics
def test_a_reference_term_pulls_toward_the_reference(tmp_path):
    """ref_coef > 0: the learner keeps a frozen reference; at θ = θ_ref its term is 0 and
    adds no gradient, and the metric names it."""
    trainer, rollout = _batch(tmp_path, ref_coef=1.0)
    assert trainer.learner.reference is not None
    out = _loss(trainer, rollout, 0.0)
    assert float(out.terms["nft/ref_mse"]) <= 1e-10  # 0 up to two passes' rounding (1.6e-14 under tests/kernel_emulation)


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"transition": "flow_sde", "logp_granularity": "chain"}, "policy.denoising.transition"),
        ({"transition": "flow_ode", "logp_granularity": "step"}, "policy.denoising.logp_granularity"),
    ],
)
def test_nft_refuses_a_chain_it_cannot_train_on(tmp_path, policy, field):
    data = nft_config()
    data["policy"]["denoising"].update(policy)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Trainer(from_dict(TrainConfig, data), tmp_path / "run")


# ---------------------------------------------------------------- through the trainer


def test_an_nft_run_resumes_exactly_with_its_old_policy(tmp_path):
    data = nft_config(ppo_epochs=2, num_minibatches=2)
    data["algo"]["loss"].update(old_rate=0.2, old_max=0.9)  # a decay that moves within the run
    data.update(total_steps=4, checkpoint={"every": 2})
    train(from_dict(TrainConfig, data), tmp_path / "straight")
    train(from_dict(TrainConfig, {**data, "total_steps": 2}), tmp_path / "split")
    train(from_dict(TrainConfig, data), tmp_path / "split", resume=True)
    _same(_steps(read_metrics(tmp_path / "split")), _steps(read_metrics(tmp_path / "straight")))
    a = torch.load(tmp_path / "straight/checkpoints/step_00000004/state.pt", weights_only=True)["loss"]["old"]
    b = torch.load(tmp_path / "split/checkpoints/step_00000004/state.pt", weights_only=True)["loss"]["old"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    wa = load_file(str(tmp_path / "straight/checkpoints/step_00000004/model.safetensors"))
    wb = load_file(str(tmp_path / "split/checkpoints/step_00000004/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    moved = [k for k in a if not torch.equal(a[k], wa[k])]
    assert moved  # the old policy lags the trained weights
    metrics = [r for r in read_metrics(tmp_path / "straight") if "nft/old_decay" in r]
    assert [r["nft/old_decay"] for r in metrics] == pytest.approx([0.0, 0.2, 0.4, 0.6])


@pytest.mark.numerics
def test_nft_with_two_processes_matches_one_process(tmp_path, write_config):
    data = nft_config(num_minibatches=2)
    data.update(checkpoint={"every": 2})
    ra, rb = _one_and_two_processes(tmp_path, write_config(data), 29541)
    a = load_file(str(tmp_path / "one/checkpoints/step_00000002/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000002/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-4)
    for x, y in zip(_steps(ra), _steps(rb)):
        for key in ("reward/total", "loss/policy", "grad_norm"):
            assert math.isclose(x[key], y[key], rel_tol=1e-4, abs_tol=1e-7), (key, x[key], y[key])


def test_nft_refuses_a_kl_term_it_has_no_log_probs_for(tmp_path):
    data = nft_config(kl={"type": "k3", "coef": 0.01})
    with pytest.raises(ConfigError, match=r"algo\.kl\.coef: got 0\.01; algo\.loss nft needs 0: it has no log-probs for a KL term"):
        Trainer(from_dict(TrainConfig, data), tmp_path / "run")


def test_switching_a_flow_grpo_config_to_nft_names_every_override_in_one_error():
    from mmrl.config import load_config

    path = ROOT / "configs" / "image_shapes_flow_grpo.yaml"  # flow_sde, one decision per step
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, path, ["algo.loss=nft", "algo.kl.coef=0.01"])
    message = str(e.value)
    assert e.value.field == "algo.loss.type" and "\n" not in message
    overrides = message.split("; override: ")[1].split()
    assert overrides == ["policy.denoising.transition=flow_ode", "policy.denoising.logp_granularity=chain", "algo.kl.coef=0"]
    cfg = load_config(TrainConfig, path, ["algo.loss=nft", "algo.kl.coef=0.01", *overrides])  # the second run loads
    assert (cfg.algo.loss.type, cfg.policy.denoising.transition, cfg.policy.denoising.logp_granularity) == ("nft", "flow_ode", "chain")


@REWARDS.register("_test_every_other_sample", config=RewardConfig)
def _every_other_sample(rollout, cfg):
    """1 for every other sample of the batch: advantages of both signs in every group."""
    return (torch.arange(rollout.batch_size) % 2).double()


def _vla_config() -> dict:
    """The flow VLA's contract example (the tabletop at 16 px), sampling with its ODE: one
    NFT row per env decision (its action chunk), r from the decision's advantage."""
    from mmrl.registry import POLICIES

    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in POLICIES.entry("flow_vla").traits["contract"]["train"].items()}
    data["policy"] = {**data["policy"], "denoising": {"num_inference_steps": 4, "transition": "flow_ode", "logp_granularity": "chain"}}
    data.update(
        name="vla_nft", seed=0, total_steps=2, log={"progress": False, "tensorboard": False}, eval={"every": 0, "at_start": False, "at_end": False},
        algo={"group_size": 2, "groups_per_step": 2, "loss": {"type": "nft", "ref_coef": 0.0}}, optim={"lr": 1e-3},
        rewards=[{"type": "_test_every_other_sample"}],
    )
    return data


def test_a_flow_vla_trains_nft_per_decision(tmp_path):
    """π-StepNFT's shape: each env decision's action chunk is a final sample; at θ = θ_old
    with every r = ½ the gradient is 0, and with a positive advantage it is not; a run of
    two updates is finite and moves the weights."""
    trainer = Trainer(from_dict(TrainConfig, _vla_config()), tmp_path / "vla")
    rollout = trainer.engine.collect(0, trainer.learner.version).rollout
    decisions = trainer.policy.final_samples(rollout.replay).shape[0]
    assert decisions == rollout.batch_size * rollout.mask.shape[1] > rollout.batch_size  # several decisions per episode
    model = trainer.learner.model
    _loss(trainer, rollout, 0.0).loss.backward()
    assert all(int(torch.count_nonzero(p.grad)) == 0 for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    _loss(trainer, rollout, 5.0).loss.backward()
    assert sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None) > 0
    model.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    summary = trainer.train()
    assert summary["step"] == 2 and math.isfinite(read_metrics(tmp_path / "vla")[-1].get("loss/policy", 0.0))
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items() if v.is_floating_point())


@pytest.mark.parametrize("case", ["image", "flow_vla"])
def test_nft_samplers_keep_only_final_samples_and_train_as_with_the_whole_chain(tmp_path, monkeypatch, case):
    """The loss reads no log-probs (``needs_log_probs=False``), so the samplers ask the policy
    for its final samples alone (``samples_final_only``): the stored chain is one latent per
    sample instead of K + 1, and the run's metrics and weights are those of a run that stores
    the whole chain, to the bit."""
    from mmrl.policies.flow_vla.model import FlowVLAPolicy
    from mmrl.policies.image_diffusion.model import ImageDiffusionPolicy

    data = _vla_config() if case == "flow_vla" else nft_config()
    runs = {}
    for final_only in (True, False):
        if not final_only:  # as a policy that cannot sample final samples alone: the whole chain is kept
            monkeypatch.setattr(FlowVLAPolicy, "samples_final_only", False)
            monkeypatch.setattr(ImageDiffusionPolicy, "samples_final_only", False)
        trainer = Trainer(from_dict(TrainConfig, data), tmp_path / str(final_only))
        rollout = trainer.engine.collect(0, trainer.learner.version).rollout
        latents = rollout.replay["chain"]["latents"]
        steps = latents.shape[2] if case == "flow_vla" else latents.shape[1]
        assert steps == (1 if final_only else 5)  # the final latent, or the 4 steps' 5 latents
        trainer.metrics.close()
        trainer.engine.close()
        trainer.sampler.close()
        train(from_dict(TrainConfig, data), tmp_path / f"run_{final_only}")
        runs[final_only] = tmp_path / f"run_{final_only}"
    _same(_steps(read_metrics(runs[True])), _steps(read_metrics(runs[False])))
    a = load_file(str(runs[True] / "checkpoints/step_00000002/model.safetensors"))
    b = load_file(str(runs[False] / "checkpoints/step_00000002/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
