"""Tests of ``skyrl_clora.recipes.taubench.schemas``: every tool schema names a tool of ``tools.TOOLS`` (one schema
per tool) with exactly that tool's arguments, all required, in the tool's order."""

from __future__ import annotations

import inspect

from skyrl_clora.recipes.taubench.schemas import TOOL_SCHEMAS
from skyrl_clora.recipes.taubench.tools import TOOLS


def test_every_schema_matches_its_tool_signature() -> None:
    assert [schema["function"]["name"] for schema in TOOL_SCHEMAS] == sorted(TOOLS)
    for schema in TOOL_SCHEMAS:
        function = schema["function"]
        parameters = list(inspect.signature(TOOLS[function["name"]]).parameters)[1:]
        assert list(function["parameters"]["properties"]) == parameters
        assert function["parameters"]["required"] == parameters
