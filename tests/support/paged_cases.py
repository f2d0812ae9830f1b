"""Paged KV caches for the attention tests (CPU and GPU): a slot cache ``[S, KV, L, d]`` paged into ``[NB, KV, BS,
d]`` blocks in a random order with an ``[S, L // BS]`` int32 block table whose unused entries are garbage, some
blocks shared by several rows; the table's logical view back as a slot cache; the decode problem the paged tests
share (rows sharing a prompt held by a cache row past the batch); prefill problems paged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.support.kernel_cases import AttentionProblem, PrefillProblem, make_attention_problem

GARBAGE_IDS = (-1, None, 2**30)  # unused table entries in turn: -1, a stale id of an unused block (None), a wild id


@dataclass
class PagedCache:
    """A paged K/V cache layer and its block table (``block_tables[r, i]``: row ``r``'s ``i``-th block)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor


def page_cache(k: torch.Tensor, v: torch.Tensor, extents: list[int], block_size: int, seed: int = 0,
               shared: dict[int, tuple[int, int]] | None = None, hidden: dict[int, int] | None = None,
               spare_blocks: int = 3) -> PagedCache:
    """Pages ``k, v: [S, KV, L, d]`` (``L`` a multiple of ``block_size``): row ``r``'s blocks ``0 ..
    cdiv(extents[r], BS) - 1`` get blocks of their own in a random order, holding the slot cache's positions;
    ``shared = {row: (source, n)}``: the row's first ``n`` table entries are the source's (the caller makes the
    rows' K/V agree there); ``hidden = {row: n}``: the row's first ``n`` entries are garbage (positions it reads
    through another row's table). Every other entry is garbage (``GARBAGE_IDS`` in turn), and the
    ``spare_blocks`` blocks no row names hold NaN: reading an entry or a block past a row's keys shows."""
    gen = torch.Generator().manual_seed(seed)
    rows, kv_heads, max_len, head_dim = k.shape
    per_row = max_len // block_size
    assert per_row * block_size == max_len, "L must be a multiple of the block size"
    shared, hidden = shared or {}, hidden or {}
    own = [(r, i) for r in range(rows) for i in range(-(-extents[r] // block_size))
           if not (r in shared and i < shared[r][1])]
    num_blocks = len(own) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen)
    stale = int(ids[-1])  # an unused block
    garbage = [stale if g is None else g for g in GARBAGE_IDS]
    table = torch.full((rows, per_row), -2, dtype=torch.int32)  # -2: not yet set
    own_rows, own_blocks = (torch.tensor([o[j] for o in own], dtype=torch.long) for j in range(2))
    table[own_rows, own_blocks] = ids[: len(own)].int()
    for row, (source, n) in shared.items():
        table[row, :n] = table[source, :n]
    for row, n in hidden.items():
        table[row, :n] = -2
    unset = table == -2
    table[unset] = torch.tensor(garbage, dtype=torch.int32).repeat(-(-int(unset.sum()) // len(garbage)))[: int(unset.sum())]

    def paged(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache.unflatten(2, (per_row, block_size)).transpose(1, 2)  # [S, M, KV, BS, d]
        out = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=cache.dtype,
                         device=cache.device)
        out[ids[: len(own)].to(cache.device)] = blocks[own_rows.to(cache.device), own_blocks.to(cache.device)]
        return out

    return PagedCache(paged(k), paged(v), table.to(k.device))


def gather_cache(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The slot cache ``[R, KV, M * BS, d]`` a paged ``cache: [NB, KV, BS, d]`` holds under ``block_tables: [R,
    M]``; a position whose entry names no block holds zeros."""
    num_blocks = cache.shape[0]
    valid = (block_tables >= 0) & (block_tables < num_blocks)
    blocks = cache[torch.where(valid, block_tables, 0).long()] * valid[:, :, None, None, None]  # [R, M, KV, BS, d]
    return blocks.transpose(1, 2).flatten(2, 3).contiguous()


# The decode problem of the paged tests: 5 rows and a sixth cache row (past the batch) holding a 128-position
# prompt that rows 1, 3 and 4 share (their first 128 positions are its K/V, their tables name its blocks); row
# 2's first 60 positions are the prompt's too (in blocks of its own).
PAGED_LENGTHS = [1, 192, 70, 150, 129]
PROMPT_ROW, PROMPT_LEN = 5, 128
# With shared prefixes: rows 1 and 2 read the prompt through table row 5 (a source past the batch: in their own
# programs), row 2 only its first 60 positions; rows 3 and 4 through row 1 (a group in the batch), row 3 only its
# first 100. Prefix lengths end inside blocks; the members' own table entries of whole blocks below their prefix
# are garbage (all but row 1's, which rows 3 and 4 read through).
PAGED_PREFIX_ROWS = [0, PROMPT_ROW, PROMPT_ROW, 1, 1]
PAGED_PREFIX_LENS = [0, PROMPT_LEN, 60, 100, PROMPT_LEN]


@dataclass
class PagedDecodeProblem:
    """A decode problem (``slot``: its clean slot cache, ``R = B + 1`` rows) and its paged cache, poisoned:
    positions past each row's keys and blocks no row names hold NaN, table entries past them are garbage."""

    slot: AttentionProblem
    paged: PagedCache
    prefix_rows: torch.Tensor | None
    prefix_lens: torch.Tensor | None

    def clean_paged(self) -> PagedCache:
        """The paged cache with its NaN replaced by zeros (for the torch reference, which reads every position)."""
        return PagedCache(self.paged.k_cache.nan_to_num(0.0), self.paged.v_cache.nan_to_num(0.0), self.paged.block_tables)


def make_paged_decode_problem(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                              with_prefix: bool, device: torch.device | str = "cpu", seed: int = 0,
                              cache_values: torch.dtype | None = None) -> PagedDecodeProblem:
    """``PAGED_LENGTHS`` rows over ``L = 192`` positions, the prompt row's blocks shared by rows 1, 3, 4 (each
    whole prompt block), with ``PAGED_PREFIX_ROWS`` / ``PAGED_PREFIX_LENS`` if ``with_prefix``; ``cache_values``
    as for ``make_attention_problem``."""
    p = make_attention_problem(len(PAGED_LENGTHS), heads, kv_heads, 192, head_dim, dtype, cache_rows=len(PAGED_LENGTHS) + 1,
                               device=device, seed=seed, lengths=PAGED_LENGTHS, cache_values=cache_values)
    sharers = (1, 3, 4)
    for row, n in ((1, PROMPT_LEN), (2, 60), (3, PROMPT_LEN), (4, PROMPT_LEN)):  # row 2: the first 60 positions
        p.k_cache[row, :, :n] = p.k_cache[PROMPT_ROW, :, :n]
        p.v_cache[row, :, :n] = p.v_cache[PROMPT_ROW, :, :n]
    extents = PAGED_LENGTHS + [PROMPT_LEN]
    poisoned_k, poisoned_v = p.k_cache.clone(), p.v_cache.clone()
    for row, extent in enumerate(extents):
        poisoned_k[row, :, extent:] = float("nan")
        poisoned_v[row, :, extent:] = float("nan")
    whole = PROMPT_LEN // block_size
    shared = {row: (PROMPT_ROW, whole) for row in sharers}
    prefix_rows = prefix_lens = None
    hidden = None
    if with_prefix:
        prefix_rows = torch.tensor(PAGED_PREFIX_ROWS, device=device)
        prefix_lens = torch.tensor(PAGED_PREFIX_LENS, device=device)
        hidden = {row: n // block_size for row, n in enumerate(PAGED_PREFIX_LENS) if row in (2, 3, 4)}
    paged = page_cache(poisoned_k, poisoned_v, extents, block_size, seed=seed, shared=shared, hidden=hidden)
    assert (paged.block_tables < 0).any() and (paged.block_tables >= paged.k_cache.shape[0]).any(), "garbage entries"
    assert torch.equal(paged.block_tables[1, :whole], paged.block_tables[3, :whole]) or with_prefix, "shared blocks"
    return PagedDecodeProblem(p, paged, prefix_rows, prefix_lens)


def page_prefill_problem(p: PrefillProblem, block_size: int, shared: dict[int, int], seed: int = 0) -> PagedCache:
    """Pages a prefill problem's cache (``make_prefill_problem``; ``L`` a multiple of ``block_size``), each row up
    to its jobs' last position. ``shared = {row: source}``: the row's keys are the source's (copied into ``p``'s
    cache first, so ``prefill_loop_ref(p)`` holds) and its table names the source's blocks, the last one shared
    only as far as the row reads it."""
    extents = [0] * p.k_cache.shape[0]
    for row, start, n in zip(p.job_rows.tolist(), p.job_starts.tolist(), p.q_lens.tolist()):
        if n > 0:
            extents[row] = max(extents[row], start + n)
    for row, source in shared.items():
        assert 0 < extents[row] <= extents[source], "a row shares a source's keys up to its own last position"
        p.k_cache[row, :, : extents[row]] = p.k_cache[source, :, : extents[row]]
        p.v_cache[row, :, : extents[row]] = p.v_cache[source, :, : extents[row]]
    blocks = {row: (source, -(-extents[row] // block_size)) for row, source in shared.items()}
    return page_cache(p.k_cache, p.v_cache, extents, block_size, seed=seed, shared=blocks)
