"""Tests of ``kernels.lora.qkv_rope`` (the q/k/v projection with its LoRA expand fused into q/k norm + rotary): the
Triton kernel (interpreter on the CPU) against the fp32 reference over adapter layouts, on both of its paths (the
folded GEMM's partial sums, and the base GEMM with the split-K shrink), other slot counts and ranks and no q/k norm,
empty batches, k and v written into a slot cache of the model dtype or fp8 as the fused block returns them, the
cache checks (``check_cache_write``) and the kernel's own argument checks; and the kernel's GPU specialisations
compile for sm_90 (``sm90_compile``). tests/gpu/ repeats the parity at Qwen3-4B sizes and in a CUDA graph.
Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

import skyrl_clora.kernels.lora.qkv_rope as qkv_rope
from skyrl_clora.kernels import KVCacheWrite, LoRAMeta, folded_qkv_rope, folded_qkv_rope_into_cache
from tests.support.kernel_cases import (
    CACHE_DTYPES,
    LAYOUTS,
    adapters_differ,
    check_kv_cache_write,
    make_qkv_rope_problem,
)
from tests.support.lora_parity import check_qkv_rope as check
from tests.support.lora_parity import run_qkv_rope as run
from tests.support.markers import interpreted
from tests.support.sm90_compile_runs import sm90_compile_test

test_compiles_for_sm90 = sm90_compile_test("skyrl_clora.kernels.lora.qkv_rope")


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
