import pytest
import torch

from mmrl.algo.masks import top_entropy_mask, truncation_mask


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_truncation_mask_zeroes_truncated_rows(dtype):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=dtype)
    out = truncation_mask(mask, torch.tensor([False, True, False]))
    assert out.dtype == dtype
    assert out.tolist() == torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=dtype).tolist()


MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # 5 valid decisions
ENTROPY = torch.tensor([[0.1, 0.9, 0.5, 100.0], [0.7, 0.2, 50.0, 50.0]])  # masked ones are the largest


def test_top_entropy_mask_keeps_highest_valid_entropies():
    # ρ = 0.2: ⌈1⌉ = 1 → 0.9;  ρ = 0.5: ⌈2.5⌉ = 3 → 0.9, 0.7, 0.5
    assert top_entropy_mask(MASK, ENTROPY, rho=0.2).tolist() == [[False, True, False, False], [False, False, False, False]]
    assert top_entropy_mask(MASK, ENTROPY, rho=0.5).tolist() == [[False, True, True, False], [True, False, False, False]]
    assert top_entropy_mask(MASK, ENTROPY, rho=1.0).tolist() == MASK.tolist()


def test_top_entropy_mask_keeps_exactly_ceil_with_ties_and_float_rho():
    mask = torch.ones(4, 25)  # 100 valid decisions, all with the same entropy
    for rho, expected in [(0.07, 7), (0.2, 20), (0.255, 26), (0.001, 1)]:  # 0.07 * 100 = 7.000000000000001
        out = top_entropy_mask(mask, torch.ones(4, 25), rho=rho)
        assert out.dtype == torch.float32 and out.sum() == expected


def test_top_entropy_mask_rejects_bad_rho():
    with pytest.raises(ValueError, match="rho"):
        top_entropy_mask(MASK, ENTROPY, rho=0.0)
