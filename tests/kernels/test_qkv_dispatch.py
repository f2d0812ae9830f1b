"""Tests of ``kernels.qkv_dispatch`` (the dispatch of the attention block's q/k/v projection with q/k norm and
rotary, and of its variant writing k and v into the K/V cache): when the fused Triton kernel runs (slots, a
power-of-two head dim of at least 32, or forced), the torch path (the folded layer then ``qk_norm_rope``; without
slots the base layer) against the fp32 reference, k and v scattered into a slot cache of the model dtype or fp8,
and both paths writing into a paged cache through its block table (Triton on the CPU through the interpreter)."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import KVCacheWrite, dispatch, folded_qkv_rope, folded_qkv_rope_into_cache
from skyrl_clora.kernels.qkv_dispatch import _fused_qkv_rope
from skyrl_clora.kernels.reference import qk_norm_rope_ref
from tests.support.kernel_cases import CACHE_DTYPES, check_kv_cache_write, make_qkv_rope_problem
from tests.support.lora_parity import check_qkv_rope as check
from tests.support.lora_parity import run_qkv_rope as run
from tests.support.markers import interpreted


@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_the_torch_path_scatters_k_and_v_into_the_cache(cache: torch.dtype | None) -> None:
    p = make_qkv_rope_problem(10, 48, 2, 1, 32, num_slots=3, rank=8, dtype=torch.float32, layout="uniform",
                              with_norm=True)
    check_kv_cache_write(p, cache_rows=4, cache_len=8, backend="torch", cache_dtype=cache)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_k_and_v_go_into_a_paged_cache_through_the_block_table(backend: str, block_size: int) -> None:
    """A paged cache layer ``[NB, KV, BS, d]`` takes the write unchanged, the block index as the row and ``BS`` as
    the length: each token at a distinct (logical row, position), written to ``(block_tables[row, position //
    BS], position % BS)``, is found there through the table (a row's positions across several blocks, two rows
    sharing a block at different offsets), and every other entry is as it was."""
    p = make_qkv_rope_problem(24, 80, 4, 2, 32, num_slots=4, rank=16, dtype=torch.bfloat16, layout="zipf",
                              with_norm=True, seed=5)
    lora = p.lora
    args = (lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, p.head_dim, p.cos, p.sin, p.q_weight,
            p.k_weight, p.eps)
    q, k, v = folded_qkv_rope(*args, backend=backend)
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = 10
    block_tables = torch.randperm(num_blocks, generator=gen)[:8].view(2, 4).int()  # 2 logical rows of 4 blocks
    block_tables[1, 3] = block_tables[0, 0]  # a block shared by both rows (row 1's last, row 0's first)
    token = torch.arange(q.shape[0])  # token t: row t % 2, its block t // 2 % 4, offset t // 8 (+ BS / 2 in row 1)
    rows = token % 2
    positions = token // 2 % 4 * block_size + token // 8 + rows * (block_size // 2)
    cache = KVCacheWrite(*(torch.randn(num_blocks, 2, block_size, 32, generator=gen).bfloat16() for _ in range(2)),
                         block_tables[rows, positions // block_size].long(), positions % block_size)
    before_k, before_v = cache.k_cache.clone(), cache.v_cache.clone()
    assert torch.equal(folded_qkv_rope_into_cache(*args, cache, backend=backend), q)
    for cache_layer, before, values in ((cache.k_cache, before_k, k), (cache.v_cache, before_v, v)):
        logical = cache_layer[block_tables.long()].transpose(1, 2).flatten(2, 3)  # [2, KV, 4 * BS, d]
        assert torch.equal(logical[rows, :, positions], values)
        untouched = torch.ones(num_blocks, block_size, dtype=torch.bool)
        untouched[cache.rows, cache.positions] = False
        assert untouched.sum() == num_blocks * block_size - q.shape[0], "each token at an entry of its own"
        assert torch.equal(cache_layer.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched])


def test_torch_path_is_the_folded_layer_then_qk_norm_rope() -> None:
    p = make_qkv_rope_problem(10, 48, 2, 1, 32, num_slots=3, rank=8, dtype=torch.float32, layout="no_adapter",
                              with_norm=True)
    check(p, run(p, "torch"))


def test_the_fused_kernel_runs_for_slots_and_fusable_heads_or_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    x, slots = torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _fused_qkv_rope(x, None, 32, "triton")  # no slots: the base layer, then the norm and rotary
    assert not _fused_qkv_rope(x, slots, 32, "torch")
    assert not _fused_qkv_rope(x, slots, 32, None)  # CPU tensors: the reference
    assert _fused_qkv_rope(x, slots, 24, "triton")  # forced, whatever the head dim (the kernel then refuses it)
    monkeypatch.setattr(dispatch, "use_triton", lambda x, backend: True)  # as for CUDA tensors
    fused = [_fused_qkv_rope(x, slots, head_dim, None) for head_dim in (16, 24, 32, 64, 96, 128)]
    assert fused == [False, False, True, True, False, True]


def test_without_slots_it_is_the_base_layer_then_qk_norm_rope() -> None:
    p = make_qkv_rope_problem(5, 48, 2, 1, 32, num_slots=2, rank=8, dtype=torch.float32, layout="uniform",
                              with_norm=True)
    lora = p.lora
    q, k, v = folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, None, 32, p.cos, p.sin, p.q_weight,
                              p.k_weight, p.eps)
    base_q, base_k, base_v = (t.reshape(5, -1, 32) for t in lora.out.split([64, 32, 32], dim=-1))
    want_q, want_k = qk_norm_rope_ref(base_q, base_k, p.cos, p.sin, p.q_weight, p.k_weight, p.eps)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(v, base_v, rtol=0, atol=0)
    assert v.is_contiguous() and v.shape == (5, 1, 32)
