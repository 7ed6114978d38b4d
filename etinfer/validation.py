"""Field checks shared by every user-facing config object.

Each check raises ``ValueError`` that names the field, the allowed range and the value given,
so a bad request is answered with something a user can act on (and the server can turn the
same message into a 400 with ``param`` set).
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_bounds(name, int(value), low, high, low_open=False, high_open=False)
    return int(value)


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    _check_bounds(name, float(value), low, high, low_open=low_open, high_open=high_open)
    return float(value)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value  # type: ignore[return-value]


def _check_bounds(
    name: str,
    value: float,
    low: float | None,
    high: float | None,
    *,
    low_open: bool,
    high_open: bool,
) -> None:
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        raise ValueError(f"{name} must be in {left}{lo}, {hi}{right}, got {value:g}")
