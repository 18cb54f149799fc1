"""One server round, the same in the simulator and in the Flower strategy: the rule aggregates the round
(its front door screens it first), the aggregate is applied to the global model, and the trust each
client got is recorded. A fix here lands in both.

A round the rule refuses for a reason the data gives (:class:`~fedtrust.aggregators.RoundRefused`:
every client quarantined, too few clients for a Byzantine budget, a fit that broke down) or whose
aggregate would make the global model non-finite leaves the model as it was, with the reason recorded.
Any other exception is a bug in the rule or the caller and propagates; so does an output that breaks the
:class:`~fedtrust.aggregators.Aggregate` contract (a user's rule returning a vector of another shape or
dtype, or weights that are not n non-negative numbers summing to 1), as a ValueError naming the rule and
what it returned, instead of a model silently broadcast from a scalar or a trust of -5 in the records.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedtrust.aggregators import Aggregate, Round, RoundRefused

__all__ = ["StepResult", "server_step"]


@dataclass
class StepResult:
    """What one server round did.

    vector:      the global vector after the round (the previous one when nothing was applied).
    aggregate:   the rule's output (None when the rule refused the round).
    error:       why nothing was applied, or None.
    weights:     trust per client of the round, in its order (NaN when the rule refused the round).
    quarantined: client id (as text) -> why its update was set aside.
    info:        the JSON-friendly part of the rule's diagnostics (:func:`json_info`).
    """

    vector: torch.Tensor
    aggregate: Aggregate | None
    error: str | None
    weights: list[float]
    quarantined: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def applied(self) -> bool:
        return self.error is None

    @property
    def diverged(self) -> bool:
        """The rule aggregated, but applying the aggregate would have made the global model non-finite."""
        return self.aggregate is not None and self.error is not None

    @property
    def warning(self) -> str | None:
        """The rule's estimator stopped at its iteration limit before converging (its message), or None."""
        return self.info.get("warning")


def server_step(
    rule: Callable[[Round], Aggregate],
    round: Round,
    previous: torch.Tensor,
    apply: Callable[[torch.Tensor], torch.Tensor],
) -> StepResult:
    """Aggregate ``round`` with ``rule`` and apply it: ``apply(aggregate) -> new global vector`` (e.g.
    ``previous + aggregate`` for model deltas, ``previous - lr * aggregate`` for gradients)."""
    try:
        out = rule(round)
    except RoundRefused as exc:
        quarantined = {str(k): v for k, v in getattr(exc, "quarantined", {}).items()}
        return StepResult(previous, None, f"{type(exc).__name__}: {exc}", [math.nan] * round.n, quarantined)
    weights = _checked(rule, round, out)
    quarantined = {str(k): v for k, v in out.info.get("quarantined", {}).items()}
    info = json_info(out.info)
    vector = apply(out.vector).detach()
    if not bool(torch.isfinite(vector).all()):
        error = "the aggregate would make the global model non-finite; the model stays"
        return StepResult(previous, out, error, weights, quarantined, info)
    return StepResult(vector, out, None, weights, quarantined, info)


def _checked(rule: Callable, round: Round, out: Any) -> list[float]:
    """The weights of ``out`` as a list, once ``out`` is an :class:`Aggregate` of this round: a (d,)
    vector of the updates' dtype on their device, and (n,) finite non-negative weights summing to 1 (to
    the rounding of n additions in their dtype). Else a ValueError (TypeError: not an Aggregate) naming
    the rule and what it returned."""
    name = getattr(rule, "name", None) or getattr(rule, "__name__", None) or type(rule).__name__
    if not isinstance(out, Aggregate):
        raise TypeError(f"rule {name!r} returned {type(out).__name__}, not an Aggregate")
    x, v, w = round.updates, out.vector, out.weights
    problems = []
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != (round.d,):
        problems.append(f"a vector of shape {_shape(v)}, expected ({round.d},): one value per coordinate")
    elif v.dtype != x.dtype or v.device != x.device:
        problems.append(f"a {v.dtype} vector on {v.device} for {x.dtype} updates on {x.device}")
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (round.n,):
        problems.append(f"weights of shape {_shape(w)}, expected ({round.n},): one per client")
    if problems:
        raise ValueError(f"rule {name!r} returned " + " and ".join(problems))
    weights = w.tolist()
    bad = [(i, a) for i, a in enumerate(weights) if not (math.isfinite(a) and a >= 0)]
    total = math.fsum(weights)
    slack = 4 * max(round.n, 1) * torch.finfo(w.dtype).eps if w.dtype.is_floating_point else 0.0
    if bad or abs(total - 1) > slack:
        shown = ", ".join(f"client {round.client_ids[i]!r}: {a}" for i, a in bad[:3])
        raise ValueError(
            f"rule {name!r} returned weights that are not a distribution over the round's clients "
            + (f"({shown}{', ...' if len(bad) > 3 else ''})" if bad else f"(they sum to {total:.6g})")
            + ": an Aggregate's weights are non-negative and sum to 1"
        )
    return weights


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def json_info(info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-friendly part of a rule's info: numbers, strings, bools, and lists (at most 1000 long) or
    string-keyed dicts of them, nested (a sybil rule's ``groups``: ``[{"clients": [...], "reason": ...}]``);
    tensors are left out, and so are the per-client ``clients`` and ``quarantined`` entries."""
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in info.items()
        if k not in ("clients", "quarantined") and _plain(v)
    }


def _plain(v: Any) -> bool:
    if isinstance(v, bool | int | float | str) or v is None:
        return True
    if isinstance(v, list | tuple):
        return len(v) <= 1000 and all(_plain(e) for e in v)
    if isinstance(v, dict):
        return len(v) <= 1000 and all(isinstance(k, str) and _plain(e) for k, e in v.items())
    return False
