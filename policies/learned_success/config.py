"""Config of the ``learned_success`` classifier."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.policies.reward_model.config import BTImageConfig, PromptEncoderConfig


@dataclass
class LearnedSuccessConfig(PolicyConfig):
    """A small CNN over every camera of an observation, plus its state and instruction → logit of P(success)."""

    type: str = option("learned_success", "registered name of this component (see `mmrl list`)")
    image_size: int = option(64, "side of each square camera image read (the env's must match)", ge=4)
    cameras: int = option(1, "cameras per observation: 1 reads images [H, W, 3], K > 1 reads [K, H, W, 3]", ge=1)
    state_dim: int = option(0, "length of the proprioceptive state read (the env's must match; 0 = images and instruction only)", ge=0)
    channels: list[int] = option(factory=lambda: [16, 32, 64], doc="output channels of the 3x3 convs, each FiLM-conditioned on the instruction")
    strides: list[int] | None = option(None, "stride of each conv (1 or 2), one per entry of channels; null = 2 for every conv")
    hidden: int = option(64, "width of the classifier head's hidden layer", ge=1)
    shift: int = option(4, "training only: shift each image by up to this many pixels (edge-padded random crop, as DrQ); 0 = off", ge=0)
    prompt: PromptEncoderConfig = option(factory=PromptEncoderConfig, doc="how the instruction is read")

    def validate(self, path: str) -> None:
        BTImageConfig.validate(self, path)  # the same conv tower (channels, strides, shift)

    @property
    def image_shape(self) -> list[int]:
        """The shape of one observation's images: [H, W, 3], or [K, H, W, 3] for K > 1 cameras."""
        side = [self.image_size, self.image_size, 3]
        return side if self.cameras == 1 else [self.cameras, *side]
