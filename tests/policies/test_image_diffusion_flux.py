"""image_diffusion over a FLUX.1-shaped pipeline directory (FluxTransformer2DModel over 2x2-packed
VAE latents, CLIPTextModel pooled + T5EncoderModel states, FlowMatchEulerDiscreteScheduler with a
resolution-dependent shift), saved with FluxPipeline.save_pretrained: parity with FluxPipeline
(guidance-distilled with its guidance embedding, and not distilled with true CFG), ratio 1 under
flow_sde, LoRA with the adapter-disabled reference, the prompt cache over FLUX's two embeddings,
the LoRA exported in diffusers' format loaded by FluxPipeline.load_lora_weights, and layouts
that do not fit as config errors."""

import json
import math
import shutil

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors import safe_open  # noqa: E402

from mmrl.core.weights import load_pretrained, save_pretrained  # noqa: E402
from mmrl.denoising import flow_sigmas, resolution_shift  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from tests.policies.test_image_diffusion_models import SD3, _clip, _tokenizer, _vae, make  # noqa: E402

PROMPTS = ["a red circle", "two blue squares", "", "a red circle"]
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
# the tiny scheduler's dynamic shift: 16 image tokens between base 4 (shift e^0.5) and max 64 (e^2)
SCHEDULER = {"use_dynamic_shifting": True, "shift": 3.0, "base_image_seq_len": 4, "max_image_seq_len": 64, "base_shift": 0.5, "max_shift": 2.0}
# FLUX.1-dev's own dynamic shift: e^0.5 at 256 image tokens, e^1.15 at 4096
FLUX1_SCHEDULER = {"use_dynamic_shifting": True, "shift": 3.0, "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
FLUX_DENOISING = {"transition": "flow_sde", "num_inference_steps": 4, "min_std": 0.0}


def flux_pipeline(directory, distilled: bool = True, scheduler: dict | None = None):
    """A FLUX.1-shaped pipeline: FluxTransformer2DModel (16 = 4 x 4 packed latent channels, one
    double and one single block, rope axes 4 + 6 + 6), the 2-level VAE (scaling 0.3611, shift
    0.1159 as FLUX.1's), a CLIPTextModel 16 wide (its pooled output), a T5 32 wide; guidance
    embedding when ``distilled`` (FLUX.1-dev) with a dynamic-shift scheduler, else (as
    FLUX.1-schnell's scheduler) a fixed shift of 1, or the given ``scheduler`` fields. Saved with
    FluxPipeline.save_pretrained."""
    torch.manual_seed(0)
    tok1, tok2 = _tokenizer(), _tokenizer(None)
    clip = _clip(tok1, 16, False)
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(tok2), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)).eval()
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=distilled, axes_dims_rope=(4, 6, 6),
    )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**(scheduler or (SCHEDULER if distilled else {"shift": 1.0})))
    pipe = diffusers.FluxPipeline(
        scheduler=scheduler, vae=_vae(0.3611, 0.1159), text_encoder=clip, tokenizer=tok1, text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(directory)
    return pipe


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("flux") / "pipe"
    flux_pipeline(directory)
    return directory


def flux_policy(directory, **fields):
    return make(spec={}, model_path=str(directory), **{"resolution": [16, 16], "max_t5_tokens": 8, "denoising": FLUX_DENOISING, **fields})


def _pack(x):
    return diffusers.FluxPipeline._pack_latents(x, x.shape[0], x.shape[1], x.shape[2], x.shape[3])


# ------------------------------------------------------------------ parity with FluxPipeline


@pytest.mark.numerics
@pytest.mark.parametrize("distilled", [True, False])
def test_the_deterministic_chain_equals_diffusers_flux_pipeline_and_decodes_as_it_does(tmp_path, distilled):
    # FluxPipeline's whole run: CLIP pooled + T5 states, packed latents at the latent image ids,
    # its sigmas np.linspace(1, 1/K, K) shifted by calculate_shift of the image's 16 tokens (dynamic)
    # or by the fixed shift, the guidance embedding (distilled) or true CFG against the empty
    # negative prompt (not distilled), the Euler loop, the VAE's scaling and shift factors
    pipe = flux_pipeline(tmp_path / "flux", distilled=distilled)
    fields = {"flux_guidance": 2.5} if distilled else {"guidance_scale": 2.0}
    policy = flux_policy(tmp_path / "flux", denoising={**FLUX_DENOISING, "transition": "flow_ode"}, **fields)
    assert policy.kind == "flux" and policy.channels == 4 and policy.resolution == (8, 8) and policy.image_resolution == (16, 16)
    assert (policy.vae_scale, policy.vae_shift) == (0.3611, 0.1159) and policy.flux_guidance == (2.5 if distilled else None)
    prompts = ["a red circle", "two squares"]
    ours = policy.sample(prompts, torch.Generator().manual_seed(1), deterministic=True)
    x = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(1))
    common = dict(latents=_pack(x), height=16, width=16, num_inference_steps=4, max_sequence_length=8)
    common.update(guidance_scale=2.5) if distilled else common.update(true_cfg_scale=2.0, negative_prompt=["", ""])
    packed = pipe(prompts, output_type="latent", **common).images
    # the schedule: the same shifted sigmas (ours in float64, then float32; the scheduler's in float32)
    torch.testing.assert_close(policy.flow_sigmas(), pipe.scheduler.sigmas, atol=1e-6, rtol=0)
    if distilled:
        assert policy.flow_sigmas()[1] > flow_sigmas(4)[1].float() + 0.05  # the dynamic shift is applied
        assert policy.denoising.time_shift == pytest.approx(resolution_shift(16, 4, 64, 0.5, 2.0)) and policy.config.denoising.time_shift == 1.0
    latents = pipe._unpack_latents(packed, 16, 16, pipe.vae_scale_factor)
    torch.testing.assert_close(ours.output, latents, atol=1e-4, rtol=1e-4)
    images = pipe(prompts, output_type="pt", **common).images  # [0, 1]
    assert (ours.info["images"].permute(0, 3, 1, 2).float() - images * 255).abs().max() <= 1.0


@pytest.mark.numerics
def test_flux_without_a_resolution_samples_at_flux_pipelines_default_for_its_vae(tmp_path):
    # FluxPipeline's default height and width: default_sample_size 128 x vae_scale_factor, 256 for
    # this VAE's 2x downsampling, whose 4,096 image tokens FLUX.1's scheduler shifts by e^1.15
    pipe = flux_pipeline(tmp_path / "flux", scheduler=FLUX1_SCHEDULER)
    size = pipe.default_sample_size * pipe.vae_scale_factor
    policy = flux_policy(tmp_path / "flux", resolution=None, denoising={**FLUX_DENOISING, "transition": "flow_ode", "num_inference_steps": 1})
    assert size == 256 and policy.image_resolution == (size, size) and policy.resolution == (128, 128)
    ours = policy.sample(["a red circle"], torch.Generator().manual_seed(1), deterministic=True)
    x = torch.randn((1, 4, 128, 128), generator=torch.Generator().manual_seed(1))
    packed = pipe(["a red circle"], latents=_pack(x), num_inference_steps=1, max_sequence_length=8, output_type="latent").images
    torch.testing.assert_close(ours.output, pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor), atol=1e-4, rtol=1e-4)
    assert ours.info["images"].shape == (1, size, size, 3) and policy.denoising.time_shift == pytest.approx(math.exp(1.15))


def test_a_resolution_whose_dynamic_shift_leaves_the_floats_is_a_config_error(flux_dir):
    # the tiny scheduler goes from e^0.5 at 4 tokens to e^2 at 64: at 1024 x 1024 mu = 1639
    with pytest.raises(ConfigError, match=r"policy\.resolution: got \[1024, 1024\]; 65536 image tokens.*overflows.*nearer 256 x 256"):
        flux_policy(flux_dir, resolution=[1024, 1024])


def test_flux_recomputes_its_log_probs_exactly_one_step_per_call(flux_dir):
    policy = flux_policy(flux_dir, denoising={**FLUX_DENOISING, "chunk_steps": 1})
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(1))
    assert sample.logp.shape == (4, 4) and torch.isfinite(sample.logp).all() and sample.output.shape == (4, 4, 8, 8)
    assert set(sample.replay) == {"chain", "prompt_ids", "prompt_ids_2"} and sample.replay["prompt_ids_2"].shape == (4, 8)
    assert sample.info["images"].shape == (4, 16, 16, 3)
    with torch.no_grad():
        assert torch.equal(policy.log_prob(sample.replay), sample.logp)  # ratio exactly 1
    policy.log_prob(sample.replay).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.transformer.parameters())
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)  # frozen VAE, CLIP and T5
    assert policy.step_activation_bytes() == (16 + 8) * 32 * 4


def test_flux_lora_trains_the_transformer_adapters_only_against_the_adapter_disabled_reference(flux_dir):
    policy = flux_policy(flux_dir, lora=LORA)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("transformer.") and "lora_" in n for n in trainable)
    assert not any(p.requires_grad for part in (policy.vae, policy.text_encoder, policy.text_encoder_2) for p in part.parameters())
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    reference = policy.reference()
    assert not list(reference.parameters())  # shares the base weights
    assert reference.denoising.time_shift == policy.denoising.time_shift != 1.0  # the same shifted schedule
    assert policy.exact_kl(sample.replay, reference).abs().max() < 1e-6  # B = 0 at the start
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    loss = -(torch.tensor([1.0, -1.0, 0.5, 0.0])[:, None] * policy.log_prob(sample.replay)).sum()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        base = reference.log_prob(sample.replay)
        assert (policy.log_prob(sample.replay) - base).abs().max() > 1e-4
    assert (policy.exact_kl(sample.replay, reference) > 0).any()


# ------------------------------------------------------------------ the prompt cache


def test_the_prompt_cache_holds_flux_pooled_and_t5_embeddings_encoded_once_per_prompt(tmp_path):
    flux_pipeline(tmp_path / "flux", distilled=False)
    fields = dict(guidance_scale=2.0, denoising={**FLUX_DENOISING, "chunk_steps": 1})
    cached, uncached = flux_policy(tmp_path / "flux", **fields), flux_policy(tmp_path / "flux", prompt_cache=0, **fields)
    calls = [0]
    for encoder in (cached.text_encoder, cached.text_encoder_2):
        encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for i, prompts in enumerate([PROMPTS, ["two blue squares", "a green star", "a red circle", "a green star"], PROMPTS]):
        a = cached.sample(prompts, torch.Generator().manual_seed(i))
        b = uncached.sample(prompts, torch.Generator().manual_seed(i))
        assert torch.equal(a.output, b.output) and torch.equal(a.logp, b.logp)
        with torch.no_grad():
            assert torch.equal(cached.log_prob(a.replay), a.logp) and torch.equal(uncached.log_prob(b.replay), a.logp)
    # "a red circle", "two blue squares", "" (also the null prompt of true CFG), "a green star": each through CLIP and T5 once
    assert calls[0] == 4 * 2 and len(cached._prompt_cache) == 4
    states, pooled = next(iter(cached._prompt_cache.entries.values()))
    assert states.shape == (1, 8, 32) and pooled.shape == (1, 16)


# ------------------------------------------------------------------ LoRA in diffusers' format


def test_flux_pipeline_load_lora_weights_reads_the_exported_adapters(tmp_path, flux_dir):
    policy = flux_policy(flux_dir, lora=LORA)
    torch.manual_seed(5)
    with torch.no_grad():  # adapters moved off their initial B = 0, as training leaves them
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    policy.eval()
    save_pretrained(policy, tmp_path / "saved")  # save_extra writes lora_diffusers/ beside the weights
    exported = tmp_path / "saved" / "lora_diffusers"
    with safe_open(str(exported / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.lora_alpha"] == 8.0
    assert keys and all(k.startswith("transformer.") and "lora" in k for k in keys)
    assert len(keys) == sum("lora_" in n for n, _ in policy.named_parameters())

    pipe = diffusers.FluxPipeline.from_pretrained(str(flux_dir))
    pipe.load_lora_weights(str(exported))
    g = torch.Generator().manual_seed(0)
    kwargs = dict(
        hidden_states=torch.randn((2, 16, 16), generator=g), timestep=torch.tensor([0.9, 0.2]), guidance=torch.tensor([3.5, 3.5]),
        pooled_projections=torch.randn((2, 16), generator=g), encoder_hidden_states=torch.randn((2, 8, 32), generator=g),
        txt_ids=policy.flux_text_ids, img_ids=policy.flux_image_ids,
    )
    with torch.no_grad():
        ours = policy.transformer(**kwargs).sample
        theirs = pipe.transformer(**kwargs).sample
        with policy.adapters_disabled():
            plain = policy.transformer(**kwargs).sample
    assert (ours - plain).abs().max() > 1e-3  # the adapters do change the output
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    loaded = load_pretrained(tmp_path / "saved")
    sample = policy.sample(["a red circle"], torch.Generator().manual_seed(2), deterministic=True)
    assert torch.equal(loaded.sample(["a red circle"], torch.Generator().manual_seed(2), deterministic=True).output, sample.output)


# ------------------------------------------------------------------ layouts that do not fit


def test_flux_layouts_and_options_that_do_not_fit_are_config_errors(tmp_path, flux_dir):
    with pytest.raises(ConfigError, match=r"policy\.resolution.*multiple of 4"):
        flux_policy(flux_dir, resolution=[16, 18])
    with pytest.raises(ConfigError, match=r"policy\.denoising\.time_shift.*use_dynamic_shifting"):
        flux_policy(flux_dir, denoising={**FLUX_DENOISING, "time_shift": 3.0})
    with pytest.raises(ConfigError, match=r"policy\.max_t5_tokens.*512"):
        flux_policy(flux_dir, max_t5_tokens=600)
    with pytest.raises(ConfigError, match=r"policy\.denoising\.transition"):
        flux_policy(flux_dir, denoising={"transition": "ddim", "clip_denoised": None})
    with pytest.raises(ConfigError, match=r"policy\.resolution.*only a FLUX"):
        make(spec={}, tiny=SD3, denoising=FLUX_DENOISING, resolution=[16, 16])
    with pytest.raises(ConfigError, match=r"policy\.resolution.*\[height, width\]"):
        make(spec={}, tiny=SD3, resolution=[16])

    schnell = tmp_path / "schnell"
    flux_pipeline(schnell, distilled=False)
    with pytest.raises(ConfigError, match=r"policy\.flux_guidance.*guidance_embeds"):
        flux_policy(schnell, flux_guidance=3.5)
    with pytest.raises(ConfigError, match=r"policy\.denoising\.time_shift.*shift 1\.0"):
        flux_policy(schnell, denoising={**FLUX_DENOISING, "time_shift": 3.0})
    assert flux_policy(schnell).flux_guidance is None and flux_policy(schnell).denoising.time_shift == 1.0

    broken = tmp_path / "broken"
    shutil.copytree(flux_dir, broken)
    scheduler = json.loads((broken / "scheduler" / "scheduler_config.json").read_text())
    (broken / "scheduler" / "scheduler_config.json").write_text(json.dumps({**scheduler, "use_karras_sigmas": True}))
    with pytest.raises(ConfigError, match=r"policy\.model_path.*use_karras_sigmas"):
        flux_policy(broken)
    (broken / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    shutil.rmtree(broken / "text_encoder_2")  # a T5 16 wide beside a transformer whose joint_attention_dim is 32
    transformers.T5EncoderModel(transformers.T5Config(vocab_size=300, d_model=16, d_kv=8, d_ff=16, num_layers=1, num_heads=2)).save_pretrained(broken / "text_encoder_2")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*T5 width 16.*joint_attention_dim 32"):
        flux_policy(broken)
    shutil.rmtree(broken / "text_encoder_2")
    shutil.copytree(flux_dir / "text_encoder_2", broken / "text_encoder_2")
    shutil.rmtree(broken / "vae")  # a VAE with 2 latent channels: 8 packed, not the transformer's 16
    diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=2, norm_num_groups=4).save_pretrained(broken / "vae")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*16 input.*4 x the VAE's 2 latent channels"):
        flux_policy(broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*vae/"):
        flux_policy(broken)
    shutil.copytree(flux_dir / "vae", broken / "vae")
    shutil.rmtree(broken / "text_encoder_2")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*text_encoder_2/ and tokenizer_2/"):
        flux_policy(broken)
    shutil.copytree(flux_dir / "text_encoder", broken / "text_encoder_2")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*text_encoder_2/ holds a CLIPTextModel.*T5EncoderModel"):
        flux_policy(broken)
