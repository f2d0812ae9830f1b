"""The suite's rules: the shared fixtures (``tests.support.fixtures``) and the ``gpu`` marker's skip without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["tests.support.fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: without it they are collected and skipped."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
