"""Decode attention over a slot or paged KV cache (flash-decoding): Triton kernels and host wrapper (the group
and reduce kernels, which never read the cache, are in ``decode_aux``).

One decode step attends each row's single query token to the first ``lengths[b]`` positions of its own cache
row. The keys of a row are cut into fixed splits of ``split_len`` positions; one program per (split, kv head,
row) runs an online softmax over its split for all the query heads that share the kv head (GQA) and writes a
normalised partial output and its log-sum-exp, visiting only the key blocks of its split that hold keys;
programs whose split starts at or past the row's length return at once (their launch still costs: hence few,
long splits, see ``default_attention_config``). Row programs (a row's own keys) and prefix programs (below)
run code of their own, each loading and computing only what its kind needs: one body for both, choosing per
query row, was slower at the engine's shared-prompt shape (RESULTS.md, Tried and did not pay). A second small
kernel combines the partials of each (row, head); on Hopper it is launched with programmatic dependent launch
(it starts while the first finishes, and waits with ``gdc_wait`` before reading the partials). The grids depend
only on ``B``, ``H``, ``KV`` and ``L``, the lengths are read on the device, and with ``out`` and a
:class:`DecodeWorkspace` given nothing is allocated: a decode step is capturable in a CUDA graph and replayable
with new lengths.

Shared prefixes (``prefix_rows`` / ``prefix_lens``: row ``b`` reads its first ``prefix_lens[b]`` positions
from cache row ``prefix_rows[b]``, e.g. the samples of a GRPO group that copied one cached prompt): the
rows naming one source row ``s`` form its group, and a group's prefix is read once per kv head and split
for up to :data:`PREFIX_GROUP_ROWS` members together (the members' query heads are the rows of one tile,
so the prefix's keys go through one program instead of one per member); each member's own programs then
read only its positions after the prefix, and the reduce merges the prefix partials with the row's own.
A small first kernel finds the groups on the device (each row's rank among the rows naming its source):
members past the first :data:`PREFIX_GROUP_ROWS` of a group, and rows naming a source outside the batch,
read their prefix in their own programs from the source row. The result equals reading each row's own
copy up to rounding (the prefix is a partial softmax of its own).

Paged caches (``block_tables: [R, M]``, caches ``[NB, KV, BS, d]``): logical row ``r``'s position ``p`` is at
``k_cache[block_tables[r, p // BS], :, p % BS]`` and the logical length is ``L = M * BS``; everything above
holds with "cache row" read as "table row". One constexpr (``PAGED``) picks the addressing, so the slot
layout compiles to its own code. A key tile loads its table entries once (one per key, shared by its K and
V loads; a tile of ``BLOCK_N`` keys spans ``BLOCK_N / BS`` blocks, or part of one), masked like its keys:
the entries past what a row uses may hold anything and are never read.

An fp8 cache (``torch.float8_e4m3fn``, scale 1.0, with a bf16/fp16/fp32 ``q``): each K/V tile is converted to
``q``'s dtype right after its load, so only the bytes read change.

Semantics: ``reference.decode_attention_ref``; entry point: ``dispatch.decode_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from skyrl_clora.kernels.attention.decode_aux import _prefix_groups_kernel, _reduce_kernel, reduce_warps
from skyrl_clora.kernels.checks import check_decode_attention
from skyrl_clora.kernels.launch import cdiv, dot_flags, has_pdl, next_power_of_2

MAX_HEAD_DIM = 256
# A row's splits at most under the default config: longer caches get longer splits (a program visits only
# the key blocks of its split that hold keys, so a long split costs a short row nothing).
_MAX_SPLITS = 8
# Keys per split at least under the default config.
_MIN_SPLIT_LEN = 512
# Rows of a shared-prefix group whose prefix one program reads together (a GRPO group's samples).
PREFIX_GROUP_ROWS = 8
# Query rows of one program at most (members x query heads per kv head) when prefixes are shared.
_MAX_QUERY_TILE = 64
_LOG2E = 1.4426950408889634
# The partials kernel's register cap with shared prefixes (head dim <= 128): the compiler's own register count
# allows fewer programs per SM, and 96 ran the engine's shared-prompt shape faster on the H200 (RESULTS.md, Engine
# decode: tenants mixed vs the base model); with row and prefix programs compiled apart the two are close.
PREFIX_MAXNREG = 96


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of one ``decode_attention`` call (``default_attention_config`` picks them)."""

    split_len: int = 512
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pdl: bool = True
    # Registers per thread at most (ptxas ``.maxnreg``; GPU only). None: :data:`PREFIX_MAXNREG` with shared
    # prefixes at head dims up to 128, the compiler's choice otherwise; 0: the compiler's choice.
    maxnreg: int | None = None
    # Warps of a reduce program (one per row and query head); 0: one per 1,024 floats of its [slots, d] tile
    # (``reduce_warps``): 4 per program ran the shared-prompt shape slower than 1 (RESULTS.md, Engine decode:
    # tenants mixed vs the base model).
    reduce_warps: int = 0


def default_attention_config(max_len: int) -> AttentionConfig:
    """Launch parameters by the cache length alone: at least ``_MIN_SPLIT_LEN`` keys per program and at most
    ``_MAX_SPLITS`` splits per row. Never by the number of rows or the lengths' values, so a row's result is
    bit-identical whatever the batch around it (the engine's runs stay reproducible when the number of
    decoded rows changes). Every program launched costs, even one whose split holds no key of its row: at
    the engine's shared-prompt shape (512 rows of up to 620 positions) 256-key splits were slower than these,
    the more so the longer ``L`` (RESULTS.md, Engine decode: tenants mixed vs the base model). The price is paid
    by a batch of one long row, which fewer, longer splits spread over fewer programs; 8 such rows or more take
    the same with either."""
    return AttentionConfig(split_len=max(_MIN_SPLIT_LEN, next_power_of_2(cdiv(max_len, _MAX_SPLITS))))


def _workspace_floats(num_rows: int, num_heads: int, head_dim: int, max_len: int, split_len: int) -> int:
    """Floats of the partials: ``[B, H, slots, d]`` outputs then ``[B, H, slots]`` log-sum-exps, with two
    slots per split (the row's own keys and, with a shared prefix, the prefix's)."""
    return num_rows * num_heads * 2 * cdiv(max_len, split_len) * (head_dim + 1)


def _group_ints(num_rows: int) -> int:
    """Ints of the prefix-group tables: per row its served prefix length, member count and
    ``PREFIX_GROUP_ROWS`` member rows."""
    return num_rows * (2 + PREFIX_GROUP_ROWS)


class DecodeWorkspace:
    """Scratch for ``decode_attention``, allocated once: float32 partial results and the int32 prefix-group
    tables.

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
        self.groups = torch.empty(_group_ints(max_rows), dtype=torch.int32, device=device)


@triton.jit
def _softmax_block(q, kt, vt, valid, m, denom, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key block of an online softmax: ``q: [Q, D]``, ``kt: [D, N]``, ``vt: [N, D]``, ``valid: [Q, N]``;
    returns the updated running max (base 2), denominator and unnormalised output."""
    scores = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # base-2 logits
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
    return m_new, denom, acc


@triton.jit
def _store_partial(o_ptr, lse_ptr, row_head, q_ok, acc, denom, m, offs_d, d_mask, D):
    """``o[row_head] = acc / denom`` and ``lse[row_head] = m + log2(denom)`` (``-inf`` without keys)."""
    tl.store(o_ptr + row_head[:, None] * D + offs_d[None, :], acc / tl.maximum(denom, 1e-30)[:, None],
             mask=q_ok[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row_head, tl.where(denom > 0, m + tl.log2(tl.maximum(denom, 1e-30)), float("-inf")), mask=q_ok)


@triton.jit
def _paged_keys(table_ptr, table_row, pos, n_mask, stride_t, BLOCK_SIZE: tl.constexpr):
    """Paged layout: the cache block (int64) and the offset in it (int64) of the keys at positions ``pos`` of
    logical row ``table_row`` (one row, or one per key): ``block_tables[table_row, pos // BLOCK_SIZE]`` and
    ``pos % BLOCK_SIZE``. The table is read once per key tile, and only where ``n_mask`` (entries past a row's
    keys may hold anything): masked keys get block 0."""
    blk = tl.load(table_ptr + table_row * stride_t + pos // BLOCK_SIZE, mask=n_mask, other=0)
    return blk.to(tl.int64), (pos % BLOCK_SIZE).to(tl.int64)


@triton.jit
def _row_partial(
    q_ptr, k_ptr, v_ptr, table_ptr, o_ptr, lse_ptr, b, slot, kvh, start, lo, hi, low_row, split_at, H, D, NUM_SLOTS,
    qk_scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_t,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """The ``GROUP`` query heads of kv head ``kvh`` of row ``b`` over keys ``[lo, hi)`` of the split starting
    at ``start`` (positions below ``split_at`` from row ``low_row``: a cache row, or with PAGED a table row)."""
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    q_ok = offs_q < GROUP
    head = kvh * GROUP + offs_q
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter mis-multiplies bf16 operands
        q = q.to(tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    # The key blocks holding keys of [lo, hi); the CPU interpreter cannot run a for loop to a runtime bound,
    # so it runs every block of the split, masked. (Bounds are set in tuple assignments: the interpreter turns
    # the value of a single-name assignment into a tensor, and with NumPy >= 2.4 range() cannot take it.)
    if UPCAST:
        first_block, end_block = 0, SPLIT_LEN // BLOCK_N
    else:
        first_block, end_block = (lo - start) // BLOCK_N, tl.cdiv(hi - start, BLOCK_N)
    for i in range(first_block, end_block):
        pos = start + i * BLOCK_N + offs_n
        n_mask = (pos >= lo) & (pos < hi)
        if PAGED:
            blk, off = _paged_keys(table_ptr, tl.where(pos < split_at, low_row, b).to(tl.int64), pos, n_mask, stride_t,
                                   BLOCK_SIZE)
            # K read as [BLOCK_N, BLOCK_D] like V (the keys' addresses in one layout), then transposed: paged steps
            # lose less time to slot ones than with K read transposed (RESULTS.md, Tried and did not pay).
            kt = tl.trans(tl.load(k_base + (blk * stride_kb + off * stride_kl)[:, None] + offs_d[None, :],
                                  mask=n_mask[:, None] & d_mask[None, :], other=0.0))  # [BLOCK_D, BLOCK_N]
            vt = tl.load(v_base + (blk * stride_vb + off * stride_vl)[:, None] + offs_d[None, :],
                         mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            row = tl.where(pos < split_at, low_row, b).to(tl.int64)
            kt = tl.load(k_base + row[None, :] * stride_kb + pos[None, :].to(tl.int64) * stride_kl + offs_d[:, None],
                         mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            vt = tl.load(v_base + row[:, None] * stride_vb + pos[:, None].to(tl.int64) * stride_vl + offs_d[None, :],
                         mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        kt, vt = kt.to(q.dtype), vt.to(q.dtype)  # an fp8 cache dequantised (scale 1); under UPCAST, to fp32
        m, denom, acc = _softmax_block(q, kt, vt, n_mask[None, :], m, denom, acc, qk_scale, DOT_PRECISION)
    row_head = (b.to(tl.int64) * H + head) * NUM_SLOTS + slot
    _store_partial(o_ptr, lse_ptr, row_head, q_ok, acc, denom, m, offs_d, d_mask, D)


@triton.jit
def _prefix_partial(
    q_ptr, k_ptr, v_ptr, table_ptr, served_ptr, count_ptr, members_ptr, o_ptr, lse_ptr, b, slot, kvh, start, H, D,
    NUM_SLOTS, qk_scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    stride_t, GROUP: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Row ``b``'s group (its first ``MEMBERS`` members, ``_prefix_groups_kernel``) over the split starting at
    ``start`` of row ``b``'s keys of kv head ``kvh`` (cache row ``b``, or with PAGED table row ``b``), each
    member up to its own prefix length; the query rows are the ``(member, query head)`` pairs. Writes nothing
    when no member has a key in the split (the reduce reads a prefix slot only below the member's prefix
    length)."""
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    member = offs_q // GROUP
    q_ok = (member < tl.load(count_ptr + b)) & (offs_q < MEMBERS * GROUP)
    m_row = tl.load(members_ptr + b * MEMBERS + member, mask=q_ok, other=0)
    hi = tl.where(q_ok, tl.minimum(start + SPLIT_LEN, tl.load(served_ptr + m_row, mask=q_ok, other=0)), start)
    last = tl.max(hi, axis=0)
    # The key blocks up to the last member's prefix end (the CPU interpreter runs every block, masked; bounds
    # in tuple assignments as in _row_partial).
    if UPCAST:
        first_block, end_block = 0, SPLIT_LEN // BLOCK_N
    else:
        first_block, end_block = 0, tl.cdiv(last - start, BLOCK_N)
    if last > start:
        head = kvh * GROUP + offs_q % GROUP
        q = tl.load(q_ptr + m_row[:, None].to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                    mask=q_ok[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if PAGED:
            k_base = k_ptr + kvh.to(tl.int64) * stride_kh
            v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        else:
            k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
            v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
        m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
        for i in range(first_block, end_block):
            pos = start + i * BLOCK_N + offs_n
            n_mask = pos < last
            if PAGED:
                blk, off = _paged_keys(table_ptr, b.to(tl.int64), pos, n_mask, stride_t, BLOCK_SIZE)
                kt = tl.trans(tl.load(k_base + (blk * stride_kb + off * stride_kl)[:, None] + offs_d[None, :],
                                      mask=n_mask[:, None] & d_mask[None, :], other=0.0))  # as in _row_partial
                vt = tl.load(v_base + (blk * stride_vb + off * stride_vl)[:, None] + offs_d[None, :],
                             mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            else:
                kt = tl.load(k_base + pos[None, :].to(tl.int64) * stride_kl + offs_d[:, None],
                             mask=n_mask[None, :] & d_mask[:, None], other=0.0)
                vt = tl.load(v_base + pos[:, None].to(tl.int64) * stride_vl + offs_d[None, :],
                             mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            kt, vt = kt.to(q.dtype), vt.to(q.dtype)  # as in _row_partial
            m, denom, acc = _softmax_block(q, kt, vt, pos[None, :] < hi[:, None], m, denom, acc, qk_scale,
                                           DOT_PRECISION)
        row_head = (m_row.to(tl.int64) * H + head) * NUM_SLOTS + slot
        _store_partial(o_ptr, lse_ptr, row_head, q_ok, acc, denom, m, offs_d, d_mask, D)


@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    len_ptr,
    prefix_row_ptr,
    prefix_len_ptr,
    served_ptr,
    count_ptr,
    members_ptr,
    o_ptr,
    lse_ptr,
    H,
    D,
    L,
    NUM_SPLITS,
    NUM_SLOTS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    stride_t,
    GROUP: tl.constexpr,
    MEMBERS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program ``(slot, kv head j, row b)``, one of two kinds, each with its own code (a program computes and
    loads only what its kind needs). ``slot = s < NUM_SPLITS``, a row program (``_row_partial``): the
    ``GROUP`` query heads of kv head ``j`` of row ``b`` over keys ``[s * SPLIT_LEN, min((s + 1) * SPLIT_LEN,
    length))``, less the positions below ``served[b]`` (read by its group's program); with HAS_PREFIX, keys
    below ``prefix_len[b]`` of a row not served come from row ``prefix_row[b]``. ``slot = NUM_SPLITS + s``, a
    prefix program (HAS_PREFIX only, ``_prefix_partial``): the members of row ``b``'s group over the same split
    of row ``b``'s keys, each up to its own prefix length. Writes ``o[row, h, slot] = softmax(q @ K.T * scale) @
    V`` over the program's keys and ``lse[row, h, slot]`` (base 2; ``-inf`` where a query has no key in the
    range). Key ``p`` of row ``r``: ``k[r, j, p]`` (slot layout), or with PAGED ``k[table[r, p // BLOCK_SIZE], j,
    p % BLOCK_SIZE]`` (``table`` rows ``stride_t`` apart; ``L`` is the table's width times ``BLOCK_SIZE``)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    if pid < NUM_SPLITS:
        start = pid * SPLIT_LEN
        length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), L)
        lo = start
        hi = tl.minimum(start + SPLIT_LEN, length)
        low_row = b
        split_at = 0
        if HAS_PREFIX:
            served = tl.load(served_ptr + b)
            lo = tl.where(served > 0, tl.maximum(lo, served), lo)
            low_row = tl.where(served > 0, b, tl.load(prefix_row_ptr + b).to(tl.int32))
            split_at = tl.where(served > 0, 0, tl.minimum(tl.load(prefix_len_ptr + b).to(tl.int32), length))
        if hi > lo:
            _row_partial(
                q_ptr, k_ptr, v_ptr, table_ptr, o_ptr, lse_ptr, b, pid, kvh, start, lo, hi, low_row, split_at, H, D,
                NUM_SLOTS, qk_scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh,
                stride_vl, stride_t, GROUP, BLOCK_Q, BLOCK_D, BLOCK_N, SPLIT_LEN, UPCAST, DOT_PRECISION, PAGED,
                BLOCK_SIZE,
            )  # fmt: skip
        else:
            offs_q = tl.arange(0, BLOCK_Q)
            tl.store(lse_ptr + (b.to(tl.int64) * H + kvh * GROUP + offs_q) * NUM_SLOTS + pid,
                     tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32), mask=offs_q < GROUP)
    elif HAS_PREFIX:
        _prefix_partial(
            q_ptr, k_ptr, v_ptr, table_ptr, served_ptr, count_ptr, members_ptr, o_ptr, lse_ptr, b, pid, kvh,
            (pid - NUM_SPLITS) * SPLIT_LEN, H, D, NUM_SLOTS, qk_scale,
            stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_t,
            GROUP, MEMBERS, BLOCK_Q, BLOCK_D, BLOCK_N, SPLIT_LEN, UPCAST, DOT_PRECISION, PAGED, BLOCK_SIZE,
        )  # fmt: skip


def _register_cap(cfg: AttentionConfig, has_prefix: bool, block_d: int, on_cpu: bool) -> dict[str, int]:
    """The partials kernel's ``maxnreg`` launch option, if any (see ``AttentionConfig.maxnreg``)."""
    if on_cpu:
        return {}
    if cfg.maxnreg is None:
        return {"maxnreg": PREFIX_MAXNREG} if has_prefix and block_d <= 128 else {}
    return {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}


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
    block_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``decode_attention`` (semantics: ``reference.decode_attention_ref``); returns ``out``.

    Launches: with a shared prefix the group tables (grid ``(B,)``), then the partials (grid ``(slots, KV, B)``,
    two slots per split with a prefix, else one) and the reduce (grid ``(H, B)``). With ``out`` and
    ``workspace`` given nothing is allocated and nothing waits for the host; otherwise they are allocated
    here. ``config`` overrides ``default_attention_config`` (benchmarks sweep it). With ``block_tables: [R, M]``
    (int32, contiguous) the caches are paged, ``[NB, KV, BS, d]``: the logical length is ``L = M * BS`` (the
    config, grids and workspace size follow it), and each key's block comes from the table, read only for the
    positions a row uses. Raises ValueError on bad shapes, dtypes or strides.
    """
    check_decode_attention(q, k_cache, v_cache, lengths, out, MAX_HEAD_DIM, prefix_rows, prefix_lens, block_tables)
    B, H, D = q.shape
    KV = k_cache.shape[1]
    paged = block_tables is not None
    block_size = k_cache.shape[2] if paged else 1
    L = block_tables.shape[1] * block_size if paged else k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    cfg = config or default_attention_config(L)
    if cfg.split_len % cfg.block_n or cfg.block_n < 16:
        raise ValueError(f"split_len {cfg.split_len} must be a multiple of block_n {cfg.block_n} (>= 16)")
    num_splits = cdiv(L, cfg.split_len)
    has_prefix = prefix_rows is not None
    num_slots = num_splits * (2 if has_prefix else 1)
    need = _workspace_floats(B, H, D, L, cfg.split_len)
    if workspace is None:
        buf = torch.empty(need, dtype=torch.float32, device=q.device)
        groups = torch.empty(_group_ints(B), dtype=torch.int32, device=q.device)
    elif workspace.buffer.numel() < need or workspace.groups.numel() < _group_ints(B) or workspace.buffer.device != q.device:
        raise ValueError(
            f"the DecodeWorkspace holds {workspace.buffer.numel()} floats on {workspace.buffer.device}, this call "
            f"needs {need} on {q.device}: build it for at least {B} rows, {H} heads, max_len {L}, head_dim {D}"
        )
    else:
        buf, groups = workspace.buffer, workspace.groups
    partial_o = buf[: B * H * num_slots * D]
    partial_lse = buf[B * H * num_slots * D : B * H * num_slots * (D + 1)]
    served, count, members = groups[: _group_ints(B)].split([B, B, B * PREFIX_GROUP_ROWS])  # members: [B, MEMBERS] used
    block_d = max(16, next_power_of_2(D))
    group = H // KV
    members_per_tile = max(1, min(PREFIX_GROUP_ROWS, _MAX_QUERY_TILE // group)) if has_prefix else 1
    on_cpu = q.device.type != "cuda"
    pdl = cfg.pdl and has_pdl(q.device)
    if has_prefix:
        _prefix_groups_kernel[(B,)](
            lengths, prefix_rows, prefix_lens, served, count, members, B, L,
            B_P2=next_power_of_2(B), MEMBERS=members_per_tile, num_warps=4,
        )  # fmt: skip
    _partial_kernel[(num_slots, KV, B)](
        q, k_cache, v_cache, block_tables if paged else lengths, lengths, prefix_rows if has_prefix else lengths,
        prefix_lens if has_prefix else lengths, served, count, members, partial_o, partial_lse, H, D, L, num_splits,
        num_slots, _LOG2E / math.sqrt(D), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0) if paged else 0,
        GROUP=group, MEMBERS=members_per_tile, BLOCK_Q=max(16, next_power_of_2(group * members_per_tile)),
        BLOCK_D=block_d, BLOCK_N=cfg.block_n, SPLIT_LEN=cfg.split_len, **dot_flags(q), PDL=pdl, HAS_PREFIX=has_prefix,
        PAGED=paged, BLOCK_SIZE=block_size,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg, has_prefix, block_d, on_cpu),
    )  # fmt: skip
    slots_p2 = next_power_of_2(num_slots)
    _reduce_kernel[(H, B)](
        partial_o, partial_lse, lengths, served, out, H, D, L, num_splits, num_slots, out.stride(0), out.stride(1),
        SPLIT_LEN=cfg.split_len, SLOTS_P2=slots_p2, BLOCK_D=block_d, PDL=pdl,
        HAS_PREFIX=has_prefix, launch_pdl=pdl, num_warps=cfg.reduce_warps or reduce_warps(slots_p2, block_d),
    )  # fmt: skip
    return out
