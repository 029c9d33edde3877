"""Config of the OpenVLA-OFT policy (a released OpenVLA-OFT checkpoint run as mmrl runs its policies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.policies.openvla.config import OpenVLAConfig


@dataclass
class OpenVLAOFTConfig(OpenVLAConfig):
    """An OpenVLA-OFT checkpoint: a chunk of actions from one parallel-decoding pass (L1 head or action tokens)."""

    type: str = option("openvla_oft", "registered name of this component (see `mmrl list`)")
    checkpoint: str | None = option(None, "the OpenVLA-OFT checkpoint, a hub id (org/name[@revision]) or a directory: the OpenVLA files, action_head--*checkpoint.pt, proprio_projector--*checkpoint.pt, lora_adapter/ (docs/openvla.md)")
    cameras: list[int] = option(factory=lambda: [0], doc="the env cameras fed to the model, in order (LIBERO: [0, 1] = agentview, then wrist)")
    use_proprio: bool = option(True, "feed the env's state through the proprio projector as one token after the image patches")
    action_head: Literal["l1", "tokens"] = option("l1", "l1: the L1-regression head on the action positions (no likelihood: SFT and evaluation only); tokens: OFT's discrete action tokens, decoded in parallel (RL)")
    chunk_size: int = option(8, "actions per chunk (OFT's NUM_ACTIONS_CHUNK: LIBERO 8, ALOHA 25, Bridge 5); the checkpoint files do not record it", ge=1)
    action_dim: int | None = option(None, "dims of one action; null = the statistics' (and the L1 head's, which must agree)", ge=1)
    normalization: Literal["bounds_q99", "bounds"] = option("bounds_q99", "OFT's ACTION_PROPRIO_NORMALIZATION_TYPE: q01/q99 (LIBERO, Bridge) or min/max (ALOHA)")
    lora_adapter: Literal["ignore", "apply"] = option(
        "ignore", "lora_adapter/: ignore it as the reference's inference does (the model files are the merged weights), or apply it to weights that are the base model's"
    )
    temperature: float = option(1.0, "sampling temperature of the action tokens (action_head: tokens; log-probs are those of the tempered distribution)", gt=0)
    logp_granularity: Literal["chunk", "token"] = option("chunk", "one RL decision = the chunk's chunk_size·action_dim tokens (one ratio) or each token (a ratio per token, as SimpleVLA-RL)")

    @property
    def action_chunk(self) -> int:
        """Actions per demonstration chunk (what ``sft_loss`` trains on)."""
        return int(self.chunk_size)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if not self.checkpoint:
            raise ConfigError(p + "checkpoint", self.checkpoint, "name an OpenVLA-OFT checkpoint directory (config.json, model*.safetensors, tokenizer, dataset_statistics.json, action_head--*checkpoint.pt)")
        if not self.temperature > 0:
            raise ConfigError(p + "temperature", self.temperature, "must be > 0")
        if not self.cameras or len(set(self.cameras)) != len(self.cameras) or min(self.cameras) < 0:
            raise ConfigError(p + "cameras", self.cameras, "list distinct camera indices >= 0 (e.g. [0, 1])")
        if self.chunk_size < 1:
            raise ConfigError(p + "chunk_size", self.chunk_size, "must be >= 1")
        self.lora.validate(p + "lora")
