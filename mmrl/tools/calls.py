"""Tool calls in an agent's turn: :func:`parse_turn`, and what the agent is told (:func:`instructions`).

Two forms are read in every turn, whichever the agent was told to use:

- ``hermes``: the chat-template form of Qwen 2.5/3, Hermes and others whose template renders
  ``tools=[...]``; a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (an unclosed block at the end of the turn counts: generation often stops at the closing tag);
- ``json``: a JSON object anywhere in the turn, ``{"tool": "calculator", "arguments": {...}}``
  (``{"name": ..., "arguments"|"parameters": ...}``, the form of Llama 3.1's template, is read too).

A turn with no call is the agent's answer. ``Answer: ...`` (the rest of the turn after it) or
a JSON ``{"answer": ...}`` marks the answer inside a longer turn; otherwise the whole turn is.
A call that cannot be read (broken JSON, no name) is an error the agent is told about, and the
episode goes on. ``<think>...</think>`` reasoning is skipped when looking for calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from mmrl.tools.tool import Tool, ToolCall

CallFormat = Literal["hermes", "json"]

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_JSON_CALL = re.compile(r'\{\s*"(?:tool|name)"\s*:')
_ANSWER_LINE = re.compile(r"^[ \t>*#]*(?:final\s+)?answer\s*:[ \t]*", re.I | re.M)


@dataclass
class Turn:
    """What one turn of the agent holds: tool calls, or else its answer; ``errors`` says what
    was wrong with each call that could not be read."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    answer: str | None = None


def parse_turn(text: str) -> Turn:
    """The tool calls of ``text`` (both forms), or its answer when it calls nothing."""
    visible = _THINK.sub("", text)
    turn = Turn()
    blocks = list(_HERMES.finditer(visible))
    for block in blocks:
        _add_call(turn, block.group(1).strip(), "<tool_call> block")
    outside = _HERMES.sub("", visible)
    found = list(_json_objects(outside))
    objects = [obj for obj, _, _ in found]
    for obj in objects:
        if isinstance(obj, dict) and ("tool" in obj or ("name" in obj and ("arguments" in obj or "parameters" in obj))):
            _add_call(turn, obj, "JSON call")
    for attempt in _JSON_CALL.finditer(outside):  # a call's opening that no readable object holds
        if not any(start <= attempt.start() < end for _, start, end in found):
            turn.errors.append('a tool call that is not valid JSON; write one object per call: {"tool": "<name>", "arguments": {...}}')
            break
    if turn.calls or turn.errors:
        return turn
    answers = [obj["answer"] for obj in objects if isinstance(obj, dict) and set(obj) == {"answer"}]
    marker = list(_ANSWER_LINE.finditer(visible))
    if marker:
        turn.answer = visible[marker[-1].end():].strip()
    elif answers:
        turn.answer = str(answers[-1])
    else:
        turn.answer = text
    return turn


def _add_call(turn: Turn, body: str | dict, form: str) -> None:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError as e:
            turn.errors.append(f"the {form} is not valid JSON ({e.msg} at character {e.pos}); write {{\"name\": \"<tool>\", \"arguments\": {{...}}}}")
            return
    if not isinstance(body, dict):
        turn.errors.append(f"the {form} must hold a JSON object, got {json.dumps(body)[:80]}")
        return
    name = body.get("tool", body.get("name"))
    arguments: Any = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        turn.errors.append(f"the {form} names no tool: give \"name\" (or \"tool\") as a string")
        return
    turn.calls.append(ToolCall(name, arguments))


def _json_objects(text: str):
    """(object, start, end) of every top-level JSON object in ``text``, left to right."""
    decoder = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        yield obj, i, end
        i = text.find("{", end)


def detect_call_format(template: Any) -> CallFormat:
    """``hermes`` when a chat template (its text, a dict of named templates, or a tokenizer
    with ``chat_template``) renders tool calls as ``<tool_call>`` blocks, else ``json``."""
    template = getattr(template, "chat_template", template)
    texts = template.values() if isinstance(template, dict) else [template]
    return "hermes" if any(isinstance(t, str) and "<tool_call>" in t for t in texts) else "json"


def instructions(tools: dict[str, Tool], call_format: CallFormat) -> str:
    """What the agent is told about its tools: in the Hermes form the text Qwen 2.5's chat
    template writes for ``tools=[...]``; in the JSON form the documented JSON line."""
    if call_format == "hermes":
        schemas = "\n".join(json.dumps(t.schema()) for t in tools.values())
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
            "When you know the answer, reply without a tool call."
        )
    listed = "\n".join(f"- {t.name}: {t.description} Arguments: {json.dumps(t.parameters['properties'])}" for t in tools.values())
    return (
        "You can use tools. To call one, write a JSON object on its own line:\n"
        '{"tool": "<name>", "arguments": {<arguments>}}\n'
        "Its result comes back as the next message. When you know the answer, write it on a line of its own:\n"
        "Answer: <your answer>\n"
        f"Tools:\n{listed}"
    )


def format_result(name: str, text: str, call_format: CallFormat) -> str:
    """A tool's result as the agent reads it: Qwen's ``<tool_response>`` block, or a labelled one."""
    if call_format == "hermes":
        return f"<tool_response>\n{text}\n</tool_response>"
    return f"Result of {name}:\n{text}"
