"""The built-in tools: ``calculator`` (exact arithmetic, parsed with ``ast``, never ``eval``)
and ``python`` (a program run in the sandbox of :mod:`mmrl.tools.sandbox`)."""

from __future__ import annotations

import ast
import math
import operator

from mmrl.tools.sandbox import SandboxConfig, run_python
from mmrl.tools.tool import TOOLS, ToolError

MAX_EXPRESSION_CHARS = 2000
MAX_DIGITS = 1000  # of any integer the calculator makes; bounds the work of ** and *
_LIMIT = 10**MAX_DIGITS
_MAX_BITS = _LIMIT.bit_length()
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "numbers, + - * / // % **, parentheses and unary minus"


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers of up to 1000 digits).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(123456789 * 987654321 - 42) // 7"
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: an integer literal beyond Python's digit limit
        raise ToolError(f"not an arithmetic expression ({e.msg if isinstance(e, SyntaxError) else e}); use {_ALLOWED}") from None
    except (RecursionError, MemoryError):
        raise ToolError("the expression is nested too deeply") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, RecursionError):
        raise ToolError("the result is too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ToolError(f"{_name(node)} is not allowed; use {_ALLOWED}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would pass MAX_DIGITS before computing it: |base| >=
    2^(bits - 1), so the result has at least (bits - 1) * exponent bits."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and (base.bit_length() - 1) * exponent > _MAX_BITS:
        raise ToolError(f"the result of {base} ** {exponent} would have more than {MAX_DIGITS} digits")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= _LIMIT:
        raise ToolError(f"a number has more than {MAX_DIGITS} digits")
    return value


def _name(node: ast.AST) -> str:
    """What the model wrote, in words, for a refusal."""
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Attribute):
        return f"attribute access (.{node.attr})"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"{type(node).__name__}"


@TOOLS.register("python")
def python(code: str, *, sandbox: SandboxConfig) -> str:
    """Run a Python program in a sandbox (no network, a fresh directory, time and memory limits) and return what it prints.

    Args:
        code: the program; print what you want to see
    """
    result = run_python(code, sandbox)
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if not result.ok:
        parts.append(f"[{result.killed_reason or f'exit status {result.exit_code}'}]")
        raise ToolError("the program failed\n" + "\n".join(parts))
    return "\n".join(parts) if parts else "(no output)"
