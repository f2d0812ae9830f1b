"""Integer helpers for the kernels' host wrappers.

Triton 3.5+ makes ``triton.cdiv`` and ``triton.next_power_of_2`` constexpr functions whose calls from Python
unwrap every argument (~3 us each); the host wrappers of one training micro-batch called them ~9,000 times
(cProfile of a bench_train round, RESULTS.md, Training: packed vs swap). Kernels keep using ``tl.cdiv``.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()
