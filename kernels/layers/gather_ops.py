"""Row gather for training whose backward sums without atomics: ``y = x[index]`` with a segmented-sum backward.

The trainer's shared-prompt pass gathers each attention segment's keys and values (a response segment's keys
are its prompt's tokens, then its own), so a prompt token is gathered once per row of its group. Torch's
``index_select`` backward is ``index_add_``, whose bf16 atomics on a micro-batch's gathered keys were a visible
share of a GPU round (RESULTS.md, Training: packed vs swap). Given the
inverse of ``index`` (which positions gathered each row, built once per micro-batch on the host), the backward
here reads every gathered row once and writes every source row once::

    y[j] = x[index[j]]                                            # forward: index_select
    dx[t] = sum over j in sources[starts[t]:starts[t + 1]] of dy[j]   # backward, fp32 sum, zero if none

``inverse_index`` builds ``(starts, sources)``. Semantics: ``x.index_select(0, index)`` under autograd;
entry point: ``dispatch.gather_rows``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.launch import cdiv, next_power_of_2

# Columns of a row one program sums (rows are the gathered tensor's trailing dims, flattened).
_BLOCK = 1024


def inverse_index(index: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts [num_rows + 1], sources [K])`` int64 for ``index: [K]`` (values in ``[0, num_rows)``): the
    positions ``j`` with ``index[j] == t`` are ``sources[starts[t]:starts[t + 1]]``, in increasing order."""
    counts = np.bincount(index, minlength=num_rows)
    if counts.shape[0] != num_rows:
        raise ValueError(f"index holds {int(index.max())}, past the {num_rows} rows it gathers from")
    return np.concatenate([[0], np.cumsum(counts)]), np.argsort(index, kind="stable")


@triton.jit
def _segment_sum_kernel(dy_ptr, starts_ptr, sources_ptr, dx_ptr, W, BLOCK: tl.constexpr):
    """Program ``(t, c)``: ``dx[t, c-block] = sum over the sources j of row t of dy[j, c-block]`` (fp32)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    j = tl.load(starts_ptr + t)
    end = tl.load(starts_ptr + t + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    while j < end:  # a while loop: the CPU interpreter cannot run a for loop to a runtime bound
        source = tl.load(sources_ptr + j).to(tl.int64)
        acc += tl.load(dy_ptr + source * W + cols, mask=mask, other=0.0).to(tl.float32)
        j += 1
    tl.store(dx_ptr + t.to(tl.int64) * W + cols, acc.to(dx_ptr.dtype.element_ty), mask=mask)


class GatherRows(torch.autograd.Function):
    """``y = x.index_select(0, index)`` for ``x: [N, ...]`` (any strides) and ``index: [K]`` int64, with the
    backward summing each source row's gradients in one Triton launch (``starts``/``sources`` from
    :func:`inverse_index`, on ``x``'s device). Returns a contiguous ``[K, ...]``; the gradient of ``x`` is
    contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, starts: torch.Tensor,  # type: ignore[override]
                sources: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(starts, sources)
        ctx.x_shape = x.shape
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        starts, sources = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dy.new_empty(ctx.x_shape)
        width = math.prod(ctx.x_shape[1:])  # elements of one row
        if dx.numel():
            block = min(_BLOCK, max(16, next_power_of_2(width)))
            _segment_sum_kernel[(dx.shape[0], cdiv(width, block))](dy, starts, sources, dx, width, BLOCK=block)
        return dx, None, None, None
