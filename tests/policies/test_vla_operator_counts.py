"""How many operators one VLA sampling call dispatches (``benchmarks/launches.py``): at the
tabletop configs' sizes, for 256 observations, a bound well under what the chains dispatched
before the static key/value cache and the prepared denoising steps (2818 operators for the token
VLA, 4520 on the SmolVLM, 2229 for the flow VLA); and the count does not grow with the batch (it
may with what the batch holds: transformers skips a mask where no instruction is padded). With
the sampling compiled (``compile_decoder``; ``compile_denoiser`` and ``compile_prefix``), what a
call launches on the CPU, the aten operators it dispatches and inductor's fused kernels, stays
within a quarter of those. A count depends on the code and the library versions, not on the
machine."""

import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

LAUNCHES = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "launches.py"))
# measured with torch 2.13 and transformers 5.25 at B = 256: 973 (token VLA), 1126 (on the SmolVLM),
# 827 (flow VLA); compiled, aten operators + fused kernels: 514 + 77 (token VLA), 391 + 68 (flow VLA)
BOUNDS = {"token_vla": 1000, "token_vla_smolvlm": 1160, "flow_vla": 850}
BEFORE = {"token_vla": 2818, "token_vla_smolvlm": 4520, "flow_vla": 2229}  # at a6ab7bd


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from mmrl.policies.vla.tiny_vlm import TinyVLMSize, save_tiny_vlm

    return str(save_tiny_vlm("smolvlm", tmp_path_factory.mktemp("vlm") / "smolvlm64", TinyVLMSize(**LAUNCHES["VLM_SIZE"])))


@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_a_sampling_call_of_256_observations_dispatches_under_its_bound_and_as_many_as_four(case, request):
    policy = LAUNCHES["_policy"](case, request.getfixturevalue("vlm_dir") if case.endswith("smolvlm") else None)
    count = LAUNCHES["count_operators"]
    many = count(policy, LAUNCHES["_inputs"](256))
    assert many <= BOUNDS[case]
    assert count(policy, LAUNCHES["_inputs"](4)) == many  # the same 4 instructions (and paddings) as the 256


@pytest.mark.parametrize("case", ["token_vla", "flow_vla"])
def test_a_compiled_sampling_call_of_256_observations_launches_a_quarter_of_what_eager_sampling_dispatched_before(case, inductor_cache_per_kernel_set):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = LAUNCHES["_policy"](case, None, compiled=True)
        inputs = LAUNCHES["_inputs"](256)
        policy.sample(inputs, torch.Generator().manual_seed(0))  # the compile
        aten, fused = LAUNCHES["count_compiled_launches"](policy, inputs)
    finally:
        torch.set_num_threads(threads)
    assert fused > 0  # the fused kernels ran, and were seen
    assert aten + fused <= BEFORE[case] / 4


def test_the_flow_vlas_prepared_expert_computes_its_velocities_bit_for_bit():
    # the memory's transposed weights, periods and additive mask against the expert's plain layers
    policy = LAUNCHES["_policy"]("flow_vla", None)
    inputs = LAUNCHES["_inputs"](6)
    memory = policy.conditioning(policy.observation(inputs))
    attend = memory["attend"] == 0
    plain = {"kv": memory["kv"], "attend": attend}
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(6, 4, 2, generator=g), torch.rand(6, generator=g)
    rows = torch.tensor([0, 2, 2, 5, 1, 3])
    for r in (None, rows):
        prepared, _ = policy.expert(x, sigma, memory, r)
        reference, _ = policy.expert(x, sigma, plain, r)
        assert torch.equal(prepared, reference)
