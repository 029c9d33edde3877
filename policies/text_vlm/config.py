"""Config of the vision-language policy: ``text_lm``'s options plus the tiny vision tower."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.policies.text_lm.config import TextLMConfig


@dataclass
class TinyVisionConfig:
    """The ``vision:`` section: the ViT (a CLIP vision tower) of the random tiny model built
    when ``model_path`` is null; its features reach the decoder of ``tiny`` through LLaVA's
    projector, one token per image patch."""

    image_size: int = option(32, "side of the square images the processor resizes and crops every image to (pixels)", ge=1)
    patch_size: int = option(8, "side of a ViT patch; an image becomes (image_size / patch_size)^2 tokens of the prompt", ge=1)
    hidden_size: int = option(32, "width of the vision tower", ge=1)
    num_layers: int = option(1, "transformer layers of the vision tower", ge=1)
    num_heads: int = option(2, "attention heads of the vision tower (must divide hidden_size)", ge=1)
    intermediate_size: int = option(64, "width of the vision tower's MLP", ge=1)

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.image_size % self.patch_size:
            raise ConfigError(p + "patch_size", self.patch_size, f"must divide image_size ({self.image_size})")
        if self.hidden_size % self.num_heads:
            raise ConfigError(p + "num_heads", self.num_heads, f"must divide hidden_size ({self.hidden_size})")

    @property
    def image_tokens(self) -> int:
        """Prompt tokens per image."""
        return (self.image_size // self.patch_size) ** 2


@dataclass
class TextVLMConfig(TextLMConfig):
    """A vision-language policy over a transformers image-text-to-text model (LLaVA family)
    and its processor: text prompts with images, completions as text_lm samples them."""

    type: str = option("text_vlm", "registered name of this component (see `mmrl list`)")
    model_path: str | None = option(
        None, "directory or hub id (org/name[@revision]) of a transformers vision-language model and its processor (save_pretrained layout); null = the random tiny model of `tiny` and `vision`"
    )
    vision: TinyVisionConfig = option(factory=TinyVisionConfig, doc="the vision tower of the random tiny model built when model_path is null")
    freeze_vision_tower: bool = option(False, "keep the vision tower's weights fixed (the projector and the decoder train)")

    def validate(self, path: str) -> None:
        p = f"{path}." if path else ""
        if self.gguf_file is not None:
            raise ConfigError(p + "gguf_file", self.gguf_file, "text_vlm loads save_pretrained directories only (GGUF files hold text models)")
        super().validate(path)
        self.vision.validate(p + "vision")
