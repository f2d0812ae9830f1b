"""Tests of ``skyrl_clora.recipes.taubench.tools``: the 16 retail tools on the project's synthetic data folder.

Error strings are the benchmark's (sierra-research/tau-bench retail tools); the expected database
updates are worked out by hand from the synthetic data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_clora.recipes.taubench.data import load_retail_data
from skyrl_clora.recipes.taubench.db import diff_databases
from skyrl_clora.recipes.taubench.tools import invoke
from tests.support.taubench_retail import ADDRESS, data_dir  # noqa: F401 (data_dir: a fixture)


@pytest.fixture()
def db(data_dir: Path) -> dict:
    return load_retail_data(data_dir).fresh_db()


def _pairs(order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str) -> dict:
    return {"order_id": order_id, "item_ids": item_ids, "new_item_ids": new_item_ids,
            "payment_method_id": payment_method_id}


# (tool, arguments, the benchmark's observation) on the untouched synthetic database.
VALIDATION_CASES = [
    ("cancel_pending_order", {"order_id": "#W9999999", "reason": "no longer needed"}, "Error: order not found"),
    ("cancel_pending_order", {"order_id": "#W1000002", "reason": "no longer needed"},
     "Error: non-pending order cannot be cancelled"),
    ("cancel_pending_order", {"order_id": "#W1000001", "reason": "too expensive"}, "Error: invalid reason"),
    ("modify_pending_order_address", {"order_id": "#W1000004", **ADDRESS},
     "Error: non-pending order cannot be modified"),
    ("modify_pending_order_payment", {"order_id": "#W1000001", "payment_method_id": "paypal_1002"},
     "Error: payment method not found"),
    ("modify_pending_order_payment", {"order_id": "#W1000001", "payment_method_id": "credit_card_1001"},
     "Error: the new payment method should be different from the current one"),
    ("modify_pending_order_payment", {"order_id": "#W1000001", "payment_method_id": "gift_card_1001"},
     "Error: insufficient gift card balance to pay for the order"),
    ("modify_pending_order_items", _pairs("#W1000002", ["2000000021"], ["2000000022"], "gift_card_1001"),
     "Error: non-pending order cannot be modified"),
    ("modify_pending_order_items", _pairs("#W1000001", ["2000000011", "2000000011"], ["2000000012"] * 2,
                                          "credit_card_1001"), "Error: 2000000011 not found"),
    ("modify_pending_order_items", _pairs("#W1000001", ["2000000001"], [], "credit_card_1001"),
     "Error: the number of items to be exchanged should match"),
    ("modify_pending_order_items", _pairs("#W1000001", ["2000000001"], ["2000000003"], "credit_card_1001"),
     "Error: new item 2000000003 not found or available"),
    ("modify_pending_order_items", _pairs("#W1000001", ["2000000001"], ["2000000011"], "credit_card_1001"),
     "Error: new item 2000000011 not found or available"),
    ("modify_pending_order_items", _pairs("#W1000001", ["2000000001"], ["2000000002"], "paypal_1003"),
     "Error: payment method not found"),
    ("modify_pending_order_items", _pairs("#W1000003", ["2000000021"], ["2000000022"], "gift_card_1002"),
     "Error: insufficient gift card balance to pay for the new item"),
    ("exchange_delivered_order_items", _pairs("#W1000001", ["2000000001"], ["2000000002"], "credit_card_1001"),
     "Error: non-delivered order cannot be exchanged"),
    ("exchange_delivered_order_items", _pairs("#W1000002", ["2000000001"], ["2000000002"], "gift_card_1001"),
     "Error: 2000000001 not found"),
    ("exchange_delivered_order_items", _pairs("#W1000002", ["2000000021"], ["2000000022"], "gift_card_1001"),
     "Error: insufficient gift card balance to pay for the price difference"),
    ("return_delivered_order_items", {"order_id": "#W1000006", "item_ids": ["2000000022"],
                                      "payment_method_id": "paypal_1003"},
     "Error: non-delivered order cannot be returned"),
    ("return_delivered_order_items", {"order_id": "#W1000005", "item_ids": ["2000000013"],
                                      "payment_method_id": "paypal_1003"},
     "Error: payment method should be either the original payment method or a gift card"),
    ("return_delivered_order_items", {"order_id": "#W1000005", "item_ids": ["2000000013"] * 3,
                                      "payment_method_id": "credit_card_1003"}, "Error: some item not found"),
    ("modify_user_address", {"user_id": "nobody_1", **ADDRESS}, "Error: user not found"),
    ("get_user_details", {"user_id": "nobody_1"}, "Error: user not found"),
    ("get_order_details", {"order_id": "W1000001"}, "Error: order not found"),
    ("get_product_details", {"product_id": "2000000001"}, "Error: product not found"),
    ("find_user_id_by_email", {"email": "nobody@example.com"}, "Error: user not found"),
    ("find_user_id_by_name_zip", {"first_name": "Ada", "last_name": "Lovelace", "zip": "10002"},
     "Error: user not found"),
    ("calculate", {"expression": "import os"}, "Error: invalid characters in expression"),
    ("calculate", {"expression": "1 / 0"}, "Error: division by zero"),
    ("calculate", {"expression": "9 ** 9 ** 9"}, "Error: exponent too large"),
    ("bogus_tool", {}, "Unknown action bogus_tool"),
]


@pytest.mark.parametrize(("tool", "arguments", "expected"), VALIDATION_CASES, ids=lambda case: str(case)[:40])
def test_validation_errors_match_the_benchmark_and_leave_the_database_unchanged(
    db: dict, data_dir: Path, tool: str, arguments: dict, expected: str
) -> None:
    assert invoke(db, tool, arguments) == expected
    assert diff_databases(db, load_retail_data(data_dir).fresh_db()) == []


def test_python_errors_become_observations(db: dict) -> None:
    missing = invoke(db, "cancel_pending_order", {"order_id": "#W1000001"})
    assert missing.startswith("Error: ") and "missing 1 required positional argument: 'reason'" in missing
    unexpected = invoke(db, "think", {"thought": "x", "mood": "calm"})
    assert unexpected.startswith("Error: ") and "unexpected keyword argument 'mood'" in unexpected


def test_lookups_and_calculate(db: dict) -> None:
    assert invoke(db, "find_user_id_by_email", {"email": "ADA.Lovelace@example.com"}) == "ada_lovelace_1001"
    assert invoke(db, "find_user_id_by_name_zip", {"first_name": "alan", "last_name": "TURING", "zip": "02108"}) == (
        "alan_turing_1002"
    )
    assert json.loads(invoke(db, "get_order_details", {"order_id": "#W1000002"}))["status"] == "delivered"
    assert json.loads(invoke(db, "list_all_product_types", {})) == {
        "Desk Lamp": "1000000003", "T-Shirt": "1000000001", "Water Bottle": "1000000002"
    }
    assert invoke(db, "calculate", {"expression": " (80 + 95.99) * 2 / 3"}) == "117.33"
    assert invoke(db, "calculate", {"expression": "2 ** 10"}) == "1024.0"
    assert invoke(db, "calculate", {"expression": "(1"}) == "Error: '(' was never closed (<string>, line 1)"
    assert invoke(db, "think", {"thought": "plan"}) == ""
    assert invoke(db, "transfer_to_human_agents", {"summary": "help"}) == "Transfer successful"


def test_cancel_refunds_gift_cards_at_once(db: dict) -> None:
    invoke(db, "modify_pending_order_address", {"order_id": "#W1000003", **ADDRESS})
    order = json.loads(invoke(db, "cancel_pending_order", {"order_id": "#W1000003", "reason": "ordered by mistake"}))
    assert order["status"] == "cancelled" and order["cancel_reason"] == "ordered by mistake"
    refund = {"transaction_type": "refund", "amount": 115.5, "payment_method_id": "gift_card_1002"}
    assert order["payment_history"][-1] == refund
    assert db["users"]["alan_turing_1002"]["payment_methods"]["gift_card_1002"]["balance"] == 120.5


def test_modify_payment_moves_the_payment_and_blocks_a_second_change(db: dict) -> None:
    move = {"order_id": "#W1000003", "payment_method_id": "paypal_1002"}
    order = json.loads(invoke(db, "modify_pending_order_payment", move))
    assert [entry["transaction_type"] for entry in order["payment_history"]] == ["payment", "payment", "refund"]
    assert order["payment_history"][2]["payment_method_id"] == "gift_card_1002"
    assert db["users"]["alan_turing_1002"]["payment_methods"]["gift_card_1002"]["balance"] == 120.5
    move_back = {"order_id": "#W1000003", "payment_method_id": "gift_card_1002"}
    assert invoke(db, "modify_pending_order_payment", move_back) == (
        "Error: there should be exactly one payment for a pending order"
    )


def test_modify_items_with_a_gift_card_and_duplicates(db: dict) -> None:
    order = json.loads(invoke(db, "modify_pending_order_items",
                              _pairs("#W1000001", ["2000000001"], ["2000000002"], "gift_card_1001")))
    assert order["status"] == "pending (item modified)"
    assert order["items"][0]["item_id"] == "2000000002" and order["items"][0]["price"] == 22.5
    assert order["items"][0]["options"] == {"color": "red", "size": "M"}
    charge = {"transaction_type": "payment", "amount": 2.5, "payment_method_id": "gift_card_1001"}
    assert order["payment_history"][-1] == charge
    assert db["users"]["ada_lovelace_1001"]["payment_methods"]["gift_card_1001"]["balance"] == 7.5


def test_exchange_of_duplicated_items_records_the_rounded_difference(db: dict) -> None:
    order = json.loads(invoke(db, "exchange_delivered_order_items",
                              _pairs("#W1000005", ["2000000013", "2000000013"], ["2000000012", "2000000011"],
                                     "credit_card_1003")))
    assert order["status"] == "exchange requested"
    assert order["exchange_items"] == ["2000000013", "2000000013"]
    assert order["exchange_new_items"] == ["2000000011", "2000000012"]
    assert order["exchange_price_difference"] == 9.0  # (35.5 - 28.25) + (30.0 - 28.25)
    assert invoke(db, "exchange_delivered_order_items",
                  _pairs("#W1000005", ["2000000013"], ["2000000011"], "credit_card_1003")) == (
        "Error: non-delivered order cannot be exchanged"
    )
