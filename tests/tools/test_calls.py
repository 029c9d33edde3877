"""Reading an agent's turn: Hermes/Qwen <tool_call> blocks, the JSON form, answers and
malformed calls; the call format a chat template implies."""

from __future__ import annotations

from mmrl.tools.calls import detect_call_format, instructions, parse_turn
from mmrl.tools.tool import ToolCall, make_tools

QWEN_TOOLS_PART = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}...{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- endif %}"
)
PLAIN_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"


def test_hermes_blocks_are_calls_even_unclosed_or_with_string_arguments():
    turn = parse_turn(
        "<think>maybe <tool_call>{\"name\": \"python\"}</tool_call></think>Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 21"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
    )
    assert turn.calls == [ToolCall("calculator", {"expression": "2 * 21"}), ToolCall("python", {"code": "print(1)"})]
    assert turn.errors == [] and turn.answer is None


def test_json_form_with_tool_or_name_keys():
    turn = parse_turn('I need the product.\n{"tool": "calculator", "arguments": {"expression": "6 * 7"}}\n')
    assert turn.calls == [ToolCall("calculator", {"expression": "6 * 7"})]
    llama = parse_turn('{"name": "calculator", "parameters": {"expression": "1 + 1"}}')
    assert llama.calls == [ToolCall("calculator", {"expression": "1 + 1"})]
    nested = parse_turn('```json\n{"tool": "lookup", "arguments": {"word": "x", "filter": {"name": "y"}}}\n```')
    assert nested.calls == [ToolCall("lookup", {"word": "x", "filter": {"name": "y"}})] and nested.errors == []


def test_a_turn_without_a_call_is_the_answer():
    assert parse_turn("Reasoning...\nAnswer: 1,234,567\n").answer == "1,234,567"
    assert parse_turn('All done. {"answer": "42"}').answer == "42"
    assert parse_turn("The value is 99.").answer == "The value is 99."
    assert parse_turn('My name is {"name": "Bob"}').answer == 'My name is {"name": "Bob"}'  # not a call: no arguments


def test_malformed_calls_are_errors_that_say_what_was_wrong():
    broken_json = parse_turn('{"tool": "calculator", "arguments": {"expression": "1+1"}')
    assert broken_json.calls == [] and "not valid JSON" in broken_json.errors[0] and broken_json.answer is None
    broken_block = parse_turn("<tool_call>{name: calculator}</tool_call>")
    assert "<tool_call> block is not valid JSON" in broken_block.errors[0]
    nameless = parse_turn('<tool_call>{"arguments": {"expression": "1"}}</tool_call>')
    assert "names no tool" in nameless.errors[0]
    not_object = parse_turn("<tool_call>[1, 2]</tool_call>")
    assert "must hold a JSON object" in not_object.errors[0]


def test_call_format_comes_from_the_chat_template():
    assert detect_call_format(QWEN_TOOLS_PART) == "hermes"
    assert detect_call_format({"default": PLAIN_TEMPLATE, "tool_use": QWEN_TOOLS_PART}) == "hermes"
    assert detect_call_format(PLAIN_TEMPLATE) == "json"
    assert detect_call_format(None) == "json"

    class Tokenizer:
        chat_template = QWEN_TOOLS_PART

    assert detect_call_format(Tokenizer()) == "hermes"


def test_instructions_teach_each_form_and_list_the_tools():
    tools = make_tools(["calculator"])
    hermes = instructions(tools, "hermes")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in hermes and "<tool_call>" in hermes
    plain = instructions(tools, "json")
    assert '{"tool": "<name>", "arguments": {<arguments>}}' in plain and "Answer: <your answer>" in plain and "- calculator: " in plain
