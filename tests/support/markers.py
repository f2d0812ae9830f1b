"""Markers for tests that launch Triton kernels; tests/conftest.py turns them into skips where Triton cannot run.
CUDA-only tests carry the ``gpu`` marker instead."""

from __future__ import annotations

import pytest

interpreted = pytest.mark.triton(interpreter_only=True)
"""The test launches Triton kernels on CPU tensors: it runs only through the Triton interpreter (TRITON_INTERPRET=1)."""

triton_runs = pytest.mark.triton
"""The test launches Triton kernels on CUDA when there is a GPU, else through the Triton interpreter."""
