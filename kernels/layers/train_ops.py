"""Fused element-wise ops of a decoder layer for training: RMSNorm with a frozen weight and SiLU-mul, each one
Triton launch forward and one backward, as torch autograd Functions.

Hugging Face's modules run RMSNorm as ~7 kernels forward and ~10 backward over fp32 copies of the
activations, and SwiGLU's ``act_fn(gate) * up`` as 2 forward and 4 backward (saving ``silu(gate)`` besides
``gate`` and ``up``); at training sizes (tens of thousands of tokens per micro-batch) each of them moves the
whole activation tensor through memory. These read and write each tensor once:

- ``RMSNormFrozenWeight``: ``y = weight * x / sqrt(mean(x ** 2, -1) + eps)`` over the last dim; the
  backward gives ``dx`` only (the base model's norm weights are frozen) and recomputes the statistics from
  ``x`` instead of saving them::

      x_hat = x * rstd;  g = dy * weight
      dx = rstd * (g - x_hat * mean(g * x_hat, -1))

- ``SiluMul``: ``y = silu(gate) * up``; backward with ``s = sigmoid(gate)``::

      d_gate = dy * up * s * (1 + gate * (1 - s));  d_up = dy * gate * s

- ``RotaryEmbedding``: the rotary embedding of q and k, ``y = x * cos + rotate_half(x) * sin`` (Hugging
  Face's ``apply_rotary_pos_emb``: 4 element-wise kernels forward and about 8 backward per tensor, over
  strided views); one launch each way for q and k together. With both halves of ``sin``'s last dim equal
  (how rotary tables are built) the transpose of ``rotate_half(.) * sin`` is ``rotate_half(.) * -sin``, so
  the backward is the same rotation with ``-sin``::

      dx = dy * cos + rotate_half(dy) * -sin

They compute in fp32 and round once to the inputs' dtype. Semantics: ``reference.rms_norm_ref`` (no
residual), ``reference.silu_mul_ref`` and ``reference.qk_norm_rope_ref`` (no weights); entry points:
``dispatch.rms_norm_with_grad``, ``dispatch.silu_mul_with_grad``, ``dispatch.rope_with_grad``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.launch import cdiv
from skyrl_clora.kernels.layers.layer_ops import SILU_BLOCK, qk_norm_rope_triton, rms_norm_triton, row_tile, silu_mul_triton


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, N, H, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)[:, None]
    x_hat = x * rstd
    g = dy * w
    dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=1) / H)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)


class RMSNormFrozenWeight(torch.autograd.Function):
    """``y = rms_norm(x, weight, eps)`` over ``x: [..., H]`` (any leading dims) with ``weight: [H]`` frozen:
    gradients flow to ``x`` only. Saves ``x`` (a contiguous ``[N, H]`` view or copy) for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, _ = rms_norm_triton(rows, weight, eps)
        ctx.save_for_backward(rows, weight)
        ctx.eps = eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        dy_rows = dy.reshape(rows.shape).contiguous()
        dx = torch.empty_like(rows)
        block, per_program, warps = row_tile(rows.shape[1])
        _rms_norm_backward_kernel[(cdiv(rows.shape[0], per_program),)](
            dy_rows, rows, weight, dx, rows.shape[0], rows.shape[1], ctx.eps, BLOCK=block, ROWS=per_program,
            num_warps=warps,
        )
        return dx.view(dy.shape), None, None


class SiluMul(torch.autograd.Function):
    """``y = silu(gate) * up`` for two tensors of one shape and dtype; saves ``gate`` and ``up``."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return silu_mul_triton(gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _silu_mul_backward_kernel[(cdiv(gate.numel(), SILU_BLOCK),)](
            dy, gate, up, d_gate, d_up, gate.numel(), BLOCK=SILU_BLOCK,
        )
        return d_gate, d_up


class RotaryEmbedding(torch.autograd.Function):
    """``(q, k) -> (rope(q), rope(k))`` for ``q: [N, Hq, d]``, ``k: [N, Hk, d]`` (contiguous heads, any token
    stride) and ``cos, sin: [N, d]`` (no gradient); saves ``cos`` and ``sin`` only."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,  # type: ignore[override]
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return qk_norm_rope_triton(q, k, cos, sin, None, None, 0.0)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, dq: torch.Tensor, dk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        grad_q, grad_k = qk_norm_rope_triton(dq, dk, cos, -sin, None, None, 0.0)
        return grad_q, grad_k, None, None
