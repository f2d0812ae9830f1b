"""The retail tools' signatures in OpenAI function-calling format, as the agent sees them.

Names, parameters and descriptions are the benchmark's own (sierra-research/tau-bench retail, commit
59a200c, MIT), so that a policy trained here reads the same tool documentation as in the benchmark.
:data:`TOOL_SCHEMAS` lists them in the benchmark's order; every schema names a tool of
:data:`..tools.TOOLS` with exactly that tool's arguments (checked by the tests).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_ORDER_ID = "The order id, such as '#W0000000'. Be careful there is a '#' symbol at the beginning of the order id."
_USER_ID = "The user id, such as 'sara_doe_496'."
_PAYMENT_METHOD_ID = (
    "The payment method id to pay or receive refund for the item price difference, such as 'gift_card_0000000' "
    "or 'credit_card_0000000'. These can be looked up from the user or order details."
)
_CONFIRM = "The agent needs to explain the {what} detail and ask for explicit user confirmation (yes/no) to proceed."
_ADDRESS = {
    "address1": "The first line of the address, such as '123 Main St'.",
    "address2": "The second line of the address, such as 'Apt 1' or ''.",
    "city": "The city, such as 'San Francisco'.",
    "state": "The state, such as 'CA'.",
    "country": "The country, such as 'USA'.",
    "zip": "The zip code, such as '12345'.",
}


def _string(description: str, enum: list[str] | None = None) -> Schema:
    schema: Schema = {"type": "string"}
    if enum is not None:
        schema["enum"] = enum
    schema["description"] = description
    return schema


def _string_list(description: str) -> Schema:
    return {"type": "array", "items": {"type": "string"}, "description": description}


def _function(name: str, description: str, properties: dict[str, Schema]) -> Schema:
    """An OpenAI function schema whose parameters are all required."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


def _items_change(what: str) -> dict[str, Schema]:
    return {
        "order_id": _string(_ORDER_ID),
        "item_ids": _string_list(
            f"The item ids to be {what}, each such as '1008292230'. There could be duplicate items in the list."
        ),
        "new_item_ids": _string_list(
            f"The item ids to be {what} for, each such as '1008292230'. There could be duplicate items in the list. "
            "Each new item id should match the item id in the same position and be of the same product."
        ),
        "payment_method_id": _string(_PAYMENT_METHOD_ID),
    }


TOOL_SCHEMAS: list[Schema] = [
    _function(
        "calculate",
        "Calculate the result of a mathematical expression.",
        {
            "expression": _string(
                "The mathematical expression to calculate, such as '2 + 2'. The expression can contain numbers, "
                "operators (+, -, *, /), parentheses, and spaces."
            )
        },
    ),
    _function(
        "cancel_pending_order",
        "Cancel a pending order. If the order is already processed or delivered, it cannot be cancelled. The "
        "agent needs to explain the cancellation detail and ask for explicit user confirmation (yes/no) to "
        "proceed. If the user confirms, the order status will be changed to 'cancelled' and the payment will be "
        "refunded. The refund will be added to the user's gift card balance immediately if the payment was made "
        "using a gift card, otherwise the refund would take 5-7 business days to process. The function returns "
        "the order details after the cancellation.",
        {
            "order_id": _string(_ORDER_ID),
            "reason": _string(
                "The reason for cancellation, which should be either 'no longer needed' or 'ordered by mistake'.",
                enum=["no longer needed", "ordered by mistake"],
            ),
        },
    ),
    _function(
        "exchange_delivered_order_items",
        "Exchange items in a delivered order to new items of the same product type. For a delivered order, "
        "return or exchange can be only done once by the agent. " + _CONFIRM.format(what="exchange"),
        _items_change("exchanged"),
    ),
    _function(
        "find_user_id_by_email",
        "Find user id by email. If the user is not found, the function will return an error message.",
        {"email": _string("The email of the user, such as 'something@example.com'.")},
    ),
    _function(
        "find_user_id_by_name_zip",
        "Find user id by first name, last name, and zip code. If the user is not found, the function will "
        "return an error message. By default, find user id by email, and only call this function if the user "
        "is not found by email or cannot remember email.",
        {
            "first_name": _string("The first name of the customer, such as 'John'."),
            "last_name": _string("The last name of the customer, such as 'Doe'."),
            "zip": _string("The zip code of the customer, such as '12345'."),
        },
    ),
    _function(
        "get_order_details", "Get the status and details of an order.", {"order_id": _string(_ORDER_ID)}
    ),
    _function(
        "get_product_details",
        "Get the inventory details of a product.",
        {
            "product_id": _string(
                "The product id, such as '6086499569'. Be careful the product id is different from the item id."
            )
        },
    ),
    _function(
        "get_user_details", "Get the details of a user, including their orders.", {"user_id": _string(_USER_ID)}
    ),
    _function(
        "list_all_product_types",
        "List the name and product id of all product types. Each product type has a variety of different items "
        "with unique item ids and options. There are only 50 product types in the store.",
        {},
    ),
    _function(
        "modify_pending_order_address",
        "Modify the shipping address of a pending order. " + _CONFIRM.format(what="modification"),
        {"order_id": _string(_ORDER_ID), **{key: _string(text) for key, text in _ADDRESS.items()}},
    ),
    _function(
        "modify_pending_order_items",
        "Modify items in a pending order to new items of the same product type. For a pending order, this "
        "function can only be called once. " + _CONFIRM.format(what="exchange"),
        _items_change("modified"),
    ),
    _function(
        "modify_pending_order_payment",
        "Modify the payment method of a pending order. " + _CONFIRM.format(what="modification"),
        {"order_id": _string(_ORDER_ID), "payment_method_id": _string(_PAYMENT_METHOD_ID)},
    ),
    _function(
        "modify_user_address",
        "Modify the default address of a user. " + _CONFIRM.format(what="modification"),
        {"user_id": _string(_USER_ID), **{key: _string(text) for key, text in _ADDRESS.items()}},
    ),
    _function(
        "return_delivered_order_items",
        "Return some items of a delivered order. The order status will be changed to 'return requested'. "
        + _CONFIRM.format(what="return")
        + " The user will receive follow-up email for how and where to return the item.",
        {
            "order_id": _string(_ORDER_ID),
            "item_ids": _string_list(
                "The item ids to be returned, each such as '1008292230'. There could be duplicate items in the list."
            ),
            "payment_method_id": _string(_PAYMENT_METHOD_ID),
        },
    ),
    _function(
        "think",
        "Use the tool to think about something. It will not obtain new information or change the database, "
        "but just append the thought to the log. Use it when complex reasoning or some cache memory is needed.",
        {"thought": _string("A thought to think about.")},
    ),
    _function(
        "transfer_to_human_agents",
        "Transfer the user to a human agent, with a summary of the user's issue. Only transfer if the user "
        "explicitly asks for a human agent, or if the user's issue cannot be resolved by the agent with the "
        "available tools.",
        {"summary": _string("A summary of the user's issue.")},
    ),
]
