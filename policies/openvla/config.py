"""Config of the OpenVLA policy (a released OpenVLA checkpoint run as mmrl runs its policies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.errors import ConfigError
from mmrl.policies.lora import LoraOptions


@dataclass
class OpenVLAConfig(PolicyConfig):
    """An OpenVLA checkpoint (Hugging Face layout) as a token policy: 7 action tokens per step."""

    type: str = option("openvla", "registered name of this component (see `mmrl list`)")
    checkpoint: str | None = option(None, "the OpenVLA checkpoint, a hub id (org/name[@revision]) or a directory: config.json, model*.safetensors, tokenizer, preprocessor_config.json, dataset_statistics.json (docs/openvla.md)")
    unnorm_key: str | None = option(None, "dataset whose action statistics un-normalize the actions (needed when the checkpoint holds several)")
    cameras: list[int] = option(factory=lambda: [0], doc="the env cameras fed to the model, in order (OpenVLA reads one image)")
    temperature: float = option(1.0, "sampling temperature of the action tokens (log-probs are those of the tempered distribution)", gt=0)
    logp_granularity: Literal["chunk", "token"] = option("chunk", "one RL decision = the step's action_dim tokens (one ratio) or each token (a ratio per token, as SimpleVLA-RL)")
    max_prompt_tokens: int | None = option(None, "prompt width kept in the replay; null = the longest prompt of the env's instructions", ge=2)
    vlm_dtype: str = option("float32", "dtype the weights are held in (the export writes each tensor back in the checkpoint's own dtype)", choices=("float32", "bfloat16"))
    attn_implementation: str = option("sdpa", "transformers attention kernel of the language model", choices=("sdpa", "eager"))
    freeze_vision_tower: bool = option(False, "keep the vision backbone (both featurizers) fixed")
    lora: LoraOptions = option(factory=LoraOptions, doc="LoRA adapters on the language model (r > 0: base weights frozen, the adapter-free model is the KL reference)")
    gripper: Literal["as_is", "libero"] = option(
        "as_is", "the last action dim as the model gives it, or as OpenVLA's LIBERO evaluation sends it: [0, 1] (1 = open) mapped to LIBERO's -1 = open / +1 = close, binarized"
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if not self.checkpoint:
            raise ConfigError(p + "checkpoint", self.checkpoint, "name an OpenVLA checkpoint directory (config.json, model*.safetensors, tokenizer, dataset_statistics.json)")
        if not self.temperature > 0:
            raise ConfigError(p + "temperature", self.temperature, "must be > 0")
        if not self.cameras or len(set(self.cameras)) != len(self.cameras) or min(self.cameras) < 0:
            raise ConfigError(p + "cameras", self.cameras, "list distinct camera indices >= 0 (e.g. [0])")
        self.lora.validate(p + "lora")
