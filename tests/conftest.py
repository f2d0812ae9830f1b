"""The suite's rules: the shared fixtures (``tests.support.fixtures``) and the skips of the ``gpu`` and ``triton``
markers (pyproject.toml registers every marker; the fast tier is ``-m "not e2e and not ray and not triton"``)."""

from __future__ import annotations

import os

import pytest
import torch

pytest_plugins = ["tests.support.fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need CUDA; ``triton`` tests need CUDA or the Triton interpreter, and
    ``triton(interpreter_only=True)`` ones (CPU tensors) the interpreter. Where that is missing they are collected and
    skipped."""
    cuda = torch.cuda.is_available()
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interpreter = pytest.mark.skip(reason="Triton on the CPU needs TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    for item in items:
        triton = item.get_closest_marker("triton")
        if item.get_closest_marker("gpu") is not None and not cuda:
            item.add_marker(no_gpu)
        elif triton is not None and not interpreter and (triton.kwargs.get("interpreter_only") or not cuda):
            item.add_marker(no_interpreter)
