"""Which cache rows share their leading KV blocks, so that a decode step's attention reads them once.

Every row that starts with a prompt's keyed blocks holds them by reference (the samples of a GRPO group, the
episodes sharing a system prompt), and a finished turn's history hands them on to the next turn's row. Rows
whose leading keyed blocks are the same (one :data:`PrefixIdentity`) hold the same K/V there; decode
attention then reads those positions once for the group, through one member's block table, the group's
*source* (``decode_attention``'s ``prefix_rows`` / ``prefix_lens``): one program per kv head and key split
takes the query heads of up to ``PREFIX_GROUP_ROWS`` rows, so the shared K/V are read once instead of once
per row. The rows of one identity are cut into groups of that many (by row), and a group's source is its
member covering the most positions (the lowest row among equals), so every member's positions are inside
it. The answer equals each row reading its own table up to rounding.
"""

from __future__ import annotations

import numpy as np

from skyrl_clora.kernels.attention.decode import PREFIX_GROUP_ROWS
from skyrl_clora.sampler.block_manager import PrefixIdentity


class SharedPrefixRows:
    """Per cache row, the identity of its leading shared blocks and its group's source row (recomputed only after a
    row joins or leaves); per decode batch, each position's source position and shared length."""

    def __init__(self, num_rows: int) -> None:
        self._identity: list[PrefixIdentity | None] = [None] * num_rows
        self._sources: tuple[np.ndarray, np.ndarray] | None = None  # per cache row: source row, shared length
        self.borrowed_positions = 0  # positions the rows read from another row (as of the last sources())

    def assign(self, row: int, identity: PrefixIdentity | None) -> None:
        """Row ``row`` now holds ``identity``'s positions (None: nothing shared)."""
        self._identity[row] = identity if identity is not None and identity[1] > 0 else None
        self._sources = None

    def clear(self, row: int) -> None:
        """Row ``row`` was retired (its K/V will be overwritten)."""
        self.assign(row, None)

    def identity(self, row: int) -> PrefixIdentity | None:
        return self._identity[row]

    def sources(self, rows: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
        """``(prefix_rows, prefix_lens)`` for a decode batch whose first ``len(rows)`` positions run cache rows
        ``rows`` (the running rows, distinct) and whose positions up to ``span`` are idle: for each position, the
        batch position of its group's source and how many positions it reads there (0, reading itself, for a row
        outside any group, an idle position, or a source not in the batch). int64 arrays of ``span``."""
        if self._sources is None:
            chains: dict[tuple, list[int]] = {}  # chain key -> its rows, in row order
            for row, identity in enumerate(self._identity):
                if identity is not None:
                    chains.setdefault(identity[0], []).append(row)
            sources = np.arange(len(self._identity), dtype=np.int64)
            lens = np.zeros(len(self._identity), dtype=np.int64)
            for members in chains.values():
                for first in range(0, len(members), PREFIX_GROUP_ROWS):
                    group = members[first : first + PREFIX_GROUP_ROWS]
                    source = max(group, key=lambda row: (self._identity[row][1], -row))
                    for row in group:
                        sources[row], lens[row] = source, self._identity[row][1]
            self._sources = (sources, lens)
            self.borrowed_positions = int(lens[sources != np.arange(len(sources))].sum())
        sources, lens = self._sources
        count = len(rows)
        position = np.full(len(sources), -1, dtype=np.int64)
        position[rows] = np.arange(count)
        source_position = position[sources[rows]]
        found = (lens[rows] > 0) & (source_position >= 0)
        prefix_rows = np.arange(span, dtype=np.int64)
        prefix_lens = np.zeros(span, dtype=np.int64)
        prefix_rows[:count] = np.where(found, source_position, prefix_rows[:count])
        prefix_lens[:count] = np.where(found, lens[rows], 0)
        return prefix_rows, prefix_lens
