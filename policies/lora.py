"""The ``lora:`` section shared by the policies over transformers models (``text_lm``,
``text_vlm``, a VLA on a pretrained VLM): low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models") added with ``peft``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

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
            example = ", ".join(type(self)().target_modules[:2])  # the defaults of this section's class
            raise ConfigError(f"{path}.target_modules" if path else "target_modules", self.target_modules, f"name at least one module (e.g. {example})")


def adapter_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` that peft gave adapters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Within the block ``module`` runs without its LoRA adapters (the base model: a LoRA
    policy's KL reference). peft's switch also sets the adapters' ``requires_grad``; what
    was frozen stays frozen."""
    trainable = {name: p.requires_grad for name, p in module.named_parameters() if "lora_" in name}
    layers = adapter_layers(module)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for name, param in module.named_parameters():
            if name in trainable:
                param.requires_grad_(trainable[name])
