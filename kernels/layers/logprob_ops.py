"""The trainer's LM-head loss on a chunk of logits: each row's chosen-token log-probability and, in place, its
gradient with respect to the row's logits, in one Triton program per row.

For ``logits: [N, V]`` (any float dtype, fp32 arithmetic) and ``targets: [N]``::

    out[n] = logits[n, t] - logsumexp(logits[n])                   # t = targets[n]; [N] float32
    logits[n, v] = (v == t) - softmax(logits[n])[v]                # with write_grad: d out[n] / d logits[n, v]

The gradient does not depend on the loss, so the trainer turns it into a gradient basis for the hidden states
in the forward pass (``(logits @ W)``, one GEMM) and the backward only scales that basis by ``d loss / d out``:
the head's GEMM runs twice per token instead of three times (forward, recompute, backward), and the
``[N, V]`` logits are read three times and written once in their own dtype instead of passing through several
fp32 copies. A row is read once for its maximum and exp-sum (running per lane, combined at the end) and, with
``write_grad``, once more to write its gradient over itself. Semantics: ``reference.chosen_logprobs_ref``;
entry point: ``dispatch.chosen_logprobs_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.launch import cdiv, next_power_of_2

# Vocabulary columns per step of a row's program.
_BLOCK_V = 4096


@triton.jit
def _chosen_logprobs_kernel(
    logits_ptr,
    targets_ptr,
    out_ptr,
    V,
    stride_row,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    """One program per row; ``NUM_CHUNKS = cdiv(V, BLOCK_V)`` (a compile-time trip count, which the CPU
    interpreter needs)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    # Finite start: a lane that only ever sees masked (-inf) columns keeps sum 0 instead of exp(nan).
    lane_max = tl.full([BLOCK_V], -1.0e30, tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for chunk in range(NUM_CHUNKS):
        cols = chunk * BLOCK_V + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    target = tl.load(targets_ptr + row)
    tl.store(out_ptr + row, tl.load(base + target).to(tl.float32) - lse)
    if WRITE_GRAD:
        for chunk in range(NUM_CHUNKS):
            cols = chunk * BLOCK_V + offs
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.where(cols == target, 1.0, 0.0) - tl.exp(x - lse)
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def chosen_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """See the module docstring; ``logits`` must have a unit column stride (checked by the dispatch)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return out
    block = min(_BLOCK_V, next_power_of_2(vocab))
    _chosen_logprobs_kernel[(rows,)](
        logits, targets, out, vocab, logits.stride(0),
        WRITE_GRAD=write_grad, BLOCK_V=block, NUM_CHUNKS=cdiv(vocab, block), num_warps=8,
    )  # fmt: skip
    return out
