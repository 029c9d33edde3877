"""A loss declares the settings it needs elsewhere in the run config once (``Loss.requires``);
``check_requirements`` reports every unmet one in one line."""

from types import SimpleNamespace

import pytest

from mmrl.algo.losses import Requirement, check_requirements
from mmrl.errors import ConfigError
from mmrl.registry import LOSSES

NEEDS = (
    Requirement("policy.denoising.transition", "flow_ode", "it samples with the ODE"),
    Requirement("policy.denoising.logp_granularity", "chain", "one loss per chain"),
    Requirement("algo.kl.coef", 0.0, "no log-probs for a KL term"),
)


def config(transition="flow_ode", granularity="chain", coef=0.0, policy_type="image_diffusion", denoising=True):
    options = SimpleNamespace(transition=transition, logp_granularity=granularity)
    policy = SimpleNamespace(type=policy_type, **({"denoising": options} if denoising else {}))
    return SimpleNamespace(policy=policy, algo=SimpleNamespace(kl=SimpleNamespace(coef=coef)))


def test_a_config_that_meets_every_requirement_passes():
    check_requirements("nft", NEEDS, config())
    check_requirements("nft", NEEDS, config(coef=0))  # 0 == 0.0


def test_one_unmet_requirement_names_its_own_field_value_and_what_is_needed():
    with pytest.raises(ConfigError) as e:
        check_requirements("nft", NEEDS, config(coef=0.04))
    assert (e.value.field, e.value.value) == ("algo.kl.coef", 0.04)
    assert str(e.value) == "algo.kl.coef: got 0.04; algo.loss nft needs 0: no log-probs for a KL term"


def test_every_unmet_requirement_is_in_one_line_with_the_overrides_that_meet_them():
    with pytest.raises(ConfigError) as e:
        check_requirements("nft", NEEDS, config(transition="flow_sde", granularity="step", coef=0.04))
    message = str(e.value)
    assert (e.value.field, e.value.value) == ("algo.loss.type", "nft") and "\n" not in message
    assert "policy.denoising.transition flow_ode (got 'flow_sde'; it samples with the ODE)" in message
    assert "policy.denoising.logp_granularity chain (got 'step'; one loss per chain)" in message
    assert "algo.kl.coef 0 (got 0.04; no log-probs for a KL term)" in message
    assert message.endswith("override: policy.denoising.transition=flow_ode policy.denoising.logp_granularity=chain algo.kl.coef=0")


def test_a_policy_without_the_field_is_told_so():
    with pytest.raises(ConfigError) as e:
        check_requirements("nft", NEEDS, config(policy_type="text_lm", denoising=False))
    assert e.value.field == "algo.loss.type" and "policy.denoising.transition flow_ode (policy text_lm has no such field; " in str(e.value)


def test_the_built_in_losses_declare_what_they_need():
    assert {r.field: r.value for r in LOSSES.get("nft").requires} == {"policy.denoising.transition": "flow_ode", "policy.denoising.logp_granularity": "chain", "algo.kl.coef": 0.0}
    assert {r.field: r.value for r in LOSSES.get("sac").requires} == {"algo.kl.coef": 0.0}
    assert LOSSES.get("policy_gradient").requires == ()
