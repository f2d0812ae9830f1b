"""The retail database of one episode: copy-on-write tables over a base loaded once per process.

A tau-bench retail database is ``{"users": {user_id: record}, "orders": {order_id: record},
"products": {product_id: record}}`` where every record is a JSON object. The benchmark reloads the JSON
files for every episode (and once more to replay the ground truth); here the files are parsed once and
each episode gets a :class:`CowTable` per table: a shallow copy of the base table whose records are
shared with the base until a tool asks for one to write (:func:`record_for_write`), which then gets
its own deep copy. An episode therefore behaves exactly as if it ran on a fresh deep copy, at the cost
of copying only the records it changes, and two episodes over the same base differ only in their owned
records, which makes comparing them O(changed records) instead of O(database).

Equality follows the benchmark's hash: values compare by their canonical JSON text (keys sorted), so
``1`` and ``1.0`` and ``True`` are distinct, as they are in tau-bench's ``str()``-based hash.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator, Mapping

TABLES: tuple[str, ...] = ("users", "orders", "products")

Record = dict[str, Any]
Database = dict[str, dict[str, Record]]


class CowTable(dict):
    """A table (record id -> record) whose records are shared with ``base`` until written.

    Reading through the dict interface may return a record of the base, which must not be mutated;
    :meth:`writable` returns the table's own deep copy of a record (made on first call). ``base`` is
    never modified.
    """

    __slots__ = ("base", "owned")

    def __init__(self, base: Mapping[str, Record] | None = None) -> None:
        base = {} if base is None else base
        super().__init__(base)
        self.base: Mapping[str, Record] = base
        self.owned: set[str] = set()

    def writable(self, key: str) -> Record:
        """The record ``key`` as this table's private copy, safe to mutate; KeyError if absent."""
        if key not in self.owned:
            self[key] = copy.deepcopy(self[key])
            self.owned.add(key)
        return self[key]


def record_for_write(table: dict[str, Record], key: str) -> Record:
    """The record ``key`` of ``table`` ready to be mutated in place.

    On a :class:`CowTable` this is the table's private copy; on a plain dict the record itself (the caller
    owns plain-dict databases). KeyError if the record does not exist.
    """
    if isinstance(table, CowTable):
        return table.writable(key)
    return table[key]


def fresh_database(base: Mapping[str, Mapping[str, Record]]) -> Database:
    """A new episode database over ``base``: equivalent to a deep copy, but copies records on write."""
    return {name: CowTable(base[name]) for name in TABLES}


def _canonical(value: Any) -> str:
    """Canonical text of a JSON value: equal text iff tau-bench's ``to_hashable`` hash is equal."""
    return json.dumps(value, sort_keys=True)


def _candidate_keys(left: dict[str, Record], right: dict[str, Record]) -> Iterator[str]:
    """Record ids that can differ between two versions of one table.

    Two CowTables over the same base can only differ in records one of them owns or holds alone; any
    other pair of tables is compared on all of its ids.
    """
    if isinstance(left, CowTable) and isinstance(right, CowTable) and left.base is right.base:
        yield from sorted(left.owned | right.owned | (left.keys() ^ right.keys()))
    else:
        yield from sorted(set(left) | set(right))


def diff_databases(left: Mapping[str, dict[str, Record]], right: Mapping[str, dict[str, Record]]) -> list[str]:
    """The records that differ between two databases, as ``"table/record_id"`` strings (empty: equal)."""
    differing: list[str] = []
    for name in sorted(set(left) | set(right)):
        left_table, right_table = left.get(name, {}), right.get(name, {})
        for key in _candidate_keys(left_table, right_table):
            left_record, right_record = left_table.get(key), right_table.get(key)
            if left_record is right_record:
                continue
            if _canonical(left_record) != _canonical(right_record):
                differing.append(f"{name}/{key}")
    return differing
