import math
from dataclasses import dataclass

import pytest
import torch

from mmrl.algo.correction import CorrectionConfig, MISConfig, TISConfig, apply_correction, mis, no_correction, tis
from mmrl.algo.objective import decoupled_ppo, ppo_clip
from mmrl.config import from_dict, option, own_options
from mmrl.errors import ConfigError
from mmrl.registry import CORRECTIONS

# Log-ratios ℓ = logπ_old − logμ. Row 0: ratios 0.5, 2, 4 (product 4, geometric 4^(1/3));
# row 1: ratios 5, 1.5 and a padding decision (product 7.5, geometric sqrt(7.5)).
RATIOS = [[0.5, 2.0, 4.0], [5.0, 1.5, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def _logps():
    """(old_logp, behaviour_logp) with the ratios above on valid decisions and NaN /
    a huge log-ratio on the padding decision, both with grad (neither may get one)."""
    behaviour = torch.full((2, 3), -1.0)
    behaviour[1, 2] = float("nan")
    old = behaviour + torch.tensor(RATIOS).log()
    old[1, 2] = 50.0
    return old.requires_grad_(), behaviour.requires_grad_()


def _call(fn, **options):
    old, behaviour = _logps()
    return fn(old, behaviour, MASK.float(), **options)


def test_registry_holds_every_correction_with_its_config():
    assert CORRECTIONS.names() == ["mis", "none", "tis"]
    configs = {e.name: e.config for e in CORRECTIONS.entries()}
    assert configs == {"none": CorrectionConfig, "tis": TISConfig, "mis": MISConfig}
    assert {e.name: e.traits["needs_behaviour"] for e in CORRECTIONS.entries()} == {"none": False, "tis": True, "mis": True}


def test_none_is_the_identity():
    old, _ = _logps()
    weight, mask, stats = no_correction(old, None, MASK.float())
    assert torch.equal(weight, torch.ones(2, 3)) and torch.equal(mask, MASK) and stats == {}
    loss = torch.randn(2, 3)
    assert torch.equal(apply_correction(loss, weight), loss)
    assert not weight.requires_grad


def test_tis_token_truncates_at_the_cap():
    weight, mask, stats = _call(tis, cap=3.0)
    # 0.5, 2, min(4, 3);  min(5, 3), 1.5, padding 1
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0, 3.0], [3.0, 1.5, 1.0]]))
    assert torch.equal(mask, MASK)
    torch.testing.assert_close(stats["correction/weight_mean"], torch.tensor(10.0 / 5))
    torch.testing.assert_close(stats["correction/weight_max"], torch.tensor(3.0))
    torch.testing.assert_close(stats["correction/truncated_fraction"], torch.tensor(2 / 5))


def test_tis_floor_raises_small_weights():
    weight, _, stats = _call(tis, cap=3.0, floor=0.6)
    torch.testing.assert_close(weight, torch.tensor([[0.6, 2.0, 3.0], [3.0, 1.5, 1.0]]))
    torch.testing.assert_close(stats["correction/weight_mean"], torch.tensor(10.1 / 5))
    torch.testing.assert_close(stats["correction/truncated_fraction"], torch.tensor(3 / 5))


def test_tis_sequence_is_the_product_of_the_valid_token_ratios():
    weight, _, stats = _call(tis, level="sequence", cap=10.0)
    torch.testing.assert_close(weight, torch.tensor([[4.0, 4.0, 4.0], [7.5, 7.5, 1.0]]))
    torch.testing.assert_close(stats["correction/weight_mean"], torch.tensor((12.0 + 15.0) / 5))
    torch.testing.assert_close(stats["correction/weight_max"], torch.tensor(7.5))
    torch.testing.assert_close(stats["correction/truncated_fraction"], torch.tensor(0.0))
    weight, _, stats = _call(tis, level="sequence", cap=5.0)
    torch.testing.assert_close(weight, torch.tensor([[4.0, 4.0, 4.0], [5.0, 5.0, 1.0]]))
    torch.testing.assert_close(stats["correction/truncated_fraction"], torch.tensor(2 / 5))


def test_tis_geometric_is_the_geometric_mean_over_valid_decisions():
    weight, _, stats = _call(tis, level="geometric", cap=2.0)
    g0 = 4.0 ** (1 / 3)  # 1.587401; row 1: sqrt(7.5) = 2.738613 → 2
    torch.testing.assert_close(weight, torch.tensor([[g0, g0, g0], [2.0, 2.0, 1.0]]))
    torch.testing.assert_close(stats["correction/truncated_fraction"], torch.tensor(2 / 5))


def test_mis_token_masks_decisions_outside_the_band():
    weight, mask, stats = _call(mis, level="token", lo=0.6, hi=3.0)
    # kept: 2 and 1.5 keep their ratio; 0.5, 4 and 5 are masked
    torch.testing.assert_close(weight, torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.5, 1.0]]))
    assert mask.tolist() == [[False, True, False], [False, True, False]]
    torch.testing.assert_close(stats["correction/masked_fraction"], torch.tensor(3 / 5))
    torch.testing.assert_close(stats["correction/weight_mean"], torch.tensor(3.5 / 5))
    torch.testing.assert_close(stats["correction/weight_max"], torch.tensor(2.0))


def test_mis_without_reweight_keeps_weight_one():
    weight, mask, stats = _call(mis, level="token", lo=0.6, hi=3.0, reweight=False)
    torch.testing.assert_close(weight, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]))
    assert mask.tolist() == [[False, True, False], [False, True, False]]
    torch.testing.assert_close(stats["correction/weight_mean"], torch.tensor(2 / 5))


def test_mis_sequence_masks_whole_sequences():
    weight, mask, stats = _call(mis, level="sequence", hi=5.0)
    # product 4 kept (weight 4), product 7.5 masked
    torch.testing.assert_close(weight, torch.tensor([[4.0, 4.0, 4.0], [0.0, 0.0, 1.0]]))
    assert mask.tolist() == [[True, True, True], [False, False, False]]
    torch.testing.assert_close(stats["correction/masked_fraction"], torch.tensor(2 / 5))


def test_mis_geometric_with_a_lower_bound_only():
    weight, mask, stats = _call(mis, level="geometric", lo=2.0, hi=None)
    g1 = math.sqrt(7.5)  # row 0's 1.587 < 2 is masked
    torch.testing.assert_close(weight, torch.tensor([[0.0, 0.0, 0.0], [g1, g1, 1.0]]))
    assert mask.tolist() == [[False, False, False], [True, True, False]]
    torch.testing.assert_close(stats["correction/masked_fraction"], torch.tensor(3 / 5))


def test_bounds_are_inclusive():
    old = torch.log(torch.tensor([[0.5, 1.0, 2.0]]))
    _, mask, _ = mis(old, torch.zeros(1, 3), torch.ones(1, 3), level="token", lo=0.5, hi=2.0)
    assert mask.all()
    weight, _, stats = tis(old, torch.zeros(1, 3), torch.ones(1, 3), cap=2.0, floor=0.5)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 1.0, 2.0]]))
    assert stats["correction/truncated_fraction"] == 0


@pytest.mark.parametrize("fn, options", [(tis, {}), (tis, {"level": "sequence"}), (mis, {}), (mis, {"level": "token"})])
def test_padding_never_counts_and_weights_carry_no_gradient(fn, options):
    old, behaviour = _logps()
    weight, mask, stats = fn(old, behaviour, MASK.float(), **options)
    assert not weight.requires_grad and weight.grad_fn is None
    assert all(not s.requires_grad for s in stats.values())
    assert torch.isfinite(weight).all() and weight[1, 2] == 1 and not mask[1, 2]
    # changing the padding decision's log-probs changes nothing
    other_old, other_behaviour = old.detach().clone(), behaviour.detach().clone()
    other_old[1, 2], other_behaviour[1, 2] = -3.0, 0.0
    again = fn(other_old, other_behaviour, MASK.float(), **options)
    assert torch.equal(again[0], weight) and torch.equal(again[1], mask)
    assert all(torch.equal(again[2][k], stats[k]) for k in stats)
    # the objective's gradient flows through logp only, scaled by the weight
    logp = old.detach().clone().requires_grad_()
    loss, _ = ppo_clip(logp, old.detach(), torch.ones(2, 3), eps_low=10.0, eps_high=10.0)  # unclipped
    grad_logp, grad_old, grad_behaviour = torch.autograd.grad(
        (apply_correction(loss, weight) * MASK).sum(), (logp, old, behaviour), allow_unused=True
    )
    assert grad_old is None and grad_behaviour is None
    torch.testing.assert_close(grad_logp, -weight * MASK)


def test_a_nan_log_prob_on_a_valid_decision_counts_as_on_policy():
    # a sampler that could not score a decision (vLLM: NaN) leaves it uncorrected, as TRL
    old = torch.log(torch.tensor([[2.0, 4.0]]))
    behaviour = torch.tensor([[float("nan"), 0.0]])
    weight, mask, _ = tis(old, behaviour, torch.ones(1, 2), cap=10.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 4.0]]))
    weight, _, _ = tis(old, behaviour, torch.ones(1, 2), level="sequence", cap=10.0)
    torch.testing.assert_close(weight, torch.tensor([[4.0, 4.0]]))
    weight, mask, _ = mis(old, behaviour, torch.ones(1, 2), level="token", hi=3.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 0.0]]))


def test_an_empty_mask_gives_zero_stats():
    old, behaviour = _logps()
    empty = torch.zeros(2, 3)
    for fn in (tis, mis):
        weight, mask, stats = fn(old, behaviour, empty)
        assert torch.equal(weight, torch.ones(2, 3)) and not mask.any()
        assert all(v == 0 for v in stats.values())


def test_log_ratio_is_clamped_before_exp_but_mis_masks_on_the_raw_ratio():
    old, behaviour, mask = torch.tensor([[30.0, 21.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    weight, _, _ = tis(old, behaviour, mask, cap=1e30)
    torch.testing.assert_close(weight, torch.full((1, 2), math.exp(20.0)))
    weight, _, _ = tis(old, behaviour, mask, cap=1e30, log_ratio_clamp=5.0)
    torch.testing.assert_close(weight, torch.full((1, 2), math.exp(5.0)))
    # hi = 1e10 = e^23.03: a ratio of e^30 is masked although its clamped value e^20 is below hi
    weight, keep, _ = mis(old, behaviour, mask, level="token", hi=1e10)
    assert keep.tolist() == [[False, True]]
    torch.testing.assert_close(weight, torch.tensor([[0.0, math.exp(20.0)]]))
    # the sequence sum is clamped after summing: Σ = 51 → e^20
    weight, _, _ = tis(old, behaviour, mask, level="sequence", cap=1e30)
    torch.testing.assert_close(weight, torch.full((1, 2), math.exp(20.0)))


def test_decoupled_ppo_is_ppo_clip_on_the_proximal_policy_times_token_mis():
    gen = torch.Generator().manual_seed(0)
    behaviour = -3 * torch.rand(4, 6, generator=gen)
    prox = behaviour + 1.2 * torch.randn(4, 6, generator=gen)
    logp = (prox + 0.3 * torch.randn(4, 6, generator=gen)).requires_grad_()
    adv = torch.randn(4, 1, generator=gen)
    mask = torch.ones(4, 6)
    theirs, stats = decoupled_ppo(logp, behaviour, adv, prox_logp=prox, behav_weight_cap=2.0)
    weight, keep, _ = mis(prox, behaviour, mask, level="token", hi=2.0)
    ours = apply_correction(ppo_clip(logp, prox, adv)[0], weight)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(weight, stats["behav_weight"])
    assert torch.equal(~keep, stats["behav_capped"].bool())
    assert 0 < stats["behav_capped"].sum() < 24


@dataclass
class _Algo:
    correction: CorrectionConfig = option(factory=CorrectionConfig, doc="off-policy correction")


def test_config_section_builds_each_correction():
    assert from_dict(_Algo, {}).correction == CorrectionConfig(type="none")
    cfg = from_dict(_Algo, {"correction": "mis"}).correction
    assert cfg == MISConfig(type="mis", log_ratio_clamp=20.0, level="sequence", lo=None, hi=3.0, reweight=True)
    cfg = from_dict(_Algo, {"correction": {"type": "tis", "level": "geometric", "cap": "2", "log_ratio_clamp": 10}}).correction
    assert isinstance(cfg, TISConfig) and (cfg.level, cfg.cap, cfg.floor, cfg.log_ratio_clamp) == ("geometric", 2.0, None, 10.0)
    options = own_options(cfg, CorrectionConfig)
    assert options == {"level": "geometric", "cap": 2.0, "floor": None}
    old, behaviour = _logps()
    built = CORRECTIONS.get(cfg.type)(old, behaviour, MASK, log_ratio_clamp=cfg.log_ratio_clamp, **options)
    direct = tis(old, behaviour, MASK, level="geometric", cap=2.0, log_ratio_clamp=10.0)
    assert torch.equal(built[0], direct[0]) and torch.equal(built[1], direct[1])
    assert own_options(from_dict(_Algo, {"correction": "none"}).correction, CorrectionConfig) == {}


@pytest.mark.parametrize(
    "section, key",
    [
        ({"type": "mis", "lo": 2.0, "hi": 1.0}, "correction.lo"),
        ({"type": "mis", "hi": None}, "correction.hi"),
        ({"type": "tis", "floor": 3.0, "cap": 3.0}, "correction.floor"),
        ({"type": "tis", "level": "sentence"}, "correction.level"),
        ({"type": "tis", "cap": 0}, "correction.cap"),
        ({"type": "none", "cap": 2.0}, "correction.cap"),
        ({"type": "psis"}, "correction.type"),
    ],
)
def test_config_rejects_bad_sections(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_dict(_Algo, {"correction": section})


def test_unknown_level_raises():
    with pytest.raises(ValueError, match="geometric"):
        tis(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), level="sentence")
