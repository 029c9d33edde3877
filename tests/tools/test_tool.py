"""Tools: the calculator's arithmetic and refusals, schemas from signatures and docstrings,
argument checks, and the registry of built-in and user tools."""

from __future__ import annotations

from typing import Literal

import pytest

from mmrl.errors import ConfigError
from mmrl.tools.tool import ToolCall, ToolError, call_tool, make_tools, tool_from_function


def lookup(word: str, limit: int = 3, mode: Literal["short", "long"] = "short", tags: list[str] | None = None) -> str:
    """Look a word up in the dictionary.

    Args:
        word: the word to
            look up
        limit (int): how many senses to give
        mode: how much to say
        tags: labels to filter by

    Returns:
        the senses, one per line
    """
    if word == "boom":
        raise RuntimeError("the dictionary is on fire")
    if word == "nothing":
        raise ToolError(f"no sense of {word!r}")
    return f"{word}: {limit} senses ({mode}, {tags})"


def undocumented(x: int) -> int:
    return x


def calculate(expression: str) -> str:
    return call_tool(make_tools(["calculator"]), ToolCall("calculator", {"expression": expression})).text


@pytest.mark.parametrize("expression, value", [
    ("123456789012 * 987654321098 - 5", str(123456789012 * 987654321098 - 5)),
    ("-(2 ** 100) // 3 % 1000", str(-(2**100) // 3 % 1000)),
    ("7 / 2", "3.5"),
    ("+5 - -3", "8"),
    ("2 ** -2", "0.25"),
    ("10 ** 999", str(10**999)),
])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, says", [
    ("__import__('os').system('true')", "a function call is not allowed"),
    ("x + 1", "the name 'x' is not allowed"),
    ("(1).real", "attribute access (.real) is not allowed"),
    ("'a' * 3", "the constant 'a' is not allowed"),
    ("9 ** 9 ** 9", "would have more than 1000 digits"),
    ("10 ** 1000", "more than 1000 digits"),
    ("1 / 0", "division by zero"),
    ("2.0 ** 10000", "too large"),
    ("1 +", "not an arithmetic expression"),
    ("[1, 2]", "List is not allowed"),
])
def test_calculator_refuses_with_an_error_observation(expression, says):
    text = calculate(expression)
    assert text.startswith("Error: ") and says in text, text


def test_user_tool_schema_comes_from_signature_and_docstring():
    (tool,) = make_tools(["tests.tools.test_tool:lookup"]).values()
    assert tool.name == "lookup" and tool.description == "Look a word up in the dictionary."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "word": {"type": "string", "description": "the word to look up"},
            "limit": {"type": "integer", "description": "how many senses to give"},
            "mode": {"type": "string", "enum": ["short", "long"], "description": "how much to say"},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True, "description": "labels to filter by"},
        },
        "required": ["word"],
    }


def test_schema_matches_what_transformers_renders_for_chat_templates():
    utils = pytest.importorskip("transformers.utils")
    theirs = utils.get_json_schema(lookup)["function"]
    ours = tool_from_function(lookup).schema()["function"]
    assert (ours["name"], ours["description"], ours["parameters"]) == (theirs["name"], theirs["description"], theirs["parameters"])


def test_bad_arguments_and_failing_tools_come_back_as_error_observations():
    tools = make_tools(["tests.tools.test_tool:lookup"])
    results = {
        "missing": call_tool(tools, ToolCall("lookup", {})),
        "unknown": call_tool(tools, ToolCall("lookup", {"word": "a", "colour": "red"})),
        "type": call_tool(tools, ToolCall("lookup", {"word": "a", "limit": "three"})),
        "enum": call_tool(tools, ToolCall("lookup", {"word": "a", "mode": "medium"})),
        "not an object": call_tool(tools, ToolCall("lookup", ["a"])),
        "raises": call_tool(tools, ToolCall("lookup", {"word": "boom"})),
        "tool error": call_tool(tools, ToolCall("lookup", {"word": "nothing"})),
        "no such tool": call_tool(tools, ToolCall("search", {"q": "a"})),
    }
    assert all(r.error and r.text.startswith("Error: ") for r in results.values())
    assert "needs the argument 'word'" in results["missing"].text
    assert "no argument 'colour'" in results["unknown"].text and "word, limit, mode, tags" in results["unknown"].text
    assert "'limit' of lookup must be an integer" in results["type"].text
    assert "one of 'short', 'long'" in results["enum"].text
    assert "RuntimeError: the dictionary is on fire" in results["raises"].text
    assert results["tool error"].text == "Error: no sense of 'nothing'"
    assert "no tool named 'search'; tools: lookup" in results["no such tool"].text
    ok = call_tool(tools, ToolCall("lookup", {"word": "a", "limit": 2, "tags": None}))
    assert (ok.text, ok.error) == ("a: 2 senses (short, None)", False)


@pytest.mark.parametrize("spec, says", [
    ("abacus", "known tools: calculator, python"),
    ("no_such_module_xyz:fn", "could not import the module 'no_such_module_xyz'"),
    ("tests.tools.test_tool:missing", "has no function 'missing'"),
    ("tests.tools.test_tool:undocumented", "a tool needs a docstring"),
])
def test_tool_names_are_checked_with_one_line_errors(spec, says):
    with pytest.raises(ConfigError) as e:
        make_tools(["calculator", spec], field="env.tools")
    assert str(e.value).startswith("env.tools[1]: ") and says in str(e.value) and "\n" not in str(e.value)


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ConfigError, match="a second tool named 'calculator'"):
        make_tools(["calculator", "calculator"])
