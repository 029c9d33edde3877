"""The token VLA decodes its action tokens with a static key/value cache
(``mmrl.policies.vla.static_decode``): it samples what transformers' growing cache samples, and
a sampling call dispatches a number of operators that does not grow with the batch."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.weights import build_policy  # noqa: E402
from mmrl.policies.vla.tiny_vlm import TinyVLMSize, save_tiny_vlm  # noqa: E402
from mmrl.registry import POLICIES  # noqa: E402

INSTRUCTIONS = ["push the red block left", "push the blue block into the right zone"]
SPEC = {"action_dim": 2, "action_low": [-1.0, -1.0], "action_high": [1.0, 1.0], "state_dim": 4, "image_shape": [16, 16, 3], "instructions": INSTRUCTIONS}
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "vision_channels": [8], "patch_grid": 4, "max_instruction_tokens": 8}
# Static and growing caches attend over other key lengths (the static one masks the slots not yet
# decoded), so a token's log-prob may differ in its last bits; a chunk sums 3 x 2 tokens of ~log 16.
# Measured: at most 3.8e-6 on a chunk of 8 tokens (the benchmark's sizes), 1 or 2 ulps.
CHUNK_ATOL = 2e-5


def make(backbone: dict, spec=None, **fields):
    data = {"type": "token_vla", "action_bins": 16, "action_chunk": 3, "backbone": backbone, **fields}
    config = from_dict(POLICIES.entry("token_vla").config, data, "policy")
    torch.manual_seed(0)
    return build_policy(config, spec or SPEC)


def observations(n: int, image_shape=(16, 16, 3), seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "image": torch.randint(0, 256, (n, *image_shape), generator=g, dtype=torch.uint8),
        "state": torch.randn(n, 4, generator=g),
        "instruction": [INSTRUCTIONS[i % 2] if i % 3 else "push" for i in range(n)],  # instructions of other lengths: padding inside the prefix
    }


def both_caches(policy, inputs, seed: int, **kwargs):
    out = {}
    for cache in ("static", "dynamic"):
        policy.config.decode_cache = cache
        out[cache] = policy.sample(inputs, torch.Generator().manual_seed(seed), **kwargs)
    return out["static"], out["dynamic"]


class Operators(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operators(policy, inputs) -> int:
    with Operators() as counter:
        policy.sample(inputs, torch.Generator().manual_seed(0))
    return counter.count


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_static_cache_samples_the_tokens_and_log_probs_of_the_growing_cache(arch):
    policy = make({**TINY, "arch": arch})
    inputs = observations(24)
    for seed in range(3):
        static, dynamic = both_caches(policy, inputs, seed)
        assert torch.equal(static.replay["action_tokens"], dynamic.replay["action_tokens"])
        assert torch.equal(static.output, dynamic.output)
        torch.testing.assert_close(static.logp, dynamic.logp, rtol=0, atol=CHUNK_ATOL)
        torch.testing.assert_close(static.entropy, dynamic.entropy, rtol=0, atol=CHUNK_ATOL)
    static, dynamic = both_caches(policy, inputs, 0, deterministic=True)
    assert torch.equal(static.replay["action_tokens"], dynamic.replay["action_tokens"])


@pytest.mark.numerics
def test_the_static_cache_on_a_pretrained_smolvlm_samples_what_its_own_cache_samples(tmp_path):
    vlm = save_tiny_vlm("smolvlm", tmp_path / "smolvlm", TinyVLMSize(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))
    spec = {**SPEC, "image_shape": [32, 32, 3]}
    policy = make({"vlm_path": str(vlm), "max_instruction_tokens": 12}, spec)
    inputs = observations(12, (32, 32, 3))
    for seed in range(2):
        static, dynamic = both_caches(policy, inputs, seed)
        assert torch.equal(static.replay["action_tokens"], dynamic.replay["action_tokens"])
        torch.testing.assert_close(static.logp, dynamic.logp, rtol=0, atol=CHUNK_ATOL)
    # and the recomputed log-probs are the sampled ones, as the growing cache's are
    torch.testing.assert_close(policy.log_prob(static.replay), static.logp, rtol=0, atol=CHUNK_ATOL)


def test_a_decoder_of_another_layout_keeps_the_growing_cache():
    policy = make({**TINY, "arch": "gemma"})
    embeds, mask = policy._prefix(policy.encode_inputs(observations(2)))
    cache = policy.backbone.new_cache()
    policy.backbone(embeds, mask, cache)
    assert policy.backbone.static_decoder(cache, mask, 3) is None
    static, dynamic = both_caches(policy, observations(6), 0)
    assert torch.equal(static.logp, dynamic.logp) and torch.equal(static.replay["action_tokens"], dynamic.replay["action_tokens"])


def test_a_sampling_call_dispatches_as_many_operators_for_256_observations_as_for_one():
    policy = make(TINY)
    assert operators(policy, observations(1)) == operators(policy, observations(256))


def test_a_static_decoding_step_dispatches_under_half_the_operators_of_a_growing_cache_step():
    # per action token after the first: the operators a chunk of 3 x 2 tokens dispatches beyond a
    # chunk of 1 x 2, over its 4 more tokens (measured: 832 with the growing cache, 360 static)
    inputs = observations(32)
    per_token = {}
    for cache in ("static", "dynamic"):
        long, short = make(TINY, decode_cache=cache), make(TINY, decode_cache=cache, action_chunk=1)
        per_token[cache] = (operators(long, inputs) - operators(short, inputs)) / 4
    assert per_token["static"] < per_token["dynamic"] / 2


@pytest.mark.numerics
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_static_steps_follow_the_decoders_own_steps_with_grouped_key_value_heads(kv_heads):
    # SmolVLM's language model shares each key/value head between several query heads
    import inspect

    import transformers

    from mmrl.policies.vla.static_decode import static_decoder

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, intermediate_size=64, vocab_size=1, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # as VLABackbone
    g = torch.Generator().manual_seed(0)
    n, p, steps = 3, 7, 4
    prefix = torch.randn(n, p, 32, generator=g)
    mask = torch.ones(n, p)
    mask[0, 4:6] = 0  # padding inside a prefix
    inputs = torch.randn(steps, n, 32, generator=g)
    with torch.no_grad():
        own, static = [], []
        cache = transformers.DynamicCache(config=config)
        model(inputs_embeds=prefix, attention_mask=mask.long(), use_cache=True, **{cache_argument: cache})
        decoder = static_decoder(model, cache, mask, torch.arange(p, p + steps).expand(n, steps))
        grown = mask
        for x in inputs:
            grown = torch.cat([grown, torch.ones(n, 1)], dim=1)
            own.append(model(inputs_embeds=x[:, None], attention_mask=grown.long(), use_cache=True, **{cache_argument: cache}).last_hidden_state[:, 0])
            static.append(decoder.step(x))
    # float32 attention over 8-11 keys (the static one over 11, those not yet decoded masked): the
    # hidden states (up to ~3 after the final norm) agree to an ulp or two (measured: at most 3e-8)
    torch.testing.assert_close(torch.stack(static), torch.stack(own), rtol=0, atol=1e-5)
