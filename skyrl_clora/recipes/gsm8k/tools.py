"""The calculator task's tool protocol: a safe calculator, and parsing/formatting of tool calls.

A tool call is Qwen3-style text inside the assistant turn::

    <tool_call>{"name":"calculator","arguments":{"expression":"23+4*17"}}</tool_call>
    <tool_call>{"name":"final_answer","arguments":{"answer":"91"}}</tool_call>

The calculator evaluates with `ast`, never `eval`: only numbers, + - * / (and ** with a small integer
exponent), unary +/- and parentheses are allowed; every intermediate result is exact (`Fraction`) and
bounded in magnitude, so no input can make it run long or allocate much.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

CALCULATOR = "calculator"
FINAL_ANSWER = "final_answer"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

MAX_EXPRESSION_CHARS = 200
MAX_ABS_VALUE = 10**15
MAX_EXPONENT = 16
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated (syntax, names, division by zero, too big)."""


class ToolCallError(ValueError):
    """Text between <tool_call> tags that is not ``{"name": str, "arguments": dict}`` JSON."""


def _check_bound(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS_VALUE:
        raise CalculatorError(f"result exceeds {MAX_ABS_VALUE:.0e} in magnitude")
    return value


def _eval_node(node: ast.AST) -> Fraction:
    """Exact value of an allowed AST node; raises CalculatorError on anything else."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _check_bound(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _eval_node(node.operand)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Add):
            return _check_bound(left + right)
        if isinstance(node.op, ast.Sub):
            return _check_bound(left - right)
        if isinstance(node.op, ast.Mult):
            return _check_bound(left * right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise CalculatorError("division by zero")
            return _check_bound(left / right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent must be an integer in [-{MAX_EXPONENT}, {MAX_EXPONENT}]")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            bits = max(abs(left.numerator).bit_length(), left.denominator.bit_length())
            if abs(right) * bits > 64:  # checked before computing, so 9**9**9-style inputs stay cheap
                raise CalculatorError(f"result exceeds {MAX_ABS_VALUE:.0e} in magnitude")
            return _check_bound(left ** int(right))
        raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
    raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / ** and parentheses")


def evaluate_expression(expression: str) -> Fraction:
    """Exact value of an arithmetic expression such as ``"23+4*17"`` or ``"(12 + 8) / 5"``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as err:
        raise CalculatorError(f"invalid expression: {expression!r}") from err
    return _eval_node(tree.body)


def format_number(value: Fraction) -> str:
    """``91`` for integers, else a decimal rounded to 6 places without trailing zeros (``2.5``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def calculate(expression: str) -> str:
    """The calculator tool: the formatted value of `expression`; raises CalculatorError."""
    return format_number(evaluate_expression(expression))


def parse_number(text: str) -> Fraction:
    """Parses an answer or ground truth (``"91"``, ``"1,234"``, ``"$5"``, ``"2.50"``) into an exact number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError) as err:
        raise CalculatorError(f"not a number: {text!r}") from err


def numbers_equal(answer: str, ground_truth: str) -> bool:
    """True iff both strings parse as numbers that agree to 1e-6 (relative to max(1, |ground truth|))."""
    try:
        got, want = parse_number(answer), parse_number(ground_truth)
    except CalculatorError:
        return False
    return abs(got - want) <= Fraction(1, 10**6) * max(1, abs(want))


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: tool `name` and its JSON `arguments`."""

    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str) -> ToolCall | None:
    """The first ``<tool_call>{json}</tool_call>`` in `text`; None if there is none.

    Raises ToolCallError if the tagged text is not a JSON object with a string "name" and an object
    "arguments".
    """
    match = _TOOL_CALL_RE.search(text)
    if match is None:
        return None
    try:
        payload = json.loads(match.group(1))
    except json.JSONDecodeError as err:
        raise ToolCallError(f"tool call is not valid JSON: {match.group(1)[:80]!r}") from err
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ToolCallError("tool call must be a JSON object with a string 'name'")
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError("tool call 'arguments' must be a JSON object")
    return ToolCall(name=payload["name"], arguments=arguments)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """Renders a tool call as compact JSON in tags (compact keeps the model's turns a few tokens shorter)."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"
