"""The decode attention's two small kernels around its partials (``decode``): the shared-prefix group tables
before them and the reduce after them. Neither reads the KV cache, so neither depends on its layout (slot or
paged).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _prefix_groups_kernel(
    len_ptr,
    prefix_row_ptr,
    prefix_len_ptr,
    served_ptr,
    count_ptr,
    members_ptr,
    B,
    L,
    B_P2: tl.constexpr,
    MEMBERS: tl.constexpr,
):
    """Row ``b`` as a member: ``served[b]`` = its shared prefix length if it is among the first ``MEMBERS``
    rows (by index) naming its source, a row of the batch (it is then ``members[source, rank]``), else 0.
    Row ``b`` as a source: ``count[b]`` = its members (at most ``MEMBERS``). A row's prefix length is
    ``min(prefix_len, length, L)``; 0 means none."""
    b = tl.program_id(0)
    offs = tl.arange(0, B_P2)
    in_batch = offs < B
    lengths = tl.minimum(tl.load(len_ptr + offs, mask=in_batch, other=0), L)
    lens = tl.minimum(tl.load(prefix_len_ptr + offs, mask=in_batch, other=0), lengths).to(tl.int32)
    rows = tl.load(prefix_row_ptr + offs, mask=in_batch, other=-1).to(tl.int32)
    grouped = (lens > 0) & (rows >= 0) & (rows < B)  # rows whose source has a group program
    source = tl.sum(tl.where(offs == b, rows, 0), axis=0)
    own_len = tl.sum(tl.where(offs == b, lens, 0), axis=0)
    is_grouped = tl.sum(tl.where(offs == b, grouped.to(tl.int32), 0), axis=0) > 0
    rank = tl.sum((grouped & (rows == source) & (offs < b)).to(tl.int32), axis=0)
    served = is_grouped & (rank < MEMBERS)
    tl.store(served_ptr + b, tl.where(served, own_len, 0))
    if served:
        tl.store(members_ptr + source * MEMBERS + rank, b)
    mine = grouped & (rows == b)
    tl.store(count_ptr + b, tl.minimum(tl.sum(mine.to(tl.int32), axis=0), MEMBERS))


@triton.jit
def _reduce_kernel(
    o_ptr,
    lse_ptr,
    len_ptr,
    served_ptr,
    out_ptr,
    H,
    D,
    L,
    NUM_SPLITS,
    NUM_SLOTS,
    stride_ob,
    stride_oh,
    SPLIT_LEN: tl.constexpr,
    SLOTS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    """``out[b, h] = sum_s w_s * o[b, h, s] / sum_s w_s`` with ``w_s = 2 ** lse[b, h, s]`` over the row's
    written slots: its splits up to its length and, when its group read its prefix, the prefix's splits;
    zeros for a row of length 0."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), L)
    offs_s = tl.arange(0, SLOTS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < (length + SPLIT_LEN - 1) // SPLIT_LEN
    d_mask = offs_d < D
    base = (b * H + h).to(tl.int64) * NUM_SLOTS
    if PDL:
        gdc_wait()  # the partials are complete and visible from here on
    if HAS_PREFIX:
        served = tl.load(served_ptr + b)
        s_mask = s_mask | ((offs_s >= NUM_SPLITS) & (offs_s < NUM_SLOTS) & ((offs_s - NUM_SPLITS) * SPLIT_LEN < served))
    lse = tl.load(lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of length 0 has no partials: all weights 0
    used = s_mask & (lse != float("-inf"))
    w = tl.where(used, tl.exp2(lse - top), 0.0)
    o = tl.load(o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=used[:, None] & d_mask[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def reduce_warps(slots_p2: int, block_d: int) -> int:
    """Warps of a reduce program over a ``[slots_p2, block_d]`` fp32 tile: one per 1,024 floats, 1 to 8."""
    return max(1, min(8, slots_p2 * block_d // 1024))
