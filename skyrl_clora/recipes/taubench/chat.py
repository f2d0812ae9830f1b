"""The agent's side of the chat format: the system prompt it reads and the tool calls it writes.

The format is Qwen's (Qwen2.5 / Qwen3 chat templates, Hermes-style tool calling):

- The system prompt is the policy document followed by the "# Tools" section that the Qwen3 template
  renders for ``apply_chat_template(..., tools=TOOL_SCHEMAS)``: one JSON schema per line inside
  ``<tools></tools>`` and the instruction to answer with ``<tool_call>`` blocks. It is rendered here into
  the system message because SkyRL's generator applies the chat template without ``tools``.
- A tool call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a message may hold
  several. A tool result goes back as a ``{"role": "tool"}`` message, which the Qwen templates render as
  ``<tool_response>...</tool_response>`` inside a user turn.
- A message without ``<tool_call>`` is a reply to the customer.

Reasoning (``<think>...</think>``, or everything up to a lone ``</think>``) and a trailing end-of-turn
token are not part of the message: tool calls inside reasoning are ignored and the customer never sees
it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def system_prompt(policy: str, tool_schemas: Sequence[dict[str, Any]]) -> str:
    """The agent's system message: the policy, then the tool signatures in the Qwen3 template's words."""
    lines = "".join("\n" + json.dumps(schema, ensure_ascii=False) for schema in tool_schemas)
    return f"{policy}\n\n{TOOLS_HEADER}{lines}{TOOLS_FOOTER}"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AgentMessage:
    """One agent output, split into what the environment acts on.

    ``calls`` holds, in order, one entry per ``<tool_call>`` block: a :class:`ToolCall`, or the error text
    for a block that could not be parsed. ``reply`` is the message for the customer (the visible text)
    when there is no tool-call block, else None.
    """

    calls: list[ToolCall | str] = field(default_factory=list)
    reply: str | None = None


def visible_text(output: str) -> str:
    """The output without its reasoning and trailing end-of-turn tokens, stripped."""
    if "</think>" in output:
        output = output.rsplit("</think>", 1)[1]
    text = output.strip()
    while text.endswith(END_OF_TURN_TOKENS):
        for token in END_OF_TURN_TOKENS:
            text = text.removesuffix(token).rstrip()
    return text


def _parse_call(block: str, closed: bool) -> ToolCall | str:
    """One ``<tool_call>`` block's body as a call, or the error text saying why it is not one."""
    if not closed:
        return "Error: invalid tool call: missing </tool_call>"
    try:
        payload = json.loads(block)
    except json.JSONDecodeError as error:
        return f"Error: invalid tool call: not JSON ({error})"
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return 'Error: invalid tool call: expected {"name": <tool name>, "arguments": {...}}'
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f"Error: invalid tool call: arguments are not JSON ({error})"
    if not isinstance(arguments, dict):
        return "Error: invalid tool call: arguments must be a JSON object"
    return ToolCall(name=payload["name"], arguments=arguments)


def parse_agent_output(output: str) -> AgentMessage:
    """Split a raw model output into tool calls or a reply (see :class:`AgentMessage`)."""
    text = visible_text(output)
    if "<tool_call>" not in text:
        return AgentMessage(reply=text)
    calls = []
    for block in _TOOL_CALL.finditer(text):
        calls.append(_parse_call(block.group(1), closed=block.group(0).endswith("</tool_call>")))
    return AgentMessage(calls=calls)
