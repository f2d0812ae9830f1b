"""Triton kernels of the segmented multi-LoRA ops (SGMV family); ``sgmv`` holds their host wrappers.

The grid's first axis walks tiles of ``BLOCK_M`` rows of one slot's segment (``LoRAMeta``); a program
finds its slot from the per-slot counts, so the grid size depends only on shapes (``cdiv(T, BLOCK_M) +
min(S, T)`` tiles bound every layout) and a step is capturable in a CUDA graph. Programs past the last
tile return at once. Rows with no adapter are never read, and never written except by the expand
kernel's STORE mode, which zeroes them (training outputs are written, not added). Kernels validate
nothing (the wrappers do). ``UPCAST`` (CPU interpreter only) multiplies in fp32, because the Triton 3.6
interpreter mis-multiplies bf16 operands.

``PDL`` (Hopper and later, decode sizes): programmatic dependent launch. The shrink lets the expand launch
as soon as every shrink program has started; the expand loads its metadata, weight tile and output tile
(none of which the shrink writes), then waits for the shrink to finish (``gdc_wait``) before reading the
partial sums. This hides the second launch's latency, the one cost left between two small launches.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from skyrl_clora.kernels.lora.meta import inclusive_cumsum


@triton.jit
def tile_of(pid_m, count_ptr, S, T, S_P2: tl.constexpr, BLOCK_M: tl.constexpr, WITH_NULL: tl.constexpr):
    """Maps tile ``pid_m`` to (slot, segment start, segment length, first row in the segment).

    Tiles are numbered slot by slot; a slot of ``c`` rows has ``cdiv(c, BLOCK_M)`` tiles. WITH_NULL adds
    the null segment (rows with no adapter, ``LoRAMeta``) as slot ``S``; it needs ``S_P2 > S`` and the
    batch size ``T``. Past the last tile the returned slot is ``>= S`` (``> S`` WITH_NULL). Keep ``S_P2``
    as small as allowed: every program sums an ``S_P2 x S_P2`` triangle, and doubling it (64 for 32
    slots) made decode-sized launches slower on the H200 (RESULTS.md, Multi-LoRA kernels vs the base GEMM).
    The segment's start and length come from the counts already loaded (no second dependent load).
    """
    sid = tl.arange(0, S_P2)
    counts = tl.load(count_ptr + sid, mask=sid < S, other=0)
    if WITH_NULL:
        counts = tl.where(sid == S, T - tl.sum(counts, axis=0), counts)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    slot = tl.sum((inclusive_cumsum(tiles, sid) <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(sid < slot, tiles, 0), axis=0)
    seg_start = tl.sum(tl.where(sid < slot, counts, 0), axis=0)
    seg_len = tl.sum(tl.where(sid == slot, counts, 0), axis=0)
    return slot, seg_start, seg_len, (pid_m - first_tile) * BLOCK_M


@triton.jit
def segment_count(S, WITH_NULL: tl.constexpr):
    """The segments ``tile_of`` walks: the ``S`` slots' and, WITH_NULL, the null segment (a tile whose slot
    is at or past this count is past the last tile)."""
    num_segments = S
    if WITH_NULL:
        num_segments = S + 1
    return num_segments


@triton.jit
def segment_rows(sorted_ptr, seg_start, seg_len, m0, BLOCK_M: tl.constexpr):
    """Rows ``m0 .. m0 + BLOCK_M`` of a segment: (int64 row indices, mask of those inside the segment)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def shrink_tile(
    x_ptr,
    w_ptr,
    rows,
    m_mask,
    k_lo,
    K,
    R,
    stride_xt,
    stride_w_r,
    stride_w_k,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``x[rows, k_lo:k_lo+K_ITERS*BLOCK_K] @ w[:R, same].T`` as fp32 ``[BLOCK_M, BLOCK_R]`` (w at its slot).

    Columns at or past ``K`` count as zero unless EVEN_K says the range lies inside ``K``. The trip count
    is a compile-time constant (also because the CPU interpreter cannot loop to a runtime bound).
    """
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xt + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_r[None, :] * stride_w_r + (k_lo + offs_k)[:, None].to(tl.int64) * stride_w_k
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for kk in range(0, K_ITERS):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=r_mask[None, :], other=0.0)
        else:
            k_mask = k_lo + kk * BLOCK_K + offs_k < K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:
            xt, wt = xt.to(tl.float32), wt.to(tl.float32)
        acc += tl.dot(xt, wt, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k
    return acc


@triton.jit
def slice_of(pid_n, nb1, nb2, n0, n1, n2, col1, col2, ss0, ss1, ss2, NUM_SLICES: tl.constexpr):
    """Output slice of column block ``pid_n``: (index, block within the slice, width, column, slot stride)."""
    sl = (pid_n >= nb1).to(tl.int32) + (pid_n >= nb2).to(tl.int32)
    first = tl.where(sl == 2, nb2, tl.where(sl == 1, nb1, 0))
    width = tl.where(sl == 2, n2, tl.where(sl == 1, n1, n0))
    col = tl.where(sl == 2, col2, tl.where(sl == 1, col1, 0))
    slot_stride = tl.where(sl == 2, ss2, tl.where(sl == 1, ss1, ss0))
    return sl, pid_n - first, width, col, slot_stride


@triton.jit
def shrink_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    sorted_ptr,
    count_ptr,
    S,
    K,
    R,
    stride_xt,
    stride_w_slice,
    stride_w_slot,
    stride_w_r,
    stride_w_k,
    stride_ws_split,
    stride_ws_slice,
    S_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``ws[split, a, row, :R] = x[row, K-range of split] @ w[a, slot(row), :R, K-range].T`` (fp32 partials)."""
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_a = tl.program_id(2)
    slot, seg_start, seg_len, m0 = tile_of(pid_m, count_ptr, S, 0, S_P2, BLOCK_M, False)
    if slot >= S:
        return
    rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0, BLOCK_M)
    w_slot = w_ptr + pid_a * stride_w_slice + slot * stride_w_slot
    acc = shrink_tile(
        x_ptr, w_slot, rows, m_mask, pid_k * K_ITERS * BLOCK_K, K, R, stride_xt, stride_w_r, stride_w_k,
        BLOCK_M, BLOCK_R, BLOCK_K, K_ITERS, EVEN_K, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    ws_ptrs = ws_ptr + pid_k * stride_ws_split + pid_a * stride_ws_slice
    tl.store(ws_ptrs + rows[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def expand_kernel(
    ws_ptr,
    out_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    scale_ptr,
    sorted_ptr,
    count_ptr,
    S,
    T,
    R,
    n0,
    n1,
    n2,
    col1,
    col2,
    nb1,
    nb2,
    ss0,
    ss1,
    ss2,
    stride_w_n,
    stride_w_r,
    stride_ot,
    stride_ws_split,
    stride_ws_slice,
    stride_ws_row,
    stride_ws_slot,
    S_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    A_PER_SLICE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    STORE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    LATE_OUT: tl.constexpr = False,
):
    """``out[row, col_i + n] += scale[slot] * sum_split(ws[split, a_i, row, slot]) @ w_i[slot, n, :R].T``.

    ``ws`` is addressed ``split * stride_ws_split + a_i * stride_ws_slice + row * stride_ws_row + slot *
    stride_ws_slot + r`` (the shrink's fp32 partials have slot stride 0; a folded GEMM's output columns hold
    every slot's ``h``). Only its first ``R`` rank columns are read. STORE: ``=`` instead of ``+=``, and rows
    with no adapter (the null segment) are set to zero. PDL: all loads but the partial sums happen before
    ``gdc_wait``; LATE_OUT also keeps the load of ``out`` after it (the kernel before wrote ``out``).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, seg_start, seg_len, m0 = tile_of(pid_m, count_ptr, S, T, S_P2, BLOCK_M, STORE)
    if slot >= segment_count(S, STORE):
        return
    sl, nb, width, col, slot_stride = slice_of(
        pid_n, nb1, nb2, n0, n1, n2, col1, col2, ss0, ss1, ss2, NUM_SLICES
    )
    rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0, BLOCK_M)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    o_ptrs = out_ptr + rows[:, None] * stride_ot + col + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if slot == S:
        tl.store(o_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=o_mask)
        return
    w_ptr = w0_ptr
    if NUM_SLICES > 1:
        if sl == 1:
            w_ptr = w1_ptr
        if sl == 2:
            w_ptr = w2_ptr
    offs_r = tl.arange(0, BLOCK_R)
    w_ptrs = w_ptr + slot * slot_stride + offs_r[:, None] * stride_w_r + offs_n[None, :] * stride_w_n
    wt = tl.load(w_ptrs, mask=(offs_r < R)[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
    if not STORE and not LATE_OUT:
        o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + slot)
    ws_ptrs = ws_ptr + rows[:, None] * stride_ws_row + slot * stride_ws_slot + offs_r[None, :]
    if A_PER_SLICE:
        ws_ptrs += sl * stride_ws_slice
    ws_mask = m_mask[:, None] & (offs_r < R)[None, :]
    if PDL:
        gdc_wait()  # the partial sums (and, LATE_OUT, out) are complete and visible from here on
    if not STORE and LATE_OUT:
        o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        h += tl.load(ws_ptrs + split * stride_ws_split, mask=ws_mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        h *= scale
    h = h.to(wt.dtype)
    if UPCAST:
        h, wt = h.to(tl.float32), wt.to(tl.float32)
    delta = tl.dot(h, wt, input_precision=DOT_PRECISION)
    if STORE:
        tl.store(o_ptrs, delta.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, (o.to(tl.float32) + delta).to(o.dtype), mask=o_mask)
