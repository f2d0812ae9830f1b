"""Tests of ``skyrl_clora.recipes.taubench.chat``: the agent's system prompt (the policy, then the Qwen3 template's
"# Tools" section with one JSON schema per line), the visible text of an output (reasoning and trailing end-of-turn
tokens removed), and an output split into its tool calls, in order, each parsed or replaced by its error text, or
else a reply to the customer."""

from __future__ import annotations

import json

import pytest

from skyrl_clora.recipes.taubench.chat import (
    TOOLS_FOOTER,
    TOOLS_HEADER,
    AgentMessage,
    ToolCall,
    parse_agent_output,
    system_prompt,
    visible_text,
)


def test_system_prompt_lists_one_schema_per_line_between_the_qwen3_sections() -> None:
    schemas = [{"name": "a", "description": "é"}, {"name": "b"}]
    prompt = system_prompt("POLICY", schemas)
    assert prompt == f'POLICY\n\n{TOOLS_HEADER}\n{{"name": "a", "description": "é"}}\n{{"name": "b"}}{TOOLS_FOOTER}'
    assert prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines() == [json.dumps(s, ensure_ascii=False)
                                                                                 for s in schemas]
    assert system_prompt("P", []) == f"P\n\n{TOOLS_HEADER}{TOOLS_FOOTER}"


@pytest.mark.parametrize(("output", "visible"), [
    ("Hello.<|im_end|>", "Hello."),
    ("  Hi <|im_end|> <|endoftext|>\n", "Hi"),
    ("<think>plan</think>\nAnswer", "Answer"),
    ("unclosed reasoning</think>Answer", "Answer"),
    ("<think>a</think>b</think> c", "c"),
    ("<|im_end|> in the middle stays", "<|im_end|> in the middle stays"),
])
def test_visible_text(output: str, visible: str) -> None:
    assert visible_text(output) == visible


def test_an_output_without_tool_calls_is_a_reply() -> None:
    reply = parse_agent_output("<think>call a tool?</think> Which order?<|im_end|>")
    assert reply == AgentMessage(reply="Which order?")
    assert parse_agent_output("<think><tool_call>{}</tool_call></think>ok") == AgentMessage(reply="ok")


def test_calls_come_in_order_with_errors_in_place() -> None:
    output = ('Checking.\n<tool_call>\n{"name": "think", "arguments": {"thought": "x"}}\n</tool_call>'
              '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
              '<tool_call>{"name": 3}</tool_call>'
              '<tool_call>{"name": "list_all_product_types"}</tool_call>'
              '<tool_call>{"name": "think", "arguments": {}}')
    message = parse_agent_output(output)
    assert message.reply is None
    assert message.calls == [
        ToolCall("think", {"thought": "x"}),
        ToolCall("calculate", {"expression": "1+1"}),
        'Error: invalid tool call: expected {"name": <tool name>, "arguments": {...}}',
        ToolCall("list_all_product_types", {}),
        "Error: invalid tool call: missing </tool_call>",
    ]
