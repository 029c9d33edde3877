"""The vision-language agent (`vlm_agent`) in `mmrl/MiniGridText-v0` through the env sampler: the
conversation is token ids and images that only grow, only the agent's tokens are decisions,
recomputed log-probs (with every image of the history) give ratio 1, the key/value cache across
turns holds the earlier images, a policy-gradient step moves the turns' log-probs the right way,
a GRPO run resumes exactly; and the env: text actions, the view, determinism, the goal."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

import gymnasium  # noqa: E402

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.registry import REWARDS  # noqa: E402
from mmrl.train.run_config import TrainConfig  # noqa: E402
from mmrl.train.trainer import Trainer  # noqa: E402

TINY = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
K = 4  # generation.max_new_tokens of config()
IMAGE_TOKENS = 16  # the tiny vision tower's (32 / 8)^2 patches


def config(**changes) -> dict:
    cfg = {
        "name": "vlm_agent", "seed": 0, "total_steps": 1, "device": "cpu",
        "env": {"type": "gym", "id": "mmrl/MiniGridText-v0", "num_envs": 4, "max_episode_steps": 3},
        "sampler": {"type": "env"},
        "policy": {"type": "vlm_agent", "tiny": TINY, "generation": {"max_new_tokens": K}, "max_context_tokens": 512},
        "rewards": [{"type": "success"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.0}},
        "eval": {"at_start": False, "at_end": False, "episodes": 4}, "log": {"progress": False, "tensorboard": False},
    }
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


@pytest.fixture
def trainer(tmp_path):
    pytest.importorskip("minigrid")
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


def _agent(seed: int = 0, **fields):
    from mmrl.core.weights import build_policy
    from mmrl.policies.vlm_agent import VLMAgentConfig

    data = {"type": "vlm_agent", "tiny": TINY, "generation": {"max_new_tokens": 6}, "max_context_tokens": 512, **fields}
    torch.manual_seed(seed)
    return build_policy(from_dict(VLMAgentConfig, data, "policy"), {"action_space": "text"})


def _turns(rollout, b):
    """(turn index, prompt ids, turn ids) of each turn of sample b that has tokens."""
    replay = rollout.replay
    out = []
    for t in range(replay["completion_ids"].shape[1]):
        turn = replay["completion_ids"][b, t][replay["completion_mask"][b, t].bool()].tolist()
        if turn:
            out.append((t, replay["prompt_ids"][b, t][replay["prompt_mask"][b, t].bool()].tolist(), turn))
    return out


# ---------------------------------------------------------------- the env


def test_the_env_takes_action_words_shows_the_view_is_deterministic_and_reaches_the_goal():
    pytest.importorskip("minigrid")
    import mmrl.envs  # noqa: F401

    env = gymnasium.make("mmrl/MiniGridText-v0")
    obs, info = env.reset(seed=5)
    assert obs in env.observation_space and obs["image"].shape == (56, 56, 3) and obs["image"].dtype == np.uint8
    assert obs["text"] == "Mission: get to the green goal square. Say one of: left, right, forward, pickup, drop, toggle, done." and not info["success"]
    grid = env.unwrapped.grid_env
    # anything but an action word: a no-op that reminds of the words (the level does not step)
    obs2, reward, term, trunc, info = env.step("go north")
    assert obs2["text"].startswith("Not an action. Say one of: left, right,") and (reward, term, trunc, info["success"]) == (0.0, False, False, False)
    assert np.array_equal(obs2["image"], obs["image"]) and grid.step_count == 0
    # whitespace, case and a final period are tolerated; the feedback names what happened
    assert env.step("  Left.\n")[0]["text"] == "You turned left. Mission: get to the green goal square." and grid.step_count == 1
    assert env.step("right")[0]["text"].startswith("You turned right.")
    assert [env.step("forward")[0]["text"].split(".")[0] for _ in range(3)] == ["You moved forward", "You moved forward", "You cannot move there"]  # the wall
    assert env.step("pickup")[0]["text"].startswith("There is nothing to pick up.")
    assert env.step("toggle")[0]["text"].startswith("You toggled the grey wall.")
    # the shortest walk reaches the goal: MiniGrid's reward, success, termination
    for level in ("MiniGrid-Empty-5x5-v0", "MiniGrid-Empty-Random-6x6-v0"):
        walk = gymnasium.make("mmrl/MiniGridText-v0", level=level)
        for seed in range(3):
            walk.reset(seed=seed)
            words = walk.unwrapped.shortest_actions()
            for i, word in enumerate(words):
                obs, reward, term, trunc, info = walk.step(word)
                assert term == info["success"] == (i == len(words) - 1)
            max_steps = walk.unwrapped.grid_env.max_steps
            assert reward == pytest.approx(1 - 0.9 * len(words) / max_steps) and obs["text"].endswith("You reached the goal! Mission: get to the green goal square.")
    # deterministic by reset seed (the random room places the agent by seed)
    def episode(seed):
        e = gymnasium.make("mmrl/MiniGridText-v0", level="MiniGrid-Empty-Random-6x6-v0", tile_size=4)
        first, _ = e.reset(seed=seed)
        steps = [first] + [e.step(word)[0] for word in ("forward", "left", "forward", "jump", "right")]
        return [s["text"] for s in steps], np.stack([s["image"] for s in steps])

    (texts, images), (texts2, images2) = episode(7), episode(7)
    assert texts == texts2 and np.array_equal(images, images2) and images.shape == (6, 28, 28, 3)
    assert any(not np.array_equal(episode(s)[1], images) for s in (8, 9, 10))


# ---------------------------------------------------------------- the conversation


def test_the_conversation_only_grows_carries_its_images_and_only_the_agents_tokens_are_decisions(trainer):
    import mmrl.envs  # noqa: F401

    t = trainer()
    rollout = t.engine.collect(0, t.learner.version).rollout
    policy, tok = t.policy, t.policy.tokenizer
    replay = rollout.replay
    slots = policy.image_slots()
    assert slots == (512 - K) // IMAGE_TOKENS
    assert replay["pixel_values"].shape == (4, 3, slots, 3, 32, 32) and replay["image_count"].shape == (4, 3)
    image_id = tok.convert_tokens_to_ids("<image>")
    placeholders = "<image>" * IMAGE_TOKENS
    # the loss mask is 1 exactly on the agent's tokens
    assert torch.equal(rollout.mask.view(4, 3, K), replay["completion_mask"].float())
    for b in range(4):
        turns = _turns(rollout, b)
        assert len(turns) == int(rollout.info["length"][b])  # one turn per env step
        for index, prompt, _ in turns:  # each turn sees every image so far, each expanded to its tokens
            assert int(replay["image_count"][b, index]) == index + 1 and prompt.count(image_id) == IMAGE_TOKENS * (index + 1)
        for (t0, prompt, turn), (t1, later, _) in zip(turns, turns[1:]):
            # token in, token out: the next prompt starts with exactly this prompt and this turn's tokens
            assert later[: len(prompt) + len(turn)] == prompt + turn
            env_part = tok.decode(later[len(prompt) + len(turn):])
            assert env_part.startswith(("\n<|im_start|>user\n" + placeholders, "<|im_end|>\n<|im_start|>user\n" + placeholders))
            assert env_part.endswith("<|im_start|>assistant\n")
            # the earlier images are carried as they were
            assert torch.equal(replay["pixel_values"][b, t1, : t0 + 1], replay["pixel_values"][b, t0, : t0 + 1])
        last = turns[-1][0]
        assert (replay["pixel_values"][b, last, last + 1:] == 0).all()
    # the first turn's prompt is the processor's encoding of the env's first observation
    first, _ = gymnasium.make("mmrl/MiniGridText-v0").reset(seed=0)  # the empty room starts alike for every seed
    ids, entries = policy.encode_observations([(first["text"], (first["image"],), None)])[0]
    assert _turns(rollout, 0)[0][1] == ids and torch.equal(replay["pixel_values"][0, 0, 0], entries[0]["pixel_values"])
    assert tok.decode(ids) == f"<|im_start|>user\n{placeholders}{first['text']}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.numerics
def test_recomputed_turn_log_probs_with_all_the_images_give_ratio_one(trainer):
    """old_logp recompute: a second pass over the [B, T] replay gives the sampled numbers to the
    bit; deferred: the trainer's two passes agree to the bit (its first ratio is exactly 1) and
    the decoding loop's provisional numbers are within the contract's tolerance."""
    from mmrl.policies.vlm_agent.model import CONTRACT

    t = trainer(policy={"generation": {"max_new_tokens": K, "old_logp": "recompute"}})
    rollout = t.engine.collect(0, t.learner.version).rollout
    assert not rollout.old.deferred and int(rollout.replay["image_count"].max()) == 3
    valid = rollout.mask > 0
    with torch.no_grad():
        again = t.policy.log_prob(rollout.replay)
    assert valid.any() and torch.equal(again[valid], rollout.old_logp[valid])
    d = trainer()
    rollout = d.engine.collect(0, d.learner.version).rollout
    assert rollout.old.deferred
    valid = rollout.mask > 0
    with torch.no_grad():
        exact = d.learner.model(rollout.replay)
    first_step = d.learner.model(rollout.replay)  # as the update's first forward runs it
    assert first_step.requires_grad and torch.equal(exact[valid], first_step.detach()[valid])
    assert (exact - rollout.old_logp)[valid].abs().max() <= CONTRACT["ratio_atol"]
    # the images matter: without them the same tokens score otherwise
    blind = {**rollout.replay, "pixel_values": torch.zeros_like(rollout.replay["pixel_values"])}
    with torch.no_grad():
        assert (d.policy.log_prob(blind) - exact)[valid].abs().max() > 1e-3


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
    assert any(p.grad is not None and bool((p.grad != 0).any()) for p in policy.vision_tower.parameters())  # through the images
    optimizer.step()
    with torch.no_grad():
        after = (policy.log_prob(rollout.replay) * mask).sum().item()
    assert after > before + 1.0


# ---------------------------------------------------------------- the key/value cache across turns


def _play(policy, turns: int, n: int = 3, seed: int | None = 0, deterministic: bool = False, passes=None):
    """policy.sample for ``turns`` turns of n episodes with random images (texts of different
    lengths per row); ``passes`` collects (tokens, images) of each prefill pass."""
    if passes is not None:
        forward = policy.forward_logits

        def counting(ids, mask, *args, image_count=None, **kwargs):
            if ids.shape[1] > 1:
                passes.append((int(ids.shape[0] * ids.shape[1]), 0 if image_count is None else int(image_count.sum())))
            return forward(ids, mask, *args, image_count=image_count, **kwargs)

        policy.forward_logits = counting
    rng = np.random.RandomState(0)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    carry, calls = None, []
    for turn in range(turns):
        images = torch.from_numpy(rng.randint(0, 256, (n, 40, 40, 3), dtype=np.uint8))
        texts = [f"turn {turn}: " + "xyz"[i % 3] * ((3 * i + 5 * turn) % 11) for i in range(n)]
        sample = policy.sample({"text": texts, "image": images, "carry": carry, "active": torch.ones(n, dtype=torch.bool)}, gen, deterministic=deterministic)
        calls.append(sample)
        carry = sample.carry
    if passes is not None:
        del policy.forward_logits
    return calls


@pytest.mark.numerics
def test_the_turn_cache_holds_the_earlier_images_and_samples_the_tokens_of_re_encoding():
    """turn_cache on and off: the same turns (greedy, and sampled), the same replay; with the
    cache a turn prefills only its new tokens and hands the model only the new image."""
    policy = _agent(0)
    assert policy.caches_turns()
    for deterministic, seed in ((True, None), (False, 0), (False, 1)):
        runs, passes = {}, {}
        for on in (True, False):
            policy.config.turn_cache = on
            passes[on] = []
            runs[on] = _play(policy, turns=4, seed=seed, deterministic=deterministic, passes=passes[on])
        for x, y in zip(runs[True], runs[False], strict=True):
            assert x.output == y.output
            assert all(torch.equal(x.replay[k], y.replay[k]) for k in x.replay)
            assert [c["ids"] for c in x.carry] == [c["ids"] for c in y.carry] and [len(c["images"]) for c in x.carry] == [len(c["images"]) for c in y.carry]
            assert torch.allclose(x.logp, y.logp, atol=1e-5, rtol=0)
        assert [images for _, images in passes[True]] == [3, 3, 3, 3]  # one new image per row and turn
        assert [images for _, images in passes[False]] == [3, 6, 9, 12]  # every image, every turn
        assert sum(tokens for tokens, _ in passes[True]) < 0.5 * sum(tokens for tokens, _ in passes[False])
    policy.config.turn_cache = True


def test_max_images_ends_the_episode_truncated():
    policy = _agent(0, max_images=2)
    assert policy.image_slots() == 2
    calls = _play(policy, turns=3)
    assert [bool(s.end.any()) for s in calls] == [False, False, True] and calls[2].end.all()
    assert calls[1].replay["pixel_values"].shape[2] == 2 and (calls[2].mask == 0).all()


def test_sft_on_episodes_with_images_learns_the_actions():
    pytest.importorskip("minigrid")
    import mmrl.envs  # noqa: F401

    env = gymnasium.make("mmrl/MiniGridText-v0", level="MiniGrid-Empty-Random-6x6-v0")
    episodes = []
    for seed in range(2):
        obs, _ = env.reset(seed=seed)
        turns = []
        for word in env.unwrapped.shortest_actions():
            turns.append(({"text": obs["text"], "image": obs["image"]}, word))
            obs = env.step(word)[0]
        episodes.append(turns)
    policy = _agent(0, max_context_tokens=1024)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    batch = {"turns": episodes}
    with torch.no_grad():
        before = policy.sft_loss(batch).item()
    for _ in range(12):
        optimizer.zero_grad()
        policy.sft_loss(batch).backward()
        optimizer.step()
    with torch.no_grad():
        assert policy.sft_loss(batch).item() < 0.5 * before


# ---------------------------------------------------------------- a GRPO run


@REWARDS.register("_test_vlm_turn_tokens", config=RewardConfig)
def _turn_tokens(rollout, cfg):
    """Test-only: the summed sampling log-prob of the agent's tokens in the episode (differs
    within a group from the first step; success is 0 for a random model)."""
    return (rollout.old_logp * rollout.mask).sum(1).double()


def test_two_grpo_updates_on_minigrid_train_and_resume_exactly(tmp_path):
    pytest.importorskip("minigrid")
    from safetensors.torch import load_file

    from mmrl.train.trainer import train

    def run(name, **changes):
        data = config(**{"rewards": [{"type": "_test_vlm_turn_tokens"}], "total_steps": 2, "checkpoint": {"every": 1, "keep": 3}, **changes})
        return from_dict(TrainConfig, data), tmp_path / name

    cfg, straight = run("straight")
    assert train(cfg, straight)["step"] == 2
    cfg1, split = run("split", total_steps=1)
    train(cfg1, split)
    train(cfg, split, resume=True)
    a = load_file(str(straight / "checkpoints/step_00000002/model.safetensors"))
    b = load_file(str(split / "checkpoints/step_00000002/model.safetensors"))
    first = load_file(str(split / "checkpoints/step_00000001/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], first[k]) for k in a)
    assert any("vision_tower" in k and not torch.equal(a[k], first[k]) for k in a)  # the images' tower trains too
