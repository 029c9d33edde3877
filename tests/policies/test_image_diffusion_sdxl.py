"""image_diffusion over an SDXL-shaped pipeline directory (a UNet2DConditionModel with SDXL's
added conditions, two CLIP text encoders), saved with StableDiffusionXLPipeline.save_pretrained:
parity with the pipeline, ratio 1, LoRA with the adapter-disabled reference; and the prompt
cache (the text encoders run once per distinct prompt; cached and uncached samples agree to
the bit; checkpoints hold no cache; the encoders can be released to the CPU)."""

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from mmrl.core.weights import load_pretrained, save_pretrained  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from tests.policies.test_image_diffusion_models import SD_DENOISING, _clip, _tokenizer, _vae, make  # noqa: E402

PROMPTS = ["a red circle", "two blue squares", "", "a red circle"]
LORA = {"r": 4, "alpha": 8.0}


def sdxl_pipeline(directory, force_zeros: bool = True, set_alpha_to_one: bool = True):
    """An SDXL-shaped pipeline: a UNet2DConditionModel with addition_embed_type text_time over a
    VAE's latents, CLIPTextModel + CLIPTextModelWithProjection (states 16 + 8 wide, projection 8),
    DDIM with SD's scaled_linear betas, its last step to alpha_bar 1 or (as SDXL's scheduler config)
    to alpha_bar_0; saved with StableDiffusionXLPipeline.save_pretrained."""
    torch.manual_seed(0)
    tok1, tok2 = _tokenizer(), _tokenizer()
    te1, te2 = _clip(tok1, 16, False), _clip(tok2, 8, True)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24, attention_head_dim=4,
        addition_embed_type="text_time", addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + 8,
    )
    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, set_alpha_to_one=set_alpha_to_one, timestep_spacing="trailing", steps_offset=1
    )
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=_vae(0.13025, None), text_encoder=te1, text_encoder_2=te2, tokenizer=tok1, tokenizer_2=tok2, unet=unet, scheduler=scheduler,
        force_zeros_for_empty_prompt=force_zeros, add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(directory)
    return pipe


@pytest.fixture(scope="module")
def sdxl_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sdxl") / "pipe"
    sdxl_pipeline(directory)
    return directory


def sdxl_policy(directory, **fields):
    return make(spec={}, model_path=str(directory), denoising=fields.pop("denoising", SD_DENOISING), **fields)


# ------------------------------------------------------------------ SDXL


@pytest.mark.numerics
@pytest.mark.parametrize("force_zeros, set_alpha_to_one", [(True, True), (False, True), (True, False)])
def test_the_deterministic_chain_equals_diffusers_sdxl_pipeline_with_guidance(tmp_path, force_zeros, set_alpha_to_one):
    # StableDiffusionXLPipeline's whole conditioning: both CLIPs' penultimate states side by side,
    # text_encoder_2's pooled projection, the time ids (original size, crop, target size), and its
    # unconditional branch (zeros with force_zeros_for_empty_prompt, else the empty prompt)
    pipe = sdxl_pipeline(tmp_path / "sdxl", force_zeros=force_zeros, set_alpha_to_one=set_alpha_to_one)
    policy = sdxl_policy(tmp_path / "sdxl", guidance_scale=3.0, sdxl_original_size=[24, 20], sdxl_crops_coords_top_left=[2, 1])
    assert policy.sdxl and policy.kind == "unet" and policy.zero_null_prompt == force_zeros and policy.text_encoder_2 is not None
    assert policy.sdxl_time_ids == (24, 20, 2, 1, 16, 16)
    prompts = ["a red circle", "two squares"]
    ours = policy.sample(prompts, torch.Generator().manual_seed(2), deterministic=True)
    x = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(2))
    common = dict(height=16, width=16, num_inference_steps=4, guidance_scale=3.0, eta=0.0, latents=x, original_size=(24, 20), crops_coords_top_left=(2, 1))
    latents = pipe(prompts, output_type="latent", **common).images
    # two float32 loops in another order (as the SD parity test)
    torch.testing.assert_close(ours.output, latents, atol=1e-4, rtol=1e-4)
    images = pipe(prompts, output_type="pt", **common).images  # [0, 1]
    assert (ours.info["images"].permute(0, 3, 1, 2).float() - images * 255).abs().max() <= 1.0


def test_sdxl_recomputes_its_log_probs_exactly_one_step_per_call(sdxl_dir):
    denoising = {**SD_DENOISING, "eta": 1.0, "chunk_steps": 1}
    policy = sdxl_policy(sdxl_dir, guidance_scale=2.0, denoising=denoising)
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(1))
    assert sample.logp.shape == (4, 4) and torch.isfinite(sample.logp).all()
    assert set(sample.replay) == {"chain", "prompt_ids", "prompt_ids_2"}
    with torch.no_grad():
        assert torch.equal(policy.log_prob(sample.replay), sample.logp)  # ratio exactly 1
    policy.log_prob(sample.replay).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.unet.parameters())
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)  # frozen VAE, both text encoders


def test_sdxl_lora_trains_the_unet_adapters_only_against_the_adapter_disabled_reference(sdxl_dir):
    policy = sdxl_policy(sdxl_dir, guidance_scale=2.0, lora=LORA, denoising={**SD_DENOISING, "eta": 1.0})
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("unet.") and "lora_" in n for n in trainable)
    assert not any(p.requires_grad for part in (policy.vae, policy.text_encoder, policy.text_encoder_2) for p in part.parameters())
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    reference = policy.reference()
    assert not list(reference.parameters())  # shares the base weights
    assert policy.exact_kl(sample.replay, reference).abs().max() < 1e-6  # B = 0 at the start
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    loss = -(torch.tensor([1.0, -1.0, 0.5, 0.0])[:, None] * policy.log_prob(sample.replay)).sum()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        base = reference.log_prob(sample.replay)
        assert (policy.log_prob(sample.replay) - base).abs().max() > 1e-4
    assert (policy.exact_kl(sample.replay, reference) > 0).any()


def test_sdxl_layouts_that_do_not_fit_are_config_errors(tmp_path):
    sdxl_pipeline(tmp_path / "sdxl")
    with pytest.raises(ConfigError, match="policy.max_prompt_tokens"):
        tok = json.loads((tmp_path / "sdxl" / "tokenizer_2" / "tokenizer_config.json").read_text())
        tok["model_max_length"] = 6
        (tmp_path / "sdxl" / "tokenizer_2" / "tokenizer_config.json").write_text(json.dumps(tok))
        sdxl_policy(tmp_path / "sdxl")
    import shutil

    shutil.rmtree(tmp_path / "sdxl" / "text_encoder_2")
    with pytest.raises(ConfigError, match="policy.model_path.*text_encoder_2/"):
        sdxl_policy(tmp_path / "sdxl")
    with pytest.raises(ConfigError, match="policy.sdxl_crops_coords_top_left"):
        make(sdxl_crops_coords_top_left=[0])


# ------------------------------------------------------------------ the prompt cache


def _count_calls(policy) -> list[int]:
    calls = [0]
    for encoder in (policy.text_encoder, policy.text_encoder_2, policy.text_encoder_3):
        if encoder is not None:
            encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("shape", ["sd3_tiny", "sdxl"])
def test_the_text_encoders_run_once_per_distinct_prompt_and_cached_samples_equal_uncached_ones(sdxl_dir, shape, tmp_path):
    if shape == "sdxl":
        fields = dict(spec={}, model_path=str(sdxl_dir), denoising={**SD_DENOISING, "eta": 1.0, "chunk_steps": 1}, guidance_scale=2.0)
        encoders = 2
    else:
        fields = dict(spec={}, tiny={"denoiser": "sd3_transformer", "conditioning": "text"}, denoising={"transition": "flow_sde", "noise_level": 0.7, "min_std": 0.0, "chunk_steps": 1}, guidance_scale=2.0)
        encoders = 1
    cached, uncached = make(**fields), make(**fields, prompt_cache=0)
    calls = _count_calls(cached)
    rounds = [PROMPTS, ["two blue squares", "a green star", "a red circle", "a green star"], PROMPTS]
    for i, prompts in enumerate(rounds):
        a = cached.sample(prompts, torch.Generator().manual_seed(i))
        b = uncached.sample(prompts, torch.Generator().manual_seed(i))
        assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
        with torch.no_grad():
            assert torch.equal(cached.log_prob(a.replay), a.logp)  # the recompute reads the same embeddings: ratio 1
            assert torch.equal(uncached.log_prob(b.replay), a.logp)
    # distinct prompts: "a red circle", "two blue squares", "" (also the null prompt of guidance), "a green star"
    assert calls[0] == 4 * encoders and len(cached._prompt_cache) == 4
    # the cache is no part of the weights: a checkpoint is the same with or without it
    save_pretrained(cached, tmp_path / "cached")
    save_pretrained(uncached, tmp_path / "uncached")
    stored, plain = load_file(str(tmp_path / "cached" / "model.safetensors")), load_file(str(tmp_path / "uncached" / "model.safetensors"))
    assert stored.keys() == plain.keys() and all(torch.equal(stored[k], plain[k]) for k in stored)
    assert (tmp_path / "cached" / "model.safetensors").read_bytes() == (tmp_path / "uncached" / "model.safetensors").read_bytes()
    loaded = load_pretrained(tmp_path / "cached")
    assert len(loaded._prompt_cache) == 0


def test_the_cache_is_an_lru_of_its_size_and_a_filled_cache_can_release_the_text_encoders(sdxl_dir, tmp_path):
    policy = sdxl_policy(sdxl_dir, guidance_scale=1.0, prompt_cache=2)
    calls = _count_calls(policy)
    policy.sample(["a", "b", "c"], torch.Generator().manual_seed(0))  # three prompts in one batch: all encoded, two kept
    assert calls[0] == 6 and len(policy._prompt_cache) == 2
    policy.sample(["c"], torch.Generator().manual_seed(0))
    assert calls[0] == 6  # "c" was kept
    policy.sample(["a"], torch.Generator().manual_seed(0))
    assert calls[0] == 8  # "a" was evicted
    with pytest.raises(ConfigError, match="policy.prompt_cache"):
        policy.cache_prompts(["a", "b", "c"])

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a red circle", "two blue squares"]))
    fields = dict(guidance_scale=2.0, prompt_files=[str(prompts)], release_text_encoders=True)
    released = sdxl_policy(sdxl_dir, **fields)
    reference = sdxl_policy(sdxl_dir, guidance_scale=2.0)
    calls = _count_calls(released)
    first = released.sample(["a red circle", "two blue squares"], torch.Generator().manual_seed(3))
    assert calls[0] == 4 and released._text_encoders_released  # the file's prompts, once each (SDXL's null is zeros)
    released.to(torch.float64)  # moving (or casting) the policy leaves the released encoders as they are
    assert next(released.text_encoder.parameters()).dtype == torch.float32 and next(released.unet.parameters()).dtype == torch.float64
    released.to(torch.float32)
    second = reference.sample(["a red circle", "two blue squares"], torch.Generator().manual_seed(3))
    assert torch.equal(first.output, second.output)
    released.sample(["a green star"], torch.Generator().manual_seed(0))  # a prompt outside the files: encoded where the encoders are
    assert calls[0] == 6
    with pytest.raises(ConfigError, match="policy.release_text_encoders"):
        sdxl_policy(sdxl_dir, release_text_encoders=True, prompt_cache=0)
    with pytest.raises(ConfigError, match="policy.prompt_files"):
        sdxl_policy(sdxl_dir, prompt_files=[str(prompts)], train_text_encoder=True)
