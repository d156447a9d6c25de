"""Numbers read from outside the process (a JSON body, a file kvtier wrote before): a finite
float, or nothing. JSON parsers accept NaN and Infinity, and integers of any size."""

from __future__ import annotations

import math


def finite_number(value: object) -> float | None:
    """`value` as a finite float; None for a bool, a non-number, NaN, an infinity, or an integer
    too large for a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
