"""Tests of ``skyrl_clora.recipes.taubench.synthetic``: the self-made retail data folder has the real benchmark's
files and shapes, its records agree with each other (users' order lists, order items priced as their product's
variants, payments summing to the items), its orders cover every status, its train tasks exercise each
database-changing tool once, and every task's ground truth runs without a tool error (the test tasks' expected
outputs appearing in what their tools return)."""

from __future__ import annotations

import json
from pathlib import Path

from skyrl_clora.recipes.taubench.data import load_retail_data, load_tasks
from skyrl_clora.recipes.taubench.db import diff_databases
from skyrl_clora.recipes.taubench.synthetic import POLICY, make_synthetic_retail
from skyrl_clora.recipes.taubench.tools import invoke
from tests.support.taubench_retail import data_dir  # noqa: F401 (data_dir: a fixture)

DATABASE_CHANGING_TOOLS = {
    "cancel_pending_order", "exchange_delivered_order_items", "modify_pending_order_address",
    "modify_pending_order_items", "modify_pending_order_payment", "modify_user_address", "return_delivered_order_items",
}


def test_the_folder_has_the_benchmarks_files(tmp_path: Path) -> None:
    folder = make_synthetic_retail(tmp_path / "a" / "retail")
    assert folder == tmp_path / "a" / "retail"
    assert sorted(p.name for p in folder.iterdir()) == [
        "orders.json", "products.json", "tasks_test.json", "tasks_train.json", "users.json", "wiki.md"]
    assert (folder / "wiki.md").read_text() == POLICY
    again = make_synthetic_retail(tmp_path / "b")
    for name in ("orders.json", "users.json", "tasks_train.json"):
        assert (folder / name).read_text() == (again / name).read_text()
    assert [len(json.loads((folder / f"{t}.json").read_text())) for t in ("products", "users", "orders")] == [3, 3, 7]
    assert (len(load_tasks(folder, "train")), len(load_tasks(folder, "test"))) == (7, 4)


def test_records_agree_with_each_other(data_dir: Path) -> None:
    tables = load_retail_data(data_dir).tables
    users, orders, products = tables["users"], tables["orders"], tables["products"]
    for user_id, user in users.items():
        assert user["orders"] == [oid for oid, order in orders.items() if order["user_id"] == user_id]
        assert all(method["id"] == method_id for method_id, method in user["payment_methods"].items())
    for order in orders.values():
        for item in order["items"]:
            variant = products[item["product_id"]]["variants"][item["item_id"]]
            assert (item["price"], item["options"]) == (variant["price"], variant["options"])
        payment = order["payment_history"][0]
        assert payment["transaction_type"] == "payment"
        assert payment["amount"] == round(sum(item["price"] for item in order["items"]), 2)
        assert payment["payment_method_id"] in users[order["user_id"]]["payment_methods"]
        assert len(order["payment_history"]) == (2 if order["status"] == "cancelled" else 1)
        assert bool(order["fulfillments"]) == (order["status"] in ("processed", "delivered"))
    assert {order["status"] for order in orders.values()} == {"pending", "processed", "delivered", "cancelled"}
    assert not all(v["available"] for p in products.values() for v in p["variants"].values())


def test_every_ground_truth_runs_and_each_train_task_changes_the_database(data_dir: Path) -> None:
    data = load_retail_data(data_dir)
    changing = []
    for split in ("train", "test"):
        for task in load_tasks(data_dir, split):
            db = data.fresh_db()
            observations = [invoke(db, action.name, action.kwargs) for action in task.actions]
            assert not any(o.startswith(("Error", "Unknown")) for o in observations), (task, observations)
            assert all(any(output in o for o in observations) for output in task.outputs), (task, observations)
            if split == "train":
                assert diff_databases(db, data.fresh_db()) != []
                changing += [action.name for action in task.actions]
    assert sorted(changing) == sorted(DATABASE_CHANGING_TOOLS)
