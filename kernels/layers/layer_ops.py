"""Fused per-layer element-wise ops of a Qwen3/Llama decoder: Triton kernels and host wrappers.

A decode step of a small batch is bound by the number of kernels, not by their arithmetic: Hugging Face's
modules run RMSNorm as ~8 kernels, the rotary embedding as ~10 and the MLP activation as 2. These fuse each
into one launch:

- ``rms_norm_triton``: optional residual add, then RMSNorm (a tile of rows per program, see ``row_tile``);
- ``qk_norm_rope_triton``: per-head RMSNorm of q and k (Qwen3's ``q_norm``/``k_norm``, optional) and the
  rotary embedding, for all heads of q and k in one launch (a tile of (token, head) rows per program);
- ``silu_mul_triton``: ``silu(gate) * up``.

They compute in fp32 and round once to the model dtype (Hugging Face rounds after each op, so results
differ in the last bits). Semantics: ``reference.rms_norm_ref``, ``reference.qk_norm_rope_ref``,
``reference.silu_mul_ref``; entry points: ``dispatch.rms_norm``, ``dispatch.qk_norm_rope``,
``dispatch.silu_mul``. No allocation beyond the outputs and no host synchronisation (capturable in a CUDA
graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.checks import check_rows_op, check_silu_mul
from skyrl_clora.kernels.launch import cdiv, next_power_of_2

SILU_BLOCK = 1024  # elements per program of the SiLU-mul kernels (forward here, backward in train_ops)
ROW_TILE_ELEMENTS = 4096  # elements per program of the row-wise kernels (see row_tile)


def row_tile(width: int) -> tuple[int, int, int]:
    """``(block, rows, num_warps)`` of the row-wise kernels for rows of ``width`` elements: the row padded to a
    power of two, and as many rows per program as fill a tile of ~4096 elements (rows of 128, Qwen3's per-head
    norms, otherwise make programs of 128 elements that leave the GPU's bandwidth unused)."""
    block = next_power_of_2(width)
    rows = max(1, ROW_TILE_ELEMENTS // block)
    return block, rows, 8 if block * rows >= 2048 else 4


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, N, H, eps, stride_x, stride_res, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """``x`` and ``res`` rows at ``stride_x`` / ``stride_res`` elements; ``y`` and ``res_out`` contiguous."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (xf * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_tables(cos_ptr, sin_ptr, tokens, mask, D: tl.constexpr):
    """The rotary tables' halves at ``tokens`` (int64 ``[rows]``; ``cos, sin: [N, D]`` contiguous) as fp32
    ``(cos1, cos2, sin1, sin2)``, each ``[rows, D/2]``, zero where ``mask`` (``[rows, 1]``) is false."""
    half = tl.arange(0, D // 2)
    table = tokens[:, None] * D + half[None, :]
    cos1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + D // 2, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + D // 2, mask=mask, other=0.0).to(tl.float32)
    return cos1, cos2, sin1, sin2


@triton.jit
def norm_rope(x1, x2, w_ptr, cos1, cos2, sin1, sin2, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head's halves ``x1, x2`` (fp32 ``[rows, D/2]``) after the per-head RMSNorm (HAS_NORM: Qwen3's
    ``q_norm``/``k_norm``, weight ``[D]`` at ``w_ptr``) and the rotary embedding ``(x1 * cos1 - x2 * sin1,
    x2 * cos2 + x1 * sin2)``."""
    if HAS_NORM:
        half = tl.arange(0, D // 2)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        x1 = x1 * rstd * tl.load(w_ptr + half).to(tl.float32)[None, :]
        x2 = x2 * rstd * tl.load(w_ptr + D // 2 + half).to(tl.float32)[None, :]
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, N, HQ, HK, eps,
                         q_token_stride, k_token_stride, q_programs, D: tl.constexpr, HAS_NORM: tl.constexpr,
                         ROWS: tl.constexpr):
    """Rows are (token, head) pairs, ``ROWS`` per program: programs ``0..q_programs-1`` take q's ``N * HQ``
    rows, the others k's ``N * HK``. Each row is read as its two halves ``x1``, ``x2``; the rotary embedding
    is ``(x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2)``."""
    pid = tl.program_id(0)
    half = tl.arange(0, D // 2)
    if pid < q_programs:
        rows = pid * ROWS + tl.arange(0, ROWS)
        valid = rows < N * HQ
        token = (rows // HQ).to(tl.int64)
        src = q_ptr + token * q_token_stride + (rows % HQ) * D
        dst = q_out_ptr + rows.to(tl.int64) * D
        w_ptr = qw_ptr
    else:
        rows = (pid - q_programs) * ROWS + tl.arange(0, ROWS)
        valid = rows < N * HK
        token = (rows // HK).to(tl.int64)
        src = k_ptr + token * k_token_stride + (rows % HK) * D
        dst = k_out_ptr + rows.to(tl.int64) * D
        w_ptr = kw_ptr
    mask = valid[:, None]
    first = src[:, None] + half[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + D // 2, mask=mask, other=0.0).to(tl.float32)
    cos1, cos2, sin1, sin2 = rope_tables(cos_ptr, sin_ptr, token, mask, D)
    x1, x2 = norm_rope(x1, x2, w_ptr, cos1, cos2, sin1, sin2, eps, D, HAS_NORM)
    out = dst[:, None] + half[None, :]
    tl.store(out, x1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + D // 2, x2.to(q_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, g_row_stride, u_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * g_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=mask)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """``x: [N, H, d]`` with contiguous heads (any token stride, e.g. a column slice of a fused q/k/v
    projection); copied only if its heads are not contiguous."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, x.shape[-1]]`` with unit column stride (any row stride, e.g. a column slice of a
    fused gate/up projection); copied only if it cannot be viewed so."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rms_norm`` (semantics: ``reference.rms_norm_ref``); ``x``, ``residual``: ``[N, H]`` with unit column
    stride (any row stride, e.g. a column view of a folded LoRA layer's output). ``y`` and, with a residual, the
    returned sum are new contiguous tensors; without one the returned ``h`` is ``x`` itself."""
    check_rows_op("x", x, weight.shape[0], residual)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    block, rows, warps = row_tile(x.shape[1])
    _rms_norm_kernel[(cdiv(x.shape[0], rows),)](
        x, residual if residual is not None else x, weight, y, residual_out, x.shape[0], x.shape[1], eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        HAS_RES=residual is not None, BLOCK=block, ROWS=rows, num_warps=warps,
    )
    return y, residual_out


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``qk_norm_rope`` (semantics: ``reference.qk_norm_rope_ref``); returns new ``(q, k)``."""
    num, heads_q, dim = q.shape
    if k.dim() != 3 or k.shape[0] != num or k.shape[2] != dim or cos.shape != (num, dim) or sin.shape != (num, dim):
        raise ValueError(f"qk_norm_rope needs q [N, Hq, d], k [N, Hk, d], cos/sin [N, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if dim & (dim - 1) or dim % 2:
        raise ValueError(f"qk_norm_rope's Triton path needs a power-of-two head dim, got {dim}; use backend='torch'")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope needs both q_weight and k_weight, or neither")
    q, k, cos, sin = _heads(q), _heads(k), cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    _, rows, warps = row_tile(dim)
    q_programs = cdiv(num * heads_q, rows)
    _qk_norm_rope_kernel[(q_programs + cdiv(num * k.shape[1], rows),)](
        q, k, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, q_out, k_out,
        num, heads_q, k.shape[1], eps, q.stride(0), k.stride(0), q_programs, D=dim, HAS_NORM=has_norm, ROWS=rows,
        num_warps=warps,
    )
    return q_out, k_out


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu_mul`` (semantics: ``reference.silu_mul_ref``); a new contiguous tensor. ``gate`` and
    ``up`` may be column slices of one fused gate/up projection (read in place)."""
    check_silu_mul(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if not gate.numel():
        return out
    width = gate.shape[-1]
    gate_rows, up_rows = _rows(gate), _rows(up)
    _silu_mul_kernel[(gate_rows.shape[0], cdiv(width, SILU_BLOCK))](
        gate_rows, up_rows, out, width, gate_rows.stride(0), up_rows.stride(0), BLOCK=SILU_BLOCK)
    return out
