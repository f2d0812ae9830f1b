"""GPU parity of the Triton decode-attention kernels at real sizes against the fp32 torch reference, slot and
paged caches, and CUDA-graph capture of a decode step replayed with new lengths (and, paged, new block tables).
Skipped without CUDA. Cache positions past each row's length and cache rows past the batch hold NaN (paged:
blocks no row names too, and table entries past each row's length are garbage), so a kernel reading them
fails. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import DecodeWorkspace, decode_attention
from tests.support.kernel_cases import (
    DTYPES,
    FP8,
    TOLERANCE,
    attention_ref_fp32,
    capture_graph,
    make_attention_problem,
    rel_error,
)
from tests.support.paged_cases import page_cache

pytestmark = pytest.mark.gpu


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_error(got, want, torch.zeros_like(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (16, 8), (32, 8)], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_real_sizes_match_reference(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    p = make_attention_problem(
        48, heads, kv_heads, 2048, head_dim, dtype, cache_rows=64, device="cuda", seed=head_dim + kv_heads, poison=True
    )
    want = attention_ref_fp32(p)
    got = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths)
    assert _err(got, want) < TOLERANCE[dtype], f"relative error {_err(got, want):.2e}"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (32, 4, 2), (256, 8, 2), (96, 12, 4)])
def test_other_head_dims_match_reference(head_dim: int, heads: int, kv_heads: int) -> None:
    """The project's tiny models (d=16, 32), Qwen-style 256, and a head dim that is not a power of two."""
    p = make_attention_problem(37, heads, kv_heads, 300, head_dim, torch.bfloat16, device="cuda", poison=True)
    p.lengths = p.lengths.int()
    got = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths)
    assert _err(got, attention_ref_fp32(p)) < TOLERANCE[torch.bfloat16]


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row's output is bit-identical whether it is decoded with 64 rows or 16 (launch config by L only)."""
    p = make_attention_problem(64, 16, 8, 2048, 128, torch.bfloat16, device="cuda", seed=3)
    full = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths)
    part = decode_attention(p.q[:16], p.k_cache, p.v_cache, p.lengths[:16])
    assert torch.equal(full[:16], part)


def test_cuda_dispatch_takes_the_triton_path() -> None:
    p = make_attention_problem(4, 4, 2, 64, 64, torch.bfloat16, device="cuda")
    strided = p.k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # same values; the reference accepts it
    with pytest.raises(ValueError, match="unit stride"):
        decode_attention(p.q, strided, p.v_cache, p.lengths)


def test_decode_step_captured_in_cuda_graph_replays_new_lengths() -> None:
    """Two layers' attention captured once with ``out`` and a workspace (no allocation in the capture);
    replays with new q and new lengths (including 1 and L) match the reference."""
    B, H, KV, L, D = 64, 16, 8, 2048, 128
    layers = [make_attention_problem(B, H, KV, L, D, torch.bfloat16, cache_rows=80, device="cuda", seed=s) for s in (0, 1)]
    q = torch.zeros(B, H, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.ones(B, dtype=torch.int32, device="cuda")
    outs = [torch.empty_like(q) for _ in layers]
    ws = DecodeWorkspace(max_rows=B, num_heads=H, max_len=L, head_dim=D, device="cuda")

    def step() -> None:
        for p, out in zip(layers, outs):
            decode_attention(q, p.k_cache, p.v_cache, lengths, out=out, workspace=ws)

    graph, _, step_allocated = capture_graph(step)
    assert step_allocated == 0, f"the captured decode step allocated {step_allocated} bytes"
    gen = torch.Generator(device="cuda").manual_seed(7)
    for replay in range(3):
        new_lengths = torch.randint(1, L + 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
        new_lengths[replay] = 1
        new_lengths[replay + 1] = L
        lengths.copy_(new_lengths)
        q.copy_(torch.randn(B, H, D, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        for p, out in zip(layers, outs):
            p.q, p.lengths = q, new_lengths
            want = attention_ref_fp32(p)
            assert _err(out, want) < TOLERANCE[torch.bfloat16], f"replay {replay}: relative error {_err(out, want):.2e}"
        assert not torch.allclose(outs[0].float(), outs[1].float(), atol=1e-2), "the two layers' caches must differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [16, 32], ids=["1.7b", "4b"])
def test_prefix_rows_read_the_shared_copy_at_real_sizes(heads: int, dtype: torch.dtype) -> None:
    """64 rows in 8 groups of 8 whose first 255 positions (a GRPO prompt less its last token) are read once
    per group (Qwen3-1.7B's and 4B's query heads per kv head: 16- and 32-row tiles); every member's own
    copy is NaN, and so is every partial the call does not write, so reading either would show."""
    p = make_attention_problem(64, heads, 8, 640, 128, dtype, device="cuda", seed=7,
                               lengths=[300 + 4 * row for row in range(64)])
    prefix_rows = (torch.arange(64, device="cuda") // 8) * 8
    prefix_lens = torch.full((64,), 255, device="cuda")
    clean_k, clean_v = p.k_cache.clone(), p.v_cache.clone()
    clean_k[:, :, :255] = p.k_cache[prefix_rows, :, :255]
    clean_v[:, :, :255] = p.v_cache[prefix_rows, :, :255]
    members = prefix_rows != torch.arange(64, device="cuda")
    p.k_cache[members, :, :255] = float("nan")
    p.v_cache[members, :, :255] = float("nan")
    want = decode_attention(p.q.float(), clean_k.float(), clean_v.float(), p.lengths, backend="torch")
    workspace = DecodeWorkspace(max_rows=64, num_heads=heads, max_len=640, head_dim=128, device="cuda")
    workspace.buffer.fill_(float("nan"))
    got = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths, workspace=workspace, prefix_rows=prefix_rows,
                           prefix_lens=prefix_lens)
    assert _err(got, want) < TOLERANCE[dtype], f"relative error {_err(got, want):.2e}"


def _paged(p, block_size: int, seed: int, shared=None, hidden=None):
    """``p``'s cache paged (tests/support/paged_cases.py), each row up to its length, NaN past it and in unused blocks."""
    return page_cache(p.k_cache, p.v_cache, p.lengths.tolist(), block_size, seed=seed, shared=shared, hidden=hidden)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_paged_real_sizes_match_reference(block_size: int, dtype: torch.dtype) -> None:
    """48 rows over 2048 positions in randomly placed blocks (the table's entries past each row's length
    garbage: -1, stale, 2**30): against the fp32 reference on the slot cache, and bit-identical to the slot
    layout's kernel on the same keys (one computation, other addresses)."""
    p = make_attention_problem(48, 16, 8, 2048, 128, dtype, device="cuda", seed=block_size, poison=True)
    paged = _paged(p, block_size, seed=block_size)
    got = decode_attention(p.q, paged.k_cache, paged.v_cache, p.lengths, block_tables=paged.block_tables)
    assert _err(got, attention_ref_fp32(p)) < TOLERANCE[dtype], f"relative error {_err(got, attention_ref_fp32(p)):.2e}"
    assert torch.equal(got, decode_attention(p.q, p.k_cache, p.v_cache, p.lengths))


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_fp8_cache_gives_the_bf16_cache_of_its_values(block_size: int) -> None:
    """An fp8 (e4m3) paged cache, converted to the query's dtype as it is loaded on the GPU: the bf16 cache holding
    the same (fp8-representable) values up to the dots' summation order (the compiler lays the converted tiles out
    otherwise): at most 0.1% of the outputs differ, each by at most one rounding of bf16; and within bf16's
    tolerance of the fp32 reference."""
    p = make_attention_problem(48, 16, 8, 2048, 128, torch.bfloat16, device="cuda", seed=block_size, poison=True,
                               cache_values=FP8)
    paged = _paged(p, block_size, seed=block_size)
    got = decode_attention(p.q, paged.k_cache.to(FP8), paged.v_cache.to(FP8), p.lengths, block_tables=paged.block_tables)
    want = decode_attention(p.q, paged.k_cache, paged.v_cache, p.lengths, block_tables=paged.block_tables)
    assert (got != want).float().mean().item() <= 1e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-14)
    assert _err(got, attention_ref_fp32(p)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("heads", [16, 32], ids=["1.7b", "4b"])
def test_paged_prefix_rows_at_real_sizes(heads: int, block_size: int) -> None:
    """The engine's shape: 64 rows in 8 GRPO groups of 8 whose 255-position prompt is the group's first row's,
    read once per group through ``prefix_rows``; the even members' tables name the first row's whole prompt
    blocks (shared blocks), the odd members' entries there are garbage. Every partial the call does not write
    is NaN."""
    p = make_attention_problem(64, heads, 8, 640, 128, torch.bfloat16, device="cuda", seed=7,
                               lengths=[300 + 4 * row for row in range(64)])
    prefix_rows = (torch.arange(64, device="cuda") // 8) * 8
    p.k_cache[:, :, :255] = p.k_cache[prefix_rows, :, :255]
    p.v_cache[:, :, :255] = p.v_cache[prefix_rows, :, :255]
    whole = 255 // block_size
    members = [row for row in range(64) if row % 8]
    paged = _paged(p, block_size, seed=heads, shared={row: (row // 8 * 8, whole) for row in members if row % 2 == 0},
                   hidden={row: whole for row in members if row % 2})
    workspace = DecodeWorkspace(max_rows=64, num_heads=heads, max_len=640, head_dim=128, device="cuda")
    workspace.buffer.fill_(float("nan"))
    got = decode_attention(p.q, paged.k_cache, paged.v_cache, p.lengths, workspace=workspace, prefix_rows=prefix_rows,
                           prefix_lens=torch.full((64,), 255, device="cuda"), block_tables=paged.block_tables)
    assert _err(got, attention_ref_fp32(p)) < TOLERANCE[torch.bfloat16], f"relative error {_err(got, attention_ref_fp32(p)):.2e}"


def test_paged_decode_step_captured_in_cuda_graph_replays_new_tables() -> None:
    """A paged decode step captured once (no allocation in the capture); each replay copies new lengths, q, cache
    blocks and a new block table (another placement of the blocks) into the captured tensors, and matches the
    reference."""
    B, H, KV, L, D, BS = 64, 16, 8, 2048, 128, 32
    num_blocks = B * L // BS + 8
    q = torch.zeros(B, H, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.ones(B, dtype=torch.int32, device="cuda")
    k_cache = torch.zeros(num_blocks, KV, BS, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.zeros(B + 1, L // BS, dtype=torch.int32, device="cuda")  # one table row past the batch
    out = torch.empty_like(q)
    ws = DecodeWorkspace(max_rows=B, num_heads=H, max_len=L, head_dim=D, device="cuda")

    def step() -> None:
        decode_attention(q, k_cache, v_cache, lengths, out=out, workspace=ws, block_tables=block_tables)

    graph, _, step_allocated = capture_graph(step)
    assert step_allocated == 0, f"the captured decode step allocated {step_allocated} bytes"
    previous = None
    for replay in range(3):
        p = make_attention_problem(B, H, KV, L, D, torch.bfloat16, device="cuda", seed=20 + replay, poison=True)
        p.lengths = p.lengths.int()
        paged = _paged(p, BS, seed=replay)
        k_cache[: paged.k_cache.shape[0]].copy_(paged.k_cache)
        v_cache[: paged.v_cache.shape[0]].copy_(paged.v_cache)
        block_tables[:B].copy_(paged.block_tables)
        block_tables[B] = -1
        lengths.copy_(p.lengths)
        q.copy_(p.q)
        graph.replay()
        torch.cuda.synchronize()
        want = attention_ref_fp32(p)
        assert _err(out, want) < TOLERANCE[torch.bfloat16], f"replay {replay}: relative error {_err(out, want):.2e}"
        assert previous is None or not torch.equal(out, previous)
        previous = out.clone()
