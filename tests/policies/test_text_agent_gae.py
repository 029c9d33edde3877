"""GAE for language agents: a value head on the LM's hidden states, and GAE over the agent's
tokens with γ between turns, turn rewards on each turn's last token, masked columns skipped."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mmrl.algo.value import TokenLayout, generalized_advantages  # noqa: E402
from mmrl.config import from_dict  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import Trainer, train  # noqa: E402


def test_token_gae_runs_over_the_valid_columns_with_gamma_between_turns():
    # two turns of K = 3 columns: turn 0 has 2 tokens, turn 1 has 1; the env's turn rewards sit
    # on each turn's last column (masked here), the outcome on the episode's last valid token
    index = torch.tensor([[0, 0, 0, 1, 1, 1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 0.25]], dtype=torch.float64)
    rewards[0, 3] += 1.0  # the outcome
    steps = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, 9.0, 0.3, 9.0, 9.0]], dtype=torch.float64)  # 9: masked, never read
    gamma, lam = 0.9, 0.8
    layout = TokenLayout(index, mask)
    r = layout.compact(layout.onto_last(rewards))
    g = gamma ** layout.compact(layout.onto_last(steps))
    adv, ret = generalized_advantages(r, layout.compact(values), layout.compact(mask), g, lam)
    adv, ret = layout.expand(adv), layout.expand(ret)
    # by hand over the three tokens: token 1 ends turn 0 (reward 0.5, then γ), token 2 ends the episode (1.25)
    v0, v1, v2 = 0.1, 0.2, 0.3
    d2 = 1.25 - v2
    d1 = 0.5 + gamma * v2 - v1
    d0 = 0.0 + 1.0 * v1 - v0
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + 1.0 * lam * a1
    expected = torch.tensor([[a0, a1, 0.0, a2, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(adv, expected, atol=1e-12)
    assert torch.allclose(ret, (expected + values) * mask, atol=1e-12)


def config(**changes) -> dict:
    cfg = {
        "name": "agent_gae", "seed": 0, "total_steps": 2, "device": "cpu",
        "env": {"type": "gym", "id": "mmrl/GuessNumber-v0", "num_envs": 4, "max_episode_steps": 3, "kwargs": {"consistent_reward": 0.2}},
        "sampler": {"type": "env"},
        "policy": {"type": "text_agent", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 4}, "max_context_tokens": 192},
        "rewards": [{"type": "success"}],
        "critic": {"type": "value_head"},
        "algo": {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.0}, "advantage": {"type": "gae", "gamma": 0.9, "lam": 0.95, "step_reward_weight": 1.0}},
        "eval": {"at_start": False, "at_end": False, "episodes": 4}, "log": {"progress": False, "tensorboard": False},
    }
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def test_the_value_features_are_the_lms_states_before_each_turn_token(tmp_path):
    t = Trainer(from_dict(TrainConfig, config()), tmp_path / "run")
    try:
        rollout = t.engine.collect(0, 0).rollout
        policy = t.policy
        features = policy.value_features(rollout.replay)
        k = 4
        assert features.shape == (*rollout.mask.shape, 32)
        b, turn = 0, 0
        replay = rollout.replay
        prompt = replay["prompt_ids"][b, turn][replay["prompt_mask"][b, turn].bool()]
        tokens = replay["completion_ids"][b, turn][replay["completion_mask"][b, turn].bool()]
        ids = torch.cat([prompt, tokens])[None]
        with torch.no_grad():
            states = policy.language_model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        n = tokens.numel()
        assert torch.allclose(features[b, :n].detach(), states[prompt.numel() - 1 : prompt.numel() - 1 + n], atol=1e-5)
        assert (features[b, n:k] == 0).all() or n == k  # no state for a turn's padding is read (masked)
        features.sum().backward()  # the head's gradient reaches the LM: the trunk is shared
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.language_model.parameters())
    finally:
        t.metrics.close()
        t.engine.close()
        t.sampler.close()


def test_gae_advantages_of_a_turn_are_per_token_and_zero_on_the_padding(tmp_path):
    t = Trainer(from_dict(TrainConfig, config()), tmp_path / "run")
    try:
        rollout = t.engine.collect(0, 0).rollout
        targets, keep = t.learner.advantage_stage(rollout, t.learner.model)
        assert targets.adv.shape == rollout.mask.shape
        assert (targets.adv[rollout.mask == 0] == 0).all() and (targets.returns[rollout.mask == 0] == 0).all()
        assert targets.adv[rollout.mask > 0].abs().sum() > 0 and keep.all()
    finally:
        t.metrics.close()
        t.engine.close()
        t.sampler.close()


def test_an_agent_with_a_critic_trains_and_its_value_loss_falls(tmp_path):
    import json

    out = train(from_dict(TrainConfig, config(total_steps=12, algo={"ppo_epochs": 2})), tmp_path / "run")
    assert out["step"] == 12
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = torch.tensor([r["loss/value"] for r in rows if "loss/value" in r])
    assert len(losses) == 12 and torch.isfinite(losses).all()
    # measured: 0.32 over the first three updates, 0.054 over the last three (seed 0)
    assert losses[-3:].mean() < 0.5 * losses[:3].mean()
