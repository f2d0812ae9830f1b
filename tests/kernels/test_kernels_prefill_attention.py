"""Prefill attention of a ragged pass: the torch reference against a plain float64 loop, its bit-level
independence of the pass's shapes, and the Triton kernel (through the Triton interpreter,
``TRITON_INTERPRET=1``, set by scripts/test.sh) against the loop at small sizes;
tests/gpu/test_prefill_attention_gpu.py repeats them at real sizes. Relative-error tolerances per dtype:
``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from skyrl_clora.kernels import prefill_attention
from skyrl_clora.kernels.attention.prefill import PrefillConfig, default_prefill_config, prefill_attention_triton
from tests.support.kernel_cases import (
    CACHE_DTYPES,
    DTYPES,
    FP8,
    TOLERANCE,
    as_cache,
    make_prefill_problem,
    prefill_loop_ref,
    rel_error,
)
from tests.support.paged_cases import gather_cache, page_prefill_problem
from tests.support.markers import interpreted

# (row, start, q_len) per job slot: a slot of length 0, a job of one token, a job of 70 tokens from position
# 70 (several query tiles and key tiles at the default config's block_n of 64), jobs sharing no row.
JOBS = [(3, 70, 70), (0, 0, 1), (5, 13, 0), (1, 130, 17), (2, 0, 40), (4, 5, 23)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_error(got, want, torch.zeros_like(want))


def _uncovered(p) -> torch.Tensor:
    """``[T]`` bool: the tokens of no job."""
    covered = torch.zeros(p.q.shape[0], dtype=torch.bool)
    for offset, n in zip(p.q_offsets.tolist(), p.q_lens.tolist()):
        covered[offset : offset + n] = True
    return ~covered


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


@interpreted
@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_triton_matches_loop(head_dim: int, kv_heads: int, dtype: torch.dtype, cache: torch.dtype | None) -> None:
    """Default config (block_q 64/32/16 for 1/2/4 query heads per kv head, block_n 64). Each row's cache
    positions past its jobs' last one, the row of no job and q's tokens of no job hold NaN, so reading any
    of them would show. An fp8 cache against the loop on its dequantised values."""
    p = make_prefill_problem(JOBS, 4, kv_heads, 160, head_dim, dtype, cache_rows=6, seed=head_dim + kv_heads, poison=True,
                             cache_values=cache)
    want = prefill_loop_ref(p)
    got = prefill_attention(*replace(p, k_cache=as_cache(p.k_cache, cache), v_cache=as_cache(p.v_cache, cache)).args(),
                            backend="triton")
    assert got.dtype == dtype and got.shape == p.q.shape
    assert not got[_uncovered(p)].any(), "tokens of no job must be zeros"
    assert _err(got, want) < TOLERANCE[dtype], f"relative error {_err(got, want):.2e}"


@interpreted
@pytest.mark.parametrize("heads,kv_heads,config", [
    (4, 2, PrefillConfig(block_q=16, block_n=16)),  # several query and key tiles for every job, 32-row tiles
    (6, 2, None),  # 3 query heads per kv head: 48 of a tile's 64 rows used
    (8, 1, None),  # 8 query heads per kv head: 128-row tiles, 8 warps
])
def test_triton_tilings_match_loop(heads: int, kv_heads: int, config: PrefillConfig | None) -> None:
    p = make_prefill_problem(JOBS, heads, kv_heads, 160, 16, torch.float32, cache_rows=6, seed=heads, poison=True)
    got = prefill_attention_triton(*p.args(), config=config)
    assert _err(got, prefill_loop_ref(p)) < TOLERANCE[torch.float32], f"relative error {_err(got, prefill_loop_ref(p)):.2e}"


@interpreted
def test_triton_jobs_do_not_depend_on_the_pass() -> None:
    """A job's outputs are bit-identical alone or among other jobs (the grid and tiles depend only on the
    shapes and the heads per kv head, a job's tiles start at its first query)."""
    p = make_prefill_problem(JOBS, 4, 2, 160, 16, torch.bfloat16, cache_rows=6, seed=3)
    full = prefill_attention(*p.args(), backend="triton")
    offset, n = int(p.q_offsets[0]), int(p.q_lens[0])
    alone = replace(p, q=p.q[offset : offset + n], job_rows=p.job_rows[:1], job_starts=p.job_starts[:1],
                    q_offsets=torch.zeros(1, dtype=torch.int64), q_lens=p.q_lens[:1])
    assert torch.equal(prefill_attention(*alone.args(), backend="triton"), full[offset : offset + n])


@interpreted
def test_triton_strided_q_and_empty_passes() -> None:
    """q as a view of a fused projection's output (``[T, (H + 2 KV) d]``, heads first); a pass whose slots are
    all unused, and one with no slot, give zeros."""
    p = make_prefill_problem(JOBS[:2], 4, 2, 160, 16, torch.float32, cache_rows=6, seed=8)
    fused = torch.randn(p.q.shape[0], 8 * 16)
    fused[:, : 4 * 16] = p.q.flatten(1)
    strided = fused[:, : 4 * 16].unflatten(1, (4, 16))
    assert not strided.is_contiguous()
    got = prefill_attention(*replace(p, q=strided).args(), backend="triton")
    assert _err(got, prefill_loop_ref(p)) < TOLERANCE[torch.float32]
    empty = replace(p, q_lens=torch.zeros_like(p.q_lens))
    assert not prefill_attention(*empty.args(), backend="triton").any()
    none = torch.zeros(0, dtype=torch.int64)
    no_slot = replace(p, job_rows=none, job_starts=none, q_offsets=none, q_lens=none)
    assert not prefill_attention(*no_slot.args(), backend="triton").any()


def test_default_config_tiles() -> None:
    """64-row tiles (128 for 8 query heads per kv head), at least 16 tokens."""
    tiles = {groups: default_prefill_config(groups).block_q * groups for groups in (1, 2, 3, 4, 8)}
    assert tiles == {1: 64, 2: 64, 3: 48, 4: 64, 8: 128}
    assert default_prefill_config(8).num_warps == 8 and default_prefill_config(2).num_warps == 4


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_rejects_bad_arguments(backend: str) -> None:
    p = make_prefill_problem(JOBS[:3], 4, 2, 32, 16, torch.float32, cache_rows=6)
    meta = p.args()[3:7]
    cases = [
        ((p.q[0], p.k_cache, p.v_cache, *meta), "q must be"),
        ((p.q, p.k_cache[0], p.v_cache[0], *meta), "k_cache and v_cache"),
        ((p.q, p.k_cache, p.v_cache[:, :, :16], *meta), "k_cache and v_cache"),
        ((p.q, p.k_cache[:, :1].expand(6, 3, 32, 16), p.v_cache[:, :1].expand(6, 3, 32, 16), *meta), "multiple"),
        ((p.q[:, :, :8], p.k_cache, p.v_cache, *meta), "head dim"),
        ((p.q.half(), p.k_cache, p.v_cache, *meta), "one dtype"),
        ((p.q, p.k_cache.to(FP8), p.v_cache, *meta), "one dtype"),  # fp8 for both caches or neither
        ((p.q, p.k_cache.to(torch.float8_e5m2), p.v_cache.to(torch.float8_e5m2), *meta), "one dtype"),
        ((p.q, p.k_cache, p.v_cache, meta[0].int(), *meta[1:]), "1-D int64 of one length"),
        ((p.q, p.k_cache, p.v_cache, *meta[:3], meta[3][:2]), "1-D int64 of one length"),
        ((p.q, p.k_cache, p.v_cache, *meta[:2], meta[2][None], meta[3]), "1-D int64 of one length"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            prefill_attention(*args, p.scale, backend=backend)


@interpreted
def test_triton_rejects_what_only_the_reference_takes() -> None:
    p = make_prefill_problem(JOBS[:2], 4, 2, 32, 16, torch.float32, cache_rows=6)
    strided = p.k_cache.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match="unit stride"):
        prefill_attention(*replace(p, k_cache=strided).args(), backend="triton")
    wide = make_prefill_problem(JOBS[:2], 2, 1, 8, 320, torch.float32, cache_rows=6)
    with pytest.raises(ValueError, match="backend='torch'"):
        prefill_attention(*wide.args(), backend="triton")
    with pytest.raises(ValueError, match="at least 16"):
        prefill_attention_triton(*p.args(), config=PrefillConfig(block_q=8))


# Paged caches (tests/support/paged_cases.py): JOBS over L = 192 positions, row 4's keys (its job's 28 positions) in row
# 2's blocks (GRPO siblings sharing a prompt), the table entries past each row's last position garbage.
PAGED_LEN, PAGED_SHARED = 192, {4: 2}


def _paged_problem(block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
                   cache_values: torch.dtype | None = None):
    p = make_prefill_problem(JOBS, heads, kv_heads, PAGED_LEN, head_dim, dtype, cache_rows=6, seed=seed, poison=True,
                             cache_values=cache_values)
    paged = page_prefill_problem(p, block_size, PAGED_SHARED, seed=seed)
    tables = paged.block_tables
    assert (tables < 0).any() and (tables >= paged.k_cache.shape[0]).any(), "garbage table entries"
    assert tables[4, 0] == tables[2, 0], "rows 2 and 4 share a block"
    return p, paged


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


@interpreted
@pytest.mark.parametrize("block_size,heads,kv_heads,config", [
    (16, 4, 2, None),  # 64-key tiles over four blocks each
    (32, 4, 1, None),  # 64-row tiles of 16 tokens x 4 heads, 64-key tiles over two blocks
    (64, 4, 4, None),  # one block per key tile
    (32, 4, 2, PrefillConfig(block_q=16, block_n=16)),  # 16-key tiles: part of a block each
    (64, 8, 1, PrefillConfig(block_q=16, block_n=32)),
])  # fmt: skip
def test_paged_triton_matches_loop(block_size: int, heads: int, kv_heads: int, config: PrefillConfig | None) -> None:
    """Positions past each row's last one, blocks no row names, q's tokens of no job and garbage table entries
    (-1, stale, 2**30) would show as NaN or a crash."""
    p, paged = _paged_problem(block_size, heads, kv_heads, 16, torch.float32, seed=block_size + heads)
    got = prefill_attention_triton(p.q, paged.k_cache, paged.v_cache, *p.args()[3:], config=config,
                                   block_tables=paged.block_tables)
    assert not got[_uncovered(p)].any(), "tokens of no job must be zeros"
    assert _err(got, prefill_loop_ref(p)) < TOLERANCE[torch.float32], f"relative error {_err(got, prefill_loop_ref(p)):.2e}"


@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paged_half_precision(dtype: torch.dtype, backend: str, cache: torch.dtype | None) -> None:
    """Paged in the half dtypes; an fp8 cache against the loop on its dequantised values (the torch path reads
    NaN-free tensors, as it attends over every gathered position)."""
    p, paged = _paged_problem(32, 4, 2, 24, dtype, seed=4, cache_values=cache)
    q, k, v = p.q, paged.k_cache, paged.v_cache
    if backend == "torch":
        q, k, v = q.nan_to_num(0.0), k.nan_to_num(0.0), v.nan_to_num(0.0)
    got = prefill_attention(q, as_cache(k, cache), as_cache(v, cache), *p.args()[3:], block_tables=paged.block_tables,
                            backend=backend)
    assert got.dtype == dtype and _err(got, prefill_loop_ref(p)) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_paged_rejects_bad_tables(backend: str) -> None:
    p, paged = _paged_problem(32, 4, 2, 16, torch.float32, seed=0)
    for bad, message in [
        (paged.block_tables.long(), "int32"),
        (paged.block_tables[:, :3], "contiguous"),
        (paged.block_tables[0], "2-D"),
    ]:
        with pytest.raises(ValueError, match=message):
            prefill_attention(p.q, paged.k_cache, paged.v_cache, *p.args()[3:], block_tables=bad, backend=backend)
    with pytest.raises(ValueError, match="paged"):
        prefill_attention(p.q, paged.k_cache, paged.v_cache[:, :, :16], *p.args()[3:], block_tables=paged.block_tables,
                          backend=backend)
