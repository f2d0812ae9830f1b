"""Prompt-prefix K/V cache of the embedded engine, per adapter version.

A prompt position's K/V depend only on the tokens up to it (see ``ModelRunner.prefill``), so a block of
``block_size`` positions computed by one request's prefill is bit-identical (on the CPU) to the block any
other request with the same prefix would compute. This cache keeps such blocks keyed by
``(adapter, adapter version, hash of all tokens up to the block's end)``: the system prompt shared by a
tenant's episodes, the prompt shared by the samples of a GRPO group and the history of a multi-turn
episode are computed once. Keys carry the adapter version, and a publish drops the adapter's blocks, so
a tenant's update never serves stale K/V and never touches another tenant's entries.

It also keeps whole histories (opt-in, :meth:`insert_history`): the K/V a finished request's row holds
(its prompt and all but its last sampled token, partly computed by decode steps), so that the next turn
of its episode, whose prompt extends that history, computes only the new tokens. Blocks and histories
share one LRU order and one byte budget.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

BlockKV = tuple[torch.Tensor, torch.Tensor]  # (k, v) of one block in every layer, each [layers, KV, block_size, d]
# A cache row's first positions as copies of a cached block chain: (the chain's last block entry, positions).
# The entry is its key plus the serial number it was stored under (a chain evicted and computed again is a
# new entry), so rows with the same one hold the same K/V bytes over the positions both cover.
PrefixIdentity = tuple[tuple, int]
HISTORY_TAIL = 8  # a history is indexed by its length and its last tokens, then compared in full


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


class PrefixCache:
    """LRU store of prefill blocks and finished histories under a byte budget (0 disables it).

    Entry keys: ``("block", adapter, version, digest)`` -> :data:`BlockKV`;
    ``("history", adapter, version, serial)`` -> ``(tokens, kv, prefix)`` with ``kv`` each
    ``[layers, KV, len(tokens), d]`` and ``prefix`` the :data:`PrefixIdentity` of the history's first positions.
    """

    def __init__(self, block_size: int, budget_bytes: int) -> None:
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = 0
        self._entries: OrderedDict[tuple, BlockKV | tuple] = OrderedDict()
        # Histories by (adapter, version, length, last tokens) -> keys; and the lengths held per adapter version.
        self._history_index: dict[tuple, list[tuple]] = {}
        self._history_lengths: dict[tuple[str | None, int], dict[int, int]] = {}
        self._serial = 0
        self._block_serial: dict[tuple, int] = {}  # block key -> the serial number it was stored under

    def lookup(self, adapter: str | None, version: int, tokens: list[int]) -> tuple[list[BlockKV], tuple | None]:
        """The cached leading whole blocks of ``tokens`` (stopping at the first miss) and the entry (key and
        serial number, as in :data:`PrefixIdentity`) of the last one (None if none is cached). All of them may
        be cached: the caller still computes the last token (its logits are needed)."""
        usable = len(tokens) // self.block_size
        found, last = [], None
        for digest in block_hashes(tokens, self.block_size, usable):
            key = ("block", adapter, version, digest)
            blocks = self._entries.get(key)
            if blocks is None:
                break
            self._entries.move_to_end(key)
            found.append(blocks)
            last = key + (self._block_serial[key],)
        self.hits += len(found)
        return found, last

    def first_missing(self, adapter: str | None, version: int, tokens: list[int]) -> bytes | None:
        """The digest of the first block :meth:`lookup` would not find (the first block a prefill of
        ``tokens`` must compute and could share with another prompt), or None when every block
        ``lookup`` may return is cached or the cache is off. No side effects."""
        if self.budget_bytes <= 0:
            return None
        usable = len(tokens) // self.block_size
        for digest in block_hashes(tokens, self.block_size, usable):
            if ("block", adapter, version, digest) not in self._entries:
                return digest
        return None

    def insert(self, adapter: str | None, version: int, tokens: list[int], first_block: int,
               read_block: Callable[[int], BlockKV]) -> PrefixIdentity | None:
        """Stores the prompt's full blocks from ``first_block`` on; ``read_block(i)`` returns block ``i``'s K/V.

        Returns the identity of the caller's row when it stored blocks ``first_block..e-1`` itself (its
        positions below ``e * block_size`` are then the cache's bytes, the earlier ones having come from
        :meth:`lookup`): ``(key of block e - 1, e * block_size)``; None when it stored none."""
        if self.budget_bytes <= 0:
            return None
        full = len(tokens) // self.block_size
        identity, run_open = None, True
        for index, digest in enumerate(block_hashes(tokens, self.block_size, full)):
            key = ("block", adapter, version, digest)
            if index < first_block:
                continue
            if key in self._entries:
                run_open = False  # cached by another row: its bytes, not necessarily this row's
                continue
            blocks = read_block(index)
            self._serial += 1
            self._block_serial[key] = self._serial
            self._store(key, blocks, blocks)
            if run_open:
                identity = (key + (self._serial,), (index + 1) * self.block_size)
        self._evict()
        return identity

    def insert_history(self, adapter: str | None, version: int, tokens: list[int], kv: BlockKV,
                       prefix: PrefixIdentity | None = None) -> None:
        """Stores the K/V ``kv`` (each ``[layers, KV, len(tokens), d]``) of the positions of ``tokens``, whose
        first positions may be copies of a cached block chain (``prefix``, handed back by :meth:`take_history`)."""
        if self.budget_bytes <= 0 or not tokens:
            return
        self._serial += 1
        key = ("history", adapter, version, self._serial)
        length = len(tokens)
        self._history_index.setdefault((adapter, version, length, _tail(tokens, length)), []).append(key)
        lengths = self._history_lengths.setdefault((adapter, version), {})
        lengths[length] = lengths.get(length, 0) + 1
        self._store(key, (list(tokens), kv, prefix), kv)
        self._evict()

    def take_history(self, adapter: str | None, version: int,
                     tokens: list[int]) -> tuple[int, BlockKV, PrefixIdentity | None] | None:
        """Removes and returns the longest stored history that is a prefix of ``tokens`` (``(length, kv,
        prefix)``), or None. A history serves one next turn: the turn's own history replaces it when it finishes."""
        lengths = self._history_lengths.get((adapter, version), {})
        for length in sorted((n for n in lengths if n <= len(tokens)), reverse=True):
            for key in self._history_index.get((adapter, version, length, _tail(tokens, length)), []):
                stored, kv, prefix = self._entries[key]
                if stored == tokens[:length]:
                    self._remove(key)
                    self.hits += 1
                    return length, kv, prefix
        return None

    def drop_adapter(self, adapter: str | None) -> None:
        """Forgets every block and history of ``adapter`` (called when it gets a new version or is removed)."""
        for key in [key for key in self._entries if key[1] == adapter]:
            self._remove(key)

    def _store(self, key: tuple, value: BlockKV | tuple, kv: BlockKV) -> None:
        self._entries[key] = value
        self.used_bytes += kv[0].nbytes + kv[1].nbytes

    def _remove(self, key: tuple) -> None:
        value = self._entries.pop(key)
        if key[0] == "history":
            tokens, kv, _ = value
            _, adapter, version, _ = key
            index_key = (adapter, version, len(tokens), _tail(tokens, len(tokens)))
            self._history_index[index_key].remove(key)
            if not self._history_index[index_key]:
                del self._history_index[index_key]
            lengths = self._history_lengths[(adapter, version)]
            lengths[len(tokens)] -= 1
            if not lengths[len(tokens)]:
                del lengths[len(tokens)]
            if not lengths:
                del self._history_lengths[(adapter, version)]
        else:
            kv = value
            del self._block_serial[key]
        self.used_bytes -= kv[0].nbytes + kv[1].nbytes

    def _evict(self) -> None:
        while self.used_bytes > self.budget_bytes and self._entries:
            self._remove(next(iter(self._entries)))
