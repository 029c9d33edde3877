"""The language agent (`text_agent`) in a text env through the env sampler: the conversation is
kept as token ids and only grows (token in, token out), only the agent's tokens are decisions,
recomputed log-probs give ratio 1, limits end episodes as truncated, SFT on demonstrated
episodes and a policy-gradient step move the turns' log-probs the right way."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.registry import REWARDS  # noqa: E402
from mmrl.tasks.guess_number.demos import binary_search_episode  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import Trainer  # noqa: E402

TINY = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}


def config(**changes) -> dict:
    cfg = {
        "name": "agent", "seed": 0, "total_steps": 1, "device": "cpu",
        "env": {"type": "gym", "id": "mmrl/GuessNumber-v0", "num_envs": 4, "max_episode_steps": 3},
        "sampler": {"type": "env"},
        "policy": {"type": "text_agent", "tiny": TINY, "generation": {"max_new_tokens": 4}, "max_context_tokens": 192},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.0}},
        "eval": {"at_start": False, "at_end": False, "episodes": 4}, "log": {"progress": False, "tensorboard": False},
    }
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


@pytest.fixture
def trainer(tmp_path):
    made = []

    def make(**changes):
        t = Trainer(from_dict(TrainConfig, config(**changes)), tmp_path / f"run{len(made)}")
        made.append(t)
        return t

    yield make
    for t in made:
        t.metrics.close()
        t.engine.close()
        t.sampler.close()


def _turns(rollout, tokenizer, b):
    """(prompt ids, turn ids) of each turn of sample b that has tokens."""
    replay = rollout.replay
    out = []
    for t in range(replay["completion_ids"].shape[1]):
        turn = replay["completion_ids"][b, t][replay["completion_mask"][b, t].bool()].tolist()
        if turn:
            out.append((replay["prompt_ids"][b, t][replay["prompt_mask"][b, t].bool()].tolist(), turn))
    return out


def test_the_conversation_only_grows_and_only_the_agents_tokens_are_decisions(trainer):
    t = trainer()
    rollout = t.engine.collect(0, t.learner.version).rollout
    tok = t.policy.tokenizer
    assert rollout.old_logp.shape == rollout.mask.shape == (4, 3 * 4)  # 3 turns of at most 4 tokens
    for b in range(4):
        turns = _turns(rollout, tok, b)
        assert len(turns) == int(rollout.info["length"][b])  # one turn per env step
        for (prompt, turn), (later_prompt, _) in zip(turns, turns[1:]):
            # token in, token out: the next prompt starts with exactly this prompt and this turn's tokens
            assert later_prompt[: len(prompt) + len(turn)] == prompt + turn
            env_part = tok.decode(later_prompt[len(prompt) + len(turn):])
            assert env_part.startswith(("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>user\n")) and env_part.endswith("<|im_start|>assistant\n")
        # the decisions are the turns' tokens, nothing else
        assert int(rollout.mask[b].sum()) == sum(len(turn) for _, turn in turns)
    first = tok.decode(_turns(rollout, tok, 0)[0][0])
    assert first == "<|im_start|>user\nI am thinking of a number between 1 and 16. Guess it.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.numerics
def test_recomputed_turn_log_probs_equal_the_sampled_ones(trainer):
    """old_logp: recompute makes sample() score the replay itself; a second pass over the whole
    [B, T] replay gives the same numbers to the bit."""
    t = trainer(policy={"generation": {"max_new_tokens": 4, "old_logp": "recompute"}})
    rollout = t.engine.collect(0, t.learner.version).rollout
    assert not rollout.old.deferred
    with torch.no_grad():
        again = t.policy.log_prob(rollout.replay)
    valid = rollout.mask > 0
    assert valid.any()
    assert torch.equal(again[valid], rollout.old_logp[valid])


def test_a_full_context_ends_the_episode_truncated_without_crashing(trainer):
    # the first prompt is ~75 tokens: a 100-token context leaves room for one 8-token turn at most
    t = trainer(policy={"generation": {"max_new_tokens": 8}, "max_context_tokens": 100}, env={"max_episode_steps": 5})
    rollout = t.engine.collect(0, t.learner.version).rollout
    assert rollout.info["truncated"].all() and (rollout.info["success"] == 0).all()
    assert (rollout.info["length"] <= 2).all()
    steps = rollout.mask.view(4, -1, 8).sum(-1)
    assert (steps[:, 0] > 0).all() and (steps[:, 2:] == 0).all()


def test_a_positive_advantage_raises_the_turns_log_prob(trainer):
    t = trainer()
    rollout = t.engine.collect(0, t.learner.version).rollout
    policy = t.policy
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
    mask = rollout.mask
    before = (policy.log_prob(rollout.replay) * mask).sum().item()
    loss = -(policy.log_prob(rollout.replay) * mask).sum() / mask.sum()  # advantage +1 on every turn token
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = (policy.log_prob(rollout.replay) * mask).sum().item()
    assert after > before + 1.0


def test_sft_on_demonstrated_episodes_teaches_the_first_guess(trainer, tmp_path):
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"turns": binary_search_episode(seed)}) + "\n" for seed in range(16)))
    t = trainer(algo={"type": "sft"}, total_steps=60, policy={"max_context_tokens": 512}, data={"type": "conversations", "path": str(demos), "batch_size": 8}, optim={"lr": 3e-3})
    episodes = [binary_search_episode(seed) for seed in range(4)]
    with torch.no_grad():
        before = t.policy.sft_loss({"turns": episodes}).item()
    t.train()
    with torch.no_grad():
        after = t.policy.sft_loss({"turns": episodes}).item()
    assert after < 0.5 * before
    # greedy play: every demonstration opens with the midpoint
    first = t.policy.sample({"text": ["I am thinking of a number between 1 and 16. Guess it."], "carry": None, "active": torch.ones(1, dtype=torch.bool)}, deterministic=True)
    assert first.output == ["8"]


def test_the_conversation_source_and_the_agent_refuse_bad_input(trainer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": [["only an observation"]]}\n')
    with pytest.raises(ConfigError, match="data.path"):
        trainer(algo={"type": "sft"}, data={"type": "conversations", "path": str(bad)})
    with pytest.raises(ConfigError, match="max_context_tokens"):
        trainer(policy={"max_context_tokens": 4})
    with pytest.raises(ConfigError, match="policy.type"):
        trainer(env={"id": "mmrl/PointReach-v0", "max_episode_steps": 3})
    robot_policy = {**config(), "policy": {"type": "gaussian_mlp"}}
    with pytest.raises(ConfigError, match="reads 'obs_dim'"):  # a robot policy on a text env
        Trainer(from_dict(TrainConfig, robot_policy), tmp_path / "robot")


def test_the_agent_calls_tools_through_the_tool_env_and_its_calls_are_counted(trainer):
    """The tools env around a text task under the env sampler: turns with a call get the tool's
    result, each episode's calls and failed calls are logged (cost/tool_calls, cost/tool_errors)."""
    t = trainer(
        env={"type": "tools", "id": "mmrl/LongArithmetic-v0", "tools": ["calculator"], "max_calls": 2, "max_episode_steps": 3, "num_envs": 4},
        policy={"max_context_tokens": 640},
    )
    rollout = t.engine.collect(0, t.learner.version).rollout
    costs = rollout.info["costs"]
    assert set(costs) >= {"tool_calls", "tool_errors"}
    assert ((costs["tool_errors"] >= 0) & (costs["tool_errors"] <= costs["tool_calls"]) & (costs["tool_calls"] <= 2)).all()
    metrics = t.sampler.metrics(rollout)
    assert "cost/tool_calls" in metrics


@REWARDS.register("_test_turn_tokens", config=RewardConfig)
def _turn_tokens(rollout, cfg):
    """Test-only: the summed sampling log-prob of the agent's tokens in the episode (differs
    within a group from the first step; the game's success is 0 for a random LM)."""
    return (rollout.old_logp * rollout.mask).sum(1).double()


def _run(tmp_path, name: str, **changes):
    data = config(**{"rewards": [{"type": "_test_turn_tokens"}], "total_steps": 2, "checkpoint": {"every": 1, "keep": 3}, **changes})
    return from_dict(TrainConfig, data), tmp_path / name


def test_an_agent_run_resumes_exactly_and_trains_with_a_rollout_worker(tmp_path):
    from safetensors.torch import load_file

    from mmrl.train.trainer import train

    cfg, straight = _run(tmp_path, "straight")
    train(cfg, straight)
    cfg1, split = _run(tmp_path, "split", total_steps=1)
    train(cfg1, split)
    train(cfg, split, resume=True)
    a = load_file(str(straight / "checkpoints/step_00000002/model.safetensors"))
    b = load_file(str(split / "checkpoints/step_00000002/model.safetensors"))
    first = load_file(str(split / "checkpoints/step_00000001/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], first[k]) for k in a)
    cfg_w, worker = _run(tmp_path, "worker", rollout={"workers": 1, "mode": "async"})
    assert train(cfg_w, worker)["step"] == 2


def test_anchor_state_keys_are_recorded_per_decision_and_train_gigpo(trainer):
    """algo.advantage.step_groups: state — the env sampler keys each decision's observation
    (equal texts, equal keys) and the step-level advantage compares decisions by (group, key),
    plus the episode-level advantage (GiGPO)."""
    t = trainer(algo={"advantage": {"type": "grpo", "level": "step", "step_groups": "state", "episode_weight": 1.0}}, rewards=[{"type": "_test_turn_tokens"}])
    rollout = t.engine.collect(0, t.learner.version).rollout
    keys = rollout.info["state_keys"]
    assert keys.shape == rollout.mask.shape
    assert (keys[:, 0] == keys[0, 0]).all()  # every episode starts from the same first message
    turn = rollout.mask.shape[1] // 3
    first_turns = keys[:, :turn]
    assert (first_turns == first_turns[:, :1]).all()  # a decision's key on each of its columns
    adv, keep = t.learner.advantages(rollout)
    assert adv.shape == rollout.mask.shape and torch.isfinite(adv).all() and adv.abs().sum() > 0


# ---------------------------------------------------------------- the key/value cache across turns


def _agent(seed: int = 0, **fields):
    from mmrl.core.weights import build_policy
    from mmrl.policies.text_agent.config import TextAgentConfig

    data = {"type": "text_agent", "tiny": TINY, "generation": {"max_new_tokens": 6}, "max_context_tokens": 256, **fields}
    torch.manual_seed(seed)
    return build_policy(from_dict(TextAgentConfig, data, "policy"), {"action_space": "text"})


def _observation(row: int, turn: int) -> str:
    """Observations of different lengths per row and turn (pads inside the batched cache)."""
    return f"turn {turn}: " + "xyz"[row % 3] * ((3 * row + 5 * turn) % 11)


def _play(policy, turns: int, n: int = 4, seed: int | None = 0, deterministic: bool = False, active=None, prefilled=None):
    """policy.sample for ``turns`` turns of n episodes, as the env sampler drives it; returns
    each call's (inputs' carry, Sample, which rows' carry held a cache when it returned).
    ``active(turn)``: the rows still running."""
    if prefilled is not None:  # count the tokens fed to the model in passes of more than one token
        forward = policy.forward_logits

        def counting(ids, mask, *args, **kwargs):
            if ids.shape[1] > 1:
                prefilled.append(int(ids.shape[0] * ids.shape[1]))
            return forward(ids, mask, *args, **kwargs)

        policy.forward_logits = counting
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    carry, calls = None, []
    for turn in range(turns):
        alive = torch.ones(n, dtype=torch.bool) if active is None else active(turn)
        sample = policy.sample({"text": [_observation(i, turn) for i in range(n)], "carry": carry, "active": alive}, gen, deterministic=deterministic)
        calls.append((carry, sample, ["kv" in state for state in sample.carry]))
        carry = sample.carry
    if prefilled is not None:
        del policy.forward_logits
    return calls


def _same_turns(a, b) -> None:
    for (_, x, _), (_, y, _) in zip(a, b, strict=True):
        assert x.output == y.output
        assert all(torch.equal(x.replay[k], y.replay[k]) for k in x.replay)  # the replay does not change
        assert [c["ids"] for c in x.carry] == [c["ids"] for c in y.carry]
        assert torch.equal(x.mask, y.mask) and torch.equal(x.end, y.end)
        assert torch.allclose(x.logp, y.logp, atol=1e-5, rtol=0)  # the backend's numbers: float rounding only


@pytest.mark.numerics
@pytest.mark.parametrize("model_seed", [0, 1, 2])
def test_the_turn_cache_samples_the_tokens_of_re_encoding(model_seed):
    """turn_cache on and off, same seeds: the same turns (greedy, and sampled for three
    generator seeds checked), the same replay; only the new tokens are prefilled."""
    policy = _agent(model_seed)
    assert policy.caches_turns()
    for deterministic, seeds in ((True, [None]), (False, [0, 1, 2])):
        for seed in seeds:
            runs, prefilled = {}, {}
            for on in (True, False):
                policy.config.turn_cache = on
                prefilled[on] = []
                runs[on] = _play(policy, turns=6, seed=seed, deterministic=deterministic, prefilled=prefilled[on])
            _same_turns(runs[True], runs[False])
            assert sum(prefilled[True]) < 0.5 * sum(prefilled[False])
    policy.config.turn_cache = True


def test_the_carried_cache_is_the_states_of_all_but_the_last_token_and_goes_when_the_episode_ends():
    policy = _agent(0)
    # row 0 ends after its 2nd turn, row 2 after its 3rd
    alive = lambda turn: torch.tensor([turn < 2, True, turn < 3, True])  # noqa: E731
    calls = _play(policy, turns=5, active=alive)
    for turn, (given, _, had) in enumerate(calls):
        if given is not None:  # handed over once: the previous call's carry let go of its states
            assert all("kv" not in state for state in given)
        assert had == alive(turn).tolist()  # an ended episode carries no cache
    _, last, _ = calls[-1]
    for i in (1, 3):
        ids = last.carry[i]["ids"]
        states = last.carry[i]["kv"]
        assert len(states) == policy.language_model.config.num_hidden_layers
        cache = policy.new_cache()
        with torch.no_grad():
            policy.forward_logits(torch.tensor([ids[:-1]]), torch.ones(1, len(ids) - 1, dtype=torch.long), cache=cache)
        for (keys, values), layer in zip(states, cache.layers):
            assert keys.shape == layer.keys[0].shape  # [H, len(ids) - 1, D]: the last token's states are not computed yet
            assert torch.allclose(keys, layer.keys[0], atol=1e-5) and torch.allclose(values, layer.values[0], atol=1e-5)


def test_with_the_turn_cache_a_full_context_still_ends_the_episode_truncated():
    policy = _agent(0, max_context_tokens=70)
    runs = {}
    for on in (True, False):
        policy.config.turn_cache = on
        runs[on] = _play(policy, turns=6)
    _same_turns(runs[True], runs[False])
    ends = torch.stack([sample.end for _, sample, _ in runs[True]])
    assert ends.any(0).all()  # every episode's context fills up within 6 turns
    for _, sample, had in runs[True]:
        for i in sample.end.nonzero().flatten().tolist():
            assert not had[i] and sample.mask[i].sum() == 0


def test_the_env_sampler_collects_the_same_episodes_with_and_without_the_turn_cache(trainer):
    t = trainer(env={"max_episode_steps": 5}, policy={"generation": {"max_new_tokens": 6}, "max_context_tokens": 140})
    rollouts = {}
    for on in (True, False):
        t.policy.config.turn_cache = on
        rollouts[on] = t.engine.collect(0, t.learner.version).rollout
    a, b = rollouts[True], rollouts[False]
    assert all(torch.equal(a.replay[k], b.replay[k]) for k in a.replay)
    assert torch.equal(a.info["truncated"], b.info["truncated"]) and a.info["truncated"].any()  # some contexts fill up
    assert torch.allclose(a.old_logp, b.old_logp, atol=1e-5, rtol=0)
    with torch.no_grad():  # the trainer's recompute is the same teacher-forced pass
        assert torch.equal(t.policy.log_prob(a.replay), t.policy.log_prob(b.replay))


class _NoCacheBackend:
    """A custom backend whose generate takes no cache: the agent re-encodes."""

    def __init__(self, policy):
        from mmrl.policies.text_lm.generation import BuiltinBackend

        self.inner = BuiltinBackend(policy)

    def generate(self, prompt_ids, options, generator, deterministic):
        return self.inner.generate(prompt_ids, options, generator, deterministic)


def test_a_backend_that_takes_no_cache_re_encodes():
    policy = _agent(0, generation={"max_new_tokens": 6, "backend": f"{__name__}:_NoCacheBackend"})
    assert policy.config.turn_cache and not policy.caches_turns()
    calls = _play(policy, turns=3)
    assert not any(any(had) for _, _, had in calls)
    reference = _agent(0)
    reference.config.turn_cache = False
    _same_turns(calls, _play(reference, turns=3))


@pytest.mark.slow
@pytest.mark.numerics
def test_an_agent_trained_by_two_processes_matches_one_process(tmp_path):
    """N processes = 1: from a short SFT (so that some episodes succeed and groups differ), two
    GRPO updates of guess-the-number by one process and by two (torchrun, 2 groups each) end
    with the same weights."""
    import yaml
    from safetensors.torch import load_file

    from mmrl.train.trainer import train
    from tests.train.test_distributed_and_cli_runs import _one_and_two_processes

    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"turns": binary_search_episode(seed, high=8, max_turns=4)}) + "\n" for seed in range(16)))
    env = {"type": "gym", "id": "mmrl/GuessNumber-v0", "num_envs": 8, "max_episode_steps": 4, "kwargs": {"high": 8}}
    sft = config(env=env, algo={"type": "sft"}, total_steps=30, policy={"max_context_tokens": 320}, data={"type": "conversations", "path": str(demos), "batch_size": 8}, optim={"lr": 3e-3})
    train(from_dict(TrainConfig, sft), tmp_path / "sft")
    rl = config(env=env, total_steps=2, policy={"max_context_tokens": 320, "pretrained": str(tmp_path / "sft")}, algo={"group_size": 4, "groups_per_step": 4, "kl": {"coef": 0.0}, "num_minibatches": 2})
    rl["checkpoint"] = {"every": 2}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(rl))
    one, two = _one_and_two_processes(tmp_path, path, 29563)
    assert any(r.get("adv/nonzero_fraction", 0) > 0 for r in one)  # the update had something to learn from
    a = load_file(str(tmp_path / "one/checkpoints/step_00000002/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step_00000002/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)  # all-reduced float32 sums in another order


def test_guess_number_rewards_guesses_consistent_with_the_feedback_when_asked():
    import gymnasium

    import mmrl.envs  # noqa: F401

    env = gymnasium.make("mmrl/GuessNumber-v0", consistent_reward=0.1)
    env.reset(seed=3)
    secret = env.unwrapped.secret
    assert secret == 13
    rewards = [env.step(guess)[1] for guess in ("8", "4", "12", "10", "x")]  # 4 and 10 ignore the feedback; x is no guess
    assert rewards == [0.1, 0.0, 0.1, 0.0, 0.0]
    assert env.step("13")[1:3] == (1.1, True)
    plain = gymnasium.make("mmrl/GuessNumber-v0")
    plain.reset(seed=3)
    assert [plain.step(guess)[1] for guess in ("8", "13")] == [0.0, 1.0]


def test_evaluation_saves_the_agents_turns_and_sft_reads_the_solved_ones(trainer, tmp_path):
    """`mmrl eval --save-episodes` on a language agent writes each episode's turns as the
    conversations source reads them; `successful_only` keeps the solved ones."""
    from mmrl.cli import main

    t = trainer(total_steps=1)
    t.train()  # a checkpoint to evaluate
    out = tmp_path / "episodes"
    assert main(["eval", str(t.run_dir), "--episodes", "6", "--save-episodes", str(out)]) == 0
    lines = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    info = json.loads((out / "info.json").read_text())
    assert len(lines) == info["episodes"] == 6 and info["mmrl"]["env"] == "mmrl/GuessNumber-v0"
    for episode in lines:
        assert 1 <= episode["length"] == len(episode["turns"]) == len(episode["rewards"]) <= 3
        assert episode["turns"][0][0].startswith("I am thinking of a number between 1 and 16")
        assert episode["return"] == sum(episode["rewards"]) and isinstance(episode["success"], bool)
        assert episode["truncated"] == (not episode["success"] and episode["length"] == 3)
        for turn, (observation, reply) in enumerate(episode["turns"][1:], 1):  # each observation answers the previous reply
            guess = episode["turns"][turn - 1][1].strip()
            assert observation in ("Higher.", "Lower.") or not guess.isdigit()
    # the saved file is SFT data; successful_only keeps the solved episodes
    lines[0]["success"], lines[1]["success"] = True, False
    (out / "edited.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines[:2]))
    from mmrl.data.sources import Conversations, ConversationsConfig

    solved = Conversations(ConversationsConfig(path=str(out / "edited.jsonl"), successful_only=True), t.policy, 0, 1, 0)
    assert solved.samples["turns"] == [[tuple(turn) for turn in lines[0]["turns"]]]
    everything = Conversations(ConversationsConfig(path=str(out / "edited.jsonl")), t.policy, 0, 1, 0)
    assert len(everything.samples["turns"]) == 2
    (out / "unmarked.jsonl").write_text(json.dumps({"turns": lines[0]["turns"]}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.successful_only: .*no boolean \"success\""):
        Conversations(ConversationsConfig(path=str(out / "unmarked.jsonl"), successful_only=True), t.policy, 0, 1, 0)


def test_step_level_advantages_give_each_turn_one_value_that_sees_the_outcome(trainer):
    t = trainer(algo={"advantage": {"type": "grpo", "level": "step"}, "group_size": 4, "groups_per_step": 2}, env={"num_envs": 8})
    rollout = t.engine.collect(0, t.learner.version).rollout
    index, mask = rollout.info["decision_index"], rollout.mask
    k = 4  # policy.generation.max_new_tokens: one column per token of a turn
    assert torch.equal(index[0], torch.arange(mask.shape[1] // k).repeat_interleave(k))
    # the first episode of each group is the one that succeeded (the learner reads the stored reward)
    won = torch.zeros(rollout.batch_size, dtype=torch.bool)
    for g in rollout.group_id.unique():
        won[(rollout.group_id == g).nonzero()[0]] = True
    targets, _ = t.learner.advantage_stage(rollout.with_(reward=won.float()), t.learner.model)
    adv = targets.adv
    for b in range(rollout.batch_size):
        for turn in range(mask.shape[1] // k):
            cols = slice(turn * k, (turn + 1) * k)
            valid = mask[b, cols] > 0
            if valid.any():  # one advantage per turn, on its tokens only
                assert torch.unique(adv[b, cols][valid]).numel() == 1 and (adv[b, cols][~valid] == 0).all()
    # the first turn's advantage follows the episode's outcome: within a group, the winner's first
    # turn is above the others' (returns-to-go include the final reward)
    for g in rollout.group_id.unique():
        rows = rollout.group_id == g
        assert adv[rows & won, 0].min() > adv[rows & ~won, 0].max()
