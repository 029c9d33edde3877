"""``DenoisingOptions``: the ``policy.denoising`` section every denoising policy embeds."""

import pytest
import torch

from mmrl.config import from_dict
from mmrl.denoising import DenoisingOptions, DiffusionTransition, FlowTransition, make_transition, stochastic_mask
from mmrl.errors import ConfigError


def options(**fields) -> DenoisingOptions:
    return from_dict(DenoisingOptions, fields, "policy.denoising")


@pytest.mark.parametrize(
    "fields, window, mask",
    [
        ({}, (0, 5), [1, 1, 1, 1, 1]),
        ({"stochastic_steps": "last", "window_size": 2}, (3, 5), [0, 0, 0, 1, 1]),
        ({"stochastic_steps": "last"}, (0, 5), [1, 1, 1, 1, 1]),
        ({"stochastic_steps": "window", "window_start": 1, "window_size": 2}, (1, 3), [0, 1, 1, 0, 0]),
        ({"stochastic_steps": "window", "window_start": 2}, (2, 5), [0, 0, 1, 1, 1]),
        ({"stochastic_steps": "all", "window_size": 2}, (0, 5), [1, 1, 1, 1, 1]),  # the window fields are for the other modes
    ],
)
def test_the_window_and_the_stochastic_mask_of_each_mode(fields, window, mask):
    opts = options(num_inference_steps=5, **fields)
    assert opts.window == window
    assert stochastic_mask(opts, 3).tolist() == [[bool(m) for m in mask]] * 3


def test_random_mode_draws_one_step_per_sample_inside_the_window_from_the_generator():
    opts = options(num_inference_steps=6, stochastic_steps="random", window_start=1, window_size=3)
    mask = stochastic_mask(opts, 200, torch.Generator().manual_seed(0))
    assert (mask.sum(1) == 1).all() and set(mask.float().argmax(1).tolist()) == {1, 2, 3}
    assert torch.equal(mask, stochastic_mask(opts, 200, torch.Generator().manual_seed(0)))


def test_flow_ode_has_no_stochastic_step():
    assert not stochastic_mask(options(transition="flow_ode"), 4).any()


def test_make_transition_builds_the_named_transition_on_its_schedule():
    ddpm = make_transition(options(transition="ddpm", num_inference_steps=4, num_train_timesteps=20, min_std=0.1))
    assert isinstance(ddpm, DiffusionTransition) and ddpm.name == "ddpm" and ddpm.num_steps == 4
    assert ddpm.timesteps.tolist() == [19, 14, 9, 4]  # trailing spacing
    cps = make_transition(options(transition="flow_cps", noise_level=0.4, num_inference_steps=4, time_shift=3.0, min_std=0.1))
    assert isinstance(cps, FlowTransition) and cps.name == "flow_cps" and cps.noise_level == pytest.approx(0.4)
    assert cps.sigmas[1].item() == pytest.approx(3 * 0.75 / (1 + 2 * 0.75))  # the SD3 shift
    assert make_transition(options(transition="flow_noise"), deterministic=True).name == "flow_ode"
    dance = make_transition(options(sde_diffusion="constant", noise_level=0.3))
    assert dance.name == "flow_sde" and dance.diffusion == "constant" and make_transition(options()).diffusion == "flow_grpo"


def test_log_prob_options_are_the_chain_functions_keyword_arguments():
    opts = options(min_std=0.1, logp_reduction="mean", logp_element_clamp=[-5, 2])
    assert opts.log_prob_options == {"min_std": 0.1, "reduce": "mean", "clamp": (-5.0, 2.0)}


@pytest.mark.parametrize(
    "fields, field, allowed",
    [
        ({"transition": "euler"}, "transition", "allowed: ddim, ddpm, lcm, flow_sde"),
        ({"transition": "ddim", "num_inference_steps": 50, "num_train_timesteps": 20, "min_std": 0.1}, "num_inference_steps", "<= num_train_timesteps (20)"),
        ({"transition": "ddim"}, "min_std", "last step of ddim has std 0"),
        ({"transition": "flow_cps", "stochastic_steps": "random"}, "min_std", "last step of flow_cps"),
        ({"transition": "flow_cps", "noise_level": 1.2, "min_std": 0.1}, "noise_level", "(0, 1]"),
        ({"stochastic_steps": "window", "window_start": 10}, "window_start", "< num_inference_steps (10)"),
        ({"stochastic_steps": "window", "window_start": 8, "window_size": 3}, "window_size", "at most 2"),
        ({"stochastic_steps": "last", "window_size": 11}, "window_size", "at most 10"),
        ({"noise_std_range": [0.3, 0.1]}, "noise_std_range", "0 < lo <= hi"),
        ({"noise_std_range": [0.1, float("inf")]}, "noise_std_range", "both finite"),
        ({"time_shift": float("inf")}, "time_shift", "finite number > 0"),
        ({"logp_element_clamp": [2, -5]}, "logp_element_clamp", "lo < hi"),
        ({"chunk_steps": 0}, "chunk_steps", ">= 1"),
        ({"logp_granularity": "token"}, "logp_granularity", "allowed: step, chain"),
        ({"sde_diffusion": "langevin"}, "sde_diffusion", "allowed: flow_grpo, constant"),
        ({"train_fraction": 0.0}, "train_fraction", "> 0"),
        ({"transition": "ddim", "min_std": 0.1, "num_train_timesteps": 20, "eval_num_inference_steps": 40}, "eval_num_inference_steps", "<= num_train_timesteps (20)"),
        ({"transition": "lcm", "min_std": 0.1, "eval_num_inference_steps": 60}, "eval_num_inference_steps", "<= lcm_original_steps (50)"),
        ({"eval_num_inference_steps": 0}, "eval_num_inference_steps", ">= 1"),
        ({"transition": "flow_cps", "sde_diffusion": "constant", "min_std": 0.1}, "sde_diffusion", "only flow_sde"),
    ],
)
def test_bad_options_name_the_field_the_value_and_what_is_allowed(fields, field, allowed):
    with pytest.raises(ConfigError, match=f"policy.denoising.{field}") as error:
        options(**fields)
    assert allowed in str(error.value)


def test_a_ddim_window_that_ends_before_the_last_step_needs_no_std_floor():
    opts = options(transition="ddim", stochastic_steps="window", window_size=4, num_inference_steps=5)
    assert opts.window == (0, 4) and opts.min_std == 0


def test_the_transition_choices_are_the_transitions_mmrl_denoising_implements():
    import typing

    from mmrl.denoising import TRANSITIONS

    assert set(typing.get_args(typing.get_type_hints(DenoisingOptions)["transition"])) == set(TRANSITIONS)


def test_deterministic_options_take_the_evaluation_steps_over_the_whole_chain():
    opts = options(num_inference_steps=10, stochastic_steps="window", window_size=3, eval_num_inference_steps=40)
    det = opts.deterministic_options()
    assert det.num_inference_steps == 40 and det.window == (0, 40) and det.eval_num_inference_steps is None
    assert make_transition(det, deterministic=True).num_steps == 40 and make_transition(opts).num_steps == 10
    assert options().deterministic_options() is not None and options(eval_num_inference_steps=10).deterministic_options().num_inference_steps == 10
