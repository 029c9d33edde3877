"""Tools: a name, a one-line description, a JSON schema of the arguments and a call that
returns the observation text.

A tool is a plain Python function. Its schema comes from the signature and the docstring,
Google style (the same JSON that ``transformers``' ``get_json_schema`` makes, so
``tokenizer.apply_chat_template(..., tools=schemas)`` renders it)::

    def lookup(word: str, limit: int = 3) -> str:
        '''Look a word up in the dictionary.

        Args:
            word: the word to look up
            limit: how many senses to return
        '''

The first docstring line describes the tool to the model; ``Args:`` describes each
parameter; parameters without a default are required. Keyword-only parameters are not shown
to the model: mmrl fills them (``sandbox``: the env's :class:`SandboxConfig`). Built-in tools
register in :data:`TOOLS`; a config names a user tool as ``package.module:function``.

A call never raises: a bad argument, a :class:`ToolError` or any exception of the tool
becomes an error observation (``Error: ...``) and the episode goes on.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal

from mmrl.errors import ConfigError
from mmrl.registry import Registry, import_callable
from mmrl.tools.sandbox import SandboxConfig

TOOLS = Registry("tools", ("mmrl.tools",))

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array", dict: "object"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?):\s*$")
_ARG = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


class ToolError(Exception):
    """Raised by a tool for a failure the model should read (its message is the observation)."""


@dataclass
class ToolCall:
    """A call parsed from a turn: the tool's name and its arguments."""

    name: str
    arguments: dict


@dataclass
class ToolResult:
    """The observation text of a call and whether the call failed."""

    text: str
    error: bool = False


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": [...]}
    fn: Callable[..., Any]
    uses_sandbox: bool = False

    def schema(self) -> dict:
        """The OpenAI function-calling form, what chat templates render (``tools=[...]``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: Any) -> ToolResult:
        """Run the tool on the model's ``arguments``; every failure is an error observation."""
        problem = self._check(arguments)
        if problem:
            return ToolResult(f"Error: {problem}", error=True)
        try:
            return ToolResult(str(self.fn(**arguments)))
        except ToolError as e:
            return ToolResult(f"Error: {e}", error=True)
        except Exception as e:  # a user tool's bug is the model's observation, not the run's end
            return ToolResult(f"Error: {self.name} raised {type(e).__name__}: {e}", error=True)

    def _check(self, arguments: Any) -> str | None:
        props, required = self.parameters["properties"], self.parameters.get("required", [])
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, got {arguments!r}"
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"{self.name} has no argument {', '.join(map(repr, unknown))}; its arguments: {', '.join(props) or 'none'}"
        missing = [name for name in required if name not in arguments]
        if missing:
            return f"{self.name} needs the argument {', '.join(map(repr, missing))}"
        for name, value in arguments.items():
            if not _fits(value, props[name]):
                return f"argument {name!r} of {self.name} must be {_describe(props[name])}, got {value!r}"
        return None


def _fits(value: Any, schema: dict) -> bool:
    if value is None and schema.get("nullable"):
        return True
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema:
        return any(_fits(value, s) for s in schema["anyOf"])
    kind = schema.get("type")
    checks = {
        "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool), "array": lambda v: isinstance(v, list),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "object": lambda v: isinstance(v, dict),
    }
    return kind is None or checks[kind](value)


def _describe(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"]))
    if "anyOf" in schema:
        return " or ".join(_describe(s) for s in schema["anyOf"])
    return {"integer": "an integer", "object": "an object", "array": "an array"}.get(schema.get("type", ""), f"a {schema.get('type', 'value')}")


def json_schema(tp: Any, where: str) -> dict:
    """The JSON schema of a parameter's type hint."""
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if tp is type(None):
        return {"type": "null"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [json_schema(a, where) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "nullable": True} if type(None) in args else schema
    if origin in (list, tuple, set):
        return {"type": "array", **({"items": json_schema(args[0], where)} if args and args[0] is not Ellipsis else {})}
    if origin is dict:
        return {"type": "object"}
    raise ConfigError(where, getattr(tp, "__name__", str(tp)), "a tool's parameter types must be str, int, float, bool, list, dict, Literal or unions of them")


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """(first line, {parameter: description}) from a Google-style docstring."""
    lines = inspect.cleandoc(fn.__doc__ or "").splitlines()
    summary = lines[0].strip() if lines else ""
    params: dict[str, str] = {}
    section, current, params_indent = None, None, 0
    for line in lines[1:]:
        header = _SECTION.match(line.strip()) if not line.startswith((" ", "\t")) else None
        if header:
            section, current = header.group(1), None
            continue
        if section not in ("Args", "Arguments", "Parameters") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        match = _ARG.match(line.strip())
        if match and (current is None or indent <= params_indent):
            current, params_indent = match.group(1).lstrip("*"), indent
            params[current] = match.group(2).strip()
        elif current is not None:
            params[current] = f"{params[current]} {line.strip()}".strip()
    return summary, params


def tool_from_function(fn: Callable, name: str | None = None, where: str = "tools") -> Tool:
    """A :class:`Tool` from a function's signature, type hints and docstring (module docstring)."""
    name = name or fn.__name__
    summary, described = _docstring(fn)
    if not summary:
        raise ConfigError(where, name, "a tool needs a docstring: its first line describes the tool to the model")
    hints = typing.get_type_hints(fn)
    properties, required, bound = {}, [], {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(where, name, f"a tool's parameters must be named: drop *{param.name}")
        if param.kind == param.KEYWORD_ONLY:  # filled by mmrl, never by the model
            if param.name != "sandbox":
                raise ConfigError(where, name, f"keyword-only parameter {param.name!r}: mmrl fills only 'sandbox' (the env's sandbox config)")
            bound[param.name] = True
            continue
        schema = json_schema(hints.get(param.name, param.annotation), f"{where}: {name}({param.name})")
        if param.name in described:
            schema["description"] = described[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name, summary, parameters, fn, uses_sandbox="sandbox" in bound)


def make_tools(specs: list[str], sandbox: SandboxConfig | None = None, field: str = "tools") -> dict[str, Tool]:
    """The tools a config names: built-in names (``mmrl list``-style: calculator, python) or
    ``package.module:function``; tools that take ``sandbox`` get ``sandbox``."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        where = f"{field}[{i}]"
        if ":" in spec:
            fn = import_callable(spec, where)
            tool = tool_from_function(fn, where=where)
        else:
            tool = tool_from_function(TOOLS.get(spec, where), name=spec, where=where)
        if tool.name in tools:
            raise ConfigError(where, spec, f"a second tool named {tool.name!r}; tool names must differ")
        if tool.uses_sandbox:
            tool.fn = partial(tool.fn, sandbox=sandbox or SandboxConfig())
        tools[tool.name] = tool
    return tools


def call_tool(tools: dict[str, Tool], call: ToolCall) -> ToolResult:
    """Run ``call`` with the tool it names; an unknown name is an error observation."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"Error: no tool named {call.name!r}; tools: {', '.join(tools)}", error=True)
    return tool(call.arguments)
