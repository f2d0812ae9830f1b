"""Tests of ``kernels.reference``'s prefill attention (``prefill_attention_ref``, the CPU path of
``dispatch.prefill_attention``): against a plain float64 loop over GQA shapes, dtypes and fp8 caches (tokens of no
job zero), a job's bits independent of the pass (alone, or its first queries of a longer job), and the paged
reference bit-identical to the slot reference on the gathered cache. Kept beside tests/kernels/test_reference.py
because the decode reference's tests (test_reference_decode_attention.py) share these tests' names.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from skyrl_clora.kernels import prefill_attention
from tests.support.attention_checks import PREFILL_JOBS as JOBS
from tests.support.attention_checks import paged_prefill_problem as _paged_problem
from tests.support.attention_checks import relative_error as _err
from tests.support.attention_checks import uncovered_tokens as _uncovered
from tests.support.kernel_cases import (
    CACHE_DTYPES,
    DTYPES,
    TOLERANCE,
    as_cache,
    make_prefill_problem,
    prefill_loop_ref,
)
from tests.support.paged_cases import gather_cache


@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
def test_reference_matches_loop(kv_heads: int, dtype: torch.dtype, cache: torch.dtype | None) -> None:
    """An fp8 cache against the loop on its dequantised values (exact in ``dtype``)."""
    p = make_prefill_problem(JOBS, 4, kv_heads, 160, 16, dtype, cache_rows=6, seed=kv_heads, cache_values=cache)
    assert p.q_offsets.tolist() != sorted(p.q_offsets.tolist()), "the jobs' tokens must lie out of job order"
    want = prefill_loop_ref(p)
    firsts = [offset for offset, n in zip(p.q_offsets.tolist(), p.q_lens.tolist()) if n > 0]
    for a, b in zip(firsts, firsts[1:]):
        assert (want[a] - want[b]).abs().max() > 1e-2, "different jobs must give different outputs"
    got = prefill_attention(*replace(p, k_cache=as_cache(p.k_cache, cache), v_cache=as_cache(p.v_cache, cache)).args())
    assert got.dtype == dtype and got.shape == p.q.shape
    assert _uncovered(p).any() and not got[_uncovered(p)].any(), "tokens of no job must be zeros"
    assert _err(got, want) < (1e-6 if dtype == torch.float32 else TOLERANCE[dtype]), f"relative error {_err(got, want):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_bits_do_not_depend_on_the_pass(dtype: torch.dtype) -> None:
    """The CPU engine's path (d=128, where the CPU's flash attention computes a block of under 6 query rows
    through another GEMM path): a job's outputs are bit-identical alone or in a pass with other jobs, and
    its first 33 or 1 queries are bit-identical to those of a 48-token job from the same start, so a token's
    K/V never depend on how the prompt was cut into passes."""
    p = make_prefill_problem([(1, 40, 48), (0, 7, 30)], 4, 2, 128, 128, dtype, cache_rows=2, seed=5)
    full = prefill_attention(*p.args())
    offset = int(p.q_offsets[0])
    for n in (33, 1):
        q = p.q[offset : offset + n]
        alone = replace(p, q=q, job_rows=p.job_rows[:1], job_starts=p.job_starts[:1], q_offsets=torch.zeros(1, dtype=torch.int64),
                        q_lens=torch.tensor([n]))
        assert torch.equal(prefill_attention(*alone.args()), full[offset : offset + n]), f"the first {n} queries differ"


@pytest.mark.parametrize("block_size,dtype,head_dim", [
    (16, torch.float32, 16),
    (32, torch.bfloat16, 128),  # d=128: the CPU flash attention's GEMM paths of the engine's shape
    (64, torch.float32, 16),
    (64, torch.bfloat16, 16),
])  # fmt: skip
def test_paged_reference_is_the_slot_reference_on_the_gathered_cache(block_size: int, dtype: torch.dtype,
                                                                     head_dim: int) -> None:
    """Bit for bit (the CPU engine's runs stay reproducible), and within rounding of the float64 loop."""
    p, paged = _paged_problem(block_size, 4, 2, head_dim, dtype, seed=block_size)
    k, v = paged.k_cache.nan_to_num(0.0), paged.v_cache.nan_to_num(0.0)
    q = p.q.nan_to_num(0.0)
    got = prefill_attention(q, k, v, *p.args()[3:], block_tables=paged.block_tables)
    gathered = replace(p, q=q, k_cache=gather_cache(k, paged.block_tables), v_cache=gather_cache(v, paged.block_tables))
    assert torch.equal(got, prefill_attention(*gathered.args()))
    assert _err(got, prefill_loop_ref(p)) < (1e-5 if dtype == torch.float32 else TOLERANCE[dtype])
