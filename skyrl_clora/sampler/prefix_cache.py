"""Prompt-prefix K/V cache of the embedded engine, per adapter version.

The model runner prefills prompts in position-aligned blocks whose K/V depend only on the tokens up to
the block's end (see ``ModelRunner.prefill``), so a block computed for one request is bit-identical to
the block any other request with the same prefix would compute. This cache keeps such blocks keyed by
``(adapter, adapter version, hash of all tokens up to the block's end)``: the system prompt shared by a
tenant's episodes, the prompt shared by the samples of a GRPO group and the history of a multi-turn
episode are computed once. Keys carry the adapter version, and a publish drops the adapter's blocks, so
a tenant's update never serves stale K/V and never touches another tenant's entries.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

BlockKV = tuple[torch.Tensor, torch.Tensor]  # (k, v) of one block in every layer, each [layers, KV, block_size, d]


def block_hashes(tokens: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Cumulative digests: entry ``i`` identifies ``tokens[: (i + 1) * block_size]`` (tokens as int32 LE)."""
    data = np.asarray(tokens[: num_blocks * block_size], dtype="<i4").tobytes()
    step = 4 * block_size
    digests, running = [], hashlib.sha256()
    for index in range(num_blocks):
        running.update(data[index * step : (index + 1) * step])
        digests.append(running.copy().digest())
    return digests


class PrefixCache:
    """LRU store of prefill blocks under a byte budget (0 disables it)."""

    def __init__(self, block_size: int, budget_bytes: int) -> None:
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = 0
        self._blocks: OrderedDict[tuple[str | None, int, bytes], BlockKV] = OrderedDict()

    def lookup(self, adapter: str | None, version: int, tokens: list[int]) -> list[BlockKV]:
        """The cached leading blocks of ``tokens`` (stopping at the first miss), leaving at least the block
        that holds the last token to be computed (its logits are needed)."""
        usable = (len(tokens) - 1) // self.block_size
        found = []
        for digest in block_hashes(tokens, self.block_size, usable):
            key = (adapter, version, digest)
            blocks = self._blocks.get(key)
            if blocks is None:
                break
            self._blocks.move_to_end(key)
            found.append(blocks)
        self.hits += len(found)
        return found

    def first_missing(self, adapter: str | None, version: int, tokens: list[int]) -> bytes | None:
        """The digest of the first block :meth:`lookup` would not find (the first block a prefill of
        ``tokens`` must compute and could share with another prompt), or None when every block
        ``lookup`` may return is cached or the cache is off. No side effects."""
        if self.budget_bytes <= 0:
            return None
        usable = (len(tokens) - 1) // self.block_size
        for digest in block_hashes(tokens, self.block_size, usable):
            if (adapter, version, digest) not in self._blocks:
                return digest
        return None

    def insert(self, adapter: str | None, version: int, tokens: list[int], first_block: int,
               read_block: Callable[[int], BlockKV]) -> None:
        """Stores the prompt's full blocks from ``first_block`` on; ``read_block(i)`` returns block ``i``'s K/V."""
        if self.budget_bytes <= 0:
            return
        full = len(tokens) // self.block_size
        for index, digest in enumerate(block_hashes(tokens, self.block_size, full)):
            key = (adapter, version, digest)
            if index < first_block or key in self._blocks:
                continue
            blocks = read_block(index)
            self._blocks[key] = blocks
            self.used_bytes += blocks[0].nbytes + blocks[1].nbytes
        while self.used_bytes > self.budget_bytes and self._blocks:
            _, evicted = self._blocks.popitem(last=False)
            self.used_bytes -= evicted[0].nbytes + evicted[1].nbytes

    def drop_adapter(self, adapter: str | None) -> None:
        """Forgets every block of ``adapter`` (called when it gets a new version or is removed)."""
        for key in [key for key in self._blocks if key[0] == adapter]:
            evicted = self._blocks.pop(key)
            self.used_bytes -= evicted[0].nbytes + evicted[1].nbytes
