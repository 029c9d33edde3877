"""The ``lora:`` section shared by the policies over transformers models (``text_lm``,
``text_vlm``, a VLA on a pretrained VLM): low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models") added with ``peft``."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.errors import ConfigError


@dataclass
class LoraOptions:
    """The ``lora:`` section: low-rank adapters (``peft``) instead of training every weight."""

    r: int = option(0, "rank of the adapters; 0 = no adapters (every weight trains)", ge=0)
    alpha: float = option(16.0, "scale of the adapters' update: W + (alpha / r) B A", gt=0)
    dropout: float = option(0.0, "dropout on the adapters' input (nonzero makes two passes of the same weights differ: ratio != 1)", ge=0, lt=1)
    target_modules: list[str] = option(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], doc="names of the linear layers that get adapters (the attention projections of llama/qwen/mistral models)"
    )

    def validate(self, path: str) -> None:
        if self.r and not self.target_modules:
            raise ConfigError(f"{path}.target_modules" if path else "target_modules", self.target_modules, "name at least one module (e.g. q_proj, v_proj)")
