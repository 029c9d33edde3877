"""Config of the language agent: a causal LM whose decision is one turn in a text env."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import option
from mmrl.errors import ConfigError
from mmrl.policies.text_lm.config import GenerationOptions, TextLMConfig


@dataclass
class TextAgentConfig(TextLMConfig):
    """A transformers causal LM acting in a gymnasium env with text observations and actions, one turn per decision."""

    type: str = option("text_agent", "registered name of this component (see `mmrl list`)")
    generation: GenerationOptions = option(
        factory=lambda: GenerationOptions(chat_template=True, max_new_tokens=32),
        doc="sampling of each turn: budget per turn (max_new_tokens), temperature, top-p, stop strings, chat template (the conversation grows through it), backend, old_logp",
    )
    max_context_tokens: int = option(1024, "longest conversation (token history + the next turn's budget); an episode that would pass it ends, truncated", ge=2)
    turn_cache: bool = option(True, "carry each episode's key/value cache from turn to turn, so a turn prefills only the env's new tokens (false: re-encode the whole history every turn; a generation.backend that takes no cache always re-encodes)")
    turn_separator: str = option("\n", "without a chat template: the text put before each observation after the first (the transcript is observation, turn, separator, observation, ...)")

    def validate(self, path: str) -> None:
        super().validate(path)
        p = f"{path}." if path else ""
        if self.max_context_tokens <= self.generation.max_new_tokens:
            raise ConfigError(p + "max_context_tokens", self.max_context_tokens, f"must exceed generation.max_new_tokens ({self.generation.max_new_tokens}): the history and one turn share it")
