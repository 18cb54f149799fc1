"""One server round, the same in the simulator and in the Flower strategy: the rule aggregates the round
(its front door screens it first), the aggregate is applied to the global model, and the trust each
client got is recorded. A fix here lands in both.

A round the rule refuses for a reason the data gives (:class:`~fedtrust.aggregators.RoundRefused`:
every client quarantined, too few clients for a Byzantine budget, a fit that broke down) or whose
aggregate would make the global model non-finite leaves the model as it was, with the reason recorded.
Any other exception is a bug in the rule or the caller and propagates.
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
    quarantined = {str(k): v for k, v in out.info.get("quarantined", {}).items()}
    weights = out.weights.tolist()
    info = json_info(out.info)
    vector = apply(out.vector).detach()
    if not bool(torch.isfinite(vector).all()):
        error = "the aggregate would make the global model non-finite; the model stays"
        return StepResult(previous, out, error, weights, quarantined, info)
    return StepResult(vector, out, None, weights, quarantined, info)


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
