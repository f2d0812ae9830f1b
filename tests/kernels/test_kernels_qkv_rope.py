"""The q/k/v projection with its LoRA expand fused into q/k norm + rotary (``kernels.lora.qkv_rope``): the Triton
kernel (interpreter on the CPU) against the fp32 reference over adapter layouts, on both of its paths (the
folded GEMM's partial sums, and the base GEMM with the split-K shrink); tests/gpu/ repeats it at Qwen3-4B
sizes and in a CUDA graph. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

import skyrl_clora.kernels.lora.qkv_rope as qkv_rope
from skyrl_clora.kernels import KVCacheWrite, LoRAMeta, folded_qkv_rope, folded_qkv_rope_into_cache
from tests.support.kernel_cases import (
    CACHE_DTYPES,
    LAYOUTS,
    QKVRopeProblem,
    TOLERANCE,
    adapters_differ,
    check_kv_cache_write,
    make_qkv_rope_problem,
    qkv_rope_ref_fp32,
    rel_error,
)
from tests.support.markers import interpreted


def run(p: QKVRopeProblem, backend: str, meta: LoRAMeta | None = None) -> tuple[torch.Tensor, ...]:
    lora = p.lora
    return folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, p.head_dim, p.cos, p.sin,
                           p.q_weight, p.k_weight, p.eps, meta=meta, backend=backend)


def check(p: QKVRopeProblem, got: tuple[torch.Tensor, ...]) -> None:
    """q and k within the dtype's tolerance of the fp32 reference (relative to their largest entry), v relative
    to the LoRA update (as the folded layer's tests), and rows with no adapter as the base layer gives them."""
    dtype = p.lora.x.dtype
    want = qkv_rope_ref_fp32(p)
    for name, g, w in zip("qk", got[:2], want[:2]):
        err = float((g.float() - w).abs().max() / w.abs().max())
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
    base_v = p.lora.out[:, -got[2].shape[1] * p.head_dim:].reshape(got[2].shape)
    err = rel_error(got[2], want[2], base_v)
    assert err < TOLERANCE[dtype], f"v: relative error {err:.2e}"
    no_adapter = p.lora.token_slots < 0
    torch.testing.assert_close(got[2][no_adapter], base_v[no_adapter])


@interpreted
@pytest.mark.parametrize("fold", [True, False], ids=["folded-gemm", "base-gemm-and-shrink"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_qkv_rope_matches_reference(layout: str, dtype: torch.dtype, fold: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 rows leave a partial row tile; h_in=80 is not a multiple of the shrink's K tiles
    p = make_qkv_rope_problem(24, 80, 4, 2, 32, num_slots=4, rank=16, dtype=dtype, layout=layout, with_norm=True,
                              seed=len(layout))
    if p.lora.token_slots.unique().ge(0).sum() > 1:
        assert adapters_differ(p.lora), "adapters give equal outputs: the parity test would be vacuous"
    monkeypatch.setattr(qkv_rope, "fold_pays", lambda *shape: fold)
    meta = LoRAMeta(max_tokens=32, num_slots=4, device="cpu", max_rank=16, max_slices=3)
    meta.build(p.lora.token_slots)
    got = run(p, "triton", meta)
    assert [t.shape for t in got] == [(24, 4, 32), (24, 2, 32), (24, 2, 32)]
    check(p, got)


@interpreted
@pytest.mark.parametrize("tokens,heads_q,heads_kv,num_slots,rank,layout,with_norm", [
    (40, 4, 2, 3, 16, "no_adapter", True),  # 3 slots: a 4-wide slot scan; the tiles past the slots' are the null segment's
    (40, 4, 2, 3, 16, "zipf", True),
    (16, 2, 1, 3, 8, "uniform", False),  # no q/k norm (Llama / Qwen2 layout), rank 8
])  # fmt: skip
def test_other_slot_counts_ranks_and_no_norm(tokens: int, heads_q: int, heads_kv: int, num_slots: int, rank: int,
                                             layout: str, with_norm: bool) -> None:
    p = make_qkv_rope_problem(tokens, 64, heads_q, heads_kv, 32, num_slots=num_slots, rank=rank, dtype=torch.float32,
                              layout=layout, with_norm=with_norm)
    check(p, run(p, "triton"))


@interpreted
def test_an_empty_batch_gives_empty_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make_qkv_rope_problem(0, 48, 2, 1, 32, num_slots=2, rank=8, dtype=torch.float32, layout="uniform",
                              with_norm=True)
    for fold in (True, False):
        monkeypatch.setattr(qkv_rope, "fold_pays", lambda *shape, fold=fold: fold)
        assert [t.shape for t in run(p, "triton")] == [(0, 2, 32), (0, 1, 32), (0, 1, 32)]


@interpreted
@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("fold", [True, False], ids=["folded-gemm", "base-gemm-and-shrink"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_k_and_v_go_into_the_cache_as_the_fused_block_returns_them(dtype: torch.dtype, fold: bool,
                                                                   cache: torch.dtype | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 cache holds exactly ``k.to(float8_e4m3fn)`` of the model-dtype k (rounded once more, not from fp32)."""
    p = make_qkv_rope_problem(24, 80, 4, 2, 32, num_slots=4, rank=16, dtype=dtype, layout="zipf", with_norm=True, seed=3)
    monkeypatch.setattr(qkv_rope, "fold_pays", lambda *shape: fold)
    check_kv_cache_write(p, cache_rows=5, cache_len=12, backend="triton", cache_dtype=cache)


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


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_a_cache_that_does_not_fit_the_block_is_refused(backend: str) -> None:
    p = make_qkv_rope_problem(8, 48, 2, 1, 32, num_slots=2, rank=8, dtype=torch.float32, layout="uniform",
                              with_norm=False)
    lora = p.lora
    args = (lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, 32, p.cos, p.sin, None, None, p.eps)
    rows = positions = torch.arange(8)
    cache = torch.zeros(8, 1, 16, 32)
    for bad, match in [
        (KVCacheWrite(cache, torch.zeros(8, 2, 16, 32), rows, positions), "two alike"),
        (KVCacheWrite(cache.half(), cache.half(), rows, positions), "must be torch.float32"),
        (KVCacheWrite(*(cache.to(torch.float8_e5m2),) * 2, rows, positions), "or torch.float8_e4m3fn"),
        (KVCacheWrite(cache, cache, rows[:7], positions), "int64 \\[8\\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            folded_qkv_rope_into_cache(*args, bad, backend=backend)


def test_torch_path_is_the_folded_layer_then_qk_norm_rope() -> None:
    p = make_qkv_rope_problem(10, 48, 2, 1, 32, num_slots=3, rank=8, dtype=torch.float32, layout="no_adapter",
                              with_norm=True)
    check(p, run(p, "torch"))


@interpreted
def test_fused_qkv_rope_rejects_what_its_kernel_cannot_run() -> None:
    p = make_qkv_rope_problem(8, 48, 2, 1, 32, num_slots=2, rank=8, dtype=torch.float32, layout="uniform",
                              with_norm=False)
    lora = p.lora
    with pytest.raises(ValueError, match="power-of-two head dim >= 32, got 16"):
        folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, 16, p.cos, p.sin, None, None,
                        p.eps, backend="triton")
    with pytest.raises(ValueError, match="whole 48-wide heads"):
        folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, 48, p.cos, p.sin, None, None,
                        p.eps, backend="triton")
    with pytest.raises(ValueError, match=r"cos/sin \[8, 32\] \(one row per token\), got \(7, 32\)"):
        folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, 32, p.cos[:7], p.sin, None,
                        None, p.eps, backend="triton")
    with pytest.raises(ValueError, match="both q_weight and k_weight, or neither"):
        folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, 32, p.cos, p.sin,
                        torch.ones(32), None, p.eps, backend="triton")
