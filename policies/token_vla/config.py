"""Config of the discrete-token VLA policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.policies.vla.backbone import VLABackboneConfig
from mmrl.core.component_config import PolicyConfig


@dataclass
class TokenVLAConfig(PolicyConfig):
    """A vision-language-action model that predicts binned actions as tokens (OpenVLA style)."""

    type: str = option("token_vla", "registered name of this component (see `mmrl list`)")
    backbone: VLABackboneConfig = option(factory=VLABackboneConfig, doc="image encoder, instruction embeddings and transformer decoder")
    action_bins: int = option(32, "uniform bins per action dimension over the normalized range [-1, 1] (the action-token vocabulary)", ge=2)
    action_chunk: int = option(1, "actions emitted per decision (an action chunk of action_chunk x action_dim tokens)", ge=1)
    logp_granularity: Literal["chunk", "token"] = option("chunk", "what one RL decision is: the whole chunk (log-prob = sum over its C x A tokens, one ratio per chunk) or every action token (a ratio per token, clipped separately, as SimpleVLA-RL)")
    temperature: float = option(1.0, "sampling temperature of the action tokens (log-probs are those of the tempered distribution)", gt=0)
    decode_cache: Literal["static", "dynamic"] = option(
        "static", "key/value cache of the sampling loop: static = buffers for the chunk's slots, each step runs only the decoder's layers (Llama-layout decoders; others stay dynamic); dynamic = transformers' growing cache"
    )
    compile_decoder: bool = option(
        False,
        "sampling (no grad) runs each decoding step of the static cache through torch.compile at fixed shapes (one compile per batch size): fewer launches per token; log_prob stays eager, so it needs old_logp: deferred (ratios of exactly 1) and decode_cache: static. On CUDA mode reduce-overhead, whose CUDA graphs torch skips for a step that writes key/value buffers it is handed (not yet measured on a GPU)",
    )
    old_logp: Literal["deferred", "sampler"] = option(
        "deferred",
        "where the old log-probs of the ratio come from: deferred = the trainer's teacher-forced log_prob at the sampling weights (the first minibatch's own forward, one no-grad pass over the other rows), ratios of exactly 1 before an update; sampler = the cached decoding loop's own numbers (no extra pass; they round differently, by up to ~1e-2 nats a chunk in bf16: the metric old_logp/sampler_gap_max shows it under deferred)",
    )

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.action_bins < 2:
            raise ConfigError(p + "action_bins", self.action_bins, "must be >= 2")
        if self.action_chunk < 1:
            raise ConfigError(p + "action_chunk", self.action_chunk, "must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(p + "temperature", self.temperature, "must be > 0")
        self.backbone.validate(p + "backbone")
        if self.compile_decoder and self.old_logp != "deferred":
            raise ConfigError(p + "compile_decoder", True, "the compiled decoding steps round otherwise than log_prob's eager pass: it needs old_logp: deferred (ratios of exactly 1)")
        if self.compile_decoder and self.decode_cache != "static":
            raise ConfigError(p + "compile_decoder", True, "compiles the steps of the static key/value cache: it needs decode_cache: static")
