import json
import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
cv2 = pytest.importorskip("cv2")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.weights import build_policy, load_pretrained, save_pretrained  # noqa: E402
from mmrl.denoising import flow_sigmas  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.diffusers_common import diffusion_target, epsilon_from_prediction  # noqa: E402
from mmrl.policies.image_diffusion import ImageDiffusionConfig, ImageDiffusionPolicy  # noqa: E402
from tests.conftest import assert_kept_sampling_graph_matches_recompute  # noqa: E402

CONDITIONS = torch.tensor([0, 1, 2, 0])
PROMPTS = ["a red circle", "two blue squares", "", "a red circle"]
# Where a recompute cannot run the UNet on the sampling pass's batches (a random subset of
# steps per chain): the diffusion default floors the last step's std at 0.01 (its std is 0
# otherwise); a float32 UNet run on another batch composition moves its mean by a few ulps k,
# and each of the n = 3 x 16 x 16 pixel terms of that step's log-prob by z k u / 0.01,
# ~sqrt(n) k u / 0.01 ~ 1e-3 in all (docs/images.md; measured: at most 7.3e-4 under
# ATEN_CPU_CAPABILITY default, avx2 and avx512, 1.2e-3 with MKL and oneDNN also on their SSE4
# kernels). Everywhere else the tests compare the same computation, to the bit: the trainer
# takes the ratio's old log-probs from its own pass (denoising.old_logp: deferred).
OTHER_BATCH_ATOL = 1e-2


def make(seed: int = 0, spec: dict | None = None, **fields) -> ImageDiffusionPolicy:
    torch.manual_seed(seed)
    return build_policy(from_dict(ImageDiffusionConfig, {"type": "image_diffusion", **fields}, "policy"), {"num_prompts": 3} if spec is None else spec)


TRANSITIONS = {
    "ddim": {"transition": "ddim", "eta": 1.0},
    "ddpm": {"transition": "ddpm"},
    "flow_sde": {"transition": "flow_sde", "noise_level": 0.7, "min_std": 0.0},
}


@pytest.mark.numerics
@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("transition", sorted(TRANSITIONS))
def test_sampled_log_probs_are_deferred_and_one_step_per_call_reproduces_them_exactly(transition, guidance):
    # the sampling pass's numbers are provisional: the trainer's own pass gives the ratio's old
    # log-probs. chunk_steps 1 runs the UNet on the batch that sampling ran it on: the same
    # float32 sums, so the two computations agree to the bit
    assert make(denoising=TRANSITIONS[transition], guidance_scale=guidance).sample(CONDITIONS, torch.Generator().manual_seed(1)).logp_deferred
    policy = make(denoising={**TRANSITIONS[transition], "chunk_steps": 1, "old_logp": "sampler"}, guidance_scale=guidance)
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(1))
    assert sample.logp.shape == (4, 8) and torch.isfinite(sample.logp).all() and not sample.logp_deferred
    with torch.no_grad():
        assert torch.equal(policy.log_prob(sample.replay), sample.logp)


@pytest.mark.numerics
@pytest.mark.parametrize(("stochastic_steps", "guidance"), [("all", 1.0), ("random", 1.0), ("all", 3.0)])
@pytest.mark.parametrize("transition", ["ddim", "flow_sde"])
def test_the_kept_sampling_graph_gives_the_recomputed_log_probs_and_gradient(transition, stochastic_steps, guidance):
    """sample(keep_graph=True): the log-probs log_prob recomputes, and their gradient (float64)."""
    assert_kept_sampling_graph_matches_recompute(
        lambda: make(denoising={**TRANSITIONS[transition], "stochastic_steps": stochastic_steps}, guidance_scale=guidance, guidance_grad="both"), CONDITIONS
    )


@pytest.mark.parametrize("guidance_grad", ["detached", "both"])
@pytest.mark.numerics
def test_text_prompts_with_guidance_give_ratio_one_and_the_gradient_reaches_the_unet_only(guidance_grad):
    policy = make(spec={}, tiny={"conditioning": "text"}, guidance_scale=2.0, guidance_grad=guidance_grad, denoising={"chunk_steps": 1})
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    assert sample.replay["prompt_ids"].shape == (4, 16)
    logp = policy.log_prob(sample.replay)
    assert torch.equal(logp.detach(), sample.logp)
    logp.sum().backward()
    assert all(p.grad is None for p in policy.text_encoder.parameters())  # frozen by default
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.unet.parameters())


WORDS = {"vocabulary": ["a", "two", "red", "blue", "circle", "squares"], "text_layers": 0}


@pytest.mark.parametrize("text", [{}, WORDS], ids=["bytes", "words"])
@pytest.mark.numerics
def test_pooled_text_conditioning_reads_the_prompt_without_attention_blocks(tmp_path, text):
    # the prompt's states, attention-pooled into the timestep embedding: a cheap global condition,
    # over the byte-level tokenizer or a word-level one (tiny.vocabulary) with no text layers
    tiny = {"conditioning": "text", "text_injection": "pooled", "pooling_heads": 4, **text}
    policy = make(spec={}, tiny=tiny, guidance_scale=2.0, train_text_encoder=True, denoising={**TRANSITIONS["flow_sde"], "chunk_steps": 1})
    assert policy.unet.config.addition_embed_type == "text"
    assert not any("attentions" in name for name, _ in policy.unet.named_parameters())
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(policy.log_prob(sample.replay), sample.logp)
    # from the same noise, another prompt gives another image and the same prompt the same one
    first = policy.sample(["a red circle", "two blue squares"], torch.Generator().manual_seed(0), deterministic=True).output
    second = policy.sample(["a red circle", "a red circle"], torch.Generator().manual_seed(0), deterministic=True).output
    assert torch.equal(first[0], second[0]) and not torch.allclose(first[1], second[1])
    policy.sft_loss({"images": torch.zeros(4, 16, 16, 3, dtype=torch.uint8), "prompt": PROMPTS}).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.text_encoder.parameters())
    save_pretrained(policy, tmp_path / "saved")
    again = load_pretrained(tmp_path / "saved").sample(PROMPTS, torch.Generator().manual_seed(0))
    assert torch.equal(again.output, sample.output)
    with pytest.raises(ConfigError, match=r"policy\.tiny\.pooling_heads"):
        make(spec={}, tiny={**tiny, "pooling_heads": 3})


def test_a_word_level_tokenizer_gives_one_token_per_word_and_unknown_words_one_token():
    from mmrl.policies.tiny_tokenizers import word_tokenizer

    tokenizer = word_tokenizer(["a", "two", "red", "circle", "circles"])
    ids = tokenizer(["A red circle", "two red circles", "two mauve circles!"], padding="max_length", max_length=5).input_ids
    unk, pad = tokenizer.unk_token_id, tokenizer.pad_token_id
    a, two, red, circle, circles = (tokenizer.convert_tokens_to_ids(w) for w in ("a", "two", "red", "circle", "circles"))
    assert ids == [[a, red, circle, pad, pad], [two, red, circles, pad, pad], [two, unk, circles, unk, pad]]
    assert len({a, two, red, circle, circles, unk, pad}) == 7


def test_a_text_policy_over_a_vocabulary_reads_unknown_words_alike_and_checks_the_words():
    tiny = {"conditioning": "text", "text_injection": "pooled", "pooling_heads": 4, **WORDS}
    policy = make(spec={}, tiny=tiny, denoising=TRANSITIONS["flow_sde"])
    assert policy.text_encoder.config.vocab_size == 3 + 6 and policy.text_encoder.config.num_hidden_layers == 0
    # words outside the vocabulary are one <unk> each, so two unknown colours read alike
    first = policy.sample(["a mauve circle", "a red circle"], torch.Generator().manual_seed(0), deterministic=True).output
    second = policy.sample(["a teal circle", "a blue circle"], torch.Generator().manual_seed(0), deterministic=True).output
    assert torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    for words in (["red", "Red"], ["light blue"], ["red,"]):
        with pytest.raises(ConfigError, match=r"policy\.tiny\.vocabulary"):
            make(spec={}, tiny={**tiny, "vocabulary": words})


def test_guidance_changes_the_samples_and_a_detached_unconditional_branch_changes_only_the_gradient():
    plain = make(guidance_scale=1.0).sample(CONDITIONS, torch.Generator().manual_seed(0))
    guided = make(guidance_scale=4.0).sample(CONDITIONS, torch.Generator().manual_seed(0))
    assert not torch.allclose(plain.output, guided.output)
    grads = {}
    for mode in ("detached", "both"):
        policy = make(guidance_scale=4.0, guidance_grad=mode)
        logp = policy.log_prob(guided.replay)
        logp.sum().backward()
        grads[mode] = policy.unet.class_embedding.weight.grad.clone()
    null = 3  # the null class (the last embedding) is used only by the unconditional branch
    assert grads["detached"][null].abs().sum() == 0
    assert grads["both"][null].abs().sum() > 0


def test_images_are_uint8_rgb_of_the_resolution_and_match_the_final_latent():
    policy = make(tiny={"resolution": 8})
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(0))
    images = sample.info["images"]
    assert images.dtype == torch.uint8 and images.shape == (4, 8, 8, 3)
    expected = ((sample.output.clamp(-1, 1) + 1) * 127.5).round().permute(0, 2, 3, 1)
    assert torch.equal(images, expected.to(torch.uint8))


@pytest.mark.numerics
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_a_vanishing_eta_reproduces_the_diffusers_ddim_loop(prediction_type):
    steps = 8
    # eta 1e-8: every step's std is then the min_std floor 1e-8, noise below float32 rounding
    # (at eta 1e-6 it moved entries near 0 by up to 6e-5, more than the rounding below)
    policy = make(prediction_type=prediction_type, denoising={"transition": "ddim", "eta": 1e-8, "num_inference_steps": steps, "min_std": 1e-8, "clip_denoised": None})
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((4, 3, 16, 16), generator=torch.Generator().manual_seed(3))
    ours = policy.sample(CONDITIONS, gen).output

    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=1000, beta_schedule="linear", clip_sample=False, set_alpha_to_one=True, timestep_spacing="trailing", prediction_type=prediction_type
    )
    scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = policy.unet(x, t, class_labels=CONDITIONS).sample
            x = scheduler.step(out, t, x, eta=0.0).prev_sample
    # two float32 loops order each step's arithmetic differently: a few ulps a step, which the
    # x0 of an epsilon prediction multiplies by up to 1/sqrt(alpha_bar) ~ 160 at t = 999 (the
    # random UNet's samples reach |x| ~ 630; measured: at most 5e-7 relative, 4% of the bound)
    torch.testing.assert_close(ours, x, atol=1e-4, rtol=1e-4)


@pytest.mark.numerics
@pytest.mark.parametrize("transition", ["flow_ode", "flow_sde"])
def test_the_flow_ode_and_a_vanishing_noise_level_reproduce_the_diffusers_flow_match_euler_loop(transition):
    steps = 6
    policy = make(denoising={"transition": transition, "noise_level": 1e-7, "num_inference_steps": steps, "min_std": 0.0})
    ours = policy.sample(CONDITIONS, torch.Generator().manual_seed(5)).output
    x = torch.randn((4, 3, 16, 16), generator=torch.Generator().manual_seed(5))

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(sigmas=flow_sigmas(steps)[:-1].tolist())  # mmrl's σ grid: 1 … 1/K, then 0
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = policy.unet(x, t.expand(4), class_labels=CONDITIONS).sample
            x = scheduler.step(out, t, x).prev_sample
    # two float32 Euler loops of 6 steps on |x| ~ 1 in another order, and the noise level's ~1e-7
    # a step (measured: at most 7e-7)
    torch.testing.assert_close(ours, x, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("transition", ["ddim", "flow_sde"])
def test_a_positive_advantage_raises_that_samples_log_prob_after_one_step(transition):
    policy = make(denoising=TRANSITIONS[transition])
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(0))
    advantage = torch.tensor([1.0, 0.0, 0.0, 0.0])
    before = policy.log_prob(sample.replay).detach()
    # a small step along the gradient: with summed log-probs the last diffusion step (std
    # floored at 0.01) is so sharp that Adam's lr-sized step on every weight overshoots it
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    loss = -(advantage[:, None] * policy.log_prob(sample.replay)).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    after = policy.log_prob(sample.replay).detach()
    assert after[0].sum() > before[0].sum()


def test_exact_kl_is_zero_to_itself_and_positive_after_an_update():
    policy = make()
    reference = make()
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(0))
    assert policy.exact_kl(sample.replay, reference).abs().max() == 0
    with torch.no_grad():
        policy.unet.conv_out.bias.add_(0.05)
    kl = policy.exact_kl(sample.replay, reference)
    assert kl.shape == sample.logp.shape and (kl > 0).all()


@pytest.mark.learning
@pytest.mark.parametrize("transition, prediction_type", [("ddim", "epsilon"), ("ddim", "v_prediction"), ("ddpm", "sample"), ("flow_sde", "velocity")])
def test_sft_loss_is_the_denoising_loss_and_a_step_lowers_it(transition, prediction_type, learning_seed, learned):
    """Measured over seeds x kernels (default 0-4, avx2 0-4, avx512 0-4; 15 runs): loss, last 3 / first 3 steps 0.0359 to
    0.346 (<= 0.55).
    """
    policy = make(seed=learning_seed, denoising=TRANSITIONS[transition], prediction_type=prediction_type, condition_dropout=0.0)
    images = torch.zeros(8, 16, 16, 3, dtype=torch.uint8)
    images[:, 4:12, 4:12, 0] = 255  # a red square on black
    batch = {"images": images, "condition": torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])}
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    losses = []
    for i in range(45):
        torch.manual_seed(3 * learning_seed + i % 3)  # the same timesteps and noise every third step
        loss = policy.sft_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert math.isfinite(losses[0])
    learned(sum(losses[-3:]) / sum(losses[:3]), 0.55, higher=False, name="loss, last 3 / first 3 steps")


def test_prediction_conversions_invert_each_other():
    x0, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    alpha_bar = torch.tensor([0.3, 0.9]).view(-1, 1, 1, 1)
    x_t = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise
    for kind in ("epsilon", "v_prediction", "sample"):
        target = diffusion_target(x0, noise, alpha_bar, kind)
        torch.testing.assert_close(epsilon_from_prediction(target, x_t, alpha_bar, kind), noise)


@pytest.mark.parametrize("conditioning", ["class", "text", "none"])
def test_save_and_load_pretrained_round_trip_exactly(tmp_path, conditioning):
    spec = {} if conditioning == "text" else {"num_prompts": 3}
    policy = make(spec=spec, tiny={"conditioning": conditioning})
    inputs = PROMPTS if conditioning == "text" else CONDITIONS
    save_pretrained(policy, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved")
    assert type(loaded) is ImageDiffusionPolicy
    for (name, a), (_, b) in zip(policy.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    first = policy.sample(inputs, torch.Generator().manual_seed(0))
    second = loaded.sample(inputs, torch.Generator().manual_seed(0))
    assert torch.equal(first.output, second.output) and torch.equal(first.logp, second.logp)


def _tiny_class_unet(num_class_embeds: int | None = 4):
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), num_class_embeds=num_class_embeds,
    )


def _text_pipeline_dir(root):
    """A tiny text-to-image pipeline directory, as diffusers lays one out."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from mmrl.policies.tiny_tokenizers import byte_tokenizer

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    tokenizer.model_max_length = 16  # as a CLIP tokenizer's 77: the text encoder's positions
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16))
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16, attention_head_dim=4,
    )
    unet.save_pretrained(root / "unet")
    text_encoder.save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")
    diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear").save_pretrained(root / "scheduler")
    return unet


def test_loads_a_diffusers_pipeline_directory_and_trains_a_grpo_step_on_text_prompts(tmp_path):
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import Trainer

    unet = _text_pipeline_dir(tmp_path / "pipe")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a red circle", "a blue square", "two green triangles"]))
    policy = {"type": "image_diffusion", "model_path": str(tmp_path / "pipe"), "guidance_scale": 2.0, "denoising": {"num_inference_steps": 4}}
    cfg = from_dict(TrainConfig, {
        "name": "t2i", "seed": 0, "total_steps": 1,
        "policy": policy,
        "sampler": {"type": "prompt", "data": {"train": str(data)}, "batch_groups": 2},
        "rewards": [{"type": "jpeg_compressibility"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1},
        "optim": {"lr": 1e-3}, "eval": {"episodes": 4},
        "log": {"progress": False, "tensorboard": False},
    })
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.policy.conditioning == "text" and trainer.policy.prediction_type == "epsilon"
    for name, value in unet.state_dict().items():
        assert torch.equal(trainer.policy.unet.state_dict()[name], value), name
    trainer.train()
    assert any(not torch.equal(trainer.policy.unet.state_dict()[n], v) for n, v in unet.state_dict().items())
    metrics = [m for m in read_metrics(tmp_path / "run") if "reward/total" in m]
    assert len(metrics) == 1 and all(math.isfinite(v) for v in metrics[0].values() if isinstance(v, float))


def test_a_class_conditional_pipeline_takes_its_prediction_type_and_null_class_from_the_directory(tmp_path):
    _tiny_class_unet().save_pretrained(tmp_path / "unet")
    diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type="v_prediction").save_pretrained(tmp_path / "scheduler")
    policy = make(model_path=str(tmp_path))
    assert policy.conditioning == "class" and policy.prediction_type == "v_prediction" and policy.null_class == 3
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(0))
    assert sample.info["images"].shape == (4, 8, 8, 3)
    with pytest.raises(ConfigError, match="null class"):
        make(model_path=str(tmp_path), spec={"num_prompts": 4})


def test_a_pipeline_whose_scheduler_disagrees_with_the_denoising_options_is_a_config_error(tmp_path):
    _tiny_class_unet().save_pretrained(tmp_path / "unet")
    diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear").save_pretrained(tmp_path / "scheduler")
    with pytest.raises(ConfigError, match="policy.denoising.beta_schedule"):
        make(model_path=str(tmp_path))
    with pytest.raises(ConfigError, match="policy.denoising.transition"):
        diffusers.FlowMatchEulerDiscreteScheduler().save_pretrained(tmp_path / "scheduler")
        make(model_path=str(tmp_path))
    with pytest.raises(ConfigError, match="policy.model_path"):
        make(model_path=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"prediction_type": "epsilon", "denoising": {"transition": "flow_sde"}}, "policy.prediction_type"),
        ({"prediction_type": "velocity"}, "policy.prediction_type"),
        ({"denoising": {"transition": "flow_noise"}}, "policy.denoising.transition"),
        ({"tiny": {"conditioning": "none"}, "guidance_scale": 2.0}, "policy.guidance_scale"),
        ({"tiny": {"resolution": 10, "block_out_channels": [8, 16, 16]}}, "policy.tiny.resolution"),
        ({"tiny": {"conditioning": "text"}, "max_prompt_tokens": 17, "spec": {}}, "policy.max_prompt_tokens"),
    ],
)
def test_bad_options_are_config_errors_that_name_the_field(fields, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make(**fields)


def test_inputs_of_the_wrong_kind_are_config_errors():
    with pytest.raises(ConfigError, match="condition ids"):
        make().sample(PROMPTS)
    with pytest.raises(ConfigError, match="prompt strings"):
        make(spec={}, tiny={"conditioning": "text"}).sample(CONDITIONS)


def test_trains_end_to_end_on_conditions_with_the_jpeg_reward(tmp_path):
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import train

    cfg = from_dict(TrainConfig, {
        "name": "ddpo", "seed": 0, "total_steps": 2,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "guidance_scale": 2.0, "denoising": {"num_inference_steps": 4}},
        "sampler": {"type": "prompt", "data": {"num_prompts": 3}, "batch_groups": 2},
        "rewards": [{"type": "jpeg_compressibility"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 2},
        "optim": {"lr": 1e-3}, "eval": {"episodes": 4},
        "log": {"progress": False, "tensorboard": True},
    })
    train(cfg, tmp_path / "run")
    # the evaluation's samples: a PNG grid of the 4 images (8 px, enlarged 4x, 1 px borders) and a TensorBoard image
    grid = cv2.imread(str(tmp_path / "run" / "samples" / "step_000002" / "images.png"))
    assert grid.shape == (4 * (2 * 8 + 3), 4 * (2 * 8 + 3), 3)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert events.Tags()["images"] == ["samples/images"]
    metrics = [m for m in read_metrics(tmp_path / "run") if "reward/total" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert type(load_pretrained(tmp_path / "run")) is ImageDiffusionPolicy


def test_is_registered_and_a_class_policy_without_conditions_says_which_sampler_to_use():
    from mmrl.registry import POLICIES

    assert POLICIES.get("image_diffusion") is ImageDiffusionPolicy and POLICIES.entry("image_diffusion").config is ImageDiffusionConfig
    with pytest.raises(ConfigError, match="sampler.type: prompt"):
        make(spec={})


def test_without_diffusers_the_error_names_the_image_extra(monkeypatch):
    import builtins

    from mmrl.errors import MissingExtraError

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "diffusers" or name.startswith("diffusers."):
            raise ImportError("No module named 'diffusers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(MissingExtraError, match=r"mmrl\[image\]"):
        make()


def test_uncheckpointed_one_step_chunks_reproduce_old_logp_exactly_and_train():
    # chunk_steps 1 without checkpointing: the UNet runs once per step on the sampling batch, with grad
    policy = make(denoising={**TRANSITIONS["ddim"], "chunk_steps": 1, "checkpoint_chunks": False})
    sample = policy.sample(CONDITIONS, torch.Generator().manual_seed(1))
    logp = policy.log_prob(sample.replay)
    assert torch.equal(logp.detach(), sample.logp)
    logp.sum().backward()
    assert all(p.grad is not None for p in policy.unet.parameters() if p.requires_grad)


def test_the_activation_estimate_is_the_first_unet_level_times_the_steps_one_call_evaluates():
    policy = make(tiny={"resolution": 32, "block_out_channels": [32, 64]})
    first_level = 32 * 32 * 32 * 4  # channels x height x width x float32 bytes
    assert policy.step_activation_bytes() == first_level
    every_step = {"chain": {"stochastic": torch.ones(4, 8, dtype=torch.bool)}}
    last_three = {"chain": {"stochastic": torch.arange(8).expand(4, 8) >= 5}}
    assert policy.activation_bytes(every_step) == 8 * first_level
    assert policy.activation_bytes(last_three) == 3 * first_level
    chunked = make(tiny={"resolution": 32, "block_out_channels": [32, 64]}, denoising={**TRANSITIONS["ddim"], "chunk_steps": 2})
    assert chunked.activation_bytes(every_step) == 2 * first_level
    guided = make(tiny={"resolution": 32, "block_out_channels": [32, 64]}, guidance_scale=2.0, guidance_grad="both")
    assert guided.activation_bytes(every_step) == 2 * 8 * first_level  # conditional and unconditional passes in one batch


@pytest.mark.numerics
def test_an_update_split_by_the_activation_estimate_equals_the_one_piece_update(tmp_path):
    """algo.micro_batches null on a CPU: the trainer cuts each minibatch into pieces by the
    policy's activation estimate; gradient accumulation gives the same gradients and loss."""
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import Trainer

    results = {}
    for micro_batches in (1, None):
        cfg = from_dict(TrainConfig, {
            "name": "pieces", "seed": 0, "total_steps": 2,
            "policy": {"type": "image_diffusion", "tiny": {"resolution": 8}, "denoising": {"num_inference_steps": 4, "logp_reduction": "mean"}},
            "sampler": {"type": "prompt", "data": {"num_prompts": 3}, "batch_groups": 4},
            "rewards": [{"type": "jpeg_compressibility"}],
            # 8 samples x 4 steps x 8 channels x 8 x 8 x 4 bytes = 64 KiB: three pieces of at most 0.025 MiB
            # the recompute's pieces (a reused sampling graph runs in one)
            "algo": {"group_size": 2, "groups_per_step": 4, "micro_batches": micro_batches, "micro_batch_mb": 0.025, "reuse_sampling_graph": False},
            "optim": {"lr": 1e-3}, "eval": {"every": 0, "at_start": False, "at_end": False}, "checkpoint": {"every": 0},
            "log": {"progress": False, "tensorboard": False},
        })
        trainer = Trainer(cfg, tmp_path / f"run{micro_batches}")
        calls, grads = [], []
        forward = trainer.learner.model.forward
        trainer.learner.model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
        # the optimizer records the gradient and leaves the weights: each step then compares two
        # gradients of the same parameters on the same samples (a step would let Adam turn a
        # rounding difference in a near-zero entry into a move of up to lr, and step 2 compare
        # gradients of other weights)
        trainer.learner.optimizer.step = lambda *a, **kw: grads.append({n: p.grad.clone() for n, p in trainer.learner.model.named_parameters() if p.grad is not None})
        trainer.train()
        # one pass a step, or several pieces a step (fewer than 3 when samples without
        # advantage are left out of the pass; the normalizers still count them)
        assert len(calls) == 2 if micro_batches == 1 else len(calls) >= 4, len(calls)
        results[micro_batches] = grads, [r for r in read_metrics(tmp_path / f"run{micro_batches}") if "loss/policy" in r]
    (g1, m1), (gk, mk) = results[1], results[None]
    assert len(g1) == len(gk) == 2 and g1[0].keys() == gk[0].keys() and "unet.conv_in.weight" in g1[0]
    # Pieces change only the order of float32 sums: each gradient entry sums m = 8 samples x 4
    # steps x 64 positions of terms no larger than the model's largest entry G (the advantages
    # nearly cancel, so one tensor's own maximum is no scale: an attention key bias has a zero
    # gradient up to rounding), and reordering m float32 terms moves a sum by at most m u G.
    m, u = 8 * 4 * 64, torch.finfo(torch.float32).eps / 2
    for i, (one, pieces) in enumerate(zip(g1, gk)):  # each step's clipped gradient, as the optimizer saw it
        bound = m * u * max(float(g.abs().max()) for g in one.values())
        for name in one:  # measured: at most 0.15 of the bound (ATEN_CPU_CAPABILITY default, avx2, avx512)
            assert float((pieces[name] - one[name]).abs().max()) <= bound, (i, name)
    assert any(float(g.abs().max()) > 1e-4 for g in g1[0].values())
    for a, b in zip(m1, mk):
        # the policy loss averages 32 decisions' terms A * ratio (|A| <= 2 here, ratio 1) that
        # nearly cancel: reordering moves it by at most 32 u * 2 (measured: 1.6e-7 of 3.8e-6);
        # the gradient norm by at most the entries' bound relative to G <= norm (measured: 1.2e-6)
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], abs=32 * u * 2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=m * u)


def test_shared_noise_starts_a_group_from_one_noise_and_leaves_its_steps_their_own():
    """``sampler.shared_noise`` (DanceGRPO): the G chains of a group start from one noise, a
    different one per group, and still differ through their stochastic steps."""
    from mmrl.config import load_config
    from mmrl.core.sampler import build_sampler
    from mmrl.core.weights import build_policy
    from mmrl.train.run_config import TrainConfig

    from tests.conftest import ROOT

    def collect(shared: bool):
        cfg = load_config(TrainConfig, ROOT / "configs" / "image_ddpo_jpeg.yaml", [f"sampler.shared_noise={str(shared).lower()}", "algo.group_size=3", "policy.tiny.resolution=8"])
        sampler = build_sampler(cfg)
        torch.manual_seed(0)
        return sampler.collect(build_policy(cfg.policy, sampler.policy_spec()), num_groups=4, group_size=3, step=1)

    shared, own = collect(True), collect(False)
    start = shared.replay["chain"]["latents"][:, 0].reshape(4, 3, -1)  # the window starts at step 0: x_init
    assert torch.equal(start, start[:, :1].expand_as(start))
    assert not torch.allclose(start[0, 0], start[1, 0])
    final = shared.replay["chain"]["latents"][:, -1].reshape(4, 3, -1)
    assert not torch.allclose(final[:, 0], final[:, 1])
    start_own = own.replay["chain"]["latents"][:, 0].reshape(4, 3, -1)
    assert not torch.allclose(start_own[:, 0], start_own[:, 1])
    # the group's one noise is the first draw of the call's generator, as the first sample's is without sharing
    torch.testing.assert_close(start[0, 0], start_own[0, 0])


def test_shared_noise_needs_a_policy_that_starts_chains_from_noise():
    from mmrl.config import load_config
    from mmrl.core.sampler import build_sampler
    from mmrl.train.run_config import TrainConfig

    from tests.conftest import ROOT

    cfg = load_config(TrainConfig, ROOT / "configs" / "text_arithmetic_grpo.yaml", ["sampler.shared_noise=true"])
    with pytest.raises(ConfigError, match="sampler.shared_noise.*image_diffusion, video_diffusion"):
        build_sampler(cfg)


def test_dancegrpo_sampling_trains_end_to_end_with_ratio_one_on_the_first_pass(tmp_path):
    """DanceGRPO's recipe (constant-diffusion SDE, one initial noise per group, the best and
    worst sample of each group trained) through the trainer: one on-policy pass, ratio 1."""
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.metrics import read_metrics
    from mmrl.train.trainer import train

    cfg = from_dict(TrainConfig, {
        "name": "dance", "seed": 0, "total_steps": 2,
        "policy": {"type": "image_diffusion", "tiny": {"resolution": 8},
                   "denoising": {"transition": "flow_sde", "sde_diffusion": "constant", "noise_level": 0.3, "num_inference_steps": 4, "logp_reduction": "mean"}},
        "sampler": {"type": "prompt", "data": {"num_prompts": 3}, "batch_groups": 2, "shared_noise": True},
        "rewards": [{"type": "jpeg_compressibility"}],
        "algo": {"group_size": 3, "groups_per_step": 2, "ppo_epochs": 1, "num_minibatches": 1, "advantage": {"best_worst": 1}},
        "optim": {"lr": 1e-3}, "eval": {"episodes": 4}, "log": {"progress": False, "tensorboard": False},
    })
    train(cfg, tmp_path / "run")
    metrics = [m for m in read_metrics(tmp_path / "run") if "reward/total" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["decisions"] == 2 * 2 * 4, m  # best and worst of each group of 3, 4 steps each
        assert m["objective/ratio"] == pytest.approx(1.0, abs=1e-4) and m["approx_kl"] < 1e-6, m


def test_evaluation_steps_set_the_deterministic_chain_and_leave_sampling_alone():
    """``denoising.eval_num_inference_steps`` (Flow-GRPO trains with 10 steps, evaluates with
    40): a deterministic sample is the 40-step policy's, a stochastic one the 10-step one's."""
    flow = {"transition": "flow_sde", "noise_level": 0.7, "num_inference_steps": 10, "stochastic_steps": "window", "window_size": 3}
    both = make(denoising={**flow, "eval_num_inference_steps": 40})
    forty = make(denoising={**flow, "num_inference_steps": 40})
    ten = make(denoising=flow)
    evaluated = both.sample(CONDITIONS, torch.Generator().manual_seed(3), deterministic=True)
    torch.testing.assert_close(evaluated.output, forty.sample(CONDITIONS, torch.Generator().manual_seed(3), deterministic=True).output, rtol=0, atol=0)
    assert not torch.allclose(evaluated.output, ten.sample(CONDITIONS, torch.Generator().manual_seed(3), deterministic=True).output)
    sampled = both.sample(CONDITIONS, torch.Generator().manual_seed(3))
    torch.testing.assert_close(sampled.output, ten.sample(CONDITIONS, torch.Generator().manual_seed(3)).output, rtol=0, atol=0)
    assert sampled.mask.sum(1).tolist() == [3.0] * 4 and evaluated.mask.sum() == 0


@pytest.mark.numerics
@pytest.mark.parametrize("granularity", ["step", "chain"])
def test_a_train_fraction_keeps_the_noise_of_every_step_and_trains_a_random_subset(granularity):
    """DanceGRPO's timestep selection (``denoising.train_fraction``): the chains are those of
    every step stochastic, a random 60% of each chain's steps are its decisions, and the
    recompute scores exactly those (ratio 1), the others 0."""
    flow = {"transition": "flow_sde", "noise_level": 0.7, "num_inference_steps": 10, "logp_granularity": granularity}
    subset = make(denoising={**flow, "train_fraction": 0.6})
    every = make(denoising=flow)
    sample = subset.sample(CONDITIONS, torch.Generator().manual_seed(2))
    torch.testing.assert_close(sample.output, every.sample(CONDITIONS, torch.Generator().manual_seed(2)).output, rtol=0, atol=0)
    trained = sample.replay["chain"]["stochastic"]
    assert trained.sum(1).tolist() == [6] * 4 and not torch.equal(trained[0], trained[1])
    recomputed = subset.log_prob(sample.replay)
    # one UNet call over all steps against the sampling's one a step: OTHER_BATCH_ATOL
    torch.testing.assert_close(recomputed, sample.logp, atol=OTHER_BATCH_ATOL, rtol=0)
    if granularity == "step":
        assert torch.equal(sample.mask.bool(), trained) and (recomputed[~trained] == 0).all()
        per_step = every.log_prob({**sample.replay, "chain": {**sample.replay["chain"], "stochastic": torch.ones_like(trained)}})
        torch.testing.assert_close(recomputed[trained], per_step[trained], atol=OTHER_BATCH_ATOL, rtol=0)
