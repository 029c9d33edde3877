"""Configs of the pairwise reward models."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.core.component_config import PolicyConfig
from mmrl.errors import ConfigError
from mmrl.policies.text_lm.config import TinyLMConfig


@dataclass
class PromptEncoderConfig:
    """The ``prompt:`` section: words of the prompt → one vector that conditions the image scorer."""

    buckets: int = option(1024, "lower-cased words are hashed (CRC-32) into this many embedding rows: no vocabulary to store, any text encodes", ge=2)
    dim: int = option(32, "width of the word embeddings and of the GRU reading them", ge=1)
    max_words: int = option(16, "words kept per prompt (longer prompts are cut)", ge=1)


@dataclass
class BTImageConfig(PolicyConfig):
    """A small CNN scoring one uint8 RGB image given its prompt (Bradley–Terry reward model)."""

    type: str = option("bt_image", "registered name of this component (see `mmrl list`)")
    image_size: int = option(32, "side of the square images scored (others are an error)", ge=4)
    channels: list[int] = option(factory=lambda: [16, 32, 64], doc="output channels of the 3x3 convs, each FiLM-conditioned on the prompt")
    strides: list[int] | None = option(None, "stride of each conv (1 or 2), one per entry of channels; null = 2 for every conv. A first stride of 1 keeps full resolution where objects are a few pixels wide")
    hflip: bool = option(False, "training only: mirror each image left-right with probability 1/2 (the label is unchanged). Only for prompts without left/right relations")
    hidden: int = option(64, "width of the score head's hidden layer", ge=1)
    prompt: PromptEncoderConfig = option(factory=PromptEncoderConfig, doc="how the prompt is read")

    def validate(self, path: str) -> None:
        if not self.channels or any(c < 1 for c in self.channels):
            raise ConfigError(f"{path}.channels" if path else "channels", self.channels, "expected a non-empty list of positive channel counts")
        if self.strides is not None and (len(self.strides) != len(self.channels) or any(s not in (1, 2) for s in self.strides)):
            raise ConfigError(f"{path}.strides" if path else "strides", self.strides, f"expected null or one stride (1 or 2) per conv ({len(self.channels)} entries)")
        if getattr(self, "shift", 0) >= self.image_size:  # the towers that shift their training images (bt_trajectory, learned_success)
            raise ConfigError(f"{path}.shift" if path else "shift", self.shift, f"must be smaller than image_size ({self.image_size})")


@dataclass
class BTImageSetConfig(BTImageConfig):
    """Scores a set of images for one prompt as the mean of a pairwise scorer over its pairs (PaCo-style)."""

    type: str = option("bt_image_set", "registered name of this component (see `mmrl list`)")


@dataclass
class BTTextConfig(PolicyConfig):
    """A tiny transformers decoder with a scalar head over prompt + completion (Bradley–Terry reward model)."""

    type: str = option("bt_text", "registered name of this component (see `mmrl list`)")
    tiny: TinyLMConfig = option(factory=lambda: TinyLMConfig(max_position_embeddings=256), doc="the decoder, built from a transformers config with random weights and mmrl's byte-level tokenizer")
    max_length: int = option(160, "tokens of prompt + separator + completion kept (the prompt is cut from the left when longer)", ge=2)
    separator: str = option("\n", "text between the prompt and the completion")
    attn_implementation: str = option("sdpa", "transformers attention kernel", choices=("sdpa", "eager"))

    def validate(self, path: str) -> None:
        self.tiny.validate(f"{path}.tiny" if path else "tiny")
        if self.max_length > self.tiny.max_position_embeddings:
            raise ConfigError(f"{path}.max_length" if path else "max_length", self.max_length, f"must be <= tiny.max_position_embeddings ({self.tiny.max_position_embeddings})")


@dataclass
class BTTrajectoryConfig(PolicyConfig):
    """Scores a robot episode (keyframes, state, actions) given its instruction (Bradley–Terry reward model, GRAPE-style)."""

    type: str = option("bt_trajectory", "registered name of this component (see `mmrl list`)")
    frames: int = option(6, "keyframes per episode: evenly spaced observations, the first and the last included (mmrl.demos.keyframes)", ge=2)
    image_size: int = option(64, "side of the square camera images scored (others are an error naming both shapes)", ge=4)
    cameras: int = option(1, "camera images per observation: 1 ([H, W, 3]) or K ([K, H, W, 3])", ge=1)
    state_dim: int = option(4, "length of the proprioceptive state vector", ge=0)
    action_dim: int = option(2, "length of the action vector", ge=1)
    channels: list[int] = option(factory=lambda: [8, 16, 32], doc="output channels of each keyframe's 3x3 convs, each FiLM-conditioned on the instruction")
    strides: list[int] | None = option(None, "stride of each conv (1 or 2), one per entry of channels; null = 2 for every conv")
    hidden: int = option(64, "width of the per-keyframe embedding and of the score head", ge=1)
    shift: int = option(0, "training only: shift each keyframe image by up to this many pixels (edge-padded random crop, as DrQ); 0 = off", ge=0)
    prompt: PromptEncoderConfig = option(factory=PromptEncoderConfig, doc="how the instruction is read")

    def validate(self, path: str) -> None:
        BTImageConfig.validate(self, path)  # the same conv tower (channels, strides, shift)
