"""What the agent families (``text_agent``, ``vlm_agent``) share about a conversation that a
chat template renders: how a turn is joined to the next observation, found by rendering a
conversation of stand-ins and finding them again."""

from __future__ import annotations

from typing import Callable

from mmrl.errors import ConfigError

# stand-ins for the contents of a rendered conversation, found again in the rendering
FIRST_MESSAGE, AGENT_REPLY, NEXT_OBSERVATION = "MMRL_FIRST_MESSAGE", "MMRL_AGENT_REPLY", "MMRL_NEXT_OBSERVATION"


def glue_texts(
    render: Callable[[list[dict], bool], str], message: Callable[[str, str], dict], system_prompt: str | None, eos: str, renderer: str
) -> tuple[str, str, str, str]:
    """(after a turn that ended with EOS, after a turn cut without it, before an observation,
    after an observation): the text a chat template puts between a turn and the next
    observation, and between that observation and the next generation prompt.

    ``render(messages, add_generation_prompt)`` is the template; ``message(role, text)`` makes
    one message; ``eos`` is the text of the EOS token, which a turn that ended with it has
    already generated; ``renderer`` names what owns the template in the error (tokenizer,
    processor). A template that rewrites earlier turns when one is appended is refused."""
    system = [message("system", system_prompt)] if system_prompt is not None else []
    talk = [*system, message("user", FIRST_MESSAGE), message("assistant", AGENT_REPLY)]
    base = render(talk, False)
    full = render([*talk, message("user", NEXT_OBSERVATION)], True)
    if not full.startswith(base) or AGENT_REPLY not in base or full[len(base):].count(NEXT_OBSERVATION) != 1:
        raise ConfigError(
            "policy.generation.chat_template", True,
            f"the {renderer}'s chat template does not render a conversation by appending turns (it rewrites earlier ones), which token-in/token-out turns need: set it false",
        )
    suffix = base[base.rindex(AGENT_REPLY) + len(AGENT_REPLY):]  # what the template closes a reply with
    before, after = full[len(base):].split(NEXT_OBSERVATION)
    return (suffix[len(eos):] if suffix.startswith(eos) else suffix, suffix, before, after)
