"""Values of the user's configuration checked against their fields' annotations
(:mod:`skyrl_clora.config.value_types`): each accepted value comes back as the type the field wants (an int as a
float, a scalar as a string, a name as a list of one), and anything else is a one-line ValueError naming the key."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from skyrl_clora.config.value_types import typed_value


@pytest.mark.parametrize("value, hint, expected", [
    (3, int, 3), (3.0, int, 3), (2, float, 2.0), (1.5, float, 1.5), (True, bool, True), (False, bool | None, False),
    (None, int | None, None), (None, Optional[str], None), (7, str, "7"), (0.5, str, "0.5"), ("x", str, "x"),
    ({"a": 1}, dict, {"a": 1}), ({"a": 1}, dict[str, Any], {"a": 1}), ("tensorboard", list[str], ["tensorboard"]),
    (["console", "wandb"], list[str], ["console", "wandb"]), ([], list[str], []), ("x", Any, "x"),
])
def test_an_accepted_value_comes_back_as_the_fields_type(value: Any, hint: Any, expected: Any) -> None:
    got = typed_value(value, hint, "k")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value, hint, message", [
    (None, int, "k must be set (it is null)"),
    (1.5, int, "k=1.5 must be an integer"),
    ("3", int, "k=3 must be an integer"),
    (True, int, "k=True must be an integer"),
    ("fast", float | None, "k=fast must be a number"),
    (False, float, "k=False must be a number"),
    ("yes", bool, "k=yes must be true or false"),
    (1, bool | None, "k=1 must be true, false or null"),
    ([1], str, "k=[1] must be a single value, not a list or mapping"),
    ([1, 2], dict, "k=[1, 2] must be a mapping"),
    ([1], list[str], "k=[1] must be a name or a list of names, e.g. [console,tensorboard]"),
    ({"a": "b"}, list[str], "k={'a': 'b'} must be a name or a list of names"),
])
def test_anything_else_is_one_line_naming_the_key(value: Any, hint: Any, message: str) -> None:
    with pytest.raises(ValueError) as error:
        typed_value(value, hint, "k")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
