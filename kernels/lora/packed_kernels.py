"""Triton kernels of packed multi-LoRA training (``packed`` holds the host side and the autograd function).

Every kernel walks the rows of one slot's segment (``LoRAMeta``) through ``sgmv_kernels.tile_of``: the
forward in tiles of ``BLOCK_M`` rows, the two backward kernels in chunks of ``CHUNK`` rows (a multiple of
``BLOCK_M``, looped over in ``CHUNK // BLOCK_M`` tiles: a compile-time trip count, which the GPU pipelines
and the CPU interpreter can run; tiles past the segment's end are masked out and load nothing). A chunk's
program owns its block of a weight gradient: a slot that fits in one chunk gets its gradient block
written (scaled) by that program; a slot of several chunks gets one float32 partial per chunk, and the
last of its chunks to finish (an atomic count per gradient block, ``LoRAMeta.arrivals``) sums them in
chunk order. No value is accumulated with atomics: results are deterministic.

``PDL`` (Hopper and later): each kernel is launched as a programmatic dependent launch, so that its launch
overlaps the end of the kernel before (``_pdl_start``).

Layouts (all contiguous unless a stride is passed): ``x, dx: [T, K]``, ``dy, y: [T, N]`` (row strides
given), ``A: [S, R, K]``, ``B: [S, N, R]``, ``h, g: [T, BLOCK_R]`` float32 (columns past ``R`` zero),
``gpart: [cdiv(N, BLOCK_N), T, BLOCK_R]`` float32, weight-gradient partials ``[chunks, numel of A[s] or
B[s]]`` float32 in the flat layout of ``A[s]`` / ``B[s]``. ``UPCAST`` (CPU interpreter only) multiplies
in fp32, because the Triton 3.6 interpreter mis-multiplies bf16 operands.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from skyrl_clora.kernels.lora.sgmv_kernels import segment_count, segment_rows, shrink_tile, tile_of


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a @ b`` with an fp32 accumulator (operands upcast first when UPCAST)."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """PDL (programmatic dependent launch): let the next kernel launch now, then wait until the kernel before
    has finished and its writes are visible. Every program calls this first, before any load or store: the
    kernel before may be any kernel (e.g. the base layer's GEMM writing ``y``), and a program that returned
    without waiting could let the next kernel run ahead of the one before."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _store_weight_grad(acc, out_ptr, part_ptr, arrivals_ptr, scale_ptr, slot, chunk, m0, seg_len, offs, mask, numel,
                       CHUNK: tl.constexpr):
    """A chunk's block of a weight gradient (``offs``: flat offsets within one slot's ``numel`` elements).
    If the whole slot's rows are in this chunk: ``out[slot] = scale[slot] * acc``. Else the chunk stores its
    float32 partial ``part[chunk] = acc`` and counts itself in at ``arrivals_ptr`` (this block's counter);
    the slot's last chunk to arrive sums every chunk's partial in chunk order (deterministic), writes
    ``out[slot]`` and sets the counter back to zero for the next launch."""
    if seg_len <= CHUNK:
        acc *= tl.load(scale_ptr + slot)
        tl.store(out_ptr + slot.to(tl.int64) * numel + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + chunk.to(tl.int64) * numel + offs, acc, mask=mask)
        chunks = (seg_len + CHUNK - 1) // CHUNK
        tl.debug_barrier()  # every thread's part of the partial is stored before the count (acq_rel: visible)
        if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            c = chunk - m0 // CHUNK  # the slot's first chunk
            c_end = c + chunks
            total = tl.zeros_like(acc)
            while c < c_end:  # a while loop: the CPU interpreter cannot run a for loop to a runtime bound
                total += tl.load(part_ptr + c.to(tl.int64) * numel + offs, mask=mask, other=0.0, cache_modifier=".cg")
                c += 1
            total *= tl.load(scale_ptr + slot)
            tl.store(out_ptr + slot.to(tl.int64) * numel + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(arrivals_ptr, 0)


@triton.jit
def packed_forward_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    scale_ptr,
    y_ptr,
    h_ptr,
    sorted_ptr,
    count_ptr,
    S,
    T,
    K,
    N,
    R,
    stride_xt,
    stride_yt,
    S_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ITERS: tl.constexpr,
    N_ITERS: tl.constexpr,
    EVEN_K: tl.constexpr,
    STORE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """One tile of a slot's rows: ``h = x[rows] @ A[s].T`` over all of K (stored to ``h``), then
    ``y[rows] (+)= (scale[s] * h) @ B[s].T`` for every column block. STORE: ``=`` instead of ``+=``, and the
    null segment's rows (no adapter) get zeros."""
    _pdl_start(PDL)
    slot, seg_start, seg_len, m0 = tile_of(tl.program_id(0), count_ptr, S, T, S_P2, BLOCK_M, STORE)
    if slot >= segment_count(S, STORE):
        return
    rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    if STORE:
        if slot == S:
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty)
            for nb in range(0, N_ITERS):
                tl.store(y_ptrs + nb * BLOCK_N, zeros, mask=m_mask[:, None] & (nb * BLOCK_N + offs_n < N)[None, :])
            return
    h = shrink_tile(
        x_ptr, a_ptr + slot.to(tl.int64) * R * K, rows, m_mask, 0, K, R, stride_xt, K, 1,
        BLOCK_M, BLOCK_R, BLOCK_K, K_ITERS, EVEN_K, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(h_ptr + rows[:, None] * BLOCK_R + offs_r[None, :], h, mask=m_mask[:, None])
    hs = (h * tl.load(scale_ptr + slot)).to(y_ptr.dtype.element_ty)
    w_ptrs = b_ptr + slot.to(tl.int64) * N * R + offs_r[:, None] + offs_n[None, :] * R  # B[s].T: [BLOCK_R, BLOCK_N]
    for nb in range(0, N_ITERS):
        n_mask = nb * BLOCK_N + offs_n < N
        wt = tl.load(w_ptrs + nb * BLOCK_N * R, mask=(offs_r < R)[:, None] & n_mask[None, :], other=0.0)
        delta = _dot(hs, wt, UPCAST, DOT_PRECISION)
        o_mask = m_mask[:, None] & n_mask[None, :]
        if STORE:
            tl.store(y_ptrs + nb * BLOCK_N, delta.to(y_ptr.dtype.element_ty), mask=o_mask)
        else:
            o = tl.load(y_ptrs + nb * BLOCK_N, mask=o_mask, other=0.0)
            tl.store(y_ptrs + nb * BLOCK_N, (o.to(tl.float32) + delta).to(o.dtype), mask=o_mask)


@triton.jit
def packed_dy_kernel(
    dy_ptr,
    b_ptr,
    h_ptr,
    gpart_ptr,
    db_ptr,
    dbpart_ptr,
    arrivals_ptr,
    scale_ptr,
    sorted_ptr,
    count_ptr,
    S,
    T,
    N,
    R,
    stride_dyt,
    S_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_DB: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (chunk c of slot s, column block n) reads ``dy[rows, n]`` once for both products:
    HAS_G: ``gpart[n, rows] = dy[rows, n] @ B[s, n]`` (unscaled; ``g = gpart.sum(0)``);
    HAS_DB: ``dB[s, n] = scale[s] * dy[rows, n].T @ h[rows]`` over the chunk (``_store_weight_grad``)."""
    _pdl_start(PDL)
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, seg_start, seg_len, m0 = tile_of(pid_c, count_ptr, S, T, S_P2, CHUNK, False)
    if slot >= S:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    w_mask = n_mask[:, None] & (offs_r < R)[None, :]
    w_offs = offs_n[:, None] * R + offs_r[None, :]  # [BLOCK_N, BLOCK_R] in B[s]'s flat layout
    if HAS_G:
        wt = tl.load(b_ptr + slot.to(tl.int64) * N * R + w_offs, mask=w_mask, other=0.0)
    gpart_ptr += pid_n.to(tl.int64) * T * BLOCK_R
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for i in range(0, CHUNK // BLOCK_M):
        rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0 + i * BLOCK_M, BLOCK_M)
        d = tl.load(dy_ptr + rows[:, None] * stride_dyt + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        if HAS_G:
            gp = _dot(d, wt, UPCAST, DOT_PRECISION)
            tl.store(gpart_ptr + rows[:, None] * BLOCK_R + offs_r[None, :], gp, mask=m_mask[:, None])
        if HAS_DB:
            ht = tl.load(h_ptr + rows[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
            acc += _dot(tl.trans(d), ht.to(d.dtype), UPCAST, DOT_PRECISION)
    if HAS_DB:
        arrivals_ptr += slot * tl.num_programs(1) + pid_n
        _store_weight_grad(acc, db_ptr, dbpart_ptr, arrivals_ptr, scale_ptr, slot, pid_c, m0, seg_len, w_offs, w_mask,
                           N * R, CHUNK)


@triton.jit
def _dx_chunk(g_ptr, a_ptr, dx_ptr, scale_ptr, sorted_ptr, slot, seg_start, seg_len, m0, offs_k, k_mask, offs_r, S, K, R,
              stride_dxt, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
              STORE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``dx[rows, k] (+)= (scale[s] * g[rows]) @ A[s, :, k]`` for a chunk's rows; STORE: ``=``, and zeros
    for the null segment (``slot == S``)."""
    if slot == S:
        zeros = tl.zeros([BLOCK_M, BLOCK_K], dtype=dx_ptr.dtype.element_ty)
        for i in range(0, CHUNK // BLOCK_M):
            rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0 + i * BLOCK_M, BLOCK_M)
            tl.store(dx_ptr + rows[:, None] * stride_dxt + offs_k[None, :], zeros, mask=m_mask[:, None] & k_mask[None, :])
    else:
        a_ptrs = a_ptr + slot.to(tl.int64) * R * K + offs_r[:, None] * K + offs_k[None, :]
        at = tl.load(a_ptrs, mask=(offs_r < R)[:, None] & k_mask[None, :], other=0.0)
        scale = tl.load(scale_ptr + slot)
        for i in range(0, CHUNK // BLOCK_M):
            rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0 + i * BLOCK_M, BLOCK_M)
            gt = tl.load(g_ptr + rows[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
            delta = _dot((gt * scale).to(at.dtype), at, UPCAST, DOT_PRECISION)
            o_ptrs = dx_ptr + rows[:, None] * stride_dxt + offs_k[None, :]
            o_mask = m_mask[:, None] & k_mask[None, :]
            if STORE:
                tl.store(o_ptrs, delta.to(dx_ptr.dtype.element_ty), mask=o_mask)
            else:
                o = tl.load(o_ptrs, mask=o_mask, other=0.0)
                tl.store(o_ptrs, (o.to(tl.float32) + delta).to(o.dtype), mask=o_mask)


@triton.jit
def packed_x_kernel(
    x_ptr,
    a_ptr,
    g_ptr,
    dx_ptr,
    da_ptr,
    dapart_ptr,
    arrivals_ptr,
    scale_ptr,
    sorted_ptr,
    count_ptr,
    S,
    T,
    K,
    R,
    stride_xt,
    stride_dxt,
    S_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DA: tl.constexpr,
    STORE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (chunk c of slot s, column block k, job j), the jobs being dA (if HAS_DA) then dx (if HAS_DX),
    each on its own programs (lighter programs, twice as many; neither reads what the other does):
    dA: reads ``x[rows, k]`` once: ``dA[s, :, k] = scale[s] * g[rows].T @ x[rows, k]`` over the chunk;
    dx: ``dx[rows, k] (+)= (scale[s] * g[rows]) @ A[s, :, k]``. STORE (HAS_DX only): ``=`` instead of
    ``+=``, and the null segment's rows get zeros."""
    _pdl_start(PDL)
    pid_c = tl.program_id(0)
    pid_k = tl.program_id(1)
    slot, seg_start, seg_len, m0 = tile_of(pid_c, count_ptr, S, T, S_P2, CHUNK, STORE)
    if slot >= segment_count(S, STORE):
        return
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    k_mask = offs_k < K
    if HAS_DX:
        job = 1
        if HAS_DA:
            job = tl.program_id(2)
        if job == 1:
            _dx_chunk(g_ptr, a_ptr, dx_ptr, scale_ptr, sorted_ptr, slot, seg_start, seg_len, m0, offs_k, k_mask, offs_r,
                      S, K, R, stride_dxt, CHUNK, BLOCK_M, BLOCK_K, BLOCK_R, STORE, UPCAST, DOT_PRECISION)
            return
    if slot < S:  # dA (the null segment has none)
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for i in range(0, CHUNK // BLOCK_M):
            rows, m_mask = segment_rows(sorted_ptr, seg_start, seg_len, m0 + i * BLOCK_M, BLOCK_M)
            gt = tl.load(g_ptr + rows[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
            xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            acc += _dot(tl.trans(gt.to(xt.dtype)), xt, UPCAST, DOT_PRECISION)
        a_mask = (offs_r < R)[:, None] & k_mask[None, :]
        a_offs = offs_r[:, None] * K + offs_k[None, :]  # [BLOCK_R, BLOCK_K] in A[s]'s flat layout
        arrivals_ptr += slot * tl.num_programs(1) + pid_k
        _store_weight_grad(acc, da_ptr, dapart_ptr, arrivals_ptr, scale_ptr, slot, pid_c, m0, seg_len, a_offs, a_mask,
                           R * K, CHUNK)


@triton.jit
def _zero_if_empty(out_ptr, count_ptr, pid, numel, BLOCK: tl.constexpr):
    """Block ``pid % cdiv(numel, BLOCK)`` of slot ``pid // cdiv(numel, BLOCK)``'s weight gradient: zeros if the
    slot has no rows (no program of the backward kernels maps to it); other slots' are the kernels' own."""
    blocks = tl.cdiv(numel, BLOCK)
    slot = pid // blocks
    offs = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    if tl.load(count_ptr + slot) == 0:
        tl.store(out_ptr + slot.to(tl.int64) * numel + offs, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty),
                 mask=offs < numel)


@triton.jit
def packed_finish_kernel(
    gpart_ptr,
    g_ptr,
    db_ptr,
    da_ptr,
    count_ptr,
    numel_g,
    numel_b,
    numel_a,
    programs_g,
    programs_b,
    G_SPLITS: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_A: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Up to three jobs in one launch, between the dy and the x kernel, each on its own range of programs, in
    this order: HAS_G, ``g = gpart.sum(0)`` (flat, ``numel_g`` elements, ``BLOCK_G`` per program;
    ``programs_g`` programs; the rows with no slot sum partials nobody wrote, so their ``g`` is garbage,
    possibly NaN, and no kernel reads it: the x kernel skips the null segment or writes its dx as zeros);
    HAS_B and HAS_A, ``_zero_if_empty`` of dB (``programs_b`` programs) and of dA, ``BLOCK`` elements per
    program."""
    _pdl_start(PDL)
    pid = tl.program_id(0)
    if HAS_G:
        if pid < programs_g:
            offs = pid * BLOCK_G + tl.arange(0, BLOCK_G)
            mask = offs < numel_g
            acc = tl.zeros([BLOCK_G], dtype=tl.float32)
            part_ptrs = gpart_ptr + offs
            for _ in tl.static_range(G_SPLITS):  # unrolled: every load in flight at once
                acc += tl.load(part_ptrs, mask=mask, other=0.0)
                part_ptrs += numel_g
            tl.store(g_ptr + offs, acc, mask=mask)
            return
        pid -= programs_g
    if HAS_B:
        if pid < programs_b:
            _zero_if_empty(db_ptr, count_ptr, pid, numel_b, BLOCK)
            return
        pid -= programs_b
    if HAS_A:
        _zero_if_empty(da_ptr, count_ptr, pid, numel_a, BLOCK)
