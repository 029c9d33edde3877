"""Configs of the ``pi0`` and ``pi05`` policies: LeRobot π0 / π0.5 checkpoints, run and fine-tuned by mmrl."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmrl.config import option
from mmrl.policies.vla.lerobot_config import LeRobotFlowConfig


@dataclass
class PI0Config(LeRobotFlowConfig):
    """A LeRobot π0 policy directory: PaliGemma + Gemma action expert (flow matching), run as LeRobot runs it; RL via Flow-SDE chains."""

    type: str = option("pi0", "registered name of this component (see `mmrl list`)")
    vlm_dir: str | None = option(None, "directory or hub id with the PaliGemma tokenizer (tokenizer_config.json) and a config.json; null = the pre-processor's tokenizer_name (a directory, or a hub id: its config and tokenizer files, cached or downloaded)")
    train_expert_only: bool | None = option(None, "freeze the whole PaliGemma (LeRobot's train_expert_only); null = the checkpoint's")
    freeze_vision_encoder: bool | None = option(None, "freeze the SigLIP vision tower; null = the checkpoint's")
    vlm_dtype: Literal["float32", "bfloat16"] = option("float32", "dtype of PaliGemma's weights (LeRobot keeps the patch/position embeddings and norms float32; the expert, projections and log-probs stay float32)")


@dataclass
class PI05Config(PI0Config):
    """A LeRobot π0.5 policy directory: PaliGemma (the state as discrete prompt tokens) + adaRMS-conditioned Gemma expert; RL via Flow-SDE chains."""

    type: str = option("pi05", "registered name of this component (see `mmrl list`)")
