"""Shared pieces of the GPU-cluster tests (not collected by the CPU suite: pytest's testpaths is tests/).

Each test module marks itself with ``gpu_node.requires`` (skipped, with the reason, on a machine without
the GPUs or packages it needs); the ``model_path`` fixture names the base model:
``SKYRL_CLORA_MODEL=/path/to/hf-checkpoint`` (e.g. Qwen3-0.6B), else the project's tiny base when it is
cached (built by ``python -m skyrl_clora.main`` on first use).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    configured = os.environ.get("SKYRL_CLORA_MODEL")
    if configured:
        if not (Path(configured) / "config.json").is_file():
            pytest.fail(f"SKYRL_CLORA_MODEL={configured} is not a Hugging Face model folder")
        return configured
    from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, tiny_base_path

    tiny_base = tiny_base_path(None, TinyBaseRecipe(corpus="gsm8k"))
    if not tiny_base.is_dir():
        pytest.skip("set SKYRL_CLORA_MODEL=/path/to/hf-checkpoint (or build the tiny base: bash scripts/run.sh)")
    return str(tiny_base)
