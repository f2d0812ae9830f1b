"""Skip conditions for tests that launch Triton kernels. CUDA-only tests carry the ``gpu`` marker instead
(tests/conftest.py skips them without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

interpreted = pytest.mark.skipif(
    not TRITON_INTERPRETED, reason="Triton on the CPU needs TRITON_INTERPRET=1 (scripts/test.sh)"
)
"""The test launches Triton kernels on CPU tensors: it runs only through the Triton interpreter."""

triton_runs = pytest.mark.skipif(
    not TRITON_INTERPRETED and not torch.cuda.is_available(),
    reason="Triton needs TRITON_INTERPRET=1 on the CPU (scripts/test.sh sets it)",
)
"""The test launches Triton kernels on CUDA when there is a GPU, else through the Triton interpreter."""
