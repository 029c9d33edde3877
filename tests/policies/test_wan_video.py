"""``wan_video``: Wan 2.x text-to-video from a local diffusers directory, checked against
diffusers' own ``WanPipeline`` on a tiny random pipeline saved with ``save_pretrained``
(nothing downloaded): the deterministic chain and decode, ratio 1, LoRA against the
adapter-disabled reference, the LoRA export for ``load_lora_weights``, the prompt cache, and
a short GRPO run through the trainer."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from mmrl.config import from_dict  # noqa: E402
from mmrl.core.weights import build_policy, save_pretrained  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.tiny_tokenizers import byte_tokenizer  # noqa: E402
from mmrl.policies.wan_video import WanVideoConfig, WanVideoPolicy  # noqa: E402

PROMPTS = ["a red circle moving right", "two blue squares", "a red circle moving right"]
SHIFT = 3.0
FRAMES, SIZE, TOKENS, STEPS = 5, 32, 16, 4
LORA = {"r": 4, "alpha": 8.0}


def wan_pipeline(directory, latents_mean=None, latents_std=None, scheduler=None):
    """A tiny WanPipeline as Wan's directories are laid out (UniPC flow scheduler, flow_shift
    3), UMT5 over a byte-level tokenizer padding on the right, z_dim 4 with non-trivial
    latents_mean / latents_std; saved with save_pretrained."""
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    tokenizer.padding_side = "right"
    text_encoder = transformers.UMT5EncoderModel(
        transformers.UMT5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8)
    ).eval()
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
        num_layers=2, rope_max_seq_len=32,
    )
    vae = diffusers.AutoencoderKLWan(
        base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=latents_mean or [0.1, -0.2, 0.3, 0.05], latents_std=latents_std or [1.5, 0.8, 2.0, 1.2],
    ).eval()
    scheduler = scheduler or diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT, num_train_timesteps=1000)
    pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return wan_pipeline(tmp_path_factory.mktemp("wan") / "pipe")


def make(path, **fields) -> WanVideoPolicy:
    base = {"type": "wan_video", "model_path": str(path), "frames": FRAMES, "height": SIZE, "width": SIZE, "max_sequence_length": TOKENS,
            "guidance_scale": 3.0, "negative_prompt": "blurry, static", "denoising": {"num_inference_steps": STEPS, "time_shift": SHIFT}}
    denoising = {**base["denoising"], **fields.pop("denoising", {})}
    spec = fields.pop("spec", {})
    return build_policy(from_dict(WanVideoConfig, {**base, **fields, "denoising": denoising}, "policy"), spec)


def test_the_deterministic_chain_and_decode_equal_wan_pipeline_with_the_euler_scheduler(wan_dir):
    policy = make(wan_dir, denoising={"transition": "flow_ode"}).eval()
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(3), deterministic=True)
    x_init = torch.randn((len(PROMPTS), *policy.latent_shape), generator=torch.Generator().manual_seed(3))
    assert policy.latent_shape == (4, (FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8)
    assert torch.equal(sample.replay["chain"]["latents"][:, 0], x_init)

    pipe = diffusers.WanPipeline.from_pretrained(str(wan_dir), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT))
    pipe.set_progress_bar_config(disable=True)
    common = dict(prompt=PROMPTS, negative_prompt="blurry, static", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                  guidance_scale=3.0, max_sequence_length=TOKENS)
    with torch.no_grad():
        latents = pipe(**common, latents=x_init.clone(), output_type="latent").frames
        frames = pipe(**common, latents=x_init.clone(), output_type="np").frames  # [B, F, H, W, 3] in [0, 1]
    assert (latents - x_init).abs().max() > 0.1  # the chain moved
    torch.testing.assert_close(sample.output, latents, atol=1e-5, rtol=1e-5)
    assert torch.equal(policy.flow_sigmas(), pipe.scheduler.sigmas)  # the Euler scheduler's own grid, shift 3
    videos = sample.info["videos"]
    assert videos.shape == (len(PROMPTS), FRAMES, SIZE, SIZE, 3) and videos.dtype == torch.uint8
    assert torch.equal(sample.info["images"], videos[:, 0])
    assert (videos.float() - torch.from_numpy(frames).float() * 255).abs().max() <= 1.0  # one grey level: rounding


@pytest.mark.parametrize("chunk_steps", [1, None])
def test_flow_sde_recomputes_its_log_probs_with_ratio_one(wan_dir, chunk_steps):
    policy = make(wan_dir, denoising={"transition": "flow_sde", "noise_level": 0.7, "chunk_steps": chunk_steps})
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    assert sample.logp_deferred and sample.logp.shape == (len(PROMPTS), STEPS) and torch.isfinite(sample.logp).all()
    assert set(sample.replay) == {"chain", "prompt_ids", "prompt_mask"} and sample.replay["prompt_ids"].shape == (len(PROMPTS), TOKENS)
    with torch.no_grad():
        logp = policy.log_prob(sample.replay)
        again = policy.log_prob(sample.replay)
    assert torch.equal(logp, again)  # two passes at the same weights: the trainer's ratio is exactly 1
    if chunk_steps == 1:  # the sampling pass's batches: the same sums, to the bit
        assert torch.equal(logp, sample.logp)
    else:
        torch.testing.assert_close(logp, sample.logp, atol=1e-4, rtol=0)
    assert torch.equal(torch.exp(logp - again), torch.ones_like(logp))


def test_lora_trains_the_transformer_adapters_only_against_the_adapter_disabled_reference(wan_dir):
    policy = make(wan_dir, lora=LORA, denoising={"chunk_steps": 1})
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("transformer.") and "lora_" in n for n in trainable)
    assert not any(p.requires_grad for part in (policy.vae, policy.text_encoder) for p in part.parameters())
    sample = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    reference = policy.reference()
    assert not list(reference.parameters())  # shares the base weights
    assert policy.exact_kl(sample.replay, reference).abs().max() < 1e-6  # B = 0 at the start
    with torch.no_grad():
        assert torch.equal(reference.log_prob(sample.replay), policy.log_prob(sample.replay))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    loss = -(torch.tensor([1.0, -1.0, 0.5])[:, None] * policy.log_prob(sample.replay)).sum()
    loss.backward()
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)  # frozen VAE, UMT5, base
    optimizer.step()
    with torch.no_grad():
        assert (policy.log_prob(sample.replay) - reference.log_prob(sample.replay)).abs().max() > 1e-6
    assert (policy.exact_kl(sample.replay, reference) > 0).any()


def test_the_exported_lora_loads_into_wan_pipeline_and_gives_the_policys_transformer(wan_dir, tmp_path):
    from safetensors import safe_open

    policy = make(wan_dir, lora={**LORA, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]})
    torch.manual_seed(1)
    with torch.no_grad():  # move the adapters off zero (alpha / r = 2)
        for name, param in policy.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    policy.eval()
    save_pretrained(policy, tmp_path / "saved")  # save_extra writes lora_diffusers/ beside the weights
    exported = tmp_path / "saved" / "lora_diffusers"
    with safe_open(str(exported / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") and "lora" in k for k in keys)
    assert len(keys) == sum("lora_" in n for n, _ in policy.named_parameters())

    pipe = diffusers.WanPipeline.from_pretrained(str(wan_dir))
    pipe.load_lora_weights(str(exported))
    g = torch.Generator().manual_seed(0)
    x, states, t = torch.randn((2, *policy.latent_shape), generator=g), torch.randn((2, TOKENS, 16), generator=g), torch.tensor([700.0, 250.0])
    with torch.no_grad():
        ours = policy.transformer(hidden_states=x, timestep=t, encoder_hidden_states=states).sample
        theirs = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=states).sample
        with policy.adapters_disabled():
            plain = policy.transformer(hidden_states=x, timestep=t, encoder_hidden_states=states).sample
    assert (ours - plain).abs().max() > 1e-3  # the adapters do change the output
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_umt5_runs_once_per_distinct_prompt_and_cached_samples_equal_uncached_ones(wan_dir):
    cached, uncached = make(wan_dir), make(wan_dir, prompt_cache=0)
    calls = []
    cached.text_encoder.register_forward_hook(lambda *args: calls.append(1))
    outs = {}
    for name, policy in (("cached", cached), ("uncached", uncached)):
        samples = [policy.sample(prompts, torch.Generator().manual_seed(i)) for i, prompts in enumerate([PROMPTS, PROMPTS[:2], ["two blue squares"]])]
        with torch.no_grad():
            outs[name] = [(s.output, s.logp, policy.log_prob(s.replay)) for s in samples]
    # two distinct prompts and the negative prompt, each encoded once over three calls and their recomputes
    assert len(calls) == 3 and len(cached._prompt_cache) == 3
    for a, b in zip(outs["cached"], outs["uncached"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_checkpoints_without_the_frozen_weights_are_small_and_load_back_to_the_same_samples(wan_dir, tmp_path):
    from mmrl.core.weights import load_pretrained

    policy = make(wan_dir, lora=LORA, save_frozen_weights=False, denoising={"chunk_steps": 1})
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    save_pretrained(policy, tmp_path / "small")
    save_pretrained(make(wan_dir, lora=LORA), tmp_path / "full")
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(tmp_path / "small") * 5 < size(tmp_path / "full")
    loaded = load_pretrained(tmp_path / "small")
    assert type(loaded) is WanVideoPolicy
    first = policy.sample(PROMPTS, torch.Generator().manual_seed(0))
    second = loaded.sample(PROMPTS, torch.Generator().manual_seed(0))
    assert torch.equal(first.output, second.output) and torch.equal(first.logp, second.logp)


def test_two_grpo_steps_with_the_temporal_consistency_reward_run_through_the_trainer(wan_dir, tmp_path):
    from mmrl.train.metrics import read_metrics
    from mmrl.train.run_config import TrainConfig
    from mmrl.train.trainer import train

    from tests.conftest import ROOT

    cfg = from_dict(TrainConfig, {
        "name": "wan_tiny", "seed": 0, "total_steps": 2, "device": "cpu",
        "policy": {"type": "wan_video", "model_path": str(wan_dir), "frames": FRAMES, "height": 16, "width": 16, "max_sequence_length": TOKENS,
                   "guidance_scale": 2.0, "lora": LORA,
                   "denoising": {"transition": "flow_sde", "num_inference_steps": 3, "time_shift": SHIFT, "stochastic_steps": "window", "window_size": 2}},
        "sampler": {"type": "prompt", "data": {"train": str(ROOT / "examples/shapes_single_count/train.jsonl"), "eval": str(ROOT / "examples/shapes_single_count/eval.jsonl")}},
        "rewards": [{"type": "temporal_consistency"}],
        "algo": {"group_size": 2, "groups_per_step": 2, "kl": {"coef": 0.01}},
        "optim": {"lr": 1e-3},
        "eval": {"at_start": False, "at_end": False},
        "log": {"progress": False, "tensorboard": False},
    })
    train(cfg, tmp_path / "run")
    metrics = [m for m in read_metrics(tmp_path / "run") if "reward/total" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 <= m["reward/total"] <= 1 for m in metrics)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"frames": 6}, "policy.frames"),
        ({"height": 24}, "policy.height"),
        ({"denoising": {"time_shift": 5.0}}, "policy.denoising.time_shift"),
        ({"denoising": {"transition": "ddim", "min_std": 0.01}}, "policy.denoising.transition"),
        ({"save_frozen_weights": False, "model_path": None}, "policy.save_frozen_weights"),
    ],
)
def test_bad_options_are_one_line_config_errors_naming_the_field(wan_dir, fields, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        make(wan_dir, **fields)
    assert "\n" not in str(e.value)


def test_layouts_that_do_not_fit_are_one_line_config_errors(wan_dir, tmp_path):
    import shutil

    def broken(name, edit):
        target = tmp_path / name
        shutil.copytree(wan_dir, target)
        edit(target)
        return target

    cases = {
        "no_transformer": lambda d: shutil.rmtree(d / "transformer"),
        "no_tokenizer": lambda d: shutil.rmtree(d / "tokenizer"),
        "no_vae": lambda d: shutil.rmtree(d / "vae"),
        "two_experts": lambda d: shutil.copytree(d / "transformer", d / "transformer_2"),
        "ddim_scheduler": lambda d: diffusers.DDIMScheduler().save_pretrained(str(d / "scheduler")),
    }
    for name, edit in cases.items():
        with pytest.raises(ConfigError, match=r"policy\.model_path") as e:
            make(broken(name, edit))
        assert "\n" not in str(e.value), name
    with pytest.raises(ConfigError, match="prompt strings"):
        make(wan_dir).sample(torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match=r"sampler\.data\.train: got 'ids\.csv'; holds integer prompts.*wan_video \(text to video\) takes prompt strings"):
        make(wan_dir, spec={"num_prompts": 2, "prompt_file": "ids.csv"})
