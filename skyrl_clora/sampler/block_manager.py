"""Paged KV blocks of the embedded engine: one pool of fixed-size blocks shared, by reference, by the running
rows, the prompt-prefix cache and the finished-turn histories.

A cache row holds blocks as it grows (position ``p`` of row ``r`` lives in block ``tables[r, p // BS]`` at
offset ``p % BS``), never a reservation of the maximum length. A block is reference counted: each row and
each history holding it counts once. Blocks of a prompt's whole ``BS``-token spans are also *keyed* (the
prefix cache) by ``(adapter, adapter version, digest of every token up to the block's end)``: a later prompt
with the same prefix (a GRPO group's other samples, a tenant's shared system prompt) takes those blocks into
its own table instead of computing them. A finished request's blocks may be kept as a *history* (its prompt
and sampled tokens), which the next turn of its episode adopts whole, computing only its new tokens. No K/V
is copied between rows, cache and histories; the one copy is of a single shared block that a row must write
into (``make_writable``: copy on write).

A block whose count drops to 0 is free, or, if keyed, *evictable*: it stays findable until the pool needs
it. Allocation takes a free block first, then the least recently used evictable block, and only when none is
left the oldest history (its blocks return to the pool as it is dropped): a history is the next turn of an episode
under way, adopted soon, while an unreferenced prompt block serves only prompts that have not arrived. A publish of
an adapter drops its keys and histories (a new version never reads K/V of the old one; other adapters' entries
stay).

Free rows' table entries name a scratch block (index ``num_blocks``, one past the pool) that decode steps of
rows not running and a prefill pass's padding write into, so every table entry is a valid block.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

HISTORY_TAIL = 8  # a history is indexed by its length and its last tokens, then compared in full
# A row's first positions as blocks other rows may hold too: (its leading keyed blocks, their positions). Rows
# with the same one hold the very same K/V there (decode attention may read them once for several rows).
PrefixIdentity = tuple[tuple[int, ...], int]


def block_hashes(tokens: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Cumulative digests: entry ``i`` identifies ``tokens[: (i + 1) * block_size]`` (tokens as int32 LE)."""
    data = np.asarray(tokens[: num_blocks * block_size], dtype="<i4").tobytes()
    step = 4 * block_size
    digests, running = [], hashlib.sha256()
    for index in range(num_blocks):
        running.update(data[index * step : (index + 1) * step])
        digests.append(running.copy().digest())
    return digests


def _tail(tokens: list[int], length: int) -> tuple[int, ...]:
    """The last (up to) :data:`HISTORY_TAIL` tokens of ``tokens[:length]``."""
    return tuple(tokens[max(0, length - HISTORY_TAIL) : length])


@dataclass
class History:
    """A finished request's K/V kept for its episode's next turn: ``tokens`` (prompt and all sampled tokens
    but the last) in ``blocks`` (one reference each), stamped with the allocation clock when stored and with the
    caller's clock (``kept_at``: the scheduler's decode steps)."""

    adapter: str | None
    version: int
    tokens: list[int]
    blocks: list[int]
    stamp: int
    kept_at: int = 0


class BlockManager:
    """The block pool and every row's block table (see module docstring).

    ``tables: [num_rows + 1, max_blocks_per_row]`` int32 (host; the last row is the scratch row of a prefill
    pass's padding) and ``dirty`` (set when a table changed: the runner copies them to the device before its
    next pass). ``cache_prefixes=False`` keys nothing and keeps no history (every prompt computed in full)."""

    def __init__(self, num_blocks: int, block_size: int, num_rows: int, max_blocks_per_row: int,
                 cache_prefixes: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_row = max_blocks_per_row
        self.cache_prefixes = cache_prefixes
        self.scratch = num_blocks
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest ids first
        self._key_of: dict[int, tuple] = {}
        self._cached: dict[tuple, int] = {}
        self._evictable: OrderedDict[int, int] = OrderedDict()  # keyed blocks held by nothing -> stamp, oldest first
        self._histories: OrderedDict[int, History] = OrderedDict()  # serial -> history, oldest first
        self._history_index: dict[tuple, list[int]] = {}  # (adapter, version, length, tail) -> serials
        self._history_lengths: dict[tuple[str | None, int], dict[int, int]] = {}
        self._clock = itertools.count()
        self.tables = np.full((num_rows + 1, max_blocks_per_row), self.scratch, dtype=np.int32)
        self.row_blocks: list[list[int]] = [[] for _ in range(num_rows)]
        self.row_counts = np.zeros(num_rows, dtype=np.int64)  # len(row_blocks[r]) per row
        self.dirty = True
        self.hits = 0  # blocks and histories found for a prompt
        self.evictions = 0  # evictable blocks and histories dropped to make room

    # ---- pool -----------------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks an allocation can take without dropping a history: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def held_blocks(self) -> int:
        """Blocks held by a row or a history."""
        return int(np.count_nonzero(self.refs))

    def reclaim(self, needed: int, kept_before: int | None = None) -> bool:
        """Drops histories, oldest first, until ``needed`` blocks are available, taking only those kept before
        ``kept_before`` (all when None), and none when those could not make ``needed`` available; whether they
        are."""
        freeable, chosen = self.available(), []
        for serial, history in self._histories.items():
            if freeable >= needed or (kept_before is not None and history.kept_at >= kept_before):
                break
            chosen.append(serial)
            freeable += sum(1 for block in history.blocks if self.refs[block] == 1)
        if freeable < needed:
            return False
        for serial in chosen:
            self._drop_history(serial)
            self.evictions += 1
        return True

    def _allocate(self) -> int | None:
        """One block with a reference for the caller: a free one, else the least recently used evictable block,
        else a block of the oldest history (dropped for it), else None."""
        while not self._free:
            if not self._evictable and not self._histories:
                return None
            self.evictions += 1
            if self._evictable:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._key_of.pop(block)]
                self._free.append(block)
            else:
                self._drop_history(next(iter(self._histories)))
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def _incref(self, block: int) -> None:
        if self.refs[block] == 0:
            self._evictable.pop(block, None)
        self.refs[block] += 1

    def _decref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = next(self._clock)
            else:
                self._free.append(block)

    # ---- rows -----------------------------------------------------------------------------------

    def adopt(self, row: int, blocks: list[int], owned: bool) -> None:
        """Row ``row`` (holding nothing) starts with ``blocks``: a reference is taken on each, or, ``owned``, the
        caller hands its references over (a history taken with :meth:`take_history`)."""
        if self.row_blocks[row]:
            raise RuntimeError(f"row {row} still holds {len(self.row_blocks[row])} blocks")
        if not owned:
            for block in blocks:
                self._incref(block)
        self.row_blocks[row] = list(blocks)
        self.row_counts[row] = len(blocks)
        self.tables[row, : len(blocks)] = blocks
        self.dirty = True

    def grow(self, row: int, count: int) -> bool:
        """Gives row ``row`` at least ``count`` blocks (positions below ``count * block_size``); whether the pool
        had them (the blocks it did have stay with the row either way)."""
        held = self.row_blocks[row]
        if count > self.max_blocks_per_row:
            raise ValueError(f"row {row} asks for {count} blocks; a row holds at most {self.max_blocks_per_row}")
        while len(held) < count:
            block = self._allocate()
            if block is None:
                return False
            self.tables[row, len(held)] = block
            held.append(block)
            self.row_counts[row] = len(held)
            self.dirty = True
        return True

    def make_writable(self, row: int, index: int) -> tuple[int, int] | None:
        """Makes block ``index`` of row ``row`` the row's own before the row writes into it: if it is shared
        (another holder, or keyed), the row gets a new block instead. Returns ``(source, copy)`` for the caller
        to copy the K/V from, or None when the block was the row's alone. Raises :class:`MemoryError` when no
        block is available."""
        block = self.row_blocks[row][index]
        if self.refs[block] == 1 and block not in self._key_of:
            return None
        copy = self._allocate()
        if copy is None:
            raise MemoryError("no KV block is free to copy a shared block into")
        self._decref(block)
        self.row_blocks[row][index] = copy
        self.tables[row, index] = copy
        self.dirty = True
        return block, copy

    def release(self, row: int) -> None:
        """Row ``row`` holds nothing any more: its blocks lose a reference, its table names the scratch block."""
        for block in self.row_blocks[row]:
            self._decref(block)
        if self.row_blocks[row]:
            self.tables[row, : len(self.row_blocks[row])] = self.scratch
            self.dirty = True
        self.row_blocks[row] = []
        self.row_counts[row] = 0

    def identity(self, row: int) -> PrefixIdentity | None:
        """Row ``row``'s leading keyed blocks and their positions (None: its first block is not keyed)."""
        blocks = self.row_blocks[row]
        count = next((i for i, block in enumerate(blocks) if block not in self._key_of), len(blocks))
        return (tuple(blocks[:count]), count * self.block_size) if count else None

    # ---- prefix cache -----------------------------------------------------------------------------

    def lookup(self, adapter: str | None, version: int, tokens: list[int]) -> list[int]:
        """The keyed blocks of ``tokens``' leading whole blocks, stopping at the first miss (no reference taken;
        found evictable blocks become the most recently used)."""
        found, _ = self.keyed_prefix(adapter, version, tokens)
        for block in found:
            if block in self._evictable:
                self._evictable[block] = next(self._clock)
                self._evictable.move_to_end(block)
        self.hits += len(found)
        return found

    def keyed_prefix(self, adapter: str | None, version: int, tokens: list[int]) -> tuple[list[int], bytes | None]:
        """``tokens``' leading whole blocks that are keyed (stopping at the first miss), and the digest of that
        first whole block not keyed (one a prefill must compute and could share with another prompt; None when
        every whole block is keyed or caching is off). No side effects."""
        if not self.cache_prefixes:
            return [], None
        found = []
        for digest in block_hashes(tokens, self.block_size, len(tokens) // self.block_size):
            block = self._cached.get((adapter, version, digest))
            if block is None:
                return found, digest
            found.append(block)
        return found, None

    def admission_cost(self, prompt_len: int, keyed: list[int], reused: int) -> int:
        """Blocks admitting a prompt of ``prompt_len`` tokens takes from :meth:`available`: its blocks past the
        ``reused`` ones it adopts (a history's), or past its ``keyed`` leading blocks (:meth:`keyed_prefix`; those
        held by nothing count, as they stop being evictable), plus one for a copy on write."""
        total = -(-prompt_len // self.block_size)
        if reused:
            return total - min(reused, total) + 1
        return total - len(keyed) + sum(1 for block in keyed if self.refs[block] == 0) + 1

    def key_prompt(self, row: int, adapter: str | None, version: int, tokens: list[int], first_block: int) -> None:
        """Keys row ``row``'s blocks ``first_block..`` that hold whole blocks of its prompt ``tokens`` (computed by
        its prefill), unless another block holds that prefix already."""
        if not self.cache_prefixes:
            return
        for index, digest in enumerate(block_hashes(tokens, self.block_size, len(tokens) // self.block_size)):
            if index < first_block:
                continue
            key = (adapter, version, digest)
            block = self.row_blocks[row][index]
            if key in self._cached or block in self._key_of:
                continue
            self._cached[key] = block
            self._key_of[block] = key

    def keep_history(self, row: int, adapter: str | None, version: int, tokens: list[int], now: int = 0) -> None:
        """Keeps the blocks of row ``row`` holding ``tokens``' positions as a history kept at ``now`` (the caller's
        clock), then releases the row."""
        if self.cache_prefixes and tokens:
            blocks = self.row_blocks[row][: -(-len(tokens) // self.block_size)]
            for block in blocks:
                self._incref(block)
            self.store_history(adapter, version, tokens, blocks, now)
        self.release(row)

    def store_history(self, adapter: str | None, version: int, tokens: list[int], blocks: list[int],
                      now: int = 0) -> None:
        """Stores ``blocks`` (whose references the caller hands over) as the history of ``tokens``, kept at
        ``now``."""
        serial = next(self._clock)
        self._histories[serial] = History(adapter, version, list(tokens), list(blocks), serial, now)
        length = len(tokens)
        self._history_index.setdefault((adapter, version, length, _tail(tokens, length)), []).append(serial)
        lengths = self._history_lengths.setdefault((adapter, version), {})
        lengths[length] = lengths.get(length, 0) + 1

    def take_history(self, adapter: str | None, version: int, tokens: list[int]) -> tuple[int, list[int]] | None:
        """Removes the longest history of ``adapter`` at ``version`` that is a prefix of ``tokens`` and returns
        ``(its length, its blocks)`` with their references (for :meth:`adopt` with ``owned``), or None."""
        serial = self._find_history(adapter, version, tokens)
        if serial is None:
            return None
        history = self._forget_history(serial)
        self.hits += 1
        return len(history.tokens), history.blocks

    def has_history(self, adapter: str | None, version: int, tokens: list[int]) -> bool:
        """Whether a history of ``adapter`` at ``version`` is a prefix of ``tokens`` (nothing changes)."""
        return self._find_history(adapter, version, tokens) is not None

    def _find_history(self, adapter: str | None, version: int, tokens: list[int]) -> int | None:
        """The serial of the longest history of ``adapter`` at ``version`` that is a prefix of ``tokens``, or None."""
        lengths = self._history_lengths.get((adapter, version), {})
        for length in sorted((n for n in lengths if n <= len(tokens)), reverse=True):
            for serial in self._history_index.get((adapter, version, length, _tail(tokens, length)), []):
                if self._histories[serial].tokens == tokens[:length]:
                    return serial
        return None

    def drop_adapter(self, adapter: str | None) -> None:
        """Forgets ``adapter``'s keys and histories (it has a new version, or is gone); rows keep their blocks."""
        for serial in [s for s, history in self._histories.items() if history.adapter == adapter]:
            self._drop_history(serial)
        for key in [key for key in self._cached if key[0] == adapter]:
            block = self._cached.pop(key)
            del self._key_of[block]
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    def _forget_history(self, serial: int) -> History:
        """Removes history ``serial`` from the index (its references go to the caller)."""
        history = self._histories.pop(serial)
        length = len(history.tokens)
        index_key = (history.adapter, history.version, length, _tail(history.tokens, length))
        self._history_index[index_key].remove(serial)
        if not self._history_index[index_key]:
            del self._history_index[index_key]
        lengths = self._history_lengths[(history.adapter, history.version)]
        lengths[length] -= 1
        if not lengths[length]:
            del lengths[length]
        if not lengths:
            del self._history_lengths[(history.adapter, history.version)]
        return history

    def _drop_history(self, serial: int) -> None:
        for block in self._forget_history(serial).blocks:
            self._decref(block)
