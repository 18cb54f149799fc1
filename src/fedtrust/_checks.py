"""Small argument checks shared by every layer: each error names the field and the value it got."""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any


def check_int(field: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``field`` (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{field} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
    return int(value)


#: Seeds are 32-bit unsigned integers: every generator fedtrust feeds (torch, numpy, scikit-learn) takes them.
SEED_LIMIT = 2**32


def check_seed(field: str, value: Any) -> int:
    """Return ``value`` as a seed in [0, 2**32), or raise naming ``field``."""
    value = check_int(field, value, minimum=0)
    if value >= SEED_LIMIT:
        raise ValueError(f"{field} must be < 2**32 (a 32-bit seed), got {value!r}")
    return value


def check_float(
    field: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_min: bool = False,
) -> float:
    """Return ``value`` as a finite float in the given range, or raise naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{field} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{field} must be finite, got {value!r}")
    if minimum is not None and (value <= minimum if strict_min else value < minimum):
        raise ValueError(f"{field} must be {'>' if strict_min else '>='} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{field} must be <= {maximum}, got {value!r}")
    return value


def check_choice(field: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value
