"""Markers for tests that launch Triton kernels (tests/conftest.py turns them into skips where Triton cannot run;
CUDA-only tests carry the ``gpu`` marker instead), and the time limit of tests that run replicated runs."""

from __future__ import annotations

import pytest

interpreted = pytest.mark.triton(interpreter_only=True)
"""The test launches Triton kernels on CPU tensors: it runs only through the Triton interpreter (TRITON_INTERPRET=1)."""

triton_runs = pytest.mark.triton
"""The test launches Triton kernels on CUDA when there is a GPU, else through the Triton interpreter."""

replicated_runs_limit = pytest.mark.timeout(2400)
"""The test runs ``main`` over Ray replicas two or three times: on a 2-core machine busy with other work that takes
several times its quiet 1-2 minutes, past pyproject.toml's 900 s per test (the limit only catches hangs)."""
