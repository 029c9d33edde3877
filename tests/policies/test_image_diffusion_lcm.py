"""RLCM: the multistep consistency sampler (transition: lcm) against diffusers' LCMScheduler."""

import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.weights import build_policy  # noqa: E402
from mmrl.denoising import make_transition  # noqa: E402
from mmrl.denoising.schedules import lcm_timesteps  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.image_diffusion import ImageDiffusionConfig  # noqa: E402

CONDITIONS = torch.tensor([0, 1, 2, 0])


def make(steps: int, prediction_type: str = "epsilon", **denoising):
    torch.manual_seed(0)
    options = {"transition": "lcm", "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_inference_steps": steps, "stochastic_steps": "window", "window_size": steps - 1, "clip_denoised": None, "min_std": 0.0, **denoising}
    cfg = from_dict(ImageDiffusionConfig, {"type": "image_diffusion", "prediction_type": prediction_type, "denoising": options}, "policy")
    return build_policy(cfg, {"num_prompts": 3})


def scheduler(prediction_type: str = "epsilon"):
    # LCMScheduler's defaults: Stable Diffusion's scaled_linear schedule from 0.00085 to 0.012
    return diffusers.LCMScheduler(num_train_timesteps=1000, original_inference_steps=50, clip_sample=False, prediction_type=prediction_type)


@pytest.mark.parametrize("steps", [1, 2, 4, 8, 50])
def test_lcm_timesteps_are_the_lcm_schedulers(steps):
    s = scheduler()
    s.set_timesteps(steps)
    assert torch.equal(lcm_timesteps(1000, steps, 50), s.timesteps.long())


@pytest.mark.numerics
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_every_lcm_step_is_the_lcm_scheduler_step_with_its_noise_as_the_decision(prediction_type):
    """Given the same x_t, diffusers' LCMScheduler makes x_prev = sqrt(ᾱ_prev)·f + sqrt(1 − ᾱ_prev)·z
    with f its ``denoised``; mmrl's chain draws x_prev from N(sqrt(ᾱ_prev)·f, (1 − ᾱ_prev) I) and
    ends on f itself. The noise z that makes diffusers' step land on mmrl's sample is recovered,
    and fed back, step by step: the two loops then produce the same images."""
    steps = 4
    policy = make(steps, prediction_type)
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(1))
    latents = sample.replay["chain"]["latents"]
    sched = scheduler(prediction_type)
    sched.set_timesteps(steps)
    x = latents[:, 0]
    with torch.no_grad():
        for k, t in enumerate(sched.timesteps):
            out = policy.unet(x, t, class_labels=CONDITIONS).sample
            denoised = sched.step(out, t, x, return_dict=False)[1]
            if k < steps - 1:
                ab_prev = sched.alphas_cumprod[sched.timesteps[k + 1]]
                z = (latents[:, k + 1] - ab_prev.sqrt() * denoised) / (1 - ab_prev).sqrt()
                assert abs(z.std().item() - 1) < 0.1 and abs(z.mean().item()) < 0.1  # a standard normal draw
                x = ab_prev.sqrt() * denoised + (1 - ab_prev).sqrt() * z
            else:
                x = denoised
            # the scheduler's float32 step and ours in another order, z recovered by a division by
            # sqrt(1 - alpha_bar_prev) (measured: at most 1.1e-5, 0.7% of the tolerance)
            torch.testing.assert_close(x, latents[:, k + 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sample.output, x, atol=1e-4, rtol=1e-4)


@pytest.mark.numerics
def test_lcm_step_log_probs_are_the_closed_form_gaussian_density_in_float64():
    steps = 4
    policy = make(steps)
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(2))
    chain = sample.replay["chain"]
    transition = make_transition(policy.denoising)
    denoise = policy.chain_denoiser(sample.replay)
    rows = torch.arange(4)
    with torch.no_grad():
        for k in range(steps - 1):
            x, x_next = chain["latents"][:, k].double(), chain["latents"][:, k + 1].double()
            step = torch.full((4,), k)
            mean, std = transition.mean_std(step, x.float(), denoise(x.float(), transition.model_time(step), rows), torch.ones(4, dtype=torch.bool))
            mean, std = mean.double(), std.double()
            ab_prev = float(transition.alpha_bar_prev[k])
            assert torch.allclose(std, torch.full_like(std, math.sqrt(1 - ab_prev)), rtol=1e-6)
            expected = torch.distributions.Normal(mean, std).log_prob(x_next).flatten(1).sum(1)
            torch.testing.assert_close(sample.logp[:, k].double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    assert torch.equal(sample.mask[:, -1], torch.zeros(4)) if sample.mask is not None else True  # the last step is no decision
    # log_prob runs the 3 decision steps in one UNet call, sampling one step a call: another
    # batch, so each ~-1000 log-prob may sum its n = 3 x 16 x 16 terms' roundings otherwise,
    # ~sqrt(n) u |logp| (measured: bitwise equal here, 2 ulps with the rows doubled); chunk_steps: 1
    # would be exact
    u = torch.finfo(torch.float32).eps / 2
    atol = math.sqrt(3 * 16 * 16) * u * sample.logp.abs().max().item()
    torch.testing.assert_close(policy.log_prob(sample.replay), sample.logp, atol=atol, rtol=0)


def test_lcm_needs_its_schedule_to_hold_the_steps():
    with pytest.raises(ConfigError, match="lcm_original_steps"):
        make(8, lcm_original_steps=4)
    with pytest.raises(ConfigError, match="min_std"):
        make(4, stochastic_steps="all", window_size=None)  # the last step outputs f with std 0
