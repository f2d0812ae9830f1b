"""The tau-bench retail recipe's test material (imported as ``tests.support.taubench_retail``): the project's
synthetic retail data folder as a module-scoped fixture ``data_dir`` (import it into the test module that uses it),
a model output calling one tool in the Qwen chat template's format, an environment over a data folder, and the
address that the address-changing tools are called with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skyrl_clora.recipes.taubench.env import TauBenchRetailEnv
from skyrl_clora.recipes.taubench.synthetic import make_synthetic_retail

ADDRESS = {"address1": "1 Main St", "address2": "", "city": "Austin", "state": "TX", "country": "USA", "zip": "73301"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_retail(tmp_path_factory.mktemp("retail"))


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A model output calling one tool, in the Qwen chat template's format."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def make_env(data_dir: Path, **extras: Any) -> TauBenchRetailEnv:
    return TauBenchRetailEnv(env_config={"data_path": str(data_dir)}, extras=extras)
