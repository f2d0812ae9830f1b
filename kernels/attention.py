"""Decode attention over a slot-based KV cache (flash-decoding): Triton kernels and host wrapper.

One decode step attends each row's single query token to the first ``lengths[b]`` positions of its own
cache row. The keys of a row are cut into fixed splits of ``split_len`` positions; one program per
(split, kv head, row) runs an online softmax over its split for all the query heads that share the kv
head (GQA) and writes a normalised partial output and its log-sum-exp; programs whose split starts at or
past the row's length return at once, so a row costs in proportion to its length, not to ``L``. A second
small kernel combines the partials of each (row, head); on Hopper it is launched with programmatic
dependent launch (it starts while the first finishes, and waits with ``gdc_wait`` before reading the
partials). The grids depend only on ``B``, ``H``, ``KV`` and ``L``, the lengths are read on the device,
and with ``out`` and a :class:`DecodeWorkspace` given nothing is allocated: a decode step is capturable
in a CUDA graph and replayable with new lengths.

Semantics: ``reference.decode_attention_ref``; entry point: ``dispatch.decode_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from skyrl_clora.kernels.checks import check_decode_attention
from skyrl_clora.kernels.sgmv import has_pdl

MAX_HEAD_DIM = 256
# A row's splits at most (bounds the reduce kernel's tile): longer caches get longer splits.
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of one ``decode_attention`` call (``default_attention_config`` picks them)."""

    split_len: int = 256
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pdl: bool = True


def default_attention_config(max_len: int) -> AttentionConfig:
    """Launch parameters by the cache length alone: 256 keys per program (at most ``_MAX_SPLITS`` splits
    per row; longer caches get longer splits). Never by the number of rows or the lengths' values, so a
    row's result is bit-identical whatever the batch around it (the engine's runs stay reproducible when
    the number of decoded rows changes); on the H200 shorter splits gained nothing (BENCHMARKS.md)."""
    return AttentionConfig(split_len=max(256, triton.next_power_of_2(triton.cdiv(max_len, _MAX_SPLITS))))


def _workspace_floats(num_rows: int, num_heads: int, head_dim: int, max_len: int, split_len: int) -> int:
    """Floats of the partials: ``[B, H, splits, d]`` outputs then ``[B, H, splits]`` log-sum-exps."""
    return num_rows * num_heads * triton.cdiv(max_len, split_len) * (head_dim + 1)


class DecodeWorkspace:
    """Float32 scratch for the partial results of ``decode_attention``, allocated once.

    Sized for batches of up to ``max_rows`` rows under the default config (one buffer serves every
    layer, since layers run one after another). Usage::

        ws = DecodeWorkspace(max_rows=512, num_heads=16, max_len=2048, head_dim=128, device="cuda")
        decode_attention(q, k_cache, v_cache, lengths, out=out, workspace=ws)   # no allocation, no host sync
    """

    def __init__(
        self,
        max_rows: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        if min(max_rows, num_heads, max_len, head_dim) < 1:
            raise ValueError(
                f"DecodeWorkspace sizes must be positive, got max_rows={max_rows}, num_heads={num_heads}, "
                f"max_len={max_len}, head_dim={head_dim}"
            )
        numel = _workspace_floats(max_rows, num_heads, head_dim, max_len, default_attention_config(max_len).split_len)
        self.buffer = torch.empty(numel, dtype=torch.float32, device=device)


@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    len_ptr,
    prefix_row_ptr,
    prefix_len_ptr,
    o_ptr,
    lse_ptr,
    H,
    D,
    L,
    NUM_SPLITS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    """For split ``s``, kv head ``j``, row ``b`` and the ``GROUP`` query heads ``h`` of kv head ``j``:
    ``o[b, h, s] = softmax(q[b, h] @ K[b, j, keys].T * scale) @ V[b, j, keys]`` and ``lse[b, h, s]`` (base 2)
    over ``keys = [s * SPLIT_LEN, min((s + 1) * SPLIT_LEN, length))``; nothing if the range is empty.
    HAS_PREFIX: the keys below ``prefix_len[b]`` are read from cache row ``prefix_row[b]`` (rows sharing a
    prefix then read one copy of it, which their programs, close in the grid, find in L2)."""
    if PDL:
        gdc_launch_dependents()
    pid_s = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), L)
    start = pid_s * SPLIT_LEN
    if start >= length:
        return
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = kvh * GROUP + offs_g
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter mis-multiplies bf16 operands
        q = q.to(tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    prefix_row = b
    prefix_len = 0
    if HAS_PREFIX:
        prefix_row = tl.load(prefix_row_ptr + b).to(tl.int32)
        prefix_len = tl.load(prefix_len_ptr + b).to(tl.int32)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for i in range(SPLIT_LEN // BLOCK_N):  # keys past the length are masked (loads of them move no data)
        pos = start + i * BLOCK_N + offs_n
        n_mask = pos < length
        row = tl.where(pos < prefix_len, prefix_row, b).to(tl.int64)  # [BLOCK_N]
        kt = tl.load(
            k_base + row[None, :] * stride_kb + pos[None, :].to(tl.int64) * stride_kl + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        vt = tl.load(
            v_base + row[:, None] * stride_vb + pos[:, None].to(tl.int64) * stride_vl + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            kt, vt = kt.to(tl.float32), vt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # base-2 logits
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the first block holds key `start`
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m = m_new
    row_head = (b * H + heads).to(tl.int64) * NUM_SPLITS + pid_s  # [BLOCK_G]
    tl.store(
        o_ptr + row_head[:, None] * D + offs_d[None, :],
        acc / denom[:, None],
        mask=g_mask[:, None] & d_mask[None, :],
    )
    tl.store(lse_ptr + row_head, m + tl.log2(denom), mask=g_mask)


@triton.jit
def _reduce_kernel(
    o_ptr,
    lse_ptr,
    len_ptr,
    out_ptr,
    H,
    D,
    L,
    NUM_SPLITS,
    stride_ob,
    stride_oh,
    SPLIT_LEN: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[b, h] = sum_s w_s * o[b, h, s] / sum_s w_s`` with ``w_s = 2 ** lse[b, h, s]`` over the row's
    non-empty splits; zeros for a row of length 0."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), L)
    n_valid = (length + SPLIT_LEN - 1) // SPLIT_LEN
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_valid
    d_mask = offs_d < D
    base = (b * H + h).to(tl.int64) * NUM_SPLITS
    if PDL:
        gdc_wait()  # the partials are complete and visible from here on
    lse = tl.load(lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(n_valid > 0, top, 0.0)  # a row of length 0 has no partials: all weights 0
    w = tl.where(s_mask, tl.exp2(lse - top), 0.0)
    o = tl.load(o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    config: AttentionConfig | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``decode_attention`` (semantics: ``reference.decode_attention_ref``); returns ``out``.

    Two launches, grids ``(splits, KV, B)`` and ``(H, B)``. With ``out`` and ``workspace`` given nothing is
    allocated and nothing waits for the host; otherwise they are allocated here. ``config`` overrides
    ``default_attention_config`` (benchmarks sweep it). Raises ValueError on bad shapes, dtypes or strides.
    """
    check_decode_attention(q, k_cache, v_cache, lengths, out, MAX_HEAD_DIM, prefix_rows, prefix_lens)
    B, H, D = q.shape
    KV, L = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    cfg = config or default_attention_config(L)
    if cfg.split_len % cfg.block_n or cfg.block_n < 16:
        raise ValueError(f"split_len {cfg.split_len} must be a multiple of block_n {cfg.block_n} (>= 16)")
    num_splits = triton.cdiv(L, cfg.split_len)
    need = _workspace_floats(B, H, D, L, cfg.split_len)
    if workspace is None:
        buf = torch.empty(need, dtype=torch.float32, device=q.device)
    elif workspace.buffer.numel() < need or workspace.buffer.device != q.device:
        raise ValueError(
            f"the DecodeWorkspace holds {workspace.buffer.numel()} floats on {workspace.buffer.device}, this call "
            f"needs {need} on {q.device}: build it for at least {B} rows, {H} heads, max_len {L}, head_dim {D}"
        )
    else:
        buf = workspace.buffer
    partial_o = buf[: B * H * num_splits * D]
    partial_lse = buf[B * H * num_splits * D : need]
    block_d = max(16, triton.next_power_of_2(D))
    group = H // KV
    on_cpu = q.device.type != "cuda"
    pdl = cfg.pdl and has_pdl(q.device)
    has_prefix = prefix_rows is not None
    _partial_kernel[(num_splits, KV, B)](
        q, k_cache, v_cache, lengths, prefix_rows if has_prefix else lengths, prefix_lens if has_prefix else lengths,
        partial_o, partial_lse, H, D, L, num_splits, _LOG2E / math.sqrt(D),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        SPLIT_LEN=cfg.split_len, UPCAST=on_cpu, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PDL=pdl, HAS_PREFIX=has_prefix, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _reduce_kernel[(H, B)](
        partial_o, partial_lse, lengths, out, H, D, L, num_splits, out.stride(0), out.stride(1),
        SPLIT_LEN=cfg.split_len, SPLITS_P2=triton.next_power_of_2(num_splits), BLOCK_D=block_d, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return out
