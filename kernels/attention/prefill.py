"""Prefill attention of a ragged pass straight from the KV cache (flash-attention style): Triton kernel and
host wrapper.

A ragged pass is a flat batch of ``T`` query tokens from ``J`` jobs; job ``j``'s queries sit at
``q[q_offsets[j] : q_offsets[j] + q_lens[j]]`` and attend causally to their own cache row
``job_rows[j]`` from position 0 (the pass's own K/V are already written there). The jobs' query tokens are
cut into tiles of ``BLOCK_Q`` tokens, numbered job after job; one program per (tile, kv head) takes the
tile's tokens times the ``GROUPS = H // KV`` query heads sharing the kv head as one ``BLOCK_Q * GROUPS``-row
tile (GQA: the group shares every key load) and runs an online softmax over the job's keys up to the tile's
last query position, ``BLOCK_N`` keys at a time: the key tiles below the tile's first query position need no
causal mask, only the last one or two do. Each program finds its (job, tile) itself from ``q_lens`` (a
cumulative sum of the jobs' tile counts), so the grid, ``(cdiv(T, BLOCK_Q) + J, KV)``, depends only on the
shapes (``sum(cdiv(q_lens, BLOCK_Q)) <= cdiv(T, BLOCK_Q) + J``), programs past the last tile return at
once, and nothing waits for the host: a whole prefill pass is capturable in a CUDA graph and replayable
with new metadata copied into the same tensors.

Paged caches (``block_tables: [R, M]``, caches ``[NB, KV, BS, d]``): job ``j`` reads its keys through table
row ``job_rows[j]``, position ``p`` at ``k_cache[block_tables[job_rows[j], p // BS], :, p % BS]``, with the
logical length ``L = M * BS``; a key tile loads its table entries once (shared by its K and V loads), only
below the tile's last key. One constexpr (``PAGED``) picks the addressing: the slot layout compiles to its
own code.

An fp8 cache (``torch.float8_e4m3fn``, scale 1.0, with a bf16/fp16/fp32 ``q``): each K/V tile is converted to
``q``'s dtype right after its load.

Semantics: ``reference.prefill_attention_ref``; entry point: ``dispatch.prefill_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.attention.decode import MAX_HEAD_DIM, _paged_keys
from skyrl_clora.kernels.checks import PREFILL_METADATA, check_attention_head_dim, check_prefill_attention
from skyrl_clora.kernels.launch import cdiv, next_power_of_2

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of one ``prefill_attention`` call (``default_prefill_config`` picks them)."""

    block_q: int = 32
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_prefill_config(groups: int) -> PrefillConfig:
    """By the query heads per kv head alone: ``block_q`` tokens so that a tile has 64 rows (``block_q *
    groups``, at least 16 tokens: 128 rows for 8 heads per kv head), 8 warps for 128-row tiles. Never by
    the metadata's values, so a job's result does not depend on the other jobs of its pass."""
    block_q = max(16, 64 // next_power_of_2(groups))
    return PrefillConfig(block_q=block_q, num_warps=8 if block_q * groups > 64 else 4)


@triton.jit
def _attend_keys(q, k_base, v_base, table_ptr, row, key_lo, key_hi, q_pos, m, denom, acc, qk_scale, stride_kb,
                 stride_kl, stride_vb, stride_vl, stride_t, offs_n, offs_d, d_ok, CAUSAL: tl.constexpr,
                 INTERPRETED: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """One online-softmax step over keys ``[key_lo, key_lo + BLOCK_N)``; returns the new ``(m, denom, acc)``.
    CAUSAL: keys at or past ``key_hi`` are neither read nor seen, and row ``r`` sees keys ``<= q_pos[r]``;
    else every key of the tile is below ``key_hi`` and seen by every row. PAGED: the keys' blocks come from
    table row ``row`` (read once per tile, below ``key_hi`` only), ``k_base``/``v_base`` point at the kv head
    of block 0; else ``k_base``/``v_base`` point at the kv head of the job's cache row."""
    pos = key_lo + offs_n
    if PAGED:
        # K read as [BLOCK_N, BLOCK_D] like V (the keys' addresses in one layout), then transposed: paged passes
        # lose less time to slot ones than with K read transposed (RESULTS.md, Tried and did not pay).
        blk, off = _paged_keys(table_ptr, row, pos, pos < key_hi, stride_t, BLOCK_SIZE)
        k_ptrs = k_base + (blk * stride_kb + off * stride_kl)[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        v_ptrs = v_base + (blk * stride_vb + off * stride_vl)[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        if CAUSAL:
            n_ok = pos < key_hi
            kt = tl.trans(tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0))
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            kt = tl.trans(tl.load(k_ptrs, mask=d_ok[None, :], other=0.0))
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k_ptrs = k_base + pos[None, :].to(tl.int64) * stride_kl + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
        v_ptrs = v_base + pos[:, None].to(tl.int64) * stride_vl + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        if CAUSAL:
            n_ok = pos < key_hi
            kt = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    kt, v = kt.to(q.dtype), v.to(q.dtype)  # an fp8 cache dequantised (scale 1); INTERPRETED, to fp32
    scores = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # base-2 logits [BLOCK_M, BLOCK_N]
    if CAUSAL:
        scores = tl.where((pos[None, :] <= q_pos[:, None]) & n_ok[None, :], scores, float("-inf"))
    # Every row sees a key of the first tile it processes (position <= the tile's first query), so m is finite.
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, denom, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    out_ptr,
    rows_ptr,
    starts_ptr,
    offsets_ptr,
    lens_ptr,
    T,
    J,
    L,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    stride_ot,
    stride_oh,
    stride_t,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program ``(tile, kv head)``: tile ``t`` is query block ``t - first_tile[j]`` of the job ``j`` whose tiles
    ``[first_tile[j], first_tile[j] + cdiv(q_lens[j], BLOCK_Q))`` hold it. Tile row ``r`` is query ``i =
    block * BLOCK_Q + r // GROUPS`` of the job, head ``kv_head * GROUPS + r % GROUPS``, at cache position
    ``job_starts[j] + i``; writes ``out[q_offsets[j] + i, head] = softmax(q @ K.T * scale) @ V`` over the
    row's keys ``k_cache[job_rows[j], kv_head, :position + 1]`` (positions clamped below ``L``); with PAGED,
    key ``p`` of the job is ``k_cache[table[job_rows[j], p // BLOCK_SIZE], kv_head, p % BLOCK_SIZE]`` (``table``
    rows ``stride_t`` apart, ``L`` its width times ``BLOCK_SIZE``). INTERPRETED: the CPU interpreter, which
    mis-multiplies bf16 operands (they are upcast) and cannot run a for loop to a runtime bound (while loops
    instead)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_j = tl.arange(0, BLOCK_J)
    lens = tl.maximum(tl.load(lens_ptr + offs_j, mask=offs_j < J, other=0).to(tl.int32), 0)
    tiles = (lens + BLOCK_Q - 1) // BLOCK_Q
    ends = tl.cumsum(tiles, axis=0)  # one past each job's last tile
    if tile >= tl.sum(tiles, axis=0):
        return
    job = tl.sum((ends <= tile).to(tl.int32), axis=0)
    q_lo = (tile - tl.sum(tl.where(offs_j == job, ends - tiles, 0), axis=0)) * BLOCK_Q  # the block's first query
    n = tl.sum(tl.where(offs_j == job, lens, 0), axis=0)
    start = tl.load(starts_ptr + job).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    query = q_lo + offs_m // GROUPS  # [BLOCK_M] index of the row's query in the job
    head = kvh * GROUPS + offs_m % GROUPS
    token = tl.load(offsets_ptr + job) + query  # int64 index into q and out
    row_ok = (offs_m < BLOCK_Q * GROUPS) & (query < n) & (token < T)
    q_pos = start + query
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if INTERPRETED:
        q = q.to(tl.float32)
    row = tl.load(rows_ptr + job)
    if PAGED:
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    else:
        k_base = k_ptr + row * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + row * stride_vb + kvh.to(tl.int64) * stride_vh
    key_hi = tl.minimum(start + tl.minimum(q_lo + BLOCK_Q, n), L)  # one past the block's last key
    unmasked = tl.minimum(start + q_lo, L) // BLOCK_N * BLOCK_N  # keys below are seen by every row
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if INTERPRETED:
        key_lo = 0
        while key_lo < unmasked:
            m, denom, acc = _attend_keys(q, k_base, v_base, table_ptr, row, key_lo, key_hi, q_pos, m, denom, acc,
                                         qk_scale, stride_kb, stride_kl, stride_vb, stride_vl, stride_t, offs_n, offs_d,
                                         d_ok, False, INTERPRETED, DOT_PRECISION, PAGED, BLOCK_SIZE)
            key_lo += BLOCK_N
    else:  # a for loop, which the compiler software-pipelines (a while loop it does not)
        for key_lo in range(0, unmasked, BLOCK_N):
            m, denom, acc = _attend_keys(q, k_base, v_base, table_ptr, row, key_lo, key_hi, q_pos, m, denom, acc,
                                         qk_scale, stride_kb, stride_kl, stride_vb, stride_vl, stride_t, offs_n, offs_d,
                                         d_ok, False, INTERPRETED, DOT_PRECISION, PAGED, BLOCK_SIZE)
    key_lo = unmasked
    while key_lo < key_hi:  # the causal tail: one or two key tiles
        m, denom, acc = _attend_keys(q, k_base, v_base, table_ptr, row, key_lo, key_hi, q_pos, m, denom, acc, qk_scale,
                                     stride_kb, stride_kl, stride_vb, stride_vl, stride_t, offs_n, offs_d, d_ok, True,
                                     INTERPRETED, DOT_PRECISION, PAGED, BLOCK_SIZE)
        key_lo += BLOCK_N
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    job_rows: torch.Tensor,
    job_starts: torch.Tensor,
    q_offsets: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    config: PrefillConfig | None = None,
    block_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``prefill_attention`` (semantics: ``reference.prefill_attention_ref``); returns a new ``[T, H, d]``.

    One launch, grid ``(cdiv(T, block_q) + J, KV)``, after zero-filling the output (tokens of no job stay
    zero). Needs unit stride along ``d`` and ``d <= 256``; the metadata's values are not checked (that
    would wait for the host): rows must lie in ``[0, S)`` (with ``block_tables: [R, M]``, ``[0, R)``),
    positions below ``L`` (keys are clamped to ``L``; paged, ``L = M * BS``), each job's tokens inside
    ``[0, T)`` (tokens past ``T`` are not written). Paged, a job reads its table row's entries up to its last
    query's block only. ``config`` overrides ``default_prefill_config`` (benchmarks sweep it). Raises
    ValueError on bad shapes, dtypes or strides.
    """
    check_prefill_attention(q, k_cache, v_cache, job_rows, job_starts, q_offsets, q_lens, block_tables)
    check_attention_head_dim(q, k_cache, v_cache, MAX_HEAD_DIM)
    T, H, D = q.shape
    KV = k_cache.shape[1]
    paged = block_tables is not None
    block_size = k_cache.shape[2] if paged else 1
    L = block_tables.shape[1] * block_size if paged else k_cache.shape[2]
    for name, t in zip(PREFILL_METADATA, (job_rows, job_starts, q_offsets, q_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    cfg = config or default_prefill_config(H // KV)
    if min(cfg.block_q, cfg.block_n) < 16:
        raise ValueError(f"block_q {cfg.block_q} and block_n {cfg.block_n} must be at least 16")
    out = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)
    J = job_rows.shape[0]
    if T == 0 or J == 0:
        return out
    groups = H // KV
    _prefill_kernel[(cdiv(T, cfg.block_q) + J, KV)](
        q, k_cache, v_cache, block_tables if paged else job_rows, out, job_rows, job_starts, q_offsets, q_lens, T, J,
        L, scale * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0) if paged else 0,
        GROUPS=groups, HEAD_DIM=D, BLOCK_Q=cfg.block_q, BLOCK_M=next_power_of_2(cfg.block_q * groups),
        BLOCK_N=cfg.block_n, BLOCK_D=max(16, next_power_of_2(D)), BLOCK_J=next_power_of_2(J),
        INTERPRETED=q.device.type != "cuda", DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PAGED=paged, BLOCK_SIZE=block_size,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
