"""The 16 tools of the tau-bench retail domain, acting on an episode database.

Each tool is ``tool(data, **arguments) -> str`` where ``data`` is a database as built by
:func:`..db.fresh_database` (or a plain dict of the same shape, mutated in place). The behaviour
reproduces sierra-research/tau-bench (retail, commit 59a200c): the same checks in the same order, the
same ``"Error: ..."`` strings, the same database updates (including float rounding and the order of
appended payment entries) and the same ``json.dumps`` observations, so that a database reached here
equals the one the benchmark reaches with the same calls. :func:`invoke` adds the benchmark's
environment wrapping: an unknown tool gives ``"Unknown action <name>"`` and an exception raised by a
tool (e.g. a missing argument) becomes the observation ``"Error: <exception>"``.

The one intended difference: :func:`calculate` evaluates its arithmetic with its own evaluator instead
of ``eval``: numbers, ``+ - * / // **`` and parentheses give the same value and the same error
texts (syntax errors, division by zero), other forms (e.g. ``()``) give ``"Error: unsupported
expression"``, and integer powers whose result would be huge (the benchmark hangs on ``9**9**9``) give
``"Error: exponent too large"``.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any, Callable

from skyrl_clora.recipes.taubench.db import Record, record_for_write

Tool = Callable[..., str]

TRANSFER_TOOL = "transfer_to_human_agents"
TERMINATE_TOOLS: frozenset[str] = frozenset({TRANSFER_TOOL})
CANCEL_REASONS: tuple[str, ...] = ("no longer needed", "ordered by mistake")
CALCULATOR_CHARACTERS = frozenset("0123456789+-*/(). ")
MAX_INT_POWER_BITS = 4096

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _arithmetic(node: ast.AST) -> Any:
    """Value of an arithmetic expression tree (numbers, + - * / // **, unary +/-), as Python computes it."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arithmetic(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_POWER_BITS:
                raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError("unsupported expression")


def calculate(data: dict, expression: str) -> str:
    """The value of an arithmetic ``expression``, rounded to 2 decimals, as text."""
    if not all(char in CALCULATOR_CHARACTERS for char in expression):
        return "Error: invalid characters in expression"
    try:
        # Leading spaces are dropped as ``eval`` drops them; the parse errors are ``eval``'s own.
        value = _arithmetic(ast.parse(expression.lstrip(" "), filename="<string>", mode="eval"))
        return str(round(float(value), 2))
    except Exception as error:
        return f"Error: {error}"


def think(data: dict, thought: str) -> str:
    """Log a thought; changes nothing and returns an empty string."""
    return ""


def transfer_to_human_agents(data: dict, summary: str) -> str:
    """Hand the customer to a human; the environment ends the episode on this tool."""
    return "Transfer successful"


def find_user_id_by_email(data: dict, email: str) -> str:
    """The id of the first user whose email equals ``email`` case-insensitively."""
    for user_id, profile in data["users"].items():
        if profile["email"].lower() == email.lower():
            return user_id
    return "Error: user not found"


def find_user_id_by_name_zip(data: dict, first_name: str, last_name: str, zip: str) -> str:
    """The id of the first user with this name (case-insensitive) and exactly this zip code."""
    for user_id, profile in data["users"].items():
        name = profile["name"]
        if (
            name["first_name"].lower() == first_name.lower()
            and name["last_name"].lower() == last_name.lower()
            and profile["address"]["zip"] == zip
        ):
            return user_id
    return "Error: user not found"


def _lookup(table: dict[str, Record], key: str, missing: str) -> str:
    return json.dumps(table[key]) if key in table else missing


def get_order_details(data: dict, order_id: str) -> str:
    """The order record as JSON."""
    return _lookup(data["orders"], order_id, "Error: order not found")


def get_product_details(data: dict, product_id: str) -> str:
    """The product record (with all its variants) as JSON."""
    return _lookup(data["products"], product_id, "Error: product not found")


def get_user_details(data: dict, user_id: str) -> str:
    """The user record as JSON."""
    return _lookup(data["users"], user_id, "Error: user not found")


def list_all_product_types(data: dict) -> str:
    """JSON object product name -> product id, sorted by name (a later product wins a name clash)."""
    by_name = {product["name"]: product["product_id"] for product in data["products"].values()}
    return json.dumps(dict(sorted(by_name.items())))


def _address(address1: str, address2: str, city: str, state: str, country: str, zip: str) -> dict[str, str]:
    return {"address1": address1, "address2": address2, "city": city, "state": state, "country": country, "zip": zip}


def modify_user_address(
    data: dict, user_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
) -> str:
    """Replace the user's default address; returns the user record."""
    if user_id not in data["users"]:
        return "Error: user not found"
    user = record_for_write(data["users"], user_id)
    user["address"] = _address(address1, address2, city, state, country, zip)
    return json.dumps(user)


def _order_with_status(data: dict, order_id: str, status: str, refusal: str) -> Record | str:
    """The writable order, or the error text when it is missing or not in ``status``."""
    if order_id not in data["orders"]:
        return "Error: order not found"
    if data["orders"][order_id]["status"] != status:
        return refusal
    return record_for_write(data["orders"], order_id)


def _payment_methods(data: dict, order: Record) -> dict[str, Record]:
    """The payment methods of the order's user, read-only (the user record may be shared)."""
    return data["users"][order["user_id"]]["payment_methods"]


def _writable_payment_method(data: dict, order: Record, payment_method_id: str) -> Record:
    return record_for_write(data["users"], order["user_id"])["payment_methods"][payment_method_id]


def modify_pending_order_address(
    data: dict, order_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
) -> str:
    """Replace the shipping address of a pending order; returns the order."""
    order = _order_with_status(data, order_id, "pending", "Error: non-pending order cannot be modified")
    if isinstance(order, str):
        return order
    order["address"] = _address(address1, address2, city, state, country, zip)
    return json.dumps(order)


def cancel_pending_order(data: dict, order_id: str, reason: str) -> str:
    """Cancel a pending order: refund every payment (gift cards are credited at once); returns the order."""
    order = _order_with_status(data, order_id, "pending", "Error: non-pending order cannot be cancelled")
    if isinstance(order, str):
        return order
    if reason not in CANCEL_REASONS:
        return "Error: invalid reason"
    refunds = []
    for payment in order["payment_history"]:
        method_id = payment["payment_method_id"]
        refunds.append({"transaction_type": "refund", "amount": payment["amount"], "payment_method_id": method_id})
        if "gift_card" in method_id:
            gift_card = _writable_payment_method(data, order, method_id)
            gift_card["balance"] = round(gift_card["balance"] + payment["amount"], 2)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].extend(refunds)
    return json.dumps(order)


def modify_pending_order_payment(data: dict, order_id: str, payment_method_id: str) -> str:
    """Move a pending order's single payment to another method (a payment there, a refund to the old
    one; gift card balances follow); returns the order."""
    order = _order_with_status(data, order_id, "pending", "Error: non-pending order cannot be modified")
    if isinstance(order, str):
        return order
    methods = _payment_methods(data, order)
    if payment_method_id not in methods:
        return "Error: payment method not found"
    history = order["payment_history"]
    if len(history) > 1 or history[0]["transaction_type"] != "payment":
        return "Error: there should be exactly one payment for a pending order"
    old_method_id = history[0]["payment_method_id"]
    if old_method_id == payment_method_id:
        return "Error: the new payment method should be different from the current one"
    amount = history[0]["amount"]
    if methods[payment_method_id]["source"] == "gift_card" and methods[payment_method_id]["balance"] < amount:
        return "Error: insufficient gift card balance to pay for the order"
    history.extend(
        [
            {"transaction_type": "payment", "amount": amount, "payment_method_id": payment_method_id},
            {"transaction_type": "refund", "amount": amount, "payment_method_id": old_method_id},
        ]
    )
    if methods[payment_method_id]["source"] == "gift_card":
        new_method = _writable_payment_method(data, order, payment_method_id)
        new_method["balance"] = round(new_method["balance"] - amount, 2)
    if "gift_card" in old_method_id:
        old_method = _writable_payment_method(data, order, old_method_id)
        old_method["balance"] = round(old_method["balance"] + amount, 2)
    return json.dumps(order)


def _missing_item(order: Record, item_ids: list[str]) -> str | None:
    """The first id of ``item_ids`` asked for more often than the order holds it, or None."""
    held = [item["item_id"] for item in order["items"]]
    for item_id in item_ids:
        if item_ids.count(item_id) > held.count(item_id):
            return item_id
    return None


def _first_item(order: Record, item_id: str) -> Record:
    """The first item of the order with this id (IndexError if none, as in the benchmark)."""
    return [item for item in order["items"] if item["item_id"] == item_id][0]


def _price_difference(data: dict, order: Record, item_ids: list[str], new_item_ids: list[str]) -> float | str:
    """Sum of (new variant price - old item price) over the pairs, or the error text for a new item
    that is not an available variant of the old item's product."""
    difference: float = 0
    for item_id, new_item_id in zip(item_ids, new_item_ids):
        item = _first_item(order, item_id)
        variants = data["products"][item["product_id"]]["variants"]
        if not (new_item_id in variants and variants[new_item_id]["available"]):
            return f"Error: new item {new_item_id} not found or available"
        difference += variants[new_item_id]["price"] - item["price"]
    return difference


def _item_swap_difference(data: dict, order: Record, item_ids: list[str], new_item_ids: list[str]) -> float | str:
    """tau-bench's checks for swapping ``item_ids`` of ``order`` for ``new_item_ids`` (every item in the
    order, as many new items as old, each new item an available variant of the same product), in its
    order; returns the price difference (new minus old) or the first error message."""
    missing = _missing_item(order, item_ids)
    if missing is not None:
        return f"Error: {missing} not found"
    if len(item_ids) != len(new_item_ids):
        return "Error: the number of items to be exchanged should match"
    return _price_difference(data, order, item_ids, new_item_ids)


def modify_pending_order_items(
    data: dict, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
) -> str:
    """Swap items of a pending order for other variants of the same products, charging or refunding
    the price difference on ``payment_method_id``; the status becomes 'pending (item modified)'."""
    order = _order_with_status(data, order_id, "pending", "Error: non-pending order cannot be modified")
    if isinstance(order, str):
        return order
    difference = _item_swap_difference(data, order, item_ids, new_item_ids)
    if isinstance(difference, str):
        return difference
    methods = _payment_methods(data, order)
    if payment_method_id not in methods:
        return "Error: payment method not found"
    if methods[payment_method_id]["source"] == "gift_card" and methods[payment_method_id]["balance"] < difference:
        return "Error: insufficient gift card balance to pay for the new item"
    order["payment_history"].append(
        {
            "transaction_type": "payment" if difference > 0 else "refund",
            "amount": abs(difference),
            "payment_method_id": payment_method_id,
        }
    )
    if methods[payment_method_id]["source"] == "gift_card":
        gift_card = _writable_payment_method(data, order, payment_method_id)
        gift_card["balance"] = round(gift_card["balance"] - difference, 2)
    for item_id, new_item_id in zip(item_ids, new_item_ids):
        item = _first_item(order, item_id)
        variant = data["products"][item["product_id"]]["variants"][new_item_id]
        item["item_id"] = new_item_id
        item["price"] = variant["price"]
        item["options"] = dict(variant["options"])
    order["status"] = "pending (item modified)"
    return json.dumps(order)


def exchange_delivered_order_items(
    data: dict, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
) -> str:
    """Request an exchange of delivered items for other variants of the same products; records the
    (rounded) price difference and sets the status to 'exchange requested'."""
    order = _order_with_status(data, order_id, "delivered", "Error: non-delivered order cannot be exchanged")
    if isinstance(order, str):
        return order
    difference = _item_swap_difference(data, order, item_ids, new_item_ids)
    if isinstance(difference, str):
        return difference
    difference = round(difference, 2)
    methods = _payment_methods(data, order)
    if payment_method_id not in methods:
        return "Error: payment method not found"
    if methods[payment_method_id]["source"] == "gift_card" and methods[payment_method_id]["balance"] < difference:
        return "Error: insufficient gift card balance to pay for the price difference"
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = difference
    return json.dumps(order)


def return_delivered_order_items(data: dict, order_id: str, item_ids: list[str], payment_method_id: str) -> str:
    """Request a return of delivered items, refunded to the original payment method or a gift card."""
    order = _order_with_status(data, order_id, "delivered", "Error: non-delivered order cannot be returned")
    if isinstance(order, str):
        return order
    if payment_method_id not in _payment_methods(data, order):
        return "Error: payment method not found"
    if "gift_card" not in payment_method_id and payment_method_id != order["payment_history"][0]["payment_method_id"]:
        return "Error: payment method should be either the original payment method or a gift card"
    if _missing_item(order, item_ids) is not None:
        return "Error: some item not found"
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return json.dumps(order)


TOOLS: dict[str, Tool] = {
    tool.__name__: tool
    for tool in (
        calculate,
        cancel_pending_order,
        exchange_delivered_order_items,
        find_user_id_by_email,
        find_user_id_by_name_zip,
        get_order_details,
        get_product_details,
        get_user_details,
        list_all_product_types,
        modify_pending_order_address,
        modify_pending_order_items,
        modify_pending_order_payment,
        modify_user_address,
        return_delivered_order_items,
        think,
        transfer_to_human_agents,
    )
}


def invoke(data: dict, name: str, arguments: dict[str, Any]) -> str:
    """Run tool ``name`` with keyword ``arguments`` on ``data``; the observation text (never raises for
    a tool's failure: unknown tools and exceptions become observations, as in the benchmark)."""
    tool = TOOLS.get(name)
    if tool is None:
        return f"Unknown action {name}"
    try:
        return tool(data, **arguments)
    except Exception as error:
        return f"Error: {error}"
