"""The options the LeRobot flow-matching policies share (``smolvla``, ``pi0``, ``pi05``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.denoising.options import DenoisingOptions
from mmrl.denoising.transitions import FLOW_TRANSITIONS
from mmrl.errors import ConfigError
from mmrl.hub import pretrained_dir
from mmrl.policies.lora import LoraOptions


@dataclass
class LeRobotDenoising(DenoisingOptions):
    """The denoising options of a LeRobot flow policy; the number of steps defaults to the checkpoint's."""

    num_inference_steps: int | None = option(None, "denoising steps K of a sampled chain; null = the checkpoint's number of steps", ge=1)

    def resolved(self, num_steps: int) -> LeRobotDenoising:
        """These options with ``num_inference_steps`` filled in from the checkpoint's."""
        return self if self.num_inference_steps is not None else dataclasses.replace(self, num_inference_steps=num_steps)


@dataclass
class LeRobotFlowConfig(PolicyConfig):
    """A LeRobot flow-matching policy directory, run as LeRobot runs it; RL via Flow-SDE chains."""

    checkpoint: str | None = option(None, "the LeRobot policy: a hub id (org/name[@revision]) or a directory (config.json, model.safetensors, policy_preprocessor.json, policy_postprocessor.json)")
    vlm_dir: str | None = option(None, "directory or hub id with the VLM's config.json and tokenizer; null = the name the checkpoint gives (a directory, or a hub id: its config and tokenizer files, cached or downloaded)")
    cameras: list[str] | None = option(None, "the checkpoint's image feature key for each env camera, in the env's camera order; null = the checkpoint's image features in order")
    n_action_steps: int | None = option(None, "actions of each predicted chunk the env executes; null = the checkpoint's n_action_steps", ge=1)
    denoising: LeRobotDenoising = option(
        factory=lambda: LeRobotDenoising(transition="flow_sde", num_inference_steps=None, noise_level=0.5, logp_granularity="chain"),
        doc="the action expert's denoising chain (a flow transition on the checkpoint's Euler grid): steps, noise, which steps are stochastic",
    )
    train_expert_only: bool | None = option(None, "freeze the whole VLM (LeRobot's train_expert_only); null = the checkpoint's")
    freeze_vision_encoder: bool | None = option(None, "freeze the VLM's vision encoder; null = the checkpoint's")
    lora: LoraOptions = option(factory=LoraOptions, doc="peft LoRA adapters; the adapter-free policy is then the KL reference")
    lora_on: Literal["expert", "vlm", "both"] = option("expert", "which transformer gets the LoRA adapters (its base weights are then frozen)")
    vlm_dtype: Literal["float32", "bfloat16"] = option("float32", "dtype of the VLM's weights (the expert, projections and log-probs stay float32)")

    @property
    def action_chunk(self) -> int:
        """Actions per demonstration chunk: the checkpoint's chunk_size (what its loss trains on)."""
        if self.checkpoint is None:
            return 1
        try:
            return int(json.loads((pretrained_dir(self.checkpoint, "policy.checkpoint") / "config.json").read_text())["chunk_size"])
        except (ConfigError, OSError, KeyError, ValueError):
            return 1

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.checkpoint is None:
            raise ConfigError(p + "checkpoint", None, f"required: a LeRobot {self.type} policy directory (docs/vla.md)")
        if self.denoising.transition not in FLOW_TRANSITIONS:
            raise ConfigError(p + "denoising.transition", self.denoising.transition, f"allowed: {', '.join(FLOW_TRANSITIONS)} (flow_noise adds a noise head that mmrl trains; it is not part of the checkpoint)")
        if self.denoising.time_shift != 1.0:
            raise ConfigError(p + "denoising.time_shift", self.denoising.time_shift, "LeRobot integrates on an even grid; leave it at 1.0")
        if self.denoising.num_inference_steps is not None:
            self.denoising.validate(p + "denoising")
        if self.cameras is not None and len(set(self.cameras)) != len(self.cameras):
            raise ConfigError(p + "cameras", self.cameras, "name each image feature once")
        self.lora.validate(p + "lora")
