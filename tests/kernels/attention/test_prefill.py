"""Tests of ``kernels.attention.prefill`` (prefill attention of a ragged pass straight from the KV cache): the Triton
kernel (through the Triton interpreter, ``TRITON_INTERPRET=1``, set by scripts/test.sh) against a plain float64 loop
at small sizes, over GQA shapes, dtypes, fp8 caches, tilings, paged caches with garbage table entries, strided q,
empty passes and a job's independence of the pass; the default config; the argument checks on both paths; and the
kernel's GPU specialisations compile for sm_90 (``sm90_compile``). tests/gpu/test_prefill_attention_gpu.py repeats
the parity at real sizes. Relative-error tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from skyrl_clora.kernels import prefill_attention
from skyrl_clora.kernels.attention.prefill import PrefillConfig, default_prefill_config, prefill_attention_triton
from tests.support.attention_checks import PREFILL_JOBS as JOBS
from tests.support.attention_checks import paged_prefill_problem as _paged_problem
from tests.support.attention_checks import relative_error as _err
from tests.support.attention_checks import uncovered_tokens as _uncovered
from tests.support.kernel_cases import (
    CACHE_DTYPES,
    DTYPES,
    FP8,
    TOLERANCE,
    as_cache,
    make_prefill_problem,
    prefill_loop_ref,
)
from tests.support.markers import interpreted
from tests.support.sm90_compile_runs import sm90_compile_test

test_compiles_for_sm90 = sm90_compile_test("skyrl_clora.kernels.attention.prefill")


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


def test_triton_needs_contiguous_metadata() -> None:
    """The kernel reads the job metadata as flat arrays: a strided view of any of them is refused before a launch."""
    p = make_prefill_problem(JOBS[:3], 4, 2, 32, 16, torch.float32, cache_rows=6)
    for index, name in enumerate(("job_rows", "job_starts", "q_offsets", "q_lens")):
        meta = list(p.args()[3:7])
        meta[index] = meta[index].repeat_interleave(2)[::2]  # the same values, every other element of a copy
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            prefill_attention_triton(p.q, p.k_cache, p.v_cache, *meta, p.scale)
