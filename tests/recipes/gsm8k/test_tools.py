"""Tests of ``skyrl_clora.recipes.gsm8k.tools``: the safe calculator (exact values, formatting, and refusal of
anything but bounded arithmetic), the parsing and formatting of ``<tool_call>`` JSON, and the numeric comparison
of an answer with the ground truth."""

from __future__ import annotations

from fractions import Fraction

import pytest

from skyrl_clora.recipes.gsm8k.tools import (
    CalculatorError,
    ToolCallError,
    calculate,
    evaluate_expression,
    format_number,
    format_tool_call,
    numbers_equal,
    parse_number,
    parse_tool_call,
)
from tests.support.gsm8k_tool_calls import calculator_call as _calc
from tests.support.gsm8k_tool_calls import final_answer_call as _final


@pytest.mark.parametrize("expression, expected", [
    ("4*17+23", "91"), ("(12 + 8) / 5", "4"), ("7/2", "3.5"), ("-3+1.5", "-1.5"), ("2**10", "1024"),
    ("10/3", "3.333333"), ("((2))", "2"),
])
def test_calculator_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x + 1", "(1).real", "abs(-1)", "'a' * 3", "True + 1", "[1, 2]",
    "9**9**9", "10**100", "2**0.5", "1/0", "0**-1", "1 if 1 else 2", "lambda: 1", "1; 2", "", "1e300*1e300",
    "9" * 30, "1+" * 150 + "1", "3 % 2", "7 // 2",
])
def test_calculator_rejects_unsafe_or_huge_input(expression: str) -> None:
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_parse_tool_call_accepts_spaced_and_compact_json() -> None:
    spaced = 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "4*17+23"}}</tool_call>'
    call = parse_tool_call(spaced)
    assert call is not None and call.name == "calculator" and call.arguments == {"expression": "4*17+23"}
    compact = parse_tool_call(_final("91") + _calc("1+1"))  # the first call wins
    assert compact is not None and compact.name == "final_answer" and compact.arguments == {"answer": "91"}
    assert parse_tool_call("the answer is 91") is None
    assert parse_tool_call('<tool_call>{"name": "calculator"') is None  # never closed
    for bad in ['<tool_call>{"name": calculator}</tool_call>', "<tool_call>[1]</tool_call>",
                '<tool_call>{"name": "x", "arguments": [1]}</tool_call>']:
        with pytest.raises(ToolCallError):
            parse_tool_call(bad)


def test_numbers_equal() -> None:
    assert numbers_equal("91", "91") and numbers_equal("91.0", "91") and numbers_equal("1,234", "1234")
    assert numbers_equal("$5", "5") and numbers_equal(" 2.50 ", "2.5")
    assert not numbers_equal("90", "91") and not numbers_equal("ninety", "91") and not numbers_equal("", "0")


def test_values_are_exact_fractions_until_formatted() -> None:
    assert evaluate_expression("1/3 + 1/6") == Fraction(1, 2)
    assert evaluate_expression("0.1 + 0.2") == Fraction(3, 10)  # floats enter by their decimal text
    assert evaluate_expression("-(2 - 5) ** 2") == -9 and evaluate_expression("2 ** -2") == Fraction(1, 4)
    assert calculate("1/3 + 1/6") == "0.5" and calculate("0.1 + 0.2") == "0.3"


def test_format_number_rounds_to_six_places_without_trailing_zeros() -> None:
    assert format_number(Fraction(91)) == "91" and format_number(Fraction(-7)) == "-7"
    assert format_number(Fraction(5, 2)) == "2.5" and format_number(Fraction(2, 3)) == "0.666667"
    assert format_number(Fraction(1, 10**7)) == "0"  # rounds to zero, both zeros and the point stripped


def test_parse_number_strips_commas_dollars_and_a_final_period() -> None:
    assert parse_number(" $1,234.50. ") == Fraction(123450, 100)
    assert parse_number("3/4") == Fraction(3, 4)
    for bad in ("", "ninety", "1/0", "1.2.3"):
        with pytest.raises(CalculatorError, match="not a number"):
            parse_number(bad)


def test_numbers_equal_tolerates_one_part_in_a_million() -> None:
    assert numbers_equal("1000000.5", "1000000") and not numbers_equal("1000002", "1000000")
    assert numbers_equal("0.0000005", "0") and not numbers_equal("0.000002", "0")


def test_format_tool_call_is_compact_and_parses_back() -> None:
    assert _calc("4*17+23") == '<tool_call>{"name":"calculator","arguments":{"expression":"4*17+23"}}</tool_call>'
    call = parse_tool_call("I am sure. " + format_tool_call("final_answer", {"answer": 91}))
    assert call is not None and call.name == "final_answer" and call.arguments == {"answer": 91}
    missing_arguments = parse_tool_call('<tool_call>{"name": "calculator"}</tool_call>')
    assert missing_arguments is not None and missing_arguments.arguments == {}
    body = _final("7")[len("<tool_call>"):-len("</tool_call>")]
    multiline = parse_tool_call("<tool_call>\n" + body + "\n</tool_call>")
    assert multiline is not None and multiline.arguments == {"answer": "7"}
