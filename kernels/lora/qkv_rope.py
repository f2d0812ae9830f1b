"""The attention block's q/k/v projection with its multi-LoRA expand fused into q/k RMSNorm + rotary.

A folded q/k/v layer (``kernels.lora.folded``) is one GEMM and one segmented expand; at decode sizes the expand is
a launch of its own whose fixed latency alone is about what a 0.35x-of-the-GEMM budget allows (RESULTS.md,
Multi-LoRA kernels vs the base GEMM), and the kernel after it (``qk_norm_rope``) reads the same q and k again. Here one
kernel does both: each program takes ``BLOCK_M`` rows of one slot's segment (``LoRAMeta``) and one head of
q, k or v, adds the rows' LoRA term to the GEMM's output in registers, rounds it to the model dtype (as the
unfused expand's ``y += delta`` does), then applies the per-head RMSNorm and rotary embedding to q and k and
writes q, k and v out: k and v either as new tensors or, for the sampling engine, straight into its slot
K/V cache at each token's (cache row, position) (:class:`KVCacheWrite`; the two scatter kernels that wrote
them there are gone). Rows with no adapter (the null segment) get the norm and rotary alone.

The LoRA partial sums ``h`` come from the folded GEMM's extra columns (one split), or at prefill sizes, where
the fold does not pay, from ``sgmv_shrink``'s split-K partials over the base GEMM; either way they are
addressed ``split * s_split + a * s_slice + row * s_row + slot * s_slot + r`` as in ``sgmv_kernels``.

On the H200 (Qwen3-4B's attention, rank 16; RESULTS.md, Multi-LoRA kernels vs the base GEMM) the fused block adds
less to the q/k/v block than the unfused one at decode sizes and 8 slots, but at 32 slots and 64-256 rows no less:
each program's chain of dependent loads then sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from skyrl_clora.kernels.checks import FP8_CACHE_DTYPE, check_add_lora
from skyrl_clora.kernels.lora.folded import FoldedWeights, fold_pays, folded_meta
from skyrl_clora.kernels.launch import cdiv, dot_flags, next_power_of_2, pdl_flags
from skyrl_clora.kernels.layers.layer_ops import norm_rope, rope_tables
from skyrl_clora.kernels.lora.meta import LoRAMeta, rank_pad
from skyrl_clora.kernels.lora.sgmv import (
    default_config,
    folded_h_layout,
    partials_layout,
    sgmv_shrink,
    shrink_workspace,
)
from skyrl_clora.kernels.lora.sgmv_kernels import segment_rows, tile_of


@dataclass(frozen=True)
class KVCacheWrite:
    """Where an attention block's new keys and values go: token ``t``'s to ``k_cache[rows[t], :, positions[t]]``
    (and ``v_cache``'s). ``k_cache, v_cache: [R, KV, L, d]`` (one layer of a slot K/V cache, unit stride along
    ``d``) in the model dtype or ``torch.float8_e4m3fn`` (k and v are rounded to the model dtype, then cast
    with a scale of 1.0, as vLLM's ``kv_cache_dtype=fp8`` without calibrated scales: values beyond +-448 are out
    of e4m3's range, NaN on the torch path, saturated by the GPU's conversion); ``rows, positions: [T]`` int64."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor


@triton.jit
def _qkv_rope_kernel(
    y_ptr, ws_ptr, bq_ptr, bk_ptr, bv_ptr, scale_ptr, sorted_ptr, count_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    q_out_ptr, k_out_ptr, v_out_ptr, cache_row_ptr, cache_pos_ptr,
    S, T, R, HQ, HK, eps, stride_yt, stride_b_n, stride_b_r, ss_q, ss_k, ss_v,
    stride_ws_split, stride_ws_slice, stride_ws_row, stride_ws_slot, stride_c_row, stride_c_head, stride_c_pos,
    S_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, SPLIT_K: tl.constexpr,
    A_PER_SLICE: tl.constexpr, HAS_NORM: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TO_CACHE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (segment tile ``pid_m``, head ``pid_n`` of ``HQ + 2 * HK``: q's, then k's, then v's); see the
    module docstring. The tiles walk the slots' segments and then the null segment (``tile_of`` over the ``S``
    slots only, whose scan costs every program ``S_P2**2`` steps: past them come the rows from ``sum(counts)``
    to ``T``). With PDL every load but ``y``, ``ws`` (written by the kernels just before) and the q/k norm
    weights happens before ``gdc_wait``. With ``TO_CACHE``, ``k_out_ptr`` / ``v_out_ptr`` are the K/V cache
    layer's and each row's k and v go to its (``cache_row_ptr``, ``cache_pos_ptr``) entry there."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    slot, seg_start, seg_len, m0 = tile_of(pid_m, count_ptr, S, T, S_P2, BLOCK_M, False)
    if slot >= S:  # the null segment: every row with no adapter, after the slots' rows
        seg_len = T - seg_start
    if m0 >= seg_len:
        return
    sl = (head >= HQ).to(tl.int32) + (head >= HQ + HK).to(tl.int32)  # 0: q, 1: k, 2: v
    head_in = head - tl.where(sl == 0, 0, tl.where(sl == 1, HQ, HQ + HK))
    b_ptr, slot_stride, w_ptr, heads = bq_ptr, ss_q, qw_ptr, HQ
    kv_ptr = k_out_ptr  # k's or v's output: a pointer type of its own (an fp8 cache's), so never q's variable
    if sl == 1:
        b_ptr, slot_stride, w_ptr, heads = bk_ptr, ss_k, kw_ptr, HK
    if sl == 2:
        b_ptr, slot_stride, heads = bv_ptr, ss_v, HK
        kv_ptr = v_out_ptr
    rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0, BLOCK_M)
    mask = m_mask[:, None]
    half = tl.arange(0, D // 2)
    offs_r = tl.arange(0, BLOCK_R)
    has_lora = slot < S
    r_mask = (offs_r < R) & has_lora
    b_ptrs = b_ptr + slot * slot_stride + (head_in * D + half)[None, :] * stride_b_n + offs_r[:, None] * stride_b_r
    b1 = tl.load(b_ptrs, mask=r_mask[:, None], other=0.0)  # [BLOCK_R, D/2]
    b2 = tl.load(b_ptrs + (D // 2) * stride_b_n, mask=r_mask[:, None], other=0.0)
    scale = tl.load(scale_ptr + slot, mask=has_lora, other=0.0)
    cos1, cos2, sin1, sin2 = rope_tables(cos_ptr, sin_ptr, rows, mask & (sl < 2), D)  # v is not rotated
    ws_ptrs = ws_ptr + rows[:, None] * stride_ws_row + slot * stride_ws_slot + offs_r[None, :]
    if A_PER_SLICE:
        ws_ptrs += sl * stride_ws_slice
    y_ptrs = y_ptr + rows[:, None] * stride_yt + head * D + half[None, :]
    dst = rows[:, None] * (heads * D) + head_in * D + half[None, :]  # int64 offsets in q, k or v
    if TO_CACHE:
        if sl > 0:  # k or v: to the row's cache entry
            cache_row = tl.load(cache_row_ptr + rows, mask=m_mask, other=0)
            cache_pos = tl.load(cache_pos_ptr + rows, mask=m_mask, other=0)
            entry = cache_row * stride_c_row + cache_pos * stride_c_pos
            dst = entry[:, None] + head_in * stride_c_head + half[None, :]
    if PDL:
        gdc_wait()  # the GEMM's output and the partial sums are complete and visible from here on
    x1 = tl.load(y_ptrs, mask=mask, other=0.0)
    x2 = tl.load(y_ptrs + D // 2, mask=mask, other=0.0)
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        h += tl.load(ws_ptrs + split * stride_ws_split, mask=mask & r_mask[None, :], other=0.0).to(tl.float32)
    h = (h * scale).to(b1.dtype)
    if UPCAST:
        h, b1, b2 = h.to(tl.float32), b1.to(tl.float32), b2.to(tl.float32)
    # y += delta in the model dtype, as the unfused expand writes it
    x1 = (x1.to(tl.float32) + tl.dot(h, b1, input_precision=DOT_PRECISION)).to(x1.dtype).to(tl.float32)
    x2 = (x2.to(tl.float32) + tl.dot(h, b2, input_precision=DOT_PRECISION)).to(x2.dtype).to(tl.float32)
    if sl < 2:
        x1, x2 = norm_rope(x1, x2, w_ptr, cos1, cos2, sin1, sin2, eps, D, HAS_NORM)
    x1, x2 = x1.to(y_ptr.dtype.element_ty), x2.to(y_ptr.dtype.element_ty)  # the model dtype
    if sl == 0:
        tl.store(q_out_ptr + dst, x1, mask=mask)
        tl.store(q_out_ptr + dst + D // 2, x2, mask=mask)
    else:
        if kv_ptr.dtype.element_ty == tl.float8e4nv:  # an fp8 cache: k.to(float8_e4m3fn) of the model-dtype k
            # e4m3's values are exact in the model dtype, so x1, x2 keep their type in both branches of `sl == 0`
            x1 = _e4m3_rounded(x1.to(tl.float32)).to(x1.dtype)
            x2 = _e4m3_rounded(x2.to(tl.float32)).to(x2.dtype)
        tl.store(kv_ptr + dst, x1.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(kv_ptr + dst + D // 2, x2.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_rounded(x):
    """fp32 ``x`` rounded to float8 e4m3's precision, to nearest even (3 mantissa bits; below 2**-6, e4m3's
    subnormals, multiples of 2**-9), so that its cast to ``tl.float8e4nv`` is exact wherever it runs: the same bits
    as torch's ``.to(torch.float8_e4m3fn)`` within e4m3's range (the Triton interpreter's own fp8 rounding rounds
    ties away from zero and drops the carry into the exponent: 1.99 -> 1.0). Beyond +-448 the cast is out of range."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (tl.abs(x) + 24576.0) - 24576.0  # 1.5 * 2**14: the sum's ulp is 2**-9
    return tl.where(tl.abs(x) < 0.015625, tl.where(x < 0, -subnormal, subnormal), normal)  # -0.0 stays signed


def folded_qkv_rope_triton(
    x: torch.Tensor,
    folded: FoldedWeights,
    lora_b: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: KVCacheWrite | None = None,
    meta: LoRAMeta | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton path of ``qkv_dispatch.folded_qkv_rope`` (and, with ``cache``, of ``folded_qkv_rope_into_cache``):
    one GEMM (over the folded weight where ``fold_pays``, else over the base weight followed by
    ``sgmv_shrink``) and one ``_qkv_rope_kernel``. Returns new contiguous ``q: [T, Hq, d]`` and ``k, v: [T, Hk,
    d]``, or with ``cache`` the cache tensors k and v were written into. With ``meta`` (built from
    ``token_slots``) nothing waits for the host; without it a meta is built here (``folded_meta``)."""
    meta = folded_meta(folded, x, token_slots, meta)
    T, K = x.shape
    widths = [b.shape[1] for b in lora_b]
    if len(lora_b) != 3 or widths[1] != widths[2] or any(w % head_dim for w in widths):
        raise ValueError(f"folded_qkv_rope needs q, k, v slices of whole {head_dim}-wide heads with k and v alike, "
                         f"got widths {widths}")
    if head_dim & (head_dim - 1) or head_dim < 32:
        raise ValueError(f"folded_qkv_rope's Triton path needs a power-of-two head dim >= 32, got {head_dim}; "
                         "use backend='torch'")
    if lora_b[1].stride()[1:] != lora_b[0].stride()[1:] or lora_b[2].stride()[1:] != lora_b[0].stride()[1:]:
        raise ValueError("folded_qkv_rope needs the q, k and v LoRA B tables laid out alike along H_out and rank")
    if cos.shape != (T, head_dim) or sin.shape != (T, head_dim):
        raise ValueError(f"folded_qkv_rope needs cos/sin [{T}, {head_dim}] (one row per token), got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("folded_qkv_rope needs both q_weight and k_weight, or neither")
    heads_q, heads_kv = widths[0] // head_dim, widths[1] // head_dim
    q = x.new_empty(T, heads_q, head_dim)
    if cache is None:
        k, v = x.new_empty(T, heads_kv, head_dim), x.new_empty(T, heads_kv, head_dim)
        cache_rows = cache_positions = q  # not read
        cache_strides = (0, 0, 0)
    else:
        check_cache_write(cache, T, heads_kv, head_dim, x)
        k, v, cache_rows, cache_positions = cache.k_cache, cache.v_cache, cache.rows, cache.positions
        cache_strides = (k.stride(0), k.stride(1), k.stride(2))
    if T == 0:
        return q, k, v
    S, R = folded.num_slots, folded.rank
    config = default_config(T, K, S, folded.slices, R)
    if fold_pays(T, folded.out_features, folded.extra_features):
        y = F.linear(x, folded.weight, folded.bias)
        ws = y[:, folded.out_features :].view(T, folded.slices, S, R)
        ws_strides, split_k = folded_h_layout(ws)
    else:
        y = F.linear(x, folded.base_weight, folded.base_bias)
        lora_a = folded.lora_a if folded.slices > 1 else folded.lora_a.unsqueeze(0)
        ws = shrink_workspace(meta, T, K, folded.slices, R, config)
        sgmv_shrink(ws, x, lora_a, meta, R, config)
        ws_strides, split_k = partials_layout(ws)
    check_add_lora(y[:, : folded.out_features], x, folded.lora_a, lora_b, scales, token_slots)
    has_norm = q_weight is not None
    cos, sin = cos.contiguous(), sin.contiguous()
    grid = (cdiv(T, config.block_m) + min(S, T) + 1, heads_q + 2 * heads_kv)
    _qkv_rope_kernel[grid](
        y, ws, lora_b[0], lora_b[1], lora_b[2], scales, meta.sorted_rows, meta.seg_count, cos, sin,
        q_weight if has_norm else y, k_weight if has_norm else y, q, k, v, cache_rows, cache_positions,
        S, T, R, heads_q, heads_kv, eps, y.stride(0), lora_b[0].stride(1), lora_b[0].stride(2),
        lora_b[0].stride(0), lora_b[1].stride(0), lora_b[2].stride(0), *ws_strides, *cache_strides,
        S_P2=next_power_of_2(S), BLOCK_M=config.block_m, BLOCK_R=rank_pad(R), D=head_dim, SPLIT_K=split_k,
        A_PER_SLICE=folded.slices > 1, HAS_NORM=has_norm, **dot_flags(x), TO_CACHE=cache is not None,
        **pdl_flags(x, config.pdl), num_warps=4,
    )  # fmt: skip
    return q, k, v


def check_cache_write(cache: KVCacheWrite, tokens: int, heads_kv: int, head_dim: int, x: torch.Tensor) -> None:
    """``cache`` fits ``tokens`` tokens' k and v of ``heads_kv`` heads of ``head_dim`` on ``x``'s device, in ``x``'s
    dtype or :data:`FP8_CACHE_DTYPE`."""
    k, v = cache.k_cache, cache.v_cache
    if k.shape != v.shape or k.stride() != v.stride() or k.dim() != 4 or k.shape[1:2] + k.shape[3:] != (heads_kv, head_dim):
        raise ValueError(f"the K/V cache must be two alike [rows, {heads_kv}, positions, {head_dim}] tensors, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"the K/V cache must be two tensors of one dtype, got {k.dtype} and {v.dtype}")
    if k.stride(3) != 1 or k.dtype not in (x.dtype, FP8_CACHE_DTYPE) or k.device != x.device:
        raise ValueError(f"the K/V cache must be {x.dtype} or {FP8_CACHE_DTYPE} on {x.device} with unit stride along "
                         "the head dim")
    if cache.rows.shape != (tokens,) or cache.positions.shape != (tokens,) or cache.rows.dtype != torch.long \
            or cache.positions.dtype != torch.long:
        raise ValueError(f"the K/V cache's rows and positions must be int64 [{tokens}], got {tuple(cache.rows.shape)} "
                         f"{cache.rows.dtype} and {tuple(cache.positions.shape)} {cache.positions.dtype}")
