"""image_diffusion over a Qwen-Image-shaped pipeline directory (QwenImageTransformer2DModel over
2x2-packed latents of an AutoencoderKLQwenImage, Qwen2.5-VL's last states under
QwenImagePipeline's chat template, FlowMatchEulerDiscreteScheduler with a resolution-dependent
shift and a shift_terminal), saved with QwenImagePipeline.save_pretrained: parity with
QwenImagePipeline (with and without its rescaled true CFG), ratio 1 under flow_sde, and layouts
that do not fit as config errors."""

import shutil

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from mmrl.denoising import flow_sigmas, resolution_shift, terminal_stretch  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from tests.policies.test_image_diffusion_models import make  # noqa: E402

# Qwen-Image's own scheduler (a dynamic shift from e^0.5 at 256 image tokens to e^0.9 at 8192,
# stretched so that the last sigma before 0 is 0.02)
SCHEDULER = {"use_dynamic_shifting": True, "shift": 1.0, "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9, "shift_terminal": 0.02}
TOKENS = 200  # the prompt states kept after the template's first 34 tokens (QwenImagePipeline's max_sequence_length)
DENOISING = {"transition": "flow_sde", "num_inference_steps": 4, "min_std": 0.0}


def _tokenizer():
    """A Qwen2Tokenizer made in code: the 256 byte-level symbols, no merges, and the chat
    template's special tokens."""
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def qwen_pipeline(directory, scheduler: dict | None = None):
    """A Qwen-Image-shaped pipeline at diffusers' own test sizes: the transformer (patch 2, 16
    = 4 x 4 packed input channels, 4 output, 2 layers, 3 heads x 16, joint_attention_dim 16,
    rope axes 8 + 4 + 4), the VAE (base_dim 24, z_dim 4, 4x spatial), a Qwen2.5-VL text model
    16 wide; saved with QwenImagePipeline.save_pretrained."""
    torch.manual_seed(0)
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}, "rope_theta": 1000000.0}
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        vision_start_token_id=300, vision_end_token_id=301, image_token_id=302, video_token_id=303,
    )
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.05, 0.3], latents_std=[1.5, 0.8, 1.2, 0.9],
    )
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**(scheduler or SCHEDULER)), vae=vae, text_encoder=text_encoder, tokenizer=_tokenizer(), transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(directory)
    return pipe


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen") / "pipe"
    qwen_pipeline(directory)
    return directory


def qwen_policy(directory, **fields):
    return make(spec={}, model_path=str(directory), **{"resolution": [32, 32], "max_prompt_tokens": TOKENS, "denoising": DENOISING, **fields})


def _pack(x):
    return diffusers.QwenImagePipeline._pack_latents(x, x.shape[0], x.shape[1], x.shape[2], x.shape[3])


@pytest.mark.numerics
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_the_deterministic_chain_equals_diffusers_qwen_image_pipeline_and_decodes_as_it_does(tmp_path, guidance):
    # QwenImagePipeline's whole run: the templated prompt through Qwen2.5-VL (its first 34 states
    # dropped, a mask per prompt), packed latents with their img_shapes, its sigmas 1 ... 1/K
    # shifted by calculate_shift and stretched to shift_terminal, the Euler loop, true CFG
    # against the empty negative prompt rescaled to the conditional norm, and the VAE's
    # per-channel latents_mean / latents_std over one frame
    pipe = qwen_pipeline(tmp_path / "qwen")
    policy = qwen_policy(tmp_path / "qwen", guidance_scale=guidance, denoising={**DENOISING, "transition": "flow_ode"})
    assert policy.kind == "qwen" and policy.channels == 4 and policy.resolution == (8, 8) and policy.image_resolution == (32, 32)
    prompts = ["a red circle", "two blue squares on the left"]
    ours = policy.sample(prompts, torch.Generator().manual_seed(1), deterministic=True)
    x = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(1))
    common = dict(latents=_pack(x), height=32, width=32, num_inference_steps=4, max_sequence_length=TOKENS)
    if guidance != 1:
        common.update(true_cfg_scale=guidance, negative_prompt=["", ""])
    packed = pipe(prompts, output_type="latent", **common).images
    torch.testing.assert_close(policy.flow_sigmas(), pipe.scheduler.sigmas, atol=1e-6, rtol=0)
    shift = resolution_shift(16, 256, 8192, 0.5, 0.9)
    torch.testing.assert_close(policy.flow_sigmas(), terminal_stretch(flow_sigmas(4, shift), 0.02).float())
    latents = pipe._unpack_latents(packed, 32, 32, pipe.vae_scale_factor)[:, :, 0]
    torch.testing.assert_close(ours.output, latents, atol=1e-4, rtol=1e-4)
    images = pipe(prompts, output_type="pt", **common).images  # [0, 1]
    assert (ours.info["images"].permute(0, 3, 1, 2).float() - images * 255).abs().max() <= 1.0


@pytest.mark.numerics
def test_qwen_image_recomputes_its_log_probs_to_a_few_ulps(qwen_dir):
    policy = qwen_policy(qwen_dir, guidance_scale=2.0)
    sample = policy.sample(["a red circle", "two blue squares", "", "a red circle"], torch.Generator().manual_seed(1))
    assert sample.logp.shape == (4, 4) and torch.isfinite(sample.logp).all() and sample.output.shape == (4, 4, 8, 8)
    assert set(sample.replay) == {"chain", "prompt_ids"} and sample.replay["prompt_ids"].shape == (4, 34 + TOKENS)
    # the old log-probs are deferred, so these are the sampling pass's provisional numbers: there the
    # prompts are encoded and guided in other batches, a few ulps of log-probs near 700 apart
    # (1 ulp, 6.1e-5, under tests/kernel_emulation; 0 on this AMD EPYC)
    with torch.no_grad():
        torch.testing.assert_close(policy.log_prob(sample.replay), sample.logp, atol=0, rtol=1e-6)
    policy.log_prob(sample.replay).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.transformer.parameters())
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)  # frozen VAE and text encoder
    # sft_loss's way in: an image encoded to the normalized latent decodes back to its size
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    assert policy.encode_images(pixels).shape == (2, 4, 8, 8) and policy.decode_latents(policy.encode_images(pixels)).shape == (2, 3, 32, 32)


def test_qwen_image_layouts_and_options_that_do_not_fit_are_config_errors(tmp_path, qwen_dir):
    with pytest.raises(ConfigError, match=r"policy\.resolution.*multiple of 8"):
        qwen_policy(qwen_dir, resolution=[32, 36])
    with pytest.raises(ConfigError, match=r"policy\.max_prompt_tokens.*at most 1024"):
        qwen_policy(qwen_dir, max_prompt_tokens=2000)
    with pytest.raises(ConfigError, match=r"policy\.flux_guidance.*only a FLUX transformer"):
        qwen_policy(qwen_dir, flux_guidance=3.5)
    with pytest.raises(ConfigError, match=r"policy\.denoising\.time_shift.*use_dynamic_shifting"):
        qwen_policy(qwen_dir, denoising={**DENOISING, "time_shift": 3.0})
    broken = tmp_path / "broken"
    shutil.copytree(qwen_dir, broken)
    shutil.rmtree(broken / "vae")
    diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4).save_pretrained(broken / "vae")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*QwenImageTransformer2DModel takes an AutoencoderKLQwenImage in vae/, not a AutoencoderKL"):
        qwen_policy(broken)
    shutil.rmtree(broken / "vae")
    shutil.copytree(qwen_dir / "vae", broken / "vae")
    shutil.rmtree(broken / "transformer")  # a transformer for a text encoder 32 wide
    diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=3, joint_attention_dim=32, axes_dims_rope=(8, 4, 4),
    ).save_pretrained(broken / "transformer")
    with pytest.raises(ConfigError, match=r"policy\.model_path.*text encoder is 16 wide.*joint_attention_dim is 32"):
        qwen_policy(broken)
