"""Config of the vision-language agent: ``text_agent``'s options over ``text_vlm``'s model."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.policies.text_agent.config import TextAgentConfig
from mmrl.policies.text_vlm.config import TextVLMConfig


@dataclass
class VLMAgentConfig(TextAgentConfig, TextVLMConfig):
    """A vision-language model (LLaVA family) acting in a gymnasium env whose observations are text and images, one turn per decision."""

    type: str = option("vlm_agent", "registered name of this component (see `mmrl list`)")
    max_images: int | None = option(
        None,
        "most images one conversation may hold (every observation's images stay in it); an episode that would pass it ends, truncated. "
        "The replay keeps this many image slots per turn (null = as many as max_context_tokens can hold)",
        ge=1,
    )
