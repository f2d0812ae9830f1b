"""Packed multi-LoRA training: several adapters' rows in one batch, forward and backward in a few launches.

The forward is the segmented shrink and expand of ``sgmv``; the backward adds a segmented reduction over
each slot's rows for the weight gradients. One backward yields the gradients of every adapter's A and B
and of ``x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.checks import check_frozen_base, check_packed
from skyrl_clora.kernels.host_math import cdiv, next_power_of_2
from skyrl_clora.kernels.meta import LoRAMeta, rank_pad
from skyrl_clora.kernels.sgmv import check_meta, default_config, sgmv_expand, sgmv_shrink

# Column tile and row tile of the weight-gradient kernel.
_GRAD_BLOCK = 128
_GRAD_ROWS = 64
# Row splits of the weight-gradient kernel (``_row_splits``): at least this many batch rows per split, a target
# of programs (about four waves on an H200's 132 multiprocessors), and a cap (each split adds an fp32
# [S, DP, DQ] partial to the workspace).
_SPLIT_ROWS = 512
_SPLIT_TARGET_PROGRAMS = 528
_MAX_SPLITS = 32
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _seg_outer_kernel(
    p_ptr,
    q_ptr,
    out_ptr,
    scale_ptr,
    sorted_ptr,
    start_ptr,
    count_ptr,
    splits,
    DP,
    DQ,
    stride_pt,
    stride_qt,
    stride_o_split,
    stride_o_slot,
    stride_o_p,
    stride_o_q,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[j, s, p, q] = scale[s] * sum over the rows t of chunk j of slot s of P[t, p] * Q[t, q]``, one
    block per program, grid axis 0 being ``s * splits + j``; operands cast to ``DOT_DTYPE``, fp32 accumulate.
    Slot ``s``'s ``n`` rows are cut into ``splits`` chunks of ``cdiv(cdiv(n, splits), BLOCK_M) * BLOCK_M`` rows
    (the last shorter, any beyond ``n`` empty: their block is written as zeros)."""
    slot = tl.program_id(0) // splits
    split = tl.program_id(0) % splits
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = offs_p < DP
    q_mask = offs_q < DQ
    seg_start = tl.load(start_ptr + slot)
    seg_len = tl.load(count_ptr + slot)
    chunk = tl.cdiv(tl.cdiv(seg_len, splits), BLOCK_M) * BLOCK_M
    m0 = split * chunk
    m_end = tl.minimum(m0 + chunk, seg_len)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    while m0 < m_end:  # a while loop: the CPU interpreter cannot run a for loop to a runtime bound
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < m_end
        rows = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
        pt = tl.load(
            p_ptr + rows[None, :] * stride_pt + offs_p[:, None],
            mask=m_mask[None, :] & p_mask[:, None],
            other=0.0,
        )
        qt = tl.load(
            q_ptr + rows[:, None] * stride_qt + offs_q[None, :],
            mask=m_mask[:, None] & q_mask[None, :],
            other=0.0,
        )
        pt, qt = pt.to(DOT_DTYPE), qt.to(DOT_DTYPE)
        if UPCAST:  # the CPU interpreter mis-multiplies bf16 operands
            pt, qt = pt.to(tl.float32), qt.to(tl.float32)
        acc += tl.dot(pt, qt, input_precision=DOT_PRECISION)
        m0 += BLOCK_M
    acc *= tl.load(scale_ptr + slot)
    out_ptr += split * stride_o_split + slot * stride_o_slot
    out_ptrs = out_ptr + offs_p[:, None] * stride_o_p + offs_q[None, :] * stride_o_q
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])


def _row_splits(num_rows: int, tiles: int) -> int:
    """Chunks each slot's rows are cut into by ``_seg_outer``: the fewest that give ``tiles`` (column tiles
    per slot) times splits at least ``_SPLIT_TARGET_PROGRAMS`` programs, but no more than ``num_rows //
    _SPLIT_ROWS`` (1 below ``2 * _SPLIT_ROWS`` rows) nor ``_MAX_SPLITS``. Based on the batch's row count,
    not on the slots: one busy slot is the case to fill the GPU for, and the host does not know the segment
    lengths."""
    return max(1, min(cdiv(_SPLIT_TARGET_PROGRAMS, tiles), num_rows // _SPLIT_ROWS, _MAX_SPLITS))


def _seg_outer(g: torch.Tensor, p: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, meta: LoRAMeta) -> None:
    """Writes ``g[s] = scales[s] * p[rows_s].T @ q[rows_s]`` for every slot (zeros for an empty slot).

    ``p: [T, DP]``, ``q: [T, DQ]`` with unit feature stride (any float dtypes: cast to ``g``'s);
    ``g: [S, DP, DQ]`` any strides, written in full. With ``splits = _row_splits(T, tiles) > 1`` the kernel
    writes per-chunk partials to a float32 workspace ``[splits, S, DP, DQ]`` and their sum is copied to ``g``.
    """
    S, DP, DQ = g.shape
    block_p = min(_GRAD_BLOCK, max(16, next_power_of_2(DP)))
    block_q = min(_GRAD_BLOCK, max(16, next_power_of_2(DQ)))
    tiles_p, tiles_q = cdiv(DP, block_p), cdiv(DQ, block_q)
    splits = _row_splits(p.shape[0], tiles_p * tiles_q)
    out = g.unsqueeze(0) if splits == 1 else g.new_empty(splits, S, DP, DQ, dtype=torch.float32)
    _seg_outer_kernel[(S * splits, tiles_p, tiles_q)](
        p, q, out, scales, meta.sorted_rows, meta.seg_start, meta.seg_count, splits, DP, DQ,
        p.stride(0), q.stride(0), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        BLOCK_M=_GRAD_ROWS, BLOCK_P=block_p, BLOCK_Q=block_q, DOT_DTYPE=_TL_DTYPE[g.dtype],
        UPCAST=p.device.type != "cuda", DOT_PRECISION="ieee" if g.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        g.copy_(out.sum(0))


def _shrink(x: torch.Tensor, w: torch.Tensor, meta: LoRAMeta, rank: int) -> torch.Tensor:
    """``h[0, 0, t, :rank] = x[t] @ w[0, slot(t)].T`` as float32 ``[1, 1, T, rank_pad(rank)]`` (split-K partials
    summed); rows with no slot hold garbage and are never read."""
    T, K = x.shape
    cfg = default_config(T, K, w.shape[1], 1, rank)
    ws = x.new_empty(cfg.split_k, 1, T, rank_pad(rank), dtype=torch.float32)
    if T > 0:
        sgmv_shrink(ws, x, w, meta, rank, cfg)
    return ws.sum(0, keepdim=True) if cfg.split_k > 1 else ws


class PackedLoRAFunction(torch.autograd.Function):
    """``y = packed_lora(x, A, B, scales, meta)`` with a backward that gives dx, dA and dB in four launches
    (plus a sum of split-K partials after each shrink and, for large batches, of row-split partials after each
    weight gradient); with a frozen base ``weight`` (and ``bias``), the whole LoRA linear layer
    ``x @ weight.T + bias + packed_lora(x, ...)`` in one node: the LoRA terms are added into the base
    GEMMs' outputs (forward and dx) by the expand kernel, instead of two more element-wise passes.

    Forward, for ``x: [T, H_in]``, ``A: [P, R, H_in]``, ``B: [P, H_out, R]``, ``s = slot(t)``::

        h[t] = x[t] @ A[s].T                      # [T, R] fp32, saved for backward
        y[t] = scales[s] * h[t] @ B[s].T          # [T, H_out], zero for rows with no slot (written, not added)
        y += x @ weight.T + bias                  # with a base layer

    Backward, for ``dy: [T, H_out]``::

        g[t]  = dy[t] @ B[s]                      # [T, R] fp32 (unscaled)
        dx[t] = scales[s] * g[t] @ A[s]           # zero for rows with no slot
        dx   += dy @ weight                       # with a base layer
        dA[p] = scales[p] * g[rows_p].T @ x[rows_p]
        dB[p] = scales[p] * dy[rows_p].T @ h[rows_p]

    ``scales``, ``weight`` and ``bias`` get no gradient. Forward keeps a snapshot of the meta's index
    buffers, so a later ``meta.build`` (the next micro-batch) cannot change what backward reads.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        meta: LoRAMeta,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        R = lora_a.shape[1]
        saved = meta.snapshot()
        base = weight is not None
        # The base GEMM runs before the shrink: an expand launched with PDL may start while the kernel just
        # before it runs (sgmv_expand), so that kernel must not be the one writing y.
        y = torch.nn.functional.linear(x, weight, bias) if base else x.new_empty(x.shape[0], lora_b.shape[1])
        h = _shrink(x, lora_a.unsqueeze(0), saved, R)
        if x.shape[0] > 0:
            cfg = default_config(x.shape[0], x.shape[1], lora_a.shape[0], 1, R)
            sgmv_expand(y, h, (lora_b,), scales, saved, R, cfg, store=not base)
        ctx.save_for_backward(x, lora_a, lora_b, scales, weight)
        ctx.h, ctx.meta, ctx.rank = h, saved, R
        return y

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, lora_a, lora_b, scales, weight = ctx.saved_tensors
        h, meta, R = ctx.h, ctx.meta, ctx.rank
        dy = dy.contiguous()
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        if x.shape[0] == 0:  # (scales, meta, weight and bias never get gradients)
            return (
                torch.empty_like(x) if need_x else None,
                torch.zeros_like(lora_a) if need_a else None,
                torch.zeros_like(lora_b) if need_b else None,
                None, None, None, None,
            )
        dx = da = db = None
        if need_x:  # the base GEMM before the shrink, as in forward
            dx = dy @ weight if weight is not None else torch.empty_like(x)
        if need_x or need_a:
            g = _shrink(dy, lora_b.transpose(1, 2).unsqueeze(0), meta, R)
            if need_x:
                cfg = default_config(x.shape[0], dy.shape[1], lora_a.shape[0], 1, R)
                sgmv_expand(dx, g, (lora_a.transpose(1, 2),), scales, meta, R, cfg, store=weight is None)
            if need_a:
                da = torch.empty_like(lora_a)
                _seg_outer(da, g[0, 0, :, :R], x, scales, meta)
        if need_b:
            db = torch.empty_like(lora_b)
            _seg_outer(db, dy, h[0, 0, :, :R], scales, meta)
        return dx, da, db, None, None, None, None


def packed_lora_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    meta: LoRAMeta | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``packed_lora`` (semantics: ``reference.packed_lora_ref``); returns a new ``[T, H_out]``. With
    a frozen base ``weight: [H_out, H_in]`` (and ``bias: [H_out]``), the whole layer: that plus
    ``x @ weight.T + bias``.

    ``meta``, if given, must have been built from ``token_slots`` (``meta.build(token_slots)``).
    """
    check_packed(x, lora_a, lora_b, scales, token_slots)
    if weight is not None:
        if weight.shape != (lora_b.shape[1], x.shape[1]) or weight.dtype != x.dtype or weight.device != x.device:
            raise ValueError(f"the base weight must be [{lora_b.shape[1]}, {x.shape[1]}] {x.dtype} on {x.device}, "
                             f"got {tuple(weight.shape)} {weight.dtype} {weight.device}")
        check_frozen_base(weight, bias)
    if meta is None:
        meta = LoRAMeta.for_batch(token_slots, lora_a.shape[0], lora_a.shape[1], 1)
    check_meta(meta, x, lora_a.shape[0])
    return PackedLoRAFunction.apply(x, lora_a, lora_b, scales, meta, weight, bias)
