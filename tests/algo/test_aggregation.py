import pytest
import torch

from mmrl.algo.aggregation import const_norm, seq_mean_token_mean, seq_mean_token_sum, token_mean
from mmrl.registry import AGGREGATIONS

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
# Σ m·L = 1 + 2 + 4 + 5 + 6 = 18 over 5 valid decisions; row sums 3, 15, 0; row means 1.5, 5, 0


def test_registry_holds_every_aggregation():
    assert AGGREGATIONS.names() == ["const_norm", "seq_mean_token_mean", "seq_mean_token_sum", "token_mean"]


def test_token_mean():
    torch.testing.assert_close(token_mean(LOSS, MASK), torch.tensor(18 / 5))
    torch.testing.assert_close(token_mean(LOSS, MASK, num_tokens=9), torch.tensor(2.0))


def test_seq_mean_token_mean():
    torch.testing.assert_close(seq_mean_token_mean(LOSS, MASK), torch.tensor(6.5 / 3))
    torch.testing.assert_close(seq_mean_token_mean(LOSS, MASK, num_seqs=13), torch.tensor(0.5))


def test_seq_mean_token_sum():
    torch.testing.assert_close(seq_mean_token_sum(LOSS, MASK), torch.tensor(6.0))
    torch.testing.assert_close(seq_mean_token_sum(LOSS, MASK, num_seqs=6), torch.tensor(3.0))


def test_const_norm():
    torch.testing.assert_close(const_norm(LOSS, MASK), torch.tensor(2.0))
    torch.testing.assert_close(const_norm(LOSS, MASK, num_seqs=2, max_len=9), torch.tensor(1.0))


def test_float_mask_gives_the_same_result():
    for name in AGGREGATIONS.names():
        fn = AGGREGATIONS.get(name)
        torch.testing.assert_close(fn(LOSS, MASK.float()), fn(LOSS, MASK))


@pytest.mark.parametrize("name", ["const_norm", "seq_mean_token_mean", "seq_mean_token_sum", "token_mean"])
def test_empty_mask_gives_zero_not_nan(name):
    assert AGGREGATIONS.get(name)(LOSS, torch.zeros_like(MASK)) == 0.0


def test_token_mean_gradient_is_uniform_over_valid_decisions():
    loss = LOSS.clone().requires_grad_()
    token_mean(loss, MASK).backward()
    torch.testing.assert_close(loss.grad, MASK.float() / 5)
