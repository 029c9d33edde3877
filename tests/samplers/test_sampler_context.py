"""Samplers read the run through a ``SamplerContext``, made from the run config in one place."""

import dataclasses

import pytest

from mmrl.config import from_dict
from mmrl.core.sampler import SamplerContext, sampler_context
from mmrl.samplers.env import EnvSampler
from mmrl.samplers.prompt import PromptSampler
from mmrl.train.run_config import TrainConfig
from tests.conftest import point_reach_config
from tests.rollout.test_engine import toy

GAE = {"advantage": {"type": "gae", "gamma": 0.9, "lam": 0.95, "bootstrap_truncated": True}, "group_size": 4, "groups_per_step": 6}


def _gae_run() -> TrainConfig:
    return from_dict(TrainConfig, point_reach_config(algo=GAE, critic={"type": "mlp", "hidden_sizes": [8]}, env={"num_envs": 16}, rollout={"over_provision": 1.5}))


def test_the_context_holds_what_samplers_read_of_the_run_config():
    cfg = _gae_run()
    ctx = sampler_context(cfg)
    assert ctx == SamplerContext(seed=cfg.seed, env=cfg.env, rewards=tuple(cfg.rewards), policy_type="gaussian_mlp", gamma=0.9, bootstrap_truncated=True, over_provision=1.5, groups_per_step=6, group_size=4)
    assert sampler_context(from_dict(TrainConfig, point_reach_config())).bootstrap_truncated is False  # an advantage without the option
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.seed = 1  # type: ignore[misc]


def test_every_field_is_documented_in_the_class_docstring():
    doc = SamplerContext.__doc__
    assert all(f"``{f.name}``" in doc for f in dataclasses.fields(SamplerContext))


def test_a_section_of_the_run_config_is_refused_with_the_field_to_read_instead():
    ctx = sampler_context(_gae_run())
    with pytest.raises(AttributeError, match=r"no 'algo'.*ctx\.gamma, ctx\.bootstrap_truncated, ctx\.groups_per_step"):
        ctx.algo  # noqa: B018
    with pytest.raises(AttributeError, match=r"no 'rollout'.*ctx\.over_provision"):
        ctx.rollout  # noqa: B018
    assert not hasattr(ctx, "optim")


def test_the_built_in_samplers_read_their_context():
    cfg = _gae_run()
    sampler = EnvSampler(cfg.sampler, sampler_context(cfg))
    try:
        assert (sampler.seed, sampler.gamma, sampler.bootstrap, sampler.over_provision) == (cfg.seed, 0.9, True, 1.5)
    finally:
        sampler.close()
    cfg = from_dict(TrainConfig, toy(seed=5))
    sampler = PromptSampler(cfg.sampler, sampler_context(cfg))
    assert (sampler.seed, sampler.groups_per_step, sampler.over_provision) == (5, 4, 1.0)
