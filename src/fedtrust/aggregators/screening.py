"""The front door every built-in rule is called through: screen the round, run the rule on the healthy
clients, give the quarantined ones weight 0 and a recorded reason.

Screening checks each client's reported scalars (sample count, the metrics the rule reads) and its update
(finite entries, a norm whose square fits in the dtype). It needs every update's norm, one pass over the
data. A rule whose own first pass over the updates can take those norms declares it with one hook,
``first_pass(round) -> FirstPass``; the front door then screens on the norms that pass took and hands
the pass to ``aggregate(round, first)``, so a clean round is read once less. A rule that does not care
defines neither and is called as ``aggregate(round)`` on a screened round.

The path of one call (``rule(round)``):

1. scalars screened (cheap); a rule without a first pass also has its updates screened (one pass);
2. ``first = rule.first_pass(round)`` on the unscreened round, when the rule has one and the scalars
   are clean: if its norms (or its ``finite`` verdict) clear every update, ``rule.aggregate(round,
   first)`` and done;
3. otherwise the round is screened from scratch, the malformed clients are removed (their reasons in
   ``Round.quarantined``) and the rule runs on the rest (``first_pass`` again, on the rest); where
   the rule refuses the rest, its :class:`RoundRefused` names them too (``exc.quarantined``);
4. the weights and per-client diagnostics are mapped back onto the round's clients.

A first pass runs on data that may hold NaN or Inf: it does arithmetic only (no state change, no
decision that could fail on a NaN) and leaves everything else to ``aggregate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedtrust.aggregators.core import Aggregate, NoValidUpdates, Round, RoundRefused

__all__ = ["LOSSES", "FirstPass", "call_rule", "has_first_pass", "negative_loss", "norm_limit", "screen"]


@dataclass(frozen=True)
class FirstPass:
    """What a rule's first pass over a round's updates found.

    value:  anything the rule wants back in ``aggregate(round, first)`` (distances, a sort, a mean).
    norms:  (n,) norms of the updates, taken by the pass: the front door screens on them. A pass that
            stops at a malformed update may return any norms with a non-finite entry there; the front door
            then screens every update itself.
    finite: instead of norms, the pass's result proves every entry finite (a positive combination of all
            the updates, as the mean: a NaN or Inf anywhere would reach it). Finite updates too large to
            square are then kept, harmless to such a rule.
    """

    value: Any = None
    norms: torch.Tensor | None = None
    finite: bool = False

    def clears(self, round: Round) -> bool:
        """Whether the pass shows every update of ``round`` sound."""
        if self.norms is not None:
            return bool((self.norms <= norm_limit(round.updates.dtype)).all())  # NaN <= limit is False
        return self.finite


def norm_limit(dtype: torch.dtype) -> float:
    """The largest norm an update may have: its square must be representable."""
    return math.sqrt(torch.finfo(dtype).max)


def screen(
    round: Round,
    requires: Sequence[str] = (),
    updates: bool = True,
    rule: str = "this rule",
    sizes: bool = True,
) -> dict[int, str]:
    """Positions of the round's malformed clients -> reason: a reported count or a required metric that
    is not finite (or a negative count), and with ``updates`` an update with a non-finite entry or (with
    ``sizes``) a norm overflowing its dtype (one pass over the updates: :attr:`Round.norms`)."""
    bad = _screen_scalars(round, requires, rule)
    return {**bad, **_screen_updates(round, sizes)} if updates else bad


def _screen_updates(round: Round, sizes: bool = True) -> dict[int, str]:
    x = round.updates
    bad: dict[int, str] = {}
    limit = norm_limit(x.dtype)
    norms = round.norms_on_host  # one transfer (on a GPU a nonzero is a sync, and its read another)
    flagged = torch.nonzero(~(norms <= limit)).flatten().tolist()  # NaN-safe: NaN <= limit is False
    if not flagged:
        return bad
    # the flagged rows' NaN and Inf counts in one transfer (a crash attack flags many clients a round)
    counts = torch.stack([torch.stack([torch.isnan(x[i]).sum(), torch.isinf(x[i]).sum()]) for i in flagged])
    for i, (nan, inf) in zip(flagged, counts.tolist(), strict=True):
        if nan or inf:
            bad[i] = f"update has non-finite entries ({nan} NaN, {inf} Inf of {round.d})"
        elif sizes:
            bad[i] = _too_large(x[i])
    return bad


def _too_large(row: torch.Tensor) -> str:
    """Why a finite update was refused for its size: the norm fits the dtype, its square does not."""
    scale = row.abs().max().double()
    norm = float(scale * (row.double() / scale).norm())  # scaled: a float64 row's squares may overflow
    dtype = str(row.dtype).removeprefix("torch.")
    return (
        f"update norm {norm:.3g} is too large to square in {dtype}, the round's dtype (its square exceeds "
        f"{torch.finfo(row.dtype).max:.3g}; the norm limit is {norm_limit(row.dtype):.3g})"
    )


#: Metrics that are a training loss (ARFL's and FOCUS's ``train_loss``): cross-entropy or squared error,
#: never below 0. A client reporting a negative one is quarantined: ARFL's closed form (eq 9) gives a
#: reported loss of -1e6 all the weight of a round.
LOSSES = ("train_loss",)


def negative_loss(name: str, value: float) -> str:
    """Why a client's reported training loss ``value`` of metric ``name`` (in :data:`LOSSES`), below 0, is
    refused."""
    return (
        f"metric {name}={value!r} is below 0, which a training loss (cross-entropy, squared error) never is"
    )


def _screen_scalars(round: Round, requires: Sequence[str], rule: str) -> dict[int, str]:
    bad: dict[int, str] = {}
    counts = round.samples_on_host()  # (on a GPU: no sync; the round keeps the counts given on the host)
    # the usual case in two reductions (a NaN fails the first test, an Inf the second)
    if not requires and len(counts) and float(counts.min()) >= 0 and math.isfinite(float(counts.sum())):
        return bad
    for i in torch.nonzero(~(torch.isfinite(counts) & (counts >= 0))).flatten().tolist():
        reported = round.reported_samples[i].item()  # as the client gave it, before the round's dtype
        if math.isfinite(reported) and reported >= 0:
            dtype = str(counts.dtype).removeprefix("torch.")
            reason = (
                f"num_samples={reported!r} overflows {dtype}, the round's dtype (max "
                f"{torch.finfo(counts.dtype).max:.3g})"
            )
        else:
            reason = f"num_samples={reported!r} is not a finite non-negative count"
        bad.setdefault(i, reason)
    for name in requires:
        if name not in round.metrics:
            raise ValueError(
                f"{rule} needs metric {name!r} in Round.metrics; got {sorted(round.metrics) or 'none'}"
            )
        values = round.metric_on_host(name)
        if name in LOSSES:
            for i in torch.nonzero((values < 0) & torch.isfinite(values)).flatten().tolist():
                bad.setdefault(i, negative_loss(name, values[i].item()))
        for i in torch.nonzero(~torch.isfinite(values)).flatten().tolist():
            value = values[i].item()
            # metrics take the updates' dtype: an infinite one may have been a finite value beyond its range
            beyond = (
                ""
                if math.isnan(value)
                else (
                    f" in {str(values.dtype).removeprefix('torch.')}, the round's dtype (a value beyond "
                    f"{torch.finfo(values.dtype).max:.3g} overflows it)"
                )
            )
            bad.setdefault(i, f"metric {name}={value!r} is not finite{beyond}")
    return bad


def call_rule(rule: Any, round: Round) -> Aggregate:
    """Screen ``round``, run ``rule`` (a :class:`~fedtrust.aggregators.base.BaseRule`) on its healthy
    clients and map the result back (the module docstring walks through it). Raises
    :class:`NoValidUpdates` when every client is malformed."""
    if not isinstance(round, Round):
        raise TypeError(f"{rule.name}: expected a fedtrust Round, got {type(round).__name__}")
    if round.previous is not None and getattr(rule, "reads_deltas", False):  # models: read as updates
        out = call_rule(rule, round.as_updates())
        out.vector = out.vector + round.previous  # a model again
        return out
    fused, first = has_first_pass(rule), None
    if fused and not screen(round, rule.requires, updates=False, rule=rule.name):
        first = rule.first_pass(round)
        if first.clears(round):
            return rule.aggregate(round, first)
    bad = screen(round, rule.requires, rule=rule.name, sizes=not getattr(rule, "keeps_large", False))
    if not bad:  # (a mean whose finite updates sum past the dtype: its first pass stands)
        return rule.aggregate(round, first) if first is not None else _aggregate(rule, round, fused)
    keep = [i for i in range(round.n) if i not in bad]
    quarantined = {round.client_ids[i]: reason for i, reason in sorted(bad.items())}
    if not keep:
        detail = "; ".join(f"{k!r}: {v}" for k, v in quarantined.items())
        raise NoValidUpdates(f"{rule.name}: all {round.n} clients were quarantined ({detail})", quarantined)
    try:
        out = _aggregate(rule, round.select(keep, quarantined=quarantined), fused)
    except RoundRefused as exc:  # the rule refused the rest: the record still names who was set aside
        exc.quarantined = {**quarantined, **getattr(exc, "quarantined", {})}
        raise
    return _expand(out, round.n, keep, quarantined)


def _aggregate(rule: Any, round: Round, fused: bool) -> Aggregate:
    return rule.aggregate(round, rule.first_pass(round)) if fused else rule.aggregate(round)


def has_first_pass(rule: Any) -> bool:
    """Whether ``rule`` declares a first pass of its own (a ``first_pass`` method)."""
    return callable(getattr(rule, "first_pass", None))


def _expand(out: Aggregate, n: int, keep: list[int], quarantined: dict) -> Aggregate:
    idx = torch.as_tensor(keep, device=out.weights.device)
    weights = torch.zeros(n, dtype=out.weights.dtype, device=out.weights.device)
    weights[idx] = out.weights
    info = dict(out.info)
    clients = {}
    for key, value in info.get("clients", {}).items():
        full = torch.full((n,), math.nan, dtype=torch.float64, device=value.device)
        full[idx] = value.to(torch.float64)
        clients[key] = full
    if clients:
        info["clients"] = clients
    info["quarantined"] = quarantined
    return Aggregate(out.vector, weights, info)
