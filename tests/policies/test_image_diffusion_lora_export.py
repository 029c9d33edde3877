"""The image_diffusion policy's LoRA adapters in diffusers' format: `save_diffusers_lora` and the
`lora_diffusers/` folder beside every save_pretrained and checkpoint, loaded by a fresh diffusers
pipeline of the same base directory with `load_lora_weights` (SD 1.x, SDXL and SD3 shaped)."""

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors import safe_open  # noqa: E402

from mmrl.core.weights import save_pretrained  # noqa: E402
from mmrl.errors import ConfigError  # noqa: E402
from mmrl.policies.image_diffusion.export import save_diffusers_lora  # noqa: E402
from mmrl.train.checkpoint import Checkpointer  # noqa: E402
from tests.policies.test_image_diffusion_models import SD3_DENOISING, SD_DENOISING, make, sd3_pipeline, sd_pipeline  # noqa: E402
from tests.policies.test_image_diffusion_sdxl import sdxl_pipeline  # noqa: E402

# alpha / r = 2: the loader must read the adapter's scale from the file's metadata
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def _trained(policy):
    """Adapters moved off their initial B = 0, as training leaves them."""
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return policy


def _inputs(shape: str):
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn((2, 4, 8, 8), generator=g), torch.tensor([500.0, 20.0])
    if shape == "sd":
        return x, t, {"encoder_hidden_states": torch.randn((2, 8, 16), generator=g)}
    if shape == "sdxl":
        cond = {"text_embeds": torch.randn((2, 8), generator=g), "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * 2)}
        return x, t, {"encoder_hidden_states": torch.randn((2, 8, 24), generator=g), "added_cond_kwargs": cond}
    return x, t, {"encoder_hidden_states": torch.randn((2, 8, 32), generator=g), "pooled_projections": torch.randn((2, 16), generator=g)}


@pytest.mark.parametrize("shape", ["sd", "sdxl", "sd3"])
def test_a_fresh_diffusers_pipeline_with_the_exported_lora_computes_the_policys_adapted_denoiser(tmp_path, shape):
    base = tmp_path / "base"
    if shape == "sd":
        sd_pipeline(base)
        policy, pipeline_class, prefix = make(spec={}, model_path=str(base), denoising=SD_DENOISING, lora=LORA), diffusers.StableDiffusionPipeline, "unet."
    elif shape == "sdxl":
        sdxl_pipeline(base)
        policy, pipeline_class, prefix = make(spec={}, model_path=str(base), denoising=SD_DENOISING, lora=LORA), diffusers.StableDiffusionXLPipeline, "unet."
    else:
        sd3_pipeline(base, t5=False)
        policy, pipeline_class, prefix = make(spec={}, model_path=str(base), denoising=SD3_DENOISING, lora=LORA), diffusers.StableDiffusion3Pipeline, "transformer."
    _trained(policy).eval()
    save_pretrained(policy, tmp_path / "saved")  # save_extra writes lora_diffusers/ beside the weights
    exported = tmp_path / "saved" / "lora_diffusers"
    with safe_open(str(exported / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(prefix) and "lora" in k for k in keys)
    assert len(keys) == sum("lora_" in n for n, _ in policy.named_parameters())

    missing = {"text_encoder_3": None, "tokenizer_3": None} if shape == "sd3" else {}  # saved without T5
    pipe = pipeline_class.from_pretrained(str(base), **missing)
    pipe.load_lora_weights(str(exported))
    denoiser = pipe.unet if prefix == "unet." else pipe.transformer
    x, t, kwargs = _inputs(shape)
    with torch.no_grad():
        ours = policy.denoiser_model(x, timestep=t, **kwargs).sample
        theirs = denoiser(x, timestep=t, **kwargs).sample
        with policy.adapters_disabled():
            plain = policy.denoiser_model(x, timestep=t, **kwargs).sample
    assert (ours - plain).abs().max() > 1e-3  # the adapters do change the output
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_checkpoints_hold_the_exported_lora_and_a_direct_export_replaces_it_atomically(tmp_path):
    sd_pipeline(tmp_path / "base")
    policy = _trained(make(spec={}, model_path=str(tmp_path / "base"), denoising=SD_DENOISING, lora=LORA, save_frozen_weights=False))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad])
    path = Checkpointer(tmp_path / "run").save(1, policy, optimizer, {}, "name: x\n")
    assert (path / "lora_diffusers" / "pytorch_lora_weights.safetensors").is_file() and (path / "model.safetensors").is_file()
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    out = save_diffusers_lora(policy, tmp_path / "export")
    again = save_diffusers_lora(policy, tmp_path / "export")  # overwrites in place
    assert out == again and sorted(p.name for p in (tmp_path).iterdir() if p.name.startswith(".export")) == []
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["lora_adapter_metadata"])["unet.lora_alpha"] == 8.0


def test_denoisers_without_a_diffusers_lora_loader_keep_their_adapters_in_the_checkpoint_only(tmp_path):
    dit = make(tiny={"denoiser": "dit_transformer", "conditioning": "class"}, denoising={"clip_denoised": None}, lora={"r": 2})
    save_pretrained(dit, tmp_path / "dit")
    assert (tmp_path / "dit" / "model.safetensors").is_file() and not (tmp_path / "dit" / "lora_diffusers").exists()
    with pytest.raises(ConfigError, match="policy.lora.r"):
        save_diffusers_lora(dit, tmp_path / "out")
    with pytest.raises(ConfigError, match="policy.lora.r"):
        save_diffusers_lora(make(tiny={"conditioning": "text"}, spec={}), tmp_path / "out")  # no adapters
    full = make(tiny={"conditioning": "text"}, spec={})
    save_pretrained(full, tmp_path / "full")
    assert not (tmp_path / "full" / "lora_diffusers").exists()
