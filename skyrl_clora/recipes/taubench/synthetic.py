"""A small self-made tau-bench retail data folder, for tests and CPU runs without the real data.

:func:`make_synthetic_retail` writes the same files, in the same shapes, as the real benchmark folder:
3 products with variants (one unavailable), 3 users (credit card, PayPal, gift cards with balances),
7 orders in every status (one with a duplicated item), a short policy, 7 train tasks (one per
database-changing tool) and 4 test tasks (a lookup with expected outputs, a duplicated-item exchange,
a transfer to a human, a calculation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

POLICY = """# Retail agent policy (synthetic)

As a retail agent, you can help users cancel or modify pending orders, return or exchange delivered orders,
modify their default user address, or provide information about their own profile, orders, and products.

- Authenticate the user first by locating their user id via email, or via name + zip code.
- Before any action that updates the database (cancel, modify, return, exchange), list the action detail
  and obtain explicit user confirmation (yes) to proceed.
- Make at most one tool call at a time, and do not respond to the user while making a tool call.
- Transfer the user to a human agent if and only if the request cannot be handled with your actions.
"""

_PRODUCTS: dict[str, tuple[str, list[tuple[str, dict[str, str], float, bool]]]] = {
    "1000000001": (
        "T-Shirt",
        [
            ("2000000001", {"color": "blue", "size": "M"}, 20.0, True),
            ("2000000002", {"color": "red", "size": "M"}, 22.5, True),
            ("2000000003", {"color": "black", "size": "L"}, 25.0, False),
        ],
    ),
    "1000000002": (
        "Water Bottle",
        [
            ("2000000011", {"capacity": "500ml", "material": "stainless steel"}, 30.0, True),
            ("2000000012", {"capacity": "1000ml", "material": "stainless steel"}, 35.5, True),
            ("2000000013", {"capacity": "750ml", "material": "glass"}, 28.25, True),
        ],
    ),
    "1000000003": (
        "Desk Lamp",
        [
            ("2000000021", {"color": "white", "bulb type": "LED"}, 80.0, True),
            ("2000000022", {"color": "black", "bulb type": "LED"}, 95.99, True),
        ],
    ),
}

_USERS: dict[str, dict[str, Any]] = {
    "ada_lovelace_1001": {
        "name": ("Ada", "Lovelace"),
        "address": ("12 Analytical Way", "Apt 3", "New York", "NY", "10001"),
        "payment_methods": {
            "credit_card_1001": {"source": "credit_card", "brand": "visa", "last_four": "1001"},
            "gift_card_1001": {"source": "gift_card", "balance": 10.0},
        },
    },
    "alan_turing_1002": {
        "name": ("Alan", "Turing"),
        "address": ("7 Enigma Road", "", "Boston", "MA", "02108"),
        "payment_methods": {
            "paypal_1002": {"source": "paypal"},
            "gift_card_1002": {"source": "gift_card", "balance": 5.0},
        },
    },
    "grace_hopper_1003": {
        "name": ("Grace", "Hopper"),
        "address": ("1 Compiler Court", "Suite 9", "Arlington", "VA", "22201"),
        "payment_methods": {
            "credit_card_1003": {"source": "credit_card", "brand": "mastercard", "last_four": "1003"},
            "paypal_1003": {"source": "paypal"},
        },
    },
}

# order id -> (user id, status, item ids, payment method id)
_ORDERS: dict[str, tuple[str, str, list[str], str]] = {
    "#W1000001": ("ada_lovelace_1001", "pending", ["2000000001", "2000000011"], "credit_card_1001"),
    "#W1000002": ("ada_lovelace_1001", "delivered", ["2000000021", "2000000002"], "gift_card_1001"),
    "#W1000003": ("alan_turing_1002", "pending", ["2000000012", "2000000021"], "gift_card_1002"),
    "#W1000004": ("alan_turing_1002", "processed", ["2000000001"], "paypal_1002"),
    "#W1000005": ("grace_hopper_1003", "delivered", ["2000000013", "2000000013"], "credit_card_1003"),
    "#W1000006": ("grace_hopper_1003", "pending", ["2000000022"], "paypal_1003"),
    "#W1000007": ("grace_hopper_1003", "cancelled", ["2000000002"], "credit_card_1003"),
}


def _address(fields: tuple[str, str, str, str, str]) -> dict[str, str]:
    address1, address2, city, state, zip_code = fields
    return {"address1": address1, "address2": address2, "city": city, "country": "USA", "state": state, "zip": zip_code}


def _products() -> dict[str, Any]:
    products = {}
    for product_id, (name, variants) in _PRODUCTS.items():
        products[product_id] = {
            "name": name,
            "product_id": product_id,
            "variants": {
                item_id: {"item_id": item_id, "options": options, "available": available, "price": price}
                for item_id, options, price, available in variants
            },
        }
    return products


def _users() -> dict[str, Any]:
    users = {}
    for user_id, spec in _USERS.items():
        first, last = spec["name"]
        users[user_id] = {
            "name": {"first_name": first, "last_name": last},
            "address": _address(spec["address"]),
            "email": f"{first.lower()}.{last.lower()}@example.com",
            "payment_methods": {
                method_id: {**fields, "id": method_id} for method_id, fields in spec["payment_methods"].items()
            },
            "orders": [order_id for order_id, order in _ORDERS.items() if order[0] == user_id],
        }
    return users


def _orders(products: dict[str, Any]) -> dict[str, Any]:
    variant_of = {
        item_id: (product, variant)
        for product in products.values()
        for item_id, variant in product["variants"].items()
    }
    orders = {}
    for number, (order_id, (user_id, status, item_ids, method_id)) in enumerate(_ORDERS.items()):
        items = []
        for item_id in item_ids:
            product, variant = variant_of[item_id]
            items.append(
                {
                    "name": product["name"],
                    "product_id": product["product_id"],
                    "item_id": item_id,
                    "price": variant["price"],
                    "options": dict(variant["options"]),
                }
            )
        total = round(sum(item["price"] for item in items), 2)
        payments = [{"transaction_type": "payment", "amount": total, "payment_method_id": method_id}]
        if status == "cancelled":
            payments.append({"transaction_type": "refund", "amount": total, "payment_method_id": method_id})
        shipped = status in ("processed", "delivered")
        orders[order_id] = {
            "order_id": order_id,
            "user_id": user_id,
            "address": _address(_USERS[user_id]["address"]),
            "items": items,
            "fulfillments": [{"tracking_id": [f"90000000{number}"], "item_ids": item_ids}] if shipped else [],
            "status": status,
            "payment_history": payments,
        }
    return orders


def _task(
    user_id: str, instruction: str, actions: list[tuple[str, dict[str, Any]]], outputs: tuple[str, ...] = ()
) -> dict[str, Any]:
    return {
        "user_id": user_id,
        "instruction": instruction,
        "actions": [{"name": name, "kwargs": kwargs} for name, kwargs in actions],
        "outputs": list(outputs),
    }


_NEW_ADDRESS = {
    "address1": "99 Harbor Street", "address2": "", "city": "Seattle", "state": "WA", "country": "USA", "zip": "98101"
}

TRAIN_TASKS = [
    _task("ada_lovelace_1001", "You are Ada Lovelace (zip 10001). Cancel order #W1000001, you no longer need it.",
          [("cancel_pending_order", {"order_id": "#W1000001", "reason": "no longer needed"})]),
    _task("ada_lovelace_1001", "You are Ada Lovelace. Return the desk lamp of #W1000002 to your gift card.",
          [("return_delivered_order_items",
            {"order_id": "#W1000002", "item_ids": ["2000000021"], "payment_method_id": "gift_card_1001"})]),
    _task("alan_turing_1002", "You are Alan Turing. Pay order #W1000003 with PayPal instead of the gift card.",
          [("modify_pending_order_payment", {"order_id": "#W1000003", "payment_method_id": "paypal_1002"})]),
    _task("grace_hopper_1003", "You are Grace Hopper. Exchange one glass bottle of #W1000005 for a 1000ml steel one.",
          [("exchange_delivered_order_items",
            {"order_id": "#W1000005", "item_ids": ["2000000013"], "new_item_ids": ["2000000012"],
             "payment_method_id": "credit_card_1003"})]),
    _task("grace_hopper_1003", "You are Grace Hopper. Change the black lamp of #W1000006 to the white one.",
          [("modify_pending_order_items",
            {"order_id": "#W1000006", "item_ids": ["2000000022"], "new_item_ids": ["2000000021"],
             "payment_method_id": "paypal_1003"})]),
    _task("ada_lovelace_1001", "You are Ada Lovelace. Ship #W1000001 to 99 Harbor Street, Seattle WA 98101.",
          [("modify_pending_order_address", {"order_id": "#W1000001", **_NEW_ADDRESS})]),
    _task("alan_turing_1002", "You are Alan Turing. Move to 99 Harbor Street, Seattle WA 98101.",
          [("modify_user_address", {"user_id": "alan_turing_1002", **_NEW_ADDRESS})]),
]

TEST_TASKS = [
    _task("ada_lovelace_1001", "You are Ada Lovelace (ada.lovelace@example.com). Ask how much order #W1000002 cost.",
          [("find_user_id_by_email", {"email": "ada.lovelace@example.com"}),
           ("get_order_details", {"order_id": "#W1000002"})],
          outputs=("102.5",)),
    _task("grace_hopper_1003", "You are Grace Hopper. Exchange both glass bottles of #W1000005: one 500ml, one 1000ml.",
          [("exchange_delivered_order_items",
            {"order_id": "#W1000005", "item_ids": ["2000000013", "2000000013"],
             "new_item_ids": ["2000000011", "2000000012"], "payment_method_id": "credit_card_1003"})]),
    _task("alan_turing_1002", "You are Alan Turing (zip 02108). Cancel #W1000004; ask for a human if refused.",
          [("find_user_id_by_name_zip", {"first_name": "Alan", "last_name": "Turing", "zip": "02108"}),
           ("transfer_to_human_agents", {"summary": "User wants to cancel processed order #W1000004."})]),
    _task("grace_hopper_1003", "You are Grace Hopper. Ask what two desk lamps (white and black) cost together.",
          [("calculate", {"expression": "80.0 + 95.99"})],
          outputs=("175.99",)),
]


def make_synthetic_retail(path: str | Path) -> Path:
    """Write the synthetic retail data folder at ``path`` (created if needed); returns its path."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    products = _products()
    files = {
        "products.json": products,
        "users.json": _users(),
        "orders.json": _orders(products),
        "tasks_train.json": TRAIN_TASKS,
        "tasks_test.json": TEST_TASKS,
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2))
    (folder / "wiki.md").write_text(POLICY)
    return folder
