"""The shared argument checks of ``batchkit._validate``."""

from __future__ import annotations

import math

import pytest

from batchkit._validate import non_negative_float, positive_float, positive_int, positive_int_or_none


@pytest.mark.parametrize("value", [1, 7, 10**12])
def test_positive_int_returns_a_whole_number_of_at_least_one(value: int) -> None:
    """A whole number >= 1 comes back unchanged."""
    assert positive_int("size", value) == value


@pytest.mark.parametrize("value", [0, -3, 1.0, "2", True, None])
def test_positive_int_refuses_anything_else_naming_the_argument(value: object) -> None:
    """Zero, negatives, floats, strings, bools and None are refused with the name and the value."""
    with pytest.raises(ValueError, match=rf"^size must be an int >= 1, got {value!r}$"):
        positive_int("size", value)


def test_positive_int_takes_none_where_allowed_and_says_so_otherwise() -> None:
    """``positive_int_or_none`` lets None through and names it in the message of a bad value."""
    assert positive_int_or_none("limit", None) is None
    assert positive_int_or_none("limit", 3) == 3
    with pytest.raises(ValueError, match=r"^limit must be an int >= 1 or None \(unbounded\), got 0$"):
        positive_int_or_none("limit", 0, note="(unbounded)")


@pytest.mark.parametrize("value", [0, 0.0, 2, 1.5])
def test_non_negative_float_returns_a_float(value: float) -> None:
    """Finite numbers >= 0 come back as floats."""
    result = non_negative_float("delay", value)
    assert result == value
    assert isinstance(result, float)


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan, True, "1", None])
def test_non_negative_float_refuses_negatives_non_finite_and_non_numbers(value: object) -> None:
    """Negatives, infinities, NaN, bools and non-numbers are refused."""
    with pytest.raises(ValueError, match=r"^delay must be a finite number >= 0 \(seconds\), got "):
        non_negative_float("delay", value, note="(seconds)")


@pytest.mark.parametrize("value", [0, -1, math.inf, False])
def test_positive_float_refuses_zero_and_below(value: object) -> None:
    """Zero is refused where a positive number is asked for; 0.5 is taken."""
    assert positive_float("rate", 0.5) == 0.5
    with pytest.raises(ValueError, match=r"^rate must be a finite number > 0, got "):
        positive_float("rate", value)
