"""Helpers shared by the attention tests of the Triton kernels and of the torch references
(tests/kernels/attention/test_decode.py, test_prefill.py, tests/kernels/test_reference_decode_attention.py,
test_reference_prefill_attention.py): the relative error against an exact result, and the ragged prefill pass they
share (its jobs, the tokens of no job, its paged variant)."""

from __future__ import annotations

import torch

from tests.support.kernel_cases import PrefillProblem, make_prefill_problem, rel_error
from tests.support.paged_cases import PagedCache, page_prefill_problem

# (row, start, q_len) per job slot: a slot of length 0, a job of one token, a job of 70 tokens from position
# 70 (several query tiles and key tiles at the default config's block_n of 64), jobs sharing no row.
PREFILL_JOBS = [(3, 70, 70), (0, 0, 1), (5, 13, 0), (1, 130, 17), (2, 0, 40), (4, 5, 23)]

# Paged caches (tests/support/paged_cases.py): PREFILL_JOBS over L = 192 positions, row 4's keys (its job's 28
# positions) in row 2's blocks (GRPO siblings sharing a prompt), the table entries past each row's last position
# garbage.
PAGED_PREFILL_LEN, PAGED_PREFILL_SHARED = 192, {4: 2}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (``kernel_cases.rel_error`` from zeros)."""
    return rel_error(got, want, torch.zeros_like(want))


def uncovered_tokens(p: PrefillProblem) -> torch.Tensor:
    """``[T]`` bool: the tokens of no job."""
    covered = torch.zeros(p.q.shape[0], dtype=torch.bool)
    for offset, n in zip(p.q_offsets.tolist(), p.q_lens.tolist()):
        covered[offset : offset + n] = True
    return ~covered


def paged_prefill_problem(block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
                          cache_values: torch.dtype | None = None) -> tuple[PrefillProblem, PagedCache]:
    """A poisoned pass of ``PREFILL_JOBS`` (``make_prefill_problem``) and its cache paged in blocks of
    ``block_size``, with garbage table entries and rows 2 and 4 sharing a block."""
    p = make_prefill_problem(PREFILL_JOBS, heads, kv_heads, PAGED_PREFILL_LEN, head_dim, dtype, cache_rows=6, seed=seed,
                             poison=True, cache_values=cache_values)
    paged = page_prefill_problem(p, block_size, PAGED_PREFILL_SHARED, seed=seed)
    tables = paged.block_tables
    assert (tables < 0).any() and (tables >= paged.k_cache.shape[0]).any(), "garbage table entries"
    assert tables[4, 0] == tables[2, 0], "rows 2 and 4 share a block"
    return p, paged
