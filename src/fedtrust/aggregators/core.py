"""The one core contract: ``Round -> rule -> Aggregate``.

A :class:`Round` is what the server knows in one round; a rule is any object with
``__call__(round) -> Aggregate`` (and ``state_dict`` / ``load_state_dict`` when it learns across
rounds); an :class:`Aggregate` is the aggregate vector plus the trust weight given to each client.
A rule that wants every client's metrics before training starts (ARFL's initial loss report) also has
``observe(client_ids, num_samples, metrics)``; the simulator and the Flower strategy call it once.

:class:`BaseRule` gives every built-in rule the same front door: it validates the round, quarantines
malformed client updates (non-finite entries, overflowing norms, bad counts or metrics) with a recorded
reason, runs the rule on the rest, and maps the weights back onto the original clients. The screening
needs each update's norm; rules whose first pass over the updates can take the norms screen there
(``screens_in_first_pass``), so a clean round is read once less.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from fedtrust._checks import check_float, check_int
from fedtrust.aggregators.kernels import row_norms

__all__ = [
    "Aggregate",
    "BaseRule",
    "NoValidUpdates",
    "Round",
    "Rule",
    "StatefulRule",
    "UnscreenedUpdates",
    "byzantine_budget",
    "check_f",
    "resolve_f",
]

_HALF = (torch.float16, torch.bfloat16)


class NoValidUpdates(ValueError):
    """Raised when every client of a round was quarantined: there is nothing left to aggregate."""


class UnscreenedUpdates(ValueError):
    """Raised by :meth:`Round.adopt_norms` when a rule's own first pass meets an update the front door
    quarantines (non-finite, or a norm overflowing the dtype). The front door catches it and screens the
    round; calling a rule's ``aggregate`` directly on such a round raises it."""


def _norm_limit(dtype: torch.dtype) -> float:
    """The largest norm an update may have: its square must be representable."""
    return math.sqrt(torch.finfo(dtype).max)


def _as_tensor(field_name: str, value: Any, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    else:
        try:
            t = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{field_name} must be array-like numbers, got {type(value).__name__}") from exc
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{field_name} must hold real numbers, got dtype {t.dtype}")
    return t if device is None else t.to(device)


@dataclass(frozen=True, eq=False)
class Round:
    """What the server knows this round (see DESIGN.md, "The one core contract").

    updates:      (n, d) floating tensor, one flat vector per reporting client (parameters or deltas).
                  float16/bfloat16 are computed in float32; float64 stays float64.
    client_ids:   n distinct stable ids (rules that learn reputation key their state by id);
                  default ``0..n-1``.
    num_samples:  (n,) reported sample counts; default all ones. A client's non-finite or negative
                  count quarantines that client.
    metrics:      name -> (n,) client-reported scalars ("train_loss" for ARFL, "global_loss" for FOCUS).
    reference:    optional callable, flat vector -> loss on the server's trusted benchmark set.
    previous:     optional (d,) previous global vector.
    """

    updates: torch.Tensor
    client_ids: Sequence[Hashable] | None = None
    num_samples: torch.Tensor | None = None
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)
    reference: Callable[[torch.Tensor], float] | None = None
    previous: torch.Tensor | None = None

    def __post_init__(self) -> None:
        x = _as_tensor("Round.updates", self.updates)
        if not x.is_floating_point():
            raise TypeError(f"Round.updates must hold floating-point numbers, got dtype {x.dtype}")
        if x.dtype in _HALF:
            x = x.float()
        if x.dim() != 2:
            raise ValueError(f"Round.updates must be a 2-D (n_clients, d) array, got shape {tuple(x.shape)}")
        n, d = x.shape
        if n == 0:
            raise ValueError(
                f"Round.updates is empty: a round needs at least one client (got shape {(n, d)})"
            )
        if d == 0:
            raise ValueError(f"Round.updates has zero coordinates (got shape {(n, d)})")
        set_ = object.__setattr__
        set_(self, "updates", x)

        ids = tuple(range(n)) if self.client_ids is None else self._ids(self.client_ids, n)
        set_(self, "client_ids", ids)

        if self.num_samples is None:
            counts = torch.ones(n, dtype=x.dtype, device=x.device)
        else:
            counts = _as_tensor("Round.num_samples", self.num_samples, x.device).to(x.dtype).reshape(-1)
            if counts.numel() != n:
                raise ValueError(
                    f"Round.num_samples must have one entry per client ({n}), got {counts.numel()}"
                )
        set_(self, "num_samples", counts)

        if not isinstance(self.metrics, Mapping):
            raise TypeError(
                f"Round.metrics must be a mapping name -> (n,) values, got {type(self.metrics).__name__}"
            )
        metrics = {}
        for name, value in self.metrics.items():
            m = _as_tensor(f"Round.metrics[{name!r}]", value, x.device).to(x.dtype).reshape(-1)
            if m.numel() != n:
                raise ValueError(
                    f"Round.metrics[{name!r}] must have one value per client ({n}), got {m.numel()}"
                )
            metrics[str(name)] = m
        set_(self, "metrics", metrics)

        if self.previous is not None:
            p = _as_tensor("Round.previous", self.previous, x.device).to(x.dtype).reshape(-1)
            if p.numel() != d:
                raise ValueError(f"Round.previous must have d={d} entries like each update, got {p.numel()}")
            if not torch.isfinite(p).all():
                raise ValueError("Round.previous (the previous global vector) has non-finite entries")
            set_(self, "previous", p)
        if self.reference is not None and not callable(self.reference):
            raise TypeError(
                f"Round.reference must be callable (vector -> loss), got {type(self.reference).__name__}"
            )

    @staticmethod
    def _ids(ids: Any, n: int) -> tuple:
        if isinstance(ids, torch.Tensor | np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"Round.client_ids must be a sequence of {n} ids, got {type(ids).__name__}")
        ids = tuple(ids)
        if len(ids) != n:
            raise ValueError(f"Round.client_ids must have one id per update ({n}), got {len(ids)}")
        try:
            unique = set(ids)
        except TypeError as exc:
            raise TypeError(f"Round.client_ids must be hashable (str or int), got {ids!r}") from exc
        if len(unique) != n:
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"Round.client_ids must be distinct: {dup!r} appears {ids.count(dup)} times")
        return ids

    @property
    def n(self) -> int:
        return self.updates.shape[0]

    @cached_property
    def norms(self) -> torch.Tensor:
        """(n,) float64 norms of the updates (:func:`~fedtrust.aggregators.kernels.row_norms`), taken
        once: the front door's screening computes them and rules that need norms reuse them."""
        return row_norms(self.updates)

    @property
    def norms_taken(self) -> bool:
        """Whether :attr:`norms` is already known (taken by the screening or adopted from a rule's pass)."""
        return "norms" in self.__dict__

    def norms_for_pass(self) -> dict[str, Any]:
        """Keyword arguments for a pass over the updates (:class:`~fedtrust.aggregators.kernels.
        CombinationPasses`, the inference module's ``Tasks``): the norms when already taken, else a hook
        through which the pass hands over the norms it takes (:meth:`adopt_norms`)."""
        if self.norms_taken:
            return {"norms": self.norms}
        return {"on_norms": self.adopt_norms}

    def adopt_norms(self, norms: torch.Tensor) -> None:
        """Keep the n norms a rule's own pass took as this round's :attr:`norms`, after checking them as
        the front door's screening would (so a rule with ``screens_in_first_pass`` needs no screening
        pass). Raises :class:`UnscreenedUpdates`, keeping nothing, when one marks a malformed update."""
        norms = norms.reshape(-1).to(torch.float64)
        if norms.numel() != self.n:
            raise ValueError(f"Round.adopt_norms: need {self.n} norms, got {norms.numel()}")
        if not bool((norms <= _norm_limit(self.updates.dtype)).all()):  # NaN <= limit is False
            raise UnscreenedUpdates(
                "Round.updates has non-finite or overflowing updates; call the rule itself (its front door "
                "quarantines them), not its aggregate()"
            )
        self.__dict__["norms"] = norms

    @property
    def d(self) -> int:
        return self.updates.shape[1]

    def select(self, index: torch.Tensor | Sequence[int]) -> Round:
        """The same round restricted to the clients at ``index`` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.updates.device)
        pos = idx.tolist()
        out = Round(
            updates=self.updates.index_select(0, idx),
            client_ids=[self.client_ids[i] for i in pos],
            num_samples=self.num_samples.index_select(0, idx),
            metrics={k: v.index_select(0, idx) for k, v in self.metrics.items()},
            reference=self.reference,
            previous=self.previous,
        )
        if self.norms_taken:  # carried over, not recomputed
            out.__dict__["norms"] = self.norms.index_select(0, idx)
        return out


@dataclass
class Aggregate:
    """What a rule returns.

    vector:  (d,) the aggregate.
    weights: (n,) non-negative, summing to 1: the effective trust given to each client this round
             (0 for quarantined clients).
    info:    diagnostics (noise levels, scores, iterations, ...). Per-client diagnostics live in
             ``info["clients"]`` as (n,) tensors aligned with the round's clients (NaN where quarantined);
             ``info["quarantined"]`` maps client id -> reason.
    """

    vector: torch.Tensor
    weights: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)

    def trust(self, client_ids: Sequence[Hashable]) -> dict[Hashable, float]:
        """The weights as a plain ``{client_id: weight}`` dict."""
        return dict(zip(client_ids, self.weights.tolist(), strict=True))


@runtime_checkable
class Rule(Protocol):
    """Any aggregation rule: ``rule(round) -> Aggregate``."""

    def __call__(self, round: Round) -> Aggregate: ...


@runtime_checkable
class StatefulRule(Rule, Protocol):
    """A rule that learns across rounds and can be checkpointed."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def resolve_f(f: int | float, n: int) -> int:
    """The assumed number of Byzantine clients among ``n``: ``f``, or ``floor(f * n)`` for a float f."""
    if isinstance(f, float):
        return math.floor(f * n)
    return f


def check_f(rule: str, f: Any) -> int | float:
    """Validate a rule's ``f`` option: a count (int >= 0) or a fraction of the clients (0 <= f < 0.5)."""
    if isinstance(f, float):
        return check_float(f"{rule}: f (as a fraction of the clients)", f, minimum=0.0, maximum=0.4999999)
    return check_int(f"{rule}: f", f, minimum=0)


def byzantine_budget(
    rule: str, f: int | float, round: Round, n_quarantined: int, need: str, minimum: Callable[[int], int]
) -> int:
    """The f to use on a clean round: ``f`` (or its fraction of all the round's clients) minus the
    clients already quarantined as malformed (they are known-faulty), checked against the rule's
    requirement ``n >= minimum(f)``."""
    n = round.n
    f_eff = max(0, resolve_f(f, n + n_quarantined) - n_quarantined)
    if n < minimum(f_eff):
        raise ValueError(f"{rule}: needs {need} clients, got n={n} with f={f_eff}")
    return f_eff


def _screen(round: Round, requires: Sequence[str]) -> dict[int, str]:
    """Indices of malformed clients -> reason. One pass over the updates (row norms)."""
    return {**_screen_scalars(round, requires), **_screen_updates(round)}


def _screen_updates(round: Round) -> dict[int, str]:
    x = round.updates
    bad: dict[int, str] = {}
    norms = round.norms
    limit = _norm_limit(x.dtype)
    for i in torch.nonzero(~(norms <= limit)).flatten().tolist():  # NaN-safe: NaN <= limit is False
        row = x[i]
        nan, inf = int(torch.isnan(row).sum()), int(torch.isinf(row).sum())
        if nan or inf:
            bad[i] = f"update has non-finite entries ({nan} NaN, {inf} Inf of {round.d})"
        else:
            dtype = str(x.dtype).removeprefix("torch.")
            bad[i] = f"update norm {float(row.double().norm()):.3g} overflows {dtype}"
    return bad


def _screen_scalars(round: Round, requires: Sequence[str]) -> dict[int, str]:
    bad: dict[int, str] = {}
    counts = round.num_samples
    if not requires and len(counts) and float(counts.min()) >= 0 and math.isfinite(float(counts.sum())):
        return bad  # the usual case in two reductions (a NaN fails the first test, an Inf the second)
    for i in torch.nonzero(~(torch.isfinite(counts) & (counts >= 0))).flatten().tolist():
        bad.setdefault(i, f"num_samples={counts[i].item()!r} is not a finite non-negative count")
    for name in requires:
        if name not in round.metrics:
            raise ValueError(
                f"this rule needs metric {name!r} in Round.metrics; got {sorted(round.metrics) or 'none'}"
            )
        values = round.metrics[name]
        for i in torch.nonzero(~torch.isfinite(values)).flatten().tolist():
            bad.setdefault(i, f"metric {name}={values[i].item()!r} is not finite")
    return bad


class BaseRule:
    """Shared front door of the built-in rules.

    Subclasses implement :meth:`aggregate` on a clean round and set ``name`` (registry name), ``paper``
    (the source, cited in ``fedtrust rules``) and ``requires`` (client metrics the rule reads).
    Stateless rules inherit an empty ``state_dict``.
    """

    name: ClassVar[str] = "base"
    paper: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    #: A stateless rule whose aggregate is a positive combination of every update (the mean, FedAvg)
    #: screens by its result: a NaN or Inf anywhere reaches the aggregate, and only then are the updates
    #: screened one by one. One pass over the data instead of two; finite updates too large to square in
    #: the dtype are harmless to a mean and are kept.
    screen_by_result: ClassVar[bool] = False
    #: A rule whose first pass over the updates takes their norms (through ``Round.norms_for_pass``)
    #: before it uses them screens there: it runs unscreened, its first pass hands the norms to
    #: ``Round.adopt_norms``, which stops it (``UnscreenedUpdates``) when a client must be quarantined,
    #: and only then is the round screened and the rule run on the rest. A clean round costs no
    #: screening pass. Its state may change only after that first pass.
    screens_in_first_pass: ClassVar[bool] = False

    def __call__(self, round: Round) -> Aggregate:
        if not isinstance(round, Round):
            raise TypeError(f"{self.name}: expected a fedtrust Round, got {type(round).__name__}")
        if self.screen_by_result and not _screen_scalars(round, self.requires):
            out = self.aggregate(round)
            if math.isfinite(float(out.vector.sum())):  # a NaN or Inf entry makes the sum non-finite
                return out
        elif (
            self.screens_in_first_pass and not round.norms_taken and not _screen_scalars(round, self.requires)
        ):
            try:
                out = self.aggregate(round)
            except ValueError:  # UnscreenedUpdates, or an error met before its pass screened the round
                if round.norms_taken:
                    raise  # the round was clean: the error is the rule's
                # (a quarantine may change the outcome, e.g. a Byzantine budget): screened below
            else:
                if not round.norms_taken:
                    raise RuntimeError(f"{self.name}: screens_in_first_pass, but its pass took no norms")
                return out
        bad = _screen(round, self.requires)
        if not bad:
            return self.aggregate(round)
        keep = [i for i in range(round.n) if i not in bad]
        quarantined = {round.client_ids[i]: reason for i, reason in sorted(bad.items())}
        if not keep:
            detail = "; ".join(f"{k!r}: {v}" for k, v in quarantined.items())
            raise NoValidUpdates(f"{self.name}: all {round.n} clients were quarantined ({detail})")
        out = self.aggregate(round.select(keep), n_quarantined=len(bad))
        return _expand(out, round.n, keep, quarantined)

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        """Aggregate a validated round. ``n_quarantined`` clients were already removed as malformed:
        rules with a Byzantine budget ``f`` count them against it (they are known-faulty)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state across rounds, got state keys {sorted(state)}")

    def options(self) -> dict[str, Any]:
        """The rule's options as given at construction (for manifests and repr)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def leaving_out(rule: Rule, client_ids) -> Rule:
    """``rule`` run on each round without the clients in ``client_ids`` (weight 0 in the aggregate): the
    "those clients absent" baseline an attack is measured against."""
    absent = set(client_ids)

    def without(round: Round) -> Aggregate:
        keep = [k for k, i in enumerate(round.client_ids) if i not in absent]
        out = rule(round.select(keep))
        weights = torch.zeros(round.n, dtype=out.weights.dtype, device=out.weights.device)
        weights[torch.as_tensor(keep, dtype=torch.long, device=out.weights.device)] = out.weights
        return Aggregate(out.vector, weights, out.info)

    return without


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
