"""A language agent's saved episodes: each turn as the conversations source reads it, the env's
answer to the last turn, and in a tool env each turn's tool calls and their results."""

from __future__ import annotations

import json

import torch

from mmrl.config import from_dict
from mmrl.core.sampler import sampler_context
from mmrl.core.weights import build_policy
from mmrl.data.sources import Conversations, ConversationsConfig
from mmrl.samplers.env import EnvSampler
from mmrl.samplers.recording import write_text_episodes
from mmrl.train.run_config import TrainConfig

CALL = '{"tool": "calculator", "arguments": {"expression": "2 + 3"}}'
RUN = {
    "env": {"type": "tools", "id": "mmrl/LongArithmetic-v0", "num_envs": 2, "tools": ["calculator"], "instructions": False, "kwargs": {"digits": 4}},
    "sampler": {"type": "env"},
    "policy": {"type": "text_agent", "tiny": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}, "generation": {"max_new_tokens": 4}, "max_context_tokens": 192},
    "rewards": [{"type": "success"}],
    "algo": {"group_size": 2, "groups_per_step": 1},
}


def test_saved_tool_episodes_keep_the_last_answer_and_each_turns_call_and_result_and_sft_reads_them(tmp_path):
    cfg = from_dict(TrainConfig, RUN)
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, sampler.policy_spec())
    turn = [0]

    def scripted(sample, on=None, bounds=None):  # the policy's turns replaced by a call, then an answer
        turn[0] += 1
        return [tuple(CALL if turn[0] == 1 else "Answer: 5" for _ in sample.output)]

    sampler.actions = scripted
    try:
        episodes = sampler.evaluate(policy, 2, seed=0, keep_episodes=True)["kept_episodes"]
    finally:
        sampler.close()
    for episode in map(lambda e: e.as_json(), episodes):
        (first, call), (result, answer) = episode["turns"]
        assert first.startswith("Compute ") and (call, result, answer) == (CALL, "Result of calculator:\n5", "Answer: 5")
        assert episode["final_observation"] == "Wrong."  # the env's answer to the last turn
        assert episode["tools"] == [{"tool_call": [{"name": "calculator", "arguments": {"expression": "2 + 3"}}], "tool_result": "Result of calculator:\n5"}, {}]
    out = write_text_episodes(tmp_path / "saved", episodes)
    saved = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    sft = Conversations(ConversationsConfig(path=str(out / "episodes.jsonl")), policy, 0, 1, 0)  # the SFT data source reads the file as it is
    assert sft.samples["turns"] == [[tuple(t) for t in e["turns"]] for e in saved]


def test_a_plain_text_env_saves_no_tool_fields():
    cfg = from_dict(TrainConfig, {**RUN, "env": {"type": "gym", "id": "mmrl/GuessNumber-v0", "num_envs": 2, "max_episode_steps": 2}})
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    policy = build_policy(cfg.policy, sampler.policy_spec())
    sampler.actions = lambda sample, on=None, bounds=None: [tuple('{"tool": "x", "arguments": {}}' for _ in sample.output)]  # looks like a call, is not one here
    try:
        episodes = sampler.evaluate(policy, 2, seed=0, keep_episodes=True)["kept_episodes"]
    finally:
        sampler.close()
    for episode in episodes:
        saved = episode.as_json()
        assert "tools" not in saved and saved["length"] == 2 and saved["final_observation"].startswith("Say one number")
