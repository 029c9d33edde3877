import json
import math
import warnings
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from mmrl.config import from_dict, option  # noqa: E402
from mmrl.core.component_config import RewardConfig  # noqa: E402
from mmrl.core.rollout import OldLogProbs, Rollout  # noqa: E402
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.text_lm import Generation, TextLMConfig, TextLMPolicy  # noqa: E402
from mmrl.policies.text_lm.generation import nucleus_mask, token_log_probs  # noqa: E402
from mmrl.policies.tiny_tokenizers import byte_tokenizer  # noqa: E402
from mmrl.registry import POLICIES, REWARDS  # noqa: E402

TINY = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
PROMPTS = ["What is 2 + 3?", "Hi", "Name a fruit that is red and round.", "7 * 6 ="]
# Two float32 computations of a token's log-prob (the key/value-cache loop and one teacher-forced
# pass, or passes over other rows and padding) sum in other orders: docs/text.md bounds the
# difference by 1e-4 per token (measured on these tiny models: at most 2.4e-6 under
# ATEN_CPU_CAPABILITY default, avx2 and avx512).
PER_TOKEN_ATOL = 1e-4


def make(seed: int = 0, tiny: dict | None = None, **fields) -> TextLMPolicy:
    data = {"type": "text_lm", "tiny": {**TINY, **(tiny or {})}, **fields}
    torch.manual_seed(seed)
    return build_policy(from_dict(TextLMConfig, data, "policy"), {})


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def byte_id(policy, char: str) -> list[int]:
    return policy.tokenizer(char, add_special_tokens=False)["input_ids"]


class _RowBias:
    """Adds a bias to the output head's logits; a per-row bias [B, 1, V] follows its rows
    when the decoding loop drops ended completions from the batch (``cache.reorder_cache``)."""

    def __init__(self, policy, bias: torch.Tensor):
        self.policy, self.bias, self.current = policy, bias, bias
        self.hook = policy.language_model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + self.current.to(out.dtype))
        if bias.dim() == 3:
            new_cache = policy.new_cache

            def tracked_cache():
                self.current = self.bias  # a new generation starts from the whole batch
                cache = new_cache()
                reorder = cache.reorder_cache

                def reorder_rows(index):
                    self.current = self.current[index]
                    reorder(index)

                cache.reorder_cache = reorder_rows
                return cache

            policy.new_cache = tracked_cache
            generate = policy.backend.generate

            def whole_batch_after(*args, **kwargs):
                try:
                    return generate(*args, **kwargs)
                finally:
                    self.current = self.bias  # teacher-forced passes see every row

            policy.backend.generate = whole_batch_after

    def remove(self):
        self.hook.remove()
        for name in ("new_cache",):
            self.policy.__dict__.pop(name, None)
        self.policy.backend.__dict__.pop("generate", None)


def bias_logits(policy, bias: torch.Tensor):
    """Add ``bias`` ([V], or [B, 1, V] per row) to the model's logits in every pass (a
    handle to remove it): a way to make chosen tokens likely in a random model."""
    return _RowBias(policy, bias)


def test_registered_and_built_from_a_yaml_style_mapping():
    assert POLICIES.entry("text_lm").config is TextLMConfig
    policy = make(tiny={"arch": "qwen2", "num_layers": 1, "num_kv_heads": 1}, generation={"max_new_tokens": 5})
    lm = policy.language_model
    assert type(lm).__name__ == "Qwen2ForCausalLM" and lm.config.num_hidden_layers == 1 and lm.config.num_key_value_heads == 1
    assert lm.config.vocab_size == len(policy.tokenizer) == 259
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight  # tied, like small pretrained LMs
    assert policy.sampling.eos_token_ids == (policy.tokenizer.convert_tokens_to_ids("<|im_end|>"),)


@pytest.mark.parametrize(
    ("arch", "temperature", "top_p", "dtype"),
    [("llama", 1.0, 1.0, "float32"), ("llama", 0.7, 0.9, "float32"), ("qwen2", 1.6, 0.8, "float32"), ("llama", 0.5, 0.05, "float32"), ("qwen2", 0.8, 0.9, "bfloat16")],
)
def test_log_prob_of_the_replay_equals_old_logp_exactly_after_sampling(arch, temperature, top_p, dtype):
    """Ratio exactly 1 before any update, under temperature and top-p, with prompts of
    different lengths padded on the left."""
    policy = make(tiny={"arch": arch}, dtype=dtype, generation={"max_new_tokens": 10, "temperature": temperature, "top_p": top_p, "old_logp": "recompute"})
    assert next(policy.parameters()).dtype == getattr(torch, dtype)
    sample = policy.sample(PROMPTS, generator(0))
    lengths = sample.replay["prompt_mask"].sum(1)
    assert len(set(lengths.tolist())) == len(PROMPTS)  # different lengths ...
    assert (sample.replay["prompt_mask"][:, -1] == 1).all() and (sample.replay["prompt_mask"][:, 0] == 0).sum() == 3  # ... padded on the left
    logp = policy.log_prob(sample.replay)
    assert torch.equal(logp, sample.logp)
    assert torch.equal(torch.exp(logp - sample.logp) * sample.mask, sample.mask)
    assert (sample.logp <= 0).all() and torch.isfinite(sample.entropy).all()


def _reference_log_prob(logits: torch.Tensor, token: int, temperature: float, top_p: float) -> float:
    """log q(token) written out: softmax of the tempered logits, the most likely tokens
    until their mass reaches top_p (ties at the edge kept), renormalized."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda v: -probs[v])
    kept, mass = [], 0.0
    for v in order:
        if mass >= top_p and probs[v] < probs[kept[-1]]:
            break
        kept.append(v)
        mass += probs[v]
    assert token in kept, "sampled outside the nucleus"
    return math.log(probs[token] / sum(probs[v] for v in kept))


@pytest.mark.numerics
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.7), (2.0, 0.95)])
def test_old_logp_is_the_log_prob_of_the_tempered_nucleus_that_was_sampled_from(temperature, top_p):
    policy = make(generation={"max_new_tokens": 6, "temperature": temperature, "top_p": top_p})
    prompts = PROMPTS[:2]
    sample = policy.sample(prompts, generator(3))
    ids = policy.tokenizer(prompts)["input_ids"]
    for row in range(len(prompts)):
        sequence = list(ids[row])
        for t in range(int(sample.mask[row].sum())):
            with torch.no_grad():
                logits = policy.language_model(input_ids=torch.tensor([sequence])).logits[0, -1]
            token = int(sample.replay["completion_ids"][row, t])
            # the decoding loop's number (old_logp: deferred) against one uncached pass's logits
            assert sample.logp[row, t].item() == pytest.approx(_reference_log_prob(logits, token, temperature, top_p), abs=PER_TOKEN_ATOL)
            sequence.append(token)


@pytest.mark.numerics
def test_the_decoding_loops_log_probs_match_the_recomputed_ones():
    """The built-in backend's key/value-cache loop reports the same log-probs as one
    teacher-forced pass, up to float rounding (old_logp: backend uses them as they are)."""
    recomputed = make(generation={"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "old_logp": "recompute"})
    from_backend = make(generation={"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "old_logp": "backend"})
    a, b = recomputed.sample(PROMPTS, generator(1)), from_backend.sample(PROMPTS, generator(1))
    assert torch.equal(a.replay["completion_ids"], b.replay["completion_ids"])
    assert torch.equal(b.logp * (1 - b.mask), torch.zeros_like(b.logp)) and torch.equal(b.entropy * (1 - b.mask), torch.zeros_like(b.entropy))
    assert torch.allclose(a.logp, b.logp, atol=PER_TOKEN_ATOL, rtol=0)
    assert torch.allclose(a.entropy, b.entropy, atol=PER_TOKEN_ATOL, rtol=0)  # the loop reports the entropy of q too
    assert not a.logp_deferred and not b.logp_deferred
    assert not torch.equal(a.logp, b.logp)  # two computations, not one copied


def test_nucleus_keeps_the_smallest_set_of_most_likely_tokens_reaching_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.4, 0.3, 0.3]])
    assert nucleus_mask(probs, 0.5).tolist() == [[True, False, False], [False, True, False], [True, True, True]]  # ties kept
    assert nucleus_mask(probs, 0.6).tolist() == [[True, True, False], [False, True, True], [True, True, True]]
    assert nucleus_mask(probs, 1.0).all()


def test_a_replayed_token_outside_the_current_nucleus_keeps_a_finite_log_prob():
    """After an update a sampled token may fall out of the nucleus; its log-prob is then
    taken over the nucleus widened to hold it: log π(a) − log Σ_{N ∪ {a}} π."""
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]]))
    logp, entropy = token_log_probs(logits, torch.tensor([2]), 1.0, 0.5, with_entropy=True)
    assert logp.item() == pytest.approx(math.log(0.1 / 0.7))
    assert entropy.item() == pytest.approx(-(6 / 7 * math.log(6 / 7) + 1 / 7 * math.log(1 / 7)))
    inside, _ = token_log_probs(logits, torch.tensor([0]), 1.0, 0.5)
    assert inside.item() == pytest.approx(0.0, abs=1e-7)  # the nucleus is the top token alone
    tempered, _ = token_log_probs(logits, torch.tensor([1]), 0.5, 1.0)
    assert tempered.item() == pytest.approx(math.log(0.25**2 / (0.6**2 + 0.25**2 + 0.1**2 + 0.05**2)), rel=1e-5)


def test_same_generator_seed_gives_the_same_completions_and_another_seed_differs():
    policy = make(generation={"max_new_tokens": 8})
    a, b, c = (policy.sample(PROMPTS, generator(s)) for s in (5, 5, 6))
    assert a.output == b.output and torch.equal(a.logp, b.logp) and torch.equal(a.replay["completion_ids"], b.replay["completion_ids"])
    assert a.output != c.output
    greedy = [policy.sample(PROMPTS, generator(s), deterministic=True).output for s in (5, 6)]
    assert greedy[0] == greedy[1]


@pytest.mark.numerics
def test_a_prompts_completion_does_not_depend_on_the_padding_of_its_batch():
    policy = make(generation={"max_new_tokens": 8})
    alone = policy.sample(["Hi"], deterministic=True)
    batched = policy.sample(["Hi", "A much longer prompt that pads the first one on the left"], deterministic=True)
    assert batched.output[0] == alone.output[0]
    assert torch.allclose(batched.logp[0, :8], alone.logp[0], atol=PER_TOKEN_ATOL, rtol=0)  # another batch: other float32 sums


def test_eos_ends_a_sample_masks_the_rest_and_only_samples_without_it_are_truncated():
    policy = make(generation={"max_new_tokens": 12})
    eos = policy.sampling.eos_token_ids[0]
    bias = torch.zeros(4, 1, len(policy.tokenizer))
    bias[[0, 2], :, eos] = 5.0  # rows 0 and 2 end after a few tokens
    bias[[1, 3], :, eos] = -1e4  # rows 1 and 3 never end
    handle = bias_logits(policy, bias)
    sample = policy.sample(PROMPTS, generator(0))
    handle.remove()
    ids, mask = sample.replay["completion_ids"], sample.mask
    assert sample.info["truncated"].tolist() == [False, True, False, True]
    for row in (0, 2):
        length = int(mask[row].sum())
        assert 1 <= length < 12 and ids[row, length - 1] == eos and (ids[row, : length - 1] != eos).all()
        assert mask[row, :length].all() and not mask[row, length:].any()
        assert (ids[row, length:] == policy.tokenizer.pad_token_id).all()
        assert (sample.logp[row, length:] == 0).all() and sample.logp[row, length - 1] < 0
        assert sample.output[row] == policy.tokenizer.decode(ids[row, : length - 1].tolist())  # the EOS is not in the text
    assert mask[[1, 3]].all() and mask.shape[1] == 12


def test_ended_completions_leave_the_batch_and_the_others_are_drawn_as_before():
    policy = make(generation={"max_new_tokens": 12})
    eos = policy.sampling.eos_token_ids[0]
    rows_seen = []
    head = policy.language_model.get_output_embeddings()
    counter = head.register_forward_hook(lambda module, args, out: rows_seen.append(out.shape[0]))
    samples = {}
    for ending in ([0, 2], []):
        bias = torch.zeros(4, 1, len(policy.tokenizer))
        bias[:, :, eos] = -1e4
        bias[ending, :, eos] = 5.0  # these rows end after a few tokens
        handle = bias_logits(policy, bias)
        rows_seen.clear()
        samples[tuple(ending)] = (policy.backend.generate(policy.encode_prompts(PROMPTS), policy.sampling, generator(3), False), list(rows_seen))
        handle.remove()
    counter.remove()
    (early, early_rows), (full, full_rows) = samples[(0, 2)], samples[()]
    assert early.finish_reason == ["eos", "length", "eos", "length"] and full.finish_reason == ["length"] * 4
    assert early_rows[0] == 4 and early_rows[-1] == 2 and set(full_rows) == {4}  # the last steps ran on rows 1 and 3 only
    # the generator advanced as if every row had stayed: the long rows drew the same tokens
    assert early.token_ids[1] == full.token_ids[1] and early.token_ids[3] == full.token_ids[3]


def test_stop_strings_end_a_completion_at_the_token_that_completes_them():
    stops = ["ab", "é"]  # é is two byte tokens
    policy = make(generation={"max_new_tokens": 40, "stop_strings": stops})
    bias = torch.zeros(len(policy.tokenizer))
    bias[byte_id(policy, "a") + byte_id(policy, "b") + byte_id(policy, "é")] = 6.0
    bias[list(policy.sampling.eos_token_ids)] = -1e4  # every completion ends at a stop string
    handle = bias_logits(policy, bias)
    sample = policy.sample(PROMPTS * 2, generator(0))
    handle.remove()
    ended = {stop: 0 for stop in stops}
    for row, text in enumerate(sample.output):
        tokens = sample.replay["completion_ids"][row, : int(sample.mask[row].sum())].tolist()
        assert text == policy.tokenizer.decode(tokens, skip_special_tokens=True)
        stop = next(s for s in stops if text.endswith(s))
        ended[stop] += 1
        assert not any(s in policy.tokenizer.decode(tokens[:-1], skip_special_tokens=True) for s in stops), text  # the last token completed it
    assert all(ended.values()) and not sample.info["truncated"].any()


def test_chat_template_sends_each_prompt_as_a_user_turn():
    policy = make(generation={"chat_template": True, "system_prompt": "Be brief."})
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert policy.encode_prompts(["Hi"]) == [policy.tokenizer(expected, add_special_tokens=False)["input_ids"]]
    assert make().encode_prompts(["Hi"]) == [byte_id(policy, "H") + byte_id(policy, "i")]


def test_positive_advantage_raises_that_completions_log_prob_after_one_adam_step():
    policy = make(generation={"max_new_tokens": 8})
    sample = policy.sample(PROMPTS, generator(0))
    advantage = torch.tensor([0.0, 0.0, 1.0, 0.0])[:, None]
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    logp = policy.log_prob(sample.replay)
    loss = -(logp * advantage * sample.mask).sum() / sample.mask.sum()
    loss.backward()
    assert [name for name, p in policy.named_parameters() if p.grad is None] == []
    optimizer.step()
    after = (policy.log_prob(sample.replay).detach() * sample.mask).sum(1)
    before = (sample.logp * sample.mask).sum(1)
    assert after[2] > before[2] + 0.1


def test_save_and_load_pretrained_round_trip_exactly(tmp_path):
    policy = make(generation={"max_new_tokens": 6, "temperature": 0.9})
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the weights a fresh build would have
    save_pretrained(policy, tmp_path / "ckpt")
    loaded = load_pretrained(tmp_path / "ckpt")
    state, loaded_state = policy.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys() and all(torch.equal(state[k], loaded_state[k]) for k in state)
    lm = loaded.language_model
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight  # still tied
    a, b = policy.sample(PROMPTS, generator(2)), loaded.sample(PROMPTS, generator(2))
    assert a.output == b.output and torch.equal(a.logp, b.logp)


def _save_transformers_model(directory, arch="qwen2", tokenizer=None):
    """What a user with real weights has: a model and tokenizer saved by transformers."""
    import transformers

    tokenizer = tokenizer or byte_tokenizer()
    config = transformers.AutoConfig.for_model(
        arch, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=len(tokenizer), tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]  # chat models list several
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.mark.numerics
def test_loads_a_transformers_model_and_tokenizer_saved_with_save_pretrained(tmp_path):
    original = _save_transformers_model(tmp_path / "hf")
    policy = make(model_path=str(tmp_path / "hf"), generation={"max_new_tokens": 6, "chat_template": True})
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        assert torch.equal(policy.language_model(input_ids=ids).logits, original(input_ids=ids).logits)
    assert policy.sampling.eos_token_ids == (256, 257)  # the tokenizer's EOS and the generation config's
    sample = policy.sample(PROMPTS[:2], generator(0))
    logp = policy.log_prob(sample.replay)
    # old_logp: deferred, so sample.logp are the decoding loop's: the documented float32 bound
    assert sample.logp_deferred and float(((logp - sample.logp) * sample.mask).abs().max()) <= 1e-4
    # an mmrl checkpoint of it loads back with the same weights: the same pass, bit for bit
    save_pretrained(policy, tmp_path / "ckpt")
    assert torch.equal(load_pretrained(tmp_path / "ckpt").log_prob(sample.replay), logp)


def test_model_path_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"policy\.model_path"):
        make(model_path=str(tmp_path / "missing"))
    _save_transformers_model(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"policy\.gguf_file"):
        make(model_path=str(tmp_path / "hf"), gguf_file="model.Q4.gguf")


def test_a_tokenizer_without_padding_pads_with_eos_and_one_without_chat_template_refuses_it(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.chat_template = None, None  # base models often have neither
    _save_transformers_model(tmp_path / "base", tokenizer=tokenizer)
    policy = make(model_path=str(tmp_path / "base"), generation={"max_new_tokens": 3, "old_logp": "recompute"})
    assert policy.sampling.pad_token_id == policy.tokenizer.eos_token_id
    sample = policy.sample(PROMPTS[:2], generator(0))
    assert torch.equal(policy.log_prob(sample.replay), sample.logp)
    with pytest.raises(ConfigError, match=r"policy\.generation\.chat_template"):
        make(model_path=str(tmp_path / "base"), generation={"chat_template": True})


@pytest.mark.numerics
def test_lora_trains_only_the_adapters_and_the_reference_is_the_model_without_them():
    pytest.importorskip("peft")
    policy = make(generation={"max_new_tokens": 8}, lora={"r": 4, "alpha": 8})
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    reference = policy.reference()
    reference.requires_grad_(False).eval()  # what the trainer does to it: must not touch the policy
    assert all(p.requires_grad for name, p in policy.named_parameters() if name in trainable) and policy.training
    assert list(reference.parameters()) == []

    sample = policy.sample(PROMPTS, generator(0))
    base = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    advantage = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    (-(policy.log_prob(sample.replay) * advantage * sample.mask).sum() / sample.mask.sum()).backward()
    optimizer.step()

    assert all(torch.equal(p, base[name]) for name, p in policy.named_parameters() if name in base)
    moved = policy.log_prob(sample.replay).detach()
    assert not torch.allclose(moved, sample.logp, atol=1e-4)
    ref_logp = reference.log_prob(sample.replay)
    assert not ref_logp.requires_grad
    # the untouched base model = the policy before its adapters moved; sample.logp are the
    # decoding loop's (old_logp: deferred), the reference's a teacher-forced pass
    assert torch.allclose(ref_logp, sample.logp, atol=PER_TOKEN_ATOL, rtol=0)
    assert torch.equal(policy.log_prob(sample.replay).detach(), moved)  # the adapters are back on


@pytest.mark.learning
def test_sft_loss_is_the_completion_tokens_cross_entropy_and_teaches_the_completion(learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): final loss 0.00362 to 0.00691 (<= 0.02);
    greedy completions right and stopped 1 to 1 (>= 1).
    """
    policy = make(seed=learning_seed, generation={"max_new_tokens": 4})
    batch = {"prompt": ["2+3=", "7*6="], "completion": ["5", "42"]}
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    first = policy.sft_loss(batch)
    assert first.item() == pytest.approx(math.log(259), rel=0.05)  # an untrained model is near uniform
    for _ in range(60):
        loss = policy.sft_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    learned(loss.item(), 0.02, higher=False, name="final loss")
    greedy = policy.sample(batch["prompt"], deterministic=True)
    right = [out == want and not cut for out, want, cut in zip(greedy.output, batch["completion"], greedy.info["truncated"].tolist())]
    learned(sum(right) / len(right), 1.0, name="greedy completions right and stopped")  # it also learned to stop


@pytest.mark.numerics
def test_log_prob_of_replays_concatenated_across_sample_calls():
    """Rollout.cat right-pads the prompts of calls with different widths; log_prob moves
    the padding back to the left, so the log-probs stay those of each call."""
    policy = make(generation={"max_new_tokens": 6})
    parts = []
    for prompts, seed in ((PROMPTS[:2], 0), (["Hi", "Hello"], 1)):
        s = policy.sample(prompts, generator(seed))
        parts.append(Rollout(group_id=torch.zeros(len(prompts), dtype=torch.long), old=OldLogProbs(s.logp), mask=s.mask, replay=s.replay))
    joined = Rollout.cat(parts)
    assert joined.replay["prompt_mask"][2:, -1].eq(0).all()  # the short call's prompts got padding on the right
    # old_logp: deferred, so these are the decoding loop's numbers
    assert torch.allclose(policy.log_prob(joined.replay) * joined.mask, joined.old_logp, atol=PER_TOKEN_ATOL, rtol=0)


@dataclass
class _ScriptedBackend:
    """A stand-in for a serving engine: completes every prompt with the same tokens."""

    policy: TextLMPolicy

    def generate(self, prompt_ids, options, generator, deterministic):
        a, b = byte_id(self.policy, "a")[0], byte_id(self.policy, "b")[0]
        scripts = [[a, b, options.eos_token_ids[0]], [a] * options.max_new_tokens, [b, a, b]]
        tokens = [scripts[i % 3] for i in range(len(prompt_ids))]
        reasons = [("eos", "length", "stop")[i % 3] for i in range(len(prompt_ids))]
        return Generation(token_ids=tokens, logp=[[-0.5] * len(t) for t in tokens], finish_reason=reasons)


def scripted_backend(policy):
    return _ScriptedBackend(policy)


@pytest.mark.parametrize("old_logp", ["recompute", "backend", "deferred"])
def test_a_generation_backend_plugs_in_by_import_path(old_logp):
    policy = make(generation={"max_new_tokens": 5, "backend": f"{__name__}:scripted_backend", "old_logp": old_logp})
    sample = policy.sample(PROMPTS[:3], generator(0))
    assert sample.output == ["ab", "aaaaa", "bab"]
    assert sample.info["truncated"].tolist() == [False, True, False]
    assert sample.mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert sample.logp_deferred == (old_logp == "deferred")  # the trainer computes the exact ones
    if old_logp != "recompute":
        assert torch.equal(sample.logp, -0.5 * sample.mask) and sample.entropy is None  # this backend reports no entropies
    else:
        assert torch.equal(policy.log_prob(sample.replay), sample.logp) and (sample.logp < 0).sum() == 11


def test_transformers_calls_raise_no_deprecation_or_future_warnings():
    # (building with LoRA warns inside peft: peft 0.21 still asks transformers for
    # `is_gradient_checkpointing`; that is peft's call, not one of the policy's)
    for fields in ({}, {"lora": {"r": 2}} if _has_peft() else {}):
        policy = make(generation={"max_new_tokens": 4, "top_p": 0.9}, **fields)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            sample = policy.sample(PROMPTS, generator(0))
            policy.log_prob(sample.replay).sum().backward()
            policy.sft_loss({"prompt": ["a"], "completion": ["b"]})


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"generation": {"temperature": 0.0}}, "policy.generation.temperature"),
        ({"generation": {"top_p": 1.5}}, "policy.generation.top_p"),
        ({"generation": {"max_new_tokens": 0}}, "policy.generation.max_new_tokens"),
        ({"generation": {"stop_strings": [""]}}, "policy.generation.stop_strings"),
        ({"generation": {"system_prompt": "hi"}}, "policy.generation.system_prompt"),
        ({"generation": {"old_logp": "engine"}}, "policy.generation.old_logp"),
        ({"gguf_file": "m.gguf"}, "policy.gguf_file"),
        ({"tiny": {"hidden_size": 30, "num_heads": 4}}, "policy.tiny.num_heads"),
        ({"tiny": {"num_kv_heads": 3}}, "policy.tiny.num_kv_heads"),
        ({"tiny": {"arch": "gpt-9"}}, "policy.tiny.arch"),
        ({"dtype": "float64"}, "policy.dtype"),
        ({"lora": {"r": 2, "target_modules": []}}, "policy.lora.target_modules"),
    ],
)
def test_bad_config_raises_config_error_naming_the_field(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_dict(TextLMConfig, {"type": "text_lm", **data}, "policy")


def test_errors_at_build_time_name_the_field():
    with pytest.raises(ConfigError, match=r"policy\.generation\.backend"):
        make(generation={"backend": "no_such_module:factory"})
    with pytest.raises(ConfigError, match=r"policy\.generation\.backend"):
        make(generation={"backend": f"{__name__}:PROMPTS"})
    with pytest.raises(ConfigError, match=r"sampler\.data\.train: got None; gives the integer conditions 0 \.\. 3.*policy\.type text_lm takes prompt strings"):
        build_policy(TextLMConfig(tiny=from_dict(TextLMConfig, {"tiny": TINY}).tiny), {"num_prompts": 4})
    if _has_peft():
        with pytest.raises(ConfigError, match=r"policy\.lora\.target_modules"):
            make(lora={"r": 2, "target_modules": ["no_such_proj"]})


@dataclass
class _DigitFractionConfig(RewardConfig):
    type: str = option("_test_digit_fraction", "registered name of this component (see `mmrl list`)")


@REWARDS.register("_test_digit_fraction", config=_DigitFractionConfig)
def _digit_fraction(rollout, cfg):
    """Test-only: the fraction of a completion's characters that are digits (a graded signal)."""
    return torch.tensor([sum(c.isdigit() for c in text) / max(len(text), 1) for text in rollout.info["completions"]])


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_trains_end_to_end_through_the_trainer_on_a_jsonl_of_prompts(tmp_path, variant):
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import Trainer

    if variant == "lora":
        pytest.importorskip("peft")
    records = [{"prompt": f"{a} + {b} =", "answer": str(a + b), "category": "add"} for a in range(4) for b in range(3)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    policy = {"type": "text_lm", "tiny": TINY, "generation": {"max_new_tokens": 6, "temperature": 1.0, "stop_strings": [" "]}}
    # the KL reference: a frozen copy of the initial model, or the model with its adapters disabled
    algo = {"group_size": 4, "groups_per_step": 4, "ppo_epochs": 2, "num_minibatches": 2, "kl": {"type": "k3", "coef": 0.05}}
    if variant == "lora":
        policy["lora"] = {"r": 4, "alpha": 8}
    cfg = from_dict(TrainConfig, {
        "name": "text", "seed": 0, "total_steps": 3,
        "policy": policy,
        "sampler": {"type": "prompt", "data": {"train": str(data), "eval_fraction": 0.25}, "batch_groups": 2},
        "rewards": [{"type": "exact_match"}, {"type": "_test_digit_fraction"}],
        "algo": algo, "optim": {"lr": 1e-3}, "eval": {"episodes": 3},
        "log": {"progress": False, "tensorboard": False},
    })
    trainer = Trainer(cfg, tmp_path / "run")
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    assert any(not torch.equal(after[name], value) for name, value in before.items())

    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if "reward/total" in m] == [1, 2, 3]
    assert any(m.get("kl/ref", 0) > 0 for m in metrics)  # the policy moved away from its reference
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert any("eval/accuracy" in m for m in metrics)
    reloaded = load_pretrained(tmp_path / "run")  # the run's checkpoint is a pretrained directory
    assert type(reloaded) is TextLMPolicy


def test_length_buckets_cut_rows_of_very_different_lengths_and_keep_similar_ones_together():
    from mmrl.policies.text_lm.model import length_buckets

    assert length_buckets([5] * 6, [10] * 6) == [list(range(6))]  # nothing to gain: one pass, rows in order
    groups = length_buckets([4] * 8, [60, 3, 58, 2, 61, 3, 59, 2], overhead=16)
    assert sorted(map(sorted, groups)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(r for g in groups for r in g) == list(range(8))


@pytest.mark.numerics
def test_log_prob_and_its_gradient_in_length_buckets_equal_one_padded_pass(monkeypatch):
    """The teacher-forced pass runs rows of similar lengths together, each group cut to its own
    longest prompt and completion: the same log-probs, entropies and gradients as one pass over
    the whole padded batch."""
    import mmrl.policies.text_lm.model as text_model

    policy = make(generation={"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95})
    prompts = ["Hi", "What is 2 + 3? Answer in one word please.", "7 * 6 =", "Name a fruit."] * 2
    sample = policy.sample(prompts, generator(4))
    # completions of very different lengths: cut half of them short
    replay = dict(sample.replay)
    replay["completion_mask"] = sample.replay["completion_mask"].clone()
    replay["completion_mask"][::2, 3:] = 0
    replay["completion_ids"] = sample.replay["completion_ids"].masked_fill(replay["completion_mask"] == 0, policy.tokenizer.pad_token_id)
    lengths = (replay["prompt_mask"].sum(1).tolist(), replay["completion_mask"].sum(1).tolist())
    assert len(text_model.length_buckets(*lengths)) > 1  # the case under test

    def scores():
        policy.zero_grad()
        logp, entropy = policy.completion_scores(replay, with_entropy=True)
        (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        return logp.detach(), entropy.detach(), [p.grad.clone() for p in policy.parameters() if p.grad is not None]

    bucketed = scores()
    monkeypatch.setattr(text_model, "length_buckets", lambda p, c: [list(range(len(c)))])
    whole = scores()
    # passes over other rows, cut to other lengths, sum in other orders
    torch.testing.assert_close(bucketed[0], whole[0], atol=PER_TOKEN_ATOL, rtol=0)
    torch.testing.assert_close(bucketed[1], whole[1], atol=PER_TOKEN_ATOL, rtol=0)
    assert (bucketed[0][replay["completion_mask"] == 0] == 0).all()
    # each gradient entry sums m = rows x token positions terms no larger than the largest
    # entry G; reordering m float32 terms moves a sum by at most m u G (measured: at most 0.009
    # of the bound)
    m, u = replay["prompt_mask"].numel() + replay["completion_mask"].numel(), torch.finfo(torch.float32).eps / 2
    bound = m * u * max(float(g.abs().max()) for g in whole[2])
    for a, b in zip(bucketed[2], whole[2]):
        assert float((a - b).abs().max()) <= bound
