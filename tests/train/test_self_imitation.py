import io
import math

import pytest

import torch
from safetensors.torch import load_file

from mmrl.core.rollout import OldLogProbs, Rollout
from mmrl.train.metrics import read_metrics
from mmrl.train.distributed import Collectives
from mmrl.train.self_imitation import SelfImitationMemory
from mmrl.train.trainer import Trainer, train
from tests.train.test_trainer import env_config, toy_config


def _rollout(values: list[float], width: int) -> Rollout:
    b = len(values)
    return Rollout(
        group_id=torch.arange(b),
        old=OldLogProbs(torch.zeros(b, width)),
        mask=torch.ones(b, width),
        replay={"x": torch.tensor(values)[:, None, None].expand(b, width, 2).clone(), "text": [f"s{v}" for v in values]},
        info={"success": torch.ones(b)},
    )


def test_memory_keeps_positive_samples_first_in_first_out_across_lengths():
    memory = SelfImitationMemory(size=3, collectives=Collectives())
    assert memory.add(_rollout([1, 2, 3], width=2), torch.tensor([0.5, -1.0, 0.0]), step=0) == 1  # only the positive one
    assert memory.add(_rollout([4, 5], width=4), torch.tensor([1.0, 2.0]), step=1) == 2
    assert len(memory) == 3 and memory.data.mask.shape == (3, 4)
    assert memory.data.mask[0].tolist() == [1, 1, 0, 0]  # the shorter sample is padded and masked
    assert memory.adv[0].tolist() == [0.5, 0.5, 0, 0]  # sequence advantages broadcast over the decisions
    memory.add(_rollout([6], width=2), torch.tensor([3.0]), step=2)
    assert memory.data.replay["text"] == ["s4", "s5", "s6"]  # the oldest went first
    assert memory.data.info == {}  # only what log_prob needs is kept
    step_adv = torch.tensor([[1.0, -2.0], [-1.0, -1.0]])  # per-decision advantages: the negative ones become 0
    fresh = SelfImitationMemory(size=8, collectives=Collectives())
    assert fresh.add(_rollout([7, 8], width=2), step_adv, step=0) == 1
    assert fresh.adv.tolist() == [[1.0, 0.0]]

    buf = io.BytesIO()
    torch.save(memory.state_dict(), buf)
    buf.seek(0)
    restored = SelfImitationMemory(size=3, collectives=Collectives())
    restored.load_state_dict(torch.load(buf, weights_only=True))  # the checkpoint's safe loader
    assert restored.data.replay["text"] == memory.data.replay["text"] and torch.equal(restored.adv, memory.adv)
    assert restored.added == memory.added == 4
    batch, adv = restored.sample(5, torch.Generator().manual_seed(0))
    assert batch.batch_size == 5 and adv.shape == (5, 4)


def _remembered_logp(trainer) -> float:
    mem = trainer.learner.memory
    with torch.no_grad():
        logp = trainer.learner.model(mem.data.to(trainer.learner.accelerator.device).replay).cpu()  # the memory is kept on the CPU
    return float((mem.adv * mem.data.mask * logp).sum() / (mem.adv * mem.data.mask).sum())


@pytest.mark.learning
def test_self_imitation_steps_raise_the_log_prob_of_remembered_good_samples(tmp_path, learning_seed, learned):
    """The self-imitation steps move the policy only through the memory: the remembered
    positive-advantage samples become more likely, the more so the more steps.

    Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): log-prob gain after 1 step 0.111 to
    0.158 (>= 0.02); gain of 4 steps beyond 1 0.22 to 0.295 (>= 0)."""
    gains = {}
    for steps in (1, 4):
        cfg = toy_config("sequence", seed=learning_seed, algo={"group_size": 8, "groups_per_step": 4, "self_imitation": {"size": 64, "steps": steps, "batch": 16}}, optim={"lr": 0.01})
        trainer = Trainer(cfg, tmp_path / f"steps{steps}")
        rollout = trainer.engine.worker.collect(0).rollout
        adv, keep = trainer.learner.advantages(rollout)
        assert trainer.learner.memory.add(rollout, adv, step=0) == int((adv > 0).sum()) > 0
        before = _remembered_logp(trainer)
        stats = trainer.learner.self_imitation(step=0)
        assert stats["loss/self_imitation"] > 0
        gains[steps] = _remembered_logp(trainer) - before
    learned(gains[1], 0.02, name="log-prob gain after 1 step")
    learned(gains[4] - gains[1], 0.0, name="gain of 4 steps beyond 1")


def test_a_run_with_self_imitation_logs_its_memory_and_resumes_exactly(tmp_path):
    algo = {"group_size": 4, "groups_per_step": 2, "ppo_epochs": 2, "self_imitation": {"size": 6, "batch": 4}}
    train(env_config(total_steps=6, checkpoint={"every": 3}, algo=algo), tmp_path / "full")
    train(env_config(total_steps=3, algo=algo), tmp_path / "part")
    Trainer(env_config(total_steps=6, algo=algo), tmp_path / "part", resume=True).train()

    def records(run):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(tmp_path / run)}

    a, b = records("full"), records("part")
    assert any(r.get("self_imitation/size", 0) > 0 for r in a.values())
    assert all(r["self_imitation/size"] <= 6 for r in a.values() if "self_imitation/size" in r)
    assert any("loss/self_imitation" in r for r in a.values())
    for step in (4, 5, 6):
        assert a[step] == b[step], step
    wa = load_file(str(tmp_path / "full/checkpoints/step_00000006/model.safetensors"))
    wb = load_file(str(tmp_path / "part/checkpoints/step_00000006/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_checkpoint_written_before_the_memory_had_its_own_name_resumes_with_its_memory(tmp_path):
    """Checkpoints of earlier runs keep the memory under ``replay_memory``."""
    from mmrl.train.checkpoint import CHECKPOINT_STATE

    algo = {"group_size": 4, "groups_per_step": 2, "self_imitation": {"size": 6, "batch": 4}}
    train(env_config(total_steps=3, algo=algo), tmp_path / "run")
    path = tmp_path / "run/checkpoints/step_00000003" / CHECKPOINT_STATE
    state = torch.load(path, weights_only=True)
    state["replay_memory"] = state.pop("self_imitation_memory")
    torch.save(state, path)
    trainer = Trainer(env_config(total_steps=4, algo=algo), tmp_path / "run", resume=True)
    assert len(trainer.learner.memory) > 0


def test_a_memory_left_out_of_checkpoints_is_refilled_on_resume(tmp_path):
    algo = {"group_size": 4, "groups_per_step": 2, "self_imitation": {"size": 6, "batch": 4, "in_checkpoint": False}}
    train(env_config(total_steps=3, algo=algo), tmp_path / "run")
    state = torch.load(tmp_path / "run/checkpoints/step_00000003/state.pt", weights_only=True)
    assert "self_imitation_memory" not in state
    kept = torch.load(tmp_path / "run/checkpoints/step_00000003/state.pt", weights_only=True)
    trainer = Trainer(env_config(total_steps=5, algo=algo), tmp_path / "run", resume=True)
    assert len(trainer.learner.memory) == 0 and kept["step"] == 3
    trainer.train()
    sizes = [r["self_imitation/size"] for r in read_metrics(tmp_path / "run") if r["step"] > 3 and "self_imitation/size" in r]
    assert sizes and sizes[-1] > 0


TINY_VLA = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8, 8], "max_instruction_tokens": 6}
ROBOT_POLICIES = {
    "flow_vla": {"type": "flow_vla", "backbone": TINY_VLA, "action_chunk": 2, "expert_layers": 1, "expert_heads": 2, "denoising": {"num_inference_steps": 3}},
    "token_vla": {"type": "token_vla", "backbone": TINY_VLA, "action_chunk": 2, "action_bins": 16},
    # one decision per trained denoising step: the chunk is imitated once per step decision
    "diffusion_policy": {
        "type": "diffusion_policy", "hidden_size": 32, "num_layers": 1, "action_chunk": 2,
        "denoising": {"num_train_timesteps": 20, "num_inference_steps": 4, "window_size": 2},
    },
}


def _robot_trainer(tmp_path, policy: str, seed: int = 0, **algo):
    from mmrl.config import from_dict
    from mmrl.train.run_config import TrainConfig
    from tests.conftest import point_reach_config

    data = point_reach_config(
        env={"num_envs": 8, "kwargs": {"max_steps": 8, "min_steps": 3}},
        algo={"group_size": 4, "groups_per_step": 2, "self_imitation": {"size": 64, "batch": 16, "loss": "sft", **algo}},
        optim={"lr": 0.003},
    )
    data["policy"] = ROBOT_POLICIES[policy]
    data["seed"] = seed
    return Trainer(from_dict(TrainConfig, data), tmp_path / policy)


@pytest.mark.parametrize("policy", sorted(ROBOT_POLICIES))
def test_imitation_batch_holds_the_executed_actions_of_every_replayed_decision(tmp_path, policy):
    trainer = _robot_trainer(tmp_path, policy)
    model = trainer.policy
    obs = trainer.sampler.observation(trainer.sampler.env.reset(seed=[0] * 8)[0], "cpu")
    sample = model.sample(obs, torch.Generator().manual_seed(0))
    flat = model.imitation_batch(sample.replay)
    decisions = sample.logp.shape[1]  # of this one call: 1 per chunk, or one per trained denoising step
    executed = sample.output.repeat_interleave(decisions, 0)  # what the env sampler clips to the bounds and steps
    torch.testing.assert_close(flat["actions"], executed)
    observation = "instruction_ids" if "instruction_ids" in flat else "state"
    assert flat["actions"].shape[0] == flat[observation].shape[0] == 8 * decisions
    assert torch.isfinite(model.sft_loss(flat))
    trainer.sampler.close()


@pytest.mark.learning
@pytest.mark.parametrize("policy", sorted(ROBOT_POLICIES))
def test_sft_self_imitation_fits_the_remembered_actions_and_ignores_zero_weights(tmp_path, policy, learning_seed, learned):
    """self_imitation.loss: sft is the policy's supervised loss on the remembered decisions with
    A+ > 0, A+-weighted; its steps lower that loss on the memory.

    Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): memory loss after / before 0.185 to
    0.651 (<= 0.8)."""
    trainer = _robot_trainer(tmp_path, policy, seed=learning_seed, steps=40)
    rollout = trainer.engine.worker.collect(0).rollout
    adv, keep = trainer.learner.advantages(rollout)
    rollout = rollout.with_(mask=trainer.learner.train_mask(rollout, keep))
    assert trainer.learner.memory.add(rollout, adv, step=0) > 0
    mem = trainer.learner.memory
    weight = mem.adv * mem.data.mask

    def memory_loss() -> float:
        torch.manual_seed(123)  # the same flow-matching noise every time
        with torch.no_grad():
            return float(trainer.learner.imitation.weighted_sft(trainer.learner.model, mem.data.replay, weight, weight.sum()))

    # a weighted mean: scaling every weight (up, or down to sums far below 1) changes nothing
    for scale in (2.0, 1e-3):
        torch.manual_seed(123)
        with torch.no_grad():
            scaled = float(trainer.learner.imitation.weighted_sft(trainer.learner.model, mem.data.replay, scale * weight, scale * weight.sum()))
        assert scaled == pytest.approx(memory_loss(), rel=1e-5), scale
    # the actions of decisions without a positive advantage (padding, the failures' and
    # zero-advantage decisions) do not count
    replay = dict(mem.data.replay)
    if policy == "token_vla":
        zero = (weight == 0).reshape(*weight.shape, 1)
        replay["action_tokens"] = torch.where(zero, torch.randint_like(replay["action_tokens"], 0, 16), replay["action_tokens"])
    else:  # a chunk is scrambled where none of its decisions has a weight
        latents = replay["chain"]["latents"]
        unweighted = (weight.view(*latents.shape[:2], -1) == 0).all(-1)
        zero = unweighted.reshape(*unweighted.shape, *[1] * (latents.dim() - 2))
        replay["chain"] = {**replay["chain"], "latents": torch.where(zero, torch.randn_like(latents), latents)}
    torch.manual_seed(123)
    with torch.no_grad():
        assert float(trainer.learner.imitation.weighted_sft(trainer.learner.model, replay, weight, weight.sum())) == pytest.approx(memory_loss(), rel=1e-5)
    assert (weight == 0).any() and (weight > 0).any()

    before = memory_loss()
    stats = trainer.learner.self_imitation(step=0)
    assert math.isfinite(stats["loss/self_imitation"])
    learned(memory_loss() / before, 0.8, higher=False, name="memory loss after / before")
    trainer.sampler.close()


def test_sft_self_imitation_loss_needs_a_policy_with_an_imitation_batch(tmp_path):
    from mmrl.errors import ConfigError

    cfg = env_config(algo={"self_imitation": {"size": 8, "loss": "sft"}})
    with pytest.raises(ConfigError, match="algo.self_imitation.loss"):
        Trainer(cfg, tmp_path / "run")


def test_best_worst_takes_advantages_over_the_whole_group_and_trains_only_its_extremes(tmp_path):
    """algo.advantage.best_worst (DanceGRPO): the advantages are the full group's, the k best
    and k worst samples of each group keep them, the others leave the update."""
    full = Trainer(toy_config("sequence"), tmp_path / "full")
    rollout = full.engine.worker.collect(0).rollout
    adv_all, keep_all = full.learner.advantages(rollout)
    picked = Trainer(toy_config("sequence", algo={"advantage": {"best_worst": 2}}), tmp_path / "picked")
    adv, keep = picked.learner.advantages(rollout)
    reward = picked.rewards.combine(rollout.rewards, rollout.group_id)
    group_id = rollout.group_id.cpu()  # advantages and keep are worked out on the CPU
    for g in group_id.unique():
        rows = (group_id == g).nonzero().flatten()
        kept = rows[keep[rows]]
        assert len(kept) == 4
        ranks = reward[rows].argsort(stable=True).argsort(stable=True)  # position of each sample in its group's order
        assert sorted(ranks[keep[rows]].tolist()) == [0, 1, 6, 7]
        torch.testing.assert_close(adv[kept], adv_all[kept])  # computed over all 8, not the 4 kept
        assert (adv[rows[~keep[rows]]] == 0).all()
    assert keep_all.all()
    assert (picked.learner.train_mask(rollout, keep).sum(1) > 0).sum() == keep.sum() == 16
