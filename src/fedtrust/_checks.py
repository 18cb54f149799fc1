"""Small argument checks shared by every layer: each error names the field and the value it got."""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

import torch
from pydantic import BaseModel, ValidationInfo, field_validator


def check_int(field: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``field`` (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{field} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{field} must be <= {maximum}, got {value!r}")
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


def check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be True or False, got {value!r}")
    return value


def check_choice(field: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


#: How many units of the data's rounding (machine epsilons) an iterative estimator's stopping quantity
#: may still move by when it stops: rounding in the passes over the data (float32 partial sums,
#: distances by expansion) perturbs each weight by a few eps times the number of terms, so a tighter
#: test would compare noise with noise.
STOPPING_EPS = 64


def share_count(share: float, total: int) -> int:
    """How many of ``total`` things a ``share`` of them is: ``share * total`` rounded half up (2.5 -> 3;
    Python's ``round`` gave 2, so 0.25 of 10 clients was 2 and 0.35 and 0.45 both 4), after rounding away
    float noise (0.35 * 10 is 3.4999999999999996, meant as 3.5). The rule for corrupted clients, sampled
    clients, benchmark rows and the overlapping partition's pool; a client's corrupted rows keep Python's
    ``round`` (:func:`~fedtrust.data.corruptions.corrupt` says why)."""
    return math.floor(round(share * total, 9) + 0.5)


def stopping_tol(dtype: torch.dtype) -> float:
    """The default stopping tolerance of an iterative estimator on data of ``dtype``: ``STOPPING_EPS``
    machine epsilons (7.6e-6 for float32, 1.4e-14 for float64). Weights that sum to ~1, computed from
    data rounded at eps, cannot be told apart more finely than a few eps: iterating until they move by
    less than that stops on noise, after a number of iterations that depends on how the rounding fell
    (the CPU's BLAS kernel, a norm taken in another order). The estimators compute in float64 whatever
    the data's dtype; what limits them is the data's rounding, so the dtype is the data's."""
    if not dtype.is_floating_point:
        dtype = torch.float64
    return STOPPING_EPS * torch.finfo(dtype).eps


def check_tol(field: str, value: Any) -> float | None:
    """``None`` (derive the tolerance from the data's dtype: :func:`stopping_tol`) or a float >= 0."""
    return None if value is None else check_float(field, value, minimum=0.0)


def resolve_tol(tol: float | None, dtype: torch.dtype) -> float:
    """``tol``, or by default (None) :func:`stopping_tol` of the data's dtype."""
    return stopping_tol(dtype) if tol is None else check_float("tol", tol, minimum=0.0)


class Settings(BaseModel):
    """Base of the config models: a number field refuses ``true``/``false`` (pydantic would read them
    as 1 and 0, so ``rounds: true`` ran one round)."""

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_bools(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError("must be a number, not true or false")
        return value


_NUMBERS = (int, float, int | float)
