"""``compile_decoder`` of the token VLA: no-grad sampling runs each decoding step after the
prefix (the static key/value cache's, ``mmrl.policies.vla.static_decode.decode_step``) through
``torch.compile``; ``log_prob``'s teacher-forced pass stays eager. Off by default, and off
changes nothing.

Tolerance of compiled against eager log-probs: the compiled step computes the same float32
operations with other kernels (fused pointwise ops, another summation order in the RMS norms,
attention and matrix products), so a hidden state differs by a few ulps (float32 eps 1.2e-7) of
values of order 1, and a token's log-prob log_softmax(W h)[k] (of order log 16 ≈ 2.8 here) by a
few ulps of the logits. A chunk sums 3 x 2 tokens: ``CHUNK_ATOL`` = 2e-5 is ~25 ulps of 2.8 per
token, the bound the static cache's own test keeps against transformers' cache for the same kind
of difference (measured here: at most 3.8e-6 on a chunk of 8 tokens at the benchmark's sizes). The
tokens themselves are drawn from probabilities that differ by those ulps, so they agree unless a
uniform draw falls within ~1e-6 of a bin's boundary: the same tokens on the seeds used here."""

import copy
import pickle

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.token_vla import TokenVLAConfig  # noqa: E402
from mmrl.policies.vla.tiny_vlm import TinyVLMSize, save_tiny_vlm  # noqa: E402
from tests.policies.test_vla_static_decode import CHUNK_ATOL, SPEC, TINY, make, observations  # noqa: E402


pytestmark = pytest.mark.usefixtures("inductor_cache_per_kernel_set", "one_thread")  # tests/policies/conftest.py


def test_off_by_default_and_off_compiles_nothing():
    assert TokenVLAConfig().compile_decoder is False
    policy = make(TINY)
    policy.sample(observations(4), torch.Generator().manual_seed(0))
    assert len(policy._compiled_steps) == 0


@pytest.mark.parametrize("fields", [{"old_logp": "sampler"}, {"decode_cache": "dynamic"}])
def test_compiling_is_refused_without_deferred_old_logp_or_the_static_cache_naming_the_field(fields):
    data = {"type": "token_vla", "compile_decoder": True, **fields}
    with pytest.raises(ConfigError, match="policy.compile_decoder"):
        from_dict(TokenVLAConfig, data, "policy").validate("policy")
    from_dict(TokenVLAConfig, {"type": "token_vla", "compile_decoder": True}, "policy").validate("policy")


def test_the_compiled_step_cache_is_not_state():
    policy = make(TINY, compile_decoder=True)
    policy._compiled_steps[("decoder", "cpu")] = lambda *a: None  # stands in for a compiled step
    assert len(copy.deepcopy(policy)._compiled_steps) == 0
    assert len(pickle.loads(pickle.dumps(policy))._compiled_steps) == 0
    assert not any("compiled" in key for key in policy.state_dict())


def compiled_against_eager(backbone: dict, spec: dict, inputs: dict, seeds):
    eager, compiled = make(backbone, spec), make(backbone, spec, compile_decoder=True)
    compiled.load_state_dict(eager.state_dict())
    for seed in seeds:
        a = eager.sample(inputs, torch.Generator().manual_seed(seed))
        b = compiled.sample(inputs, torch.Generator().manual_seed(seed))
        assert torch.equal(b.replay["action_tokens"], a.replay["action_tokens"]) and torch.equal(b.output, a.output)
        torch.testing.assert_close(b.logp, a.logp, rtol=0, atol=CHUNK_ATOL)
        torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=CHUNK_ATOL)
        # log_prob is the eager teacher-forced pass: the trainer's deferred old log-probs give ratio 1
        recompute = compiled.log_prob(b.replay).detach()
        assert torch.equal(recompute, eager.log_prob(b.replay).detach())
        torch.testing.assert_close(recompute, b.logp, rtol=0, atol=CHUNK_ATOL)
    a, b = eager.sample(inputs, deterministic=True), compiled.sample(inputs, deterministic=True)
    assert torch.equal(b.replay["action_tokens"], a.replay["action_tokens"])
    assert set(compiled._compiled_steps) == {("decoder", "cpu")}


@pytest.mark.numerics
def test_compiled_decoding_samples_the_eager_tokens_and_recomputes_with_ratio_one():
    compiled_against_eager(TINY, SPEC, observations(24), range(2))


@pytest.mark.numerics
def test_compiled_decoding_on_a_pretrained_smolvlm(tmp_path):
    size = TinyVLMSize(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    vlm = save_tiny_vlm("smolvlm", tmp_path / "smolvlm", size)
    compiled_against_eager({"vlm_path": str(vlm), "max_instruction_tokens": 12}, {**SPEC, "image_shape": [32, 32, 3]}, observations(12, (32, 32, 3)), range(1))


@pytest.mark.numerics
def test_compiled_steps_follow_the_eager_steps_with_grouped_key_value_heads():
    # SmolVLM's language model shares each key/value head between several query heads
    import inspect

    import transformers

    from mmrl.policies.vla.action_chunk import compiled_callable
    from mmrl.policies.vla.static_decode import decode_step, static_decoder

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=1, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # as VLABackbone
    g = torch.Generator().manual_seed(0)
    n, p, steps = 3, 7, 4
    prefix, mask = torch.randn(n, p, 32, generator=g), torch.ones(n, p)
    mask[0, 4:6] = 0  # padding inside a prefix
    inputs = torch.randn(steps, n, 32, generator=g)
    step = compiled_callable({}, "decoder", decode_step, torch.device("cpu"))
    with torch.no_grad():
        decoders = []
        for _ in range(2):
            cache = transformers.DynamicCache(config=config)
            model(inputs_embeds=prefix, attention_mask=mask.long(), use_cache=True, **{cache_argument: cache})
            decoders.append(static_decoder(model, cache, mask, torch.arange(p, p + steps).expand(n, steps)))
        eager, compiled = decoders
        for x in inputs:
            # hidden states up to ~3 after the final norm, a few ulps apart (the module docstring)
            torch.testing.assert_close(compiled.step(x, step), eager.step(x), rtol=0, atol=1e-5)
    for a, b in zip(compiled.layers, eager.layers):  # the keys and values written into every slot
        for buffer_a, buffer_b in zip(a["cache"], b["cache"]):
            torch.testing.assert_close(buffer_a, buffer_b, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_trainer_update_after_compiled_decoding_starts_from_ratio_exactly_one(tmp_path, monkeypatch):
    import json
    import math

    from mmrl.config import from_dict as config_from_dict
    from mmrl.policies.vla.static_decode import StaticDecoder
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import train
    from tests.conftest import point_reach_config
    from tests.policies.test_flow_vla import BACKBONE

    data = point_reach_config(
        total_steps=1,
        env={"num_envs": 4, "kwargs": {"max_steps": 6, "min_steps": 3}},
        algo={"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1},
        eval={"every": 1000, "at_start": False, "at_end": False},
    )
    data["policy"] = {"type": "token_vla", "backbone": BACKBONE, "action_chunk": 2, "action_bins": 8, "compile_decoder": True}
    calls, step = [], StaticDecoder.step
    monkeypatch.setattr(StaticDecoder, "step", lambda self, x, compiled=None: calls.append(compiled is not None) or step(self, x, compiled))
    train(config_from_dict(TrainConfig, data), tmp_path / "run")
    assert calls and all(calls)  # the rollout decoded through the compiled step
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    update = [m for m in metrics if "loss/policy" in m][-1]
    assert update["objective/ratio"] == 1.0 and update["approx_kl"] == 0.0 and math.isfinite(update["loss/policy"]), update
