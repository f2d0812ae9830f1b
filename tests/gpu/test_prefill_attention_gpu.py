"""GPU parity of the Triton prefill-attention kernel at real sizes against the fp32 torch reference, slot and
paged caches, and CUDA-graph capture of a prefill pass replayed with new metadata (and, paged, new tables).
Skipped without CUDA. Each cache row's positions past its job's last one, the rows of no job and q's tokens of
no job hold NaN (paged: blocks no row names too, and table entries past each row's last position are
garbage), so a kernel reading them fails. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from skyrl_clora.kernels import prefill_attention
from tests.support.kernel_cases import (
    DTYPES,
    TOLERANCE,
    capture_graph,
    make_prefill_problem,
    prefill_ref_fp32,
    rel_error,
)
from tests.support.paged_cases import page_prefill_problem

pytestmark = pytest.mark.gpu
CACHE_ROWS, MAX_LEN, KV_HEADS, HEAD_DIM = 80, 1024, 8, 128  # Qwen3-1.7B/4B: 8 kv heads of 128


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_error(got, want, torch.zeros_like(want))


def _jobs(layout: str, seed: int, slots: int = 64) -> list[tuple[int, int, int]]:
    """``slots`` job slots ``(row, start, q_len)`` on distinct cache rows. ``turns``: 64 jobs of 33-48
    tokens (the first 48) after 350-430 positions of history, an episode's next turns; ``prompts``: 8 jobs
    of 256 tokens from position 0 then unused slots; ``mixed``: a 1-token job, unused slots between jobs, a
    job ending at the last cache position, one of 700 tokens."""
    gen = random.Random(seed)
    rows = gen.sample(range(CACHE_ROWS), slots)
    if layout == "turns":
        jobs = [(row, gen.randint(350, 430), 48 if j == 0 else gen.randint(33, 48)) for j, row in enumerate(rows)]
    elif layout == "prompts":
        jobs = [(row, 0, 256 if j < 8 else 0) for j, row in enumerate(rows)]
    else:
        sizes = [(0, 1), (0, 0), (MAX_LEN - 40, 40), (0, 0), (100, 700), (517, 33)]
        jobs = [(row, *sizes[j]) if j < len(sizes) else (row, 0, 0) for j, row in enumerate(rows)]
    return jobs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["turns", "prompts"])
@pytest.mark.parametrize("heads", [16, 32], ids=["1.7b", "4b"])
def test_real_sizes_match_reference(heads: int, layout: str, dtype: torch.dtype) -> None:
    p = make_prefill_problem(_jobs(layout, seed=heads), heads, KV_HEADS, MAX_LEN, HEAD_DIM, dtype,
                             cache_rows=CACHE_ROWS, device="cuda", seed=heads, poison=True)
    got = prefill_attention(*p.args())
    want = prefill_ref_fp32(p)
    assert got.dtype == dtype and got.shape == p.q.shape
    assert _err(got, want) < TOLERANCE[dtype], f"relative error {_err(got, want):.2e}"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (64, 16, 16), (96, 12, 4), (256, 8, 2), (128, 64, 8)])
def test_other_head_layouts_match_reference(head_dim: int, heads: int, kv_heads: int) -> None:
    """The project's tiny model (d=16), one query head per kv head, a head dim that is not a power of two
    with 3 query heads per kv head, Qwen-style 256, and 8 query heads per kv head (128-row tiles)."""
    p = make_prefill_problem(_jobs("mixed", seed=head_dim), heads, kv_heads, MAX_LEN, head_dim, torch.bfloat16,
                             cache_rows=CACHE_ROWS, device="cuda", seed=head_dim, poison=True)
    got = prefill_attention(*p.args())
    assert _err(got, prefill_ref_fp32(p)) < TOLERANCE[torch.bfloat16], f"relative error {_err(got, prefill_ref_fp32(p)):.2e}"


def test_jobs_do_not_depend_on_the_pass() -> None:
    """A job's outputs are bit-identical alone or among 63 other jobs (tiles start at each job's first query)."""
    p = make_prefill_problem(_jobs("turns", seed=3), 16, KV_HEADS, MAX_LEN, HEAD_DIM, torch.bfloat16,
                             cache_rows=CACHE_ROWS, device="cuda", seed=3)
    full = prefill_attention(*p.args())
    offset, n = int(p.q_offsets[5]), int(p.q_lens[5])
    alone = replace(p, q=p.q[offset : offset + n], job_rows=p.job_rows[5:6], job_starts=p.job_starts[5:6],
                    q_offsets=torch.zeros(1, dtype=torch.int64, device="cuda"), q_lens=p.q_lens[5:6])
    assert torch.equal(prefill_attention(*alone.args()), full[offset : offset + n])


def test_cuda_dispatch_takes_the_triton_path() -> None:
    p = make_prefill_problem(_jobs("mixed", seed=0), 4, 2, MAX_LEN, 64, torch.bfloat16, cache_rows=CACHE_ROWS, device="cuda")
    strided = p.k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # same values; the reference accepts it
    with pytest.raises(ValueError, match="unit stride"):
        prefill_attention(*replace(p, k_cache=strided).args())


def _replay_and_check(graph: torch.cuda.CUDAGraph, out: torch.Tensor, q: torch.Tensor, metadata: torch.Tensor,
                      p, replay: int) -> None:
    """Copies problem ``p``'s queries (NaN past them) and metadata into the captured ``q`` and ``metadata`` (its
    cache already copied in), replays ``graph`` and checks ``out`` against the fp32 reference, zeros past the pass."""
    used = p.q.shape[0]
    q[:used].copy_(p.q)
    q[used:] = float("nan")
    metadata.copy_(torch.stack([p.job_rows, p.job_starts, p.q_offsets, p.q_lens]))
    graph.replay()
    torch.cuda.synchronize()
    want = prefill_ref_fp32(p)
    assert _err(out[:used], want) < TOLERANCE[torch.bfloat16], f"replay {replay}: relative error {_err(out[:used], want):.2e}"
    assert not out[used:].any(), f"replay {replay}: tokens past the pass must be zeros"


def test_prefill_pass_captured_in_cuda_graph_replays_new_metadata() -> None:
    """One layer's prefill attention captured once over fixed q, cache and metadata tensors (64 job slots,
    the metadata one ``[4, 64]`` tensor as the runner holds it), allocating only its output; replays
    after copying three passes' q, caches and metadata into them match the reference, tokens past a pass
    zeros."""
    heads, num_tokens, slots = 16, 4096, 64
    q = torch.zeros(num_tokens, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(CACHE_ROWS, KV_HEADS, MAX_LEN, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    metadata = torch.zeros(4, slots, dtype=torch.int64, device="cuda")  # rows, starts, offsets, lengths

    def attend() -> torch.Tensor:
        return prefill_attention(q, k_cache, v_cache, *metadata, HEAD_DIM**-0.5)

    graph, out, pass_allocated = capture_graph(attend)
    assert pass_allocated == out.numel() * out.element_size(), f"the captured pass allocated {pass_allocated} bytes"
    previous = None
    for replay, layout in enumerate(["turns", "prompts", "mixed"]):
        p = make_prefill_problem(_jobs(layout, seed=10 + replay), heads, KV_HEADS, MAX_LEN, HEAD_DIM, torch.bfloat16,
                                 cache_rows=CACHE_ROWS, device="cuda", seed=10 + replay, poison=True)
        k_cache.copy_(p.k_cache)
        v_cache.copy_(p.v_cache)
        _replay_and_check(graph, out, q, metadata, p, replay)
        assert previous is None or not torch.equal(out, previous), "each replay must give its own pass's answer"
        previous = out.clone()


@pytest.mark.parametrize("layout", ["turns", "prompts", "mixed"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paged_real_sizes_match_reference(block_size: int, layout: str) -> None:
    """The jobs' rows in randomly placed blocks (tests/support/paged_cases.py; entries past each row's last position
    garbage, blocks no row names NaN): against the fp32 reference, and bit-identical to the slot layout's
    kernel on the same keys."""
    p = make_prefill_problem(_jobs(layout, seed=block_size), 16, KV_HEADS, MAX_LEN, HEAD_DIM, torch.bfloat16,
                             cache_rows=CACHE_ROWS, device="cuda", seed=block_size, poison=True)
    paged = page_prefill_problem(p, block_size, {}, seed=block_size)
    got = prefill_attention(p.q, paged.k_cache, paged.v_cache, *p.args()[3:], block_tables=paged.block_tables)
    assert _err(got, prefill_ref_fp32(p)) < TOLERANCE[torch.bfloat16], f"relative error {_err(got, prefill_ref_fp32(p)):.2e}"
    assert torch.equal(got, prefill_attention(*p.args()))


def test_paged_prefill_pass_captured_in_cuda_graph_replays_new_tables() -> None:
    """A paged prefill pass captured once (allocating only its output); replays after copying three passes' q,
    cache blocks, metadata and block tables (other placements) into the captured tensors match the reference."""
    heads, num_tokens, slots, block_size = 16, 4096, 64, 32
    num_blocks = CACHE_ROWS * MAX_LEN // block_size + 8
    q = torch.zeros(num_tokens, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(num_blocks, KV_HEADS, block_size, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.zeros(CACHE_ROWS, MAX_LEN // block_size, dtype=torch.int32, device="cuda")
    metadata = torch.zeros(4, slots, dtype=torch.int64, device="cuda")  # rows, starts, offsets, lengths

    def attend() -> torch.Tensor:
        return prefill_attention(q, k_cache, v_cache, *metadata, HEAD_DIM**-0.5, block_tables=block_tables)

    graph, out, pass_allocated = capture_graph(attend)
    assert pass_allocated == out.numel() * out.element_size(), f"the captured pass allocated {pass_allocated} bytes"
    for replay, layout in enumerate(["turns", "prompts", "mixed"]):
        p = make_prefill_problem(_jobs(layout, seed=20 + replay), heads, KV_HEADS, MAX_LEN, HEAD_DIM, torch.bfloat16,
                                 cache_rows=CACHE_ROWS, device="cuda", seed=20 + replay, poison=True)
        paged = page_prefill_problem(p, block_size, {}, seed=replay)
        k_cache[: paged.k_cache.shape[0]].copy_(paged.k_cache)
        v_cache[: paged.v_cache.shape[0]].copy_(paged.v_cache)
        block_tables.copy_(paged.block_tables)
        _replay_and_check(graph, out, q, metadata, p, replay)
