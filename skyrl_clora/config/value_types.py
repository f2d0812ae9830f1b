"""Values of the user's configuration checked against the types they must have (a field's annotation)."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin


def typed_value(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against the annotation ``hint`` (``int``, ``float``, ``bool``, ``str``, a ``dict``,
    ``list[str]``, or one of those ``| None``) and returned, an int as a float where a float is wanted, a scalar as
    a string where a string is, and a single string as a list of one where a list is (``logger=tensorboard``);
    anything else raises ValueError with a one-line message naming ``key``."""
    optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{key} must be set (it is null)")
    if optional:
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"{key}={value} must be true, false or null" if optional else f"{key}={value} must be true or false")
    if hint is int and not (number and float(value).is_integer()):
        raise ValueError(f"{key}={value} must be an integer")
    if hint is float and not number:
        raise ValueError(f"{key}={value} must be a number")
    if hint is str and not isinstance(value, (str, int, float)):
        raise ValueError(f"{key}={value} must be a single value, not a list or mapping")
    if (hint is dict or get_origin(hint) is dict) and not isinstance(value, dict):
        raise ValueError(f"{key}={value} must be a mapping")
    if get_origin(hint) is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ValueError(f"{key}={value} must be a name or a list of names, e.g. [console,tensorboard]")
        return list(items)
    if hint in (int, float, str):
        return hint(value)
    return value
