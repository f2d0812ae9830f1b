"""Tests of ``skyrl_clora.recipes.taubench.db``: each episode's database behaves as a fresh deep copy of the base
tables (copy-on-write records, the base never written), and two databases compare record by record as the
benchmark's hash compares them (``1`` and ``1.0`` differ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_clora.recipes.taubench.data import load_retail_data
from skyrl_clora.recipes.taubench.db import CowTable, diff_databases, fresh_database, record_for_write
from skyrl_clora.recipes.taubench.tools import invoke
from tests.support.taubench_retail import ADDRESS, data_dir  # noqa: F401 (data_dir: a fixture)


def test_episode_databases_are_independent_copies(data_dir: Path) -> None:
    data = load_retail_data(data_dir)
    before = json.dumps(data.tables, sort_keys=True)
    first, second = data.fresh_db(), data.fresh_db()
    invoke(first, "cancel_pending_order", {"order_id": "#W1000003", "reason": "no longer needed"})
    invoke(first, "modify_user_address", {"user_id": "ada_lovelace_1001", **ADDRESS})
    assert json.dumps(data.tables, sort_keys=True) == before
    assert second["orders"]["#W1000003"]["status"] == "pending"
    assert diff_databases(first, second) == ["orders/#W1000003", "users/ada_lovelace_1001", "users/alan_turing_1002"]
    # A plain deep copy compares the same way as the copy-on-write view.
    plain = json.loads(json.dumps(first))
    assert diff_databases(plain, first) == [] and len(diff_databases(plain, second)) == 3


def test_equality_distinguishes_int_from_float_like_the_benchmark_hash(data_dir: Path) -> None:
    data = load_retail_data(data_dir)
    left, right = data.fresh_db(), data.fresh_db()
    left["users"].writable("alan_turing_1002")["payment_methods"]["gift_card_1002"]["balance"] = 5
    assert diff_databases(left, right) == ["users/alan_turing_1002"]


def test_a_record_is_copied_once_on_its_first_write() -> None:
    base = {"users": {"u1": {"name": {"first": "A"}}, "u2": {"name": {"first": "B"}}}, "orders": {}, "products": {}}
    db = fresh_database(base)
    assert isinstance(db["users"], CowTable) and db["users"]["u1"] is base["users"]["u1"]
    mine = record_for_write(db["users"], "u1")
    assert mine is not base["users"]["u1"] and mine == base["users"]["u1"]
    assert record_for_write(db["users"], "u1") is mine
    mine["name"]["first"] = "Z"
    assert base["users"]["u1"]["name"]["first"] == "A" and db["users"].owned == {"u1"}
    assert diff_databases(db, fresh_database(base)) == ["users/u1"]
    with pytest.raises(KeyError):
        record_for_write(db["users"], "u3")
    plain = {"u1": {"name": "A"}}
    assert record_for_write(plain, "u1") is plain["u1"]  # a plain dict database is the caller's own


def test_added_removed_and_missing_tables_count_as_differences() -> None:
    base = {"users": {"u1": {"a": 1}}, "orders": {"o1": {"s": "x"}}, "products": {}}
    left, right = fresh_database(base), fresh_database(base)
    left["orders"]["o2"] = {"s": "y"}
    del right["users"]["u1"]
    assert diff_databases(left, right) == ["orders/o2", "users/u1"]
    assert diff_databases({"users": {"u1": {"a": 1}}}, {}) == ["users/u1"]
    assert diff_databases({"t": {"k": {"a": [1, 2]}}}, {"t": {"k": {"a": [1, 2]}}}) == []
    assert diff_databases({"t": {"k": {"a": True}}}, {"t": {"k": {"a": 1}}}) == ["t/k"]
