"""Config of the ``smolvla`` policy: a LeRobot SmolVLA checkpoint, run and fine-tuned by mmrl."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.policies.vla.lerobot_config import LeRobotFlowConfig


@dataclass
class SmolVLAConfig(LeRobotFlowConfig):
    """A LeRobot SmolVLA policy directory: SmolVLM + flow-matching action expert, run as LeRobot runs it; RL via Flow-SDE chains."""

    type: str = option("smolvla", "registered name of this component (see `mmrl list`)")
    vlm_dir: str | None = option(None, "directory or hub id with the VLM's config.json and tokenizer; null = the checkpoint's vlm_model_name (a directory, or a hub id: its config and tokenizer files, cached or downloaded)")
    train_state_proj: bool | None = option(None, "train the state projection; null = the checkpoint's")
