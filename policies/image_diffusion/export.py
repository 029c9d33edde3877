"""The diffusers LoRA layout of an ``image_diffusion`` policy's adapters
(``pytorch_lora_weights.safetensors``, for ``pipeline.load_lora_weights``).

Apart from the policy because it writes a file format for diffusers to read, from the
policy's denoiser, adapters and pipeline kind alone (model.py imports it; it imports nothing of model.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mmrl.errors import ConfigError
from mmrl.policies.image_diffusion.build import require_diffusers


# the pipeline class whose save_lora_weights / load_lora_weights a denoiser's adapters follow
LORA_EXPORTS = {"UNet2DConditionModel": "unet", "SD3Transformer2DModel": "transformer", "FluxTransformer2DModel": "transformer"}


def save_diffusers_lora(policy, out_dir: str | os.PathLike) -> Path:
    """Write the LoRA adapters of ``policy`` (an ``ImageDiffusionPolicy``) where diffusers'
    LoRA loaders read them: ``out_dir/pytorch_lora_weights.safetensors``, which
    ``pipeline.load_lora_weights(out_dir)`` of the user's pipeline (built from the same base
    directory) loads into its denoiser.

    Follows diffusers' LoRA training scripts (``train_text_to_image_lora.py``,
    ``train_dreambooth_lora_sdxl.py``, ``train_dreambooth_lora_sd3.py``): peft's
    ``get_peft_model_state_dict`` of the denoiser (diffusers' key names for a UNet,
    ``convert_state_dict_to_diffusers``), saved with the pipeline class's
    ``save_lora_weights`` — ``StableDiffusionPipeline`` (SD 1.x / 2.x) or
    ``StableDiffusionXLPipeline`` (SDXL), keys prefixed ``unet.``; ``StableDiffusion3Pipeline``
    or ``FluxPipeline`` (``train_dreambooth_lora_flux.py``), keys prefixed ``transformer.`` — with the adapter's ``LoraConfig`` as metadata, so the
    loader applies the same rank, alpha and target modules (scale alpha / r). The directory
    is written under a temporary name and renamed into place. A ``DiTTransformer2DModel`` or
    ``UNet2DModel`` has no diffusers LoRA loader: a config error (its adapters are in
    ``model.safetensors``)."""
    lora = policy.config.lora
    if not lora.r:
        raise ConfigError("policy.lora.r", lora.r, "there are no adapters to export (LoRA is off)")
    diffusers = require_diffusers()
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    model = policy.denoiser_model
    slot = LORA_EXPORTS.get(type(model).__name__)
    if slot is None:
        raise ConfigError("policy.lora.r", lora.r, f"diffusers has no LoRA loader for a {type(model).__name__} (supported: {list(LORA_EXPORTS)}); its adapters are in model.safetensors")
    layers = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    metadata = model.peft_config["default"].to_dict()
    if slot == "unet":
        pipeline = diffusers.StableDiffusionXLPipeline if policy.sdxl else diffusers.StableDiffusionPipeline
        kwargs = {"unet_lora_layers": convert_state_dict_to_diffusers(layers), "unet_lora_adapter_metadata": metadata}
    else:
        pipeline = diffusers.FluxPipeline if policy.kind == "flux" else diffusers.StableDiffusion3Pipeline
        kwargs = {"transformer_lora_layers": layers, "transformer_lora_adapter_metadata": metadata}
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipeline.save_lora_weights(str(tmp), safe_serialization=True, **kwargs)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out

