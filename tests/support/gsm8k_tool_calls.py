"""Assistant turns of the GSM8K calculator task (``skyrl_clora.recipes.gsm8k``), as the policy writes them: one
``<tool_call>`` of ``calculator`` or ``final_answer`` in the recipe's own compact format. Shared by the tests of the
recipe's environment and of its parquet loading (imported as ``tests.support.gsm8k_tool_calls``)."""

from __future__ import annotations

from skyrl_clora.recipes.gsm8k.tools import format_tool_call


def calculator_call(expression: str) -> str:
    """A turn calling the calculator on ``expression``."""
    return format_tool_call("calculator", {"expression": expression})


def final_answer_call(answer: str) -> str:
    """A turn giving ``answer`` as the final answer."""
    return format_tool_call("final_answer", {"answer": answer})
