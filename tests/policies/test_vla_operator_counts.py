"""How many operators one VLA sampling call dispatches (``benchmarks/launches.py``): at the
tabletop configs' sizes, for 256 observations, a bound well under what the chains dispatched
before the static key/value cache and the prepared denoising steps (2818 operators for the token
VLA, 2229 for the flow VLA); and the count does not grow with the batch (it may with what
the batch holds: transformers skips a mask where no instruction is padded). A count depends on the
code and the library versions, not on the machine."""

import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

LAUNCHES = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "launches.py"))
# measured with torch 2.13 and transformers 5.25: 988 (token VLA) and 861 (flow VLA) at B = 256
BOUNDS = {"token_vla": 1100, "flow_vla": 950}


@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_a_sampling_call_of_256_observations_dispatches_under_its_bound_and_as_many_as_four(case):
    policy = LAUNCHES["_policy"](case, None)
    count = LAUNCHES["count_operators"]
    many = count(policy, LAUNCHES["_inputs"](256))
    assert many <= BOUNDS[case]
    assert count(policy, LAUNCHES["_inputs"](4)) == many  # the same 4 instructions (and paddings) as the 256


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
