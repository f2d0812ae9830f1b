"""What the Triton kernels' host wrappers share: the GPU's programmatic dependent launch (PDL), the dot
precision flags by dtype and device, and integer grid helpers.

Triton 3.5+ makes ``triton.cdiv`` and ``triton.next_power_of_2`` constexpr functions whose calls from Python
unwrap every argument, and the host wrappers of one training micro-batch call them thousands of times (a
cProfile of a ``benchmarks.train`` round: RESULTS.md, Training: packed vs swap), hence ``cdiv`` and
``next_power_of_2`` here. Kernels keep using ``tl.cdiv``.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper or later GPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dot_flags(x: torch.Tensor) -> dict[str, object]:
    """A kernel's ``UPCAST`` (the CPU interpreter computes dots in fp32) and ``DOT_PRECISION`` (IEEE for fp32
    inputs, TF32 otherwise) constexprs for inputs like ``x``."""
    return {
        "UPCAST": x.device.type != "cuda",
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
    }


def pdl_flags(x: torch.Tensor, pdl: bool) -> dict[str, bool]:
    """A kernel's ``PDL`` flag and launch option: on when ``pdl`` is asked for and ``x``'s GPU has it."""
    on = pdl and has_pdl(x.device)
    return {"PDL": on, "launch_pdl": on}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()
