"""One adapter slot applied to every row of a batch: a dense LoRA linear layer on the GEMM library.

The trainer's pass of one tenant (swap mode) routes every row to one slot, so the segmented kernels'
grouping buys nothing there, and their host side did cost: a ``benchmarks.train`` round took well over its GPU
time, most of the host's time going to the Triton launches of the LoRA layers (RESULTS.md, Training: packed vs
swap). Here the layer is plain torch GEMMs, each launched through torch's
dispatcher. For ``x: [T, H_in]``, ``A = lora_a[slot]: [R, H_in]``, ``B = lora_b[slot]: [H_out, R]``,
``s = scales[slot]``::

    hs = s * (x @ A.T)                        # [T, R], model dtype, saved for backward
    y  = hs @ B.T + bias;  y += x @ weight.T   # the base GEMM accumulates onto the LoRA term (beta = 1)
    gs = s * (dy @ B)                         # backward
    dx = gs @ A;  dx += dy @ weight
    dA[slot] = gs.T @ x;  dB[slot] = dy.T @ hs   # every other slot's gradient is zero

``hs`` is rounded to the model dtype, as PEFT's LoRA layers do (the packed Triton op keeps it in fp32).
Semantics: ``reference.packed_lora_ref`` with every row in ``slot``; entry point: ``dispatch.dense_lora_linear``.
"""

from __future__ import annotations

import torch


class DenseLoRALinear(torch.autograd.Function):
    """``y = x @ weight.T + bias + scales[slot] * (x @ lora_a[slot].T) @ lora_b[slot].T`` with frozen ``weight``,
    ``bias`` and ``scales``; gradients for ``x``, ``lora_a`` and ``lora_b`` (``[S, R, H_in]``, ``[S, H_out, R]``,
    zero outside ``slot``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        slot: int,
    ) -> torch.Tensor:
        scale = scales[slot]
        hs = torch.mm(x, lora_a[slot].t()).mul_(scale)
        # The rank-R product writes y and the base GEMM accumulates onto it (its epilogue reads y): one pass
        # over y fewer than adding the LoRA term to the base output afterwards.
        y = torch.mm(hs, lora_b[slot].t()) if bias is None else torch.addmm(bias, hs, lora_b[slot].t())
        y.addmm_(x, weight.t())
        ctx.save_for_backward(x, weight, lora_a, lora_b, scales, hs)
        ctx.slot = slot
        return y

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, lora_a, lora_b, scales, hs = ctx.saved_tensors
        slot = ctx.slot
        need_x, _, _, need_a, need_b = ctx.needs_input_grad[:5]
        dx = da = db = None
        gs = torch.mm(dy, lora_b[slot]).mul_(scales[slot]) if need_x or need_a else None
        if need_x:  # as in forward: the rank-R product first, the base GEMM accumulating onto it
            dx = torch.mm(gs, lora_a[slot])
            dx.addmm_(dy, weight)
        if need_a:
            da = torch.zeros_like(lora_a)
            torch.mm(gs.t(), x, out=da[slot])
        if need_b:
            db = torch.zeros_like(lora_b)
            torch.mm(dy.t(), hs, out=db[slot])
        return dx, None, None, da, db, None, None
