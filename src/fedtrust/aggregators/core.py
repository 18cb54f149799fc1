"""The one core contract: ``Round -> rule -> Aggregate``.

A :class:`Round` is what the server knows in one round; a rule is any object with
``__call__(round) -> Aggregate`` (and ``state_dict`` / ``load_state_dict`` when it learns across
rounds); an :class:`Aggregate` is the aggregate vector plus the trust weight given to each client.
A rule that wants every client's metrics before training starts (ARFL's initial loss report) also has
``observe(client_ids, num_samples, metrics)``; the simulator and the Flower strategy call it once.

The built-in rules derive from :class:`~fedtrust.aggregators.base.BaseRule`, whose front door
(:mod:`fedtrust.aggregators.screening`) quarantines malformed clients before the rule sees the round.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fedtrust._checks import check_float, check_int
from fedtrust.aggregators.info import Info, Reference
from fedtrust.aggregators.passes import row_norms

__all__ = [
    "Aggregate",
    "Info",
    "NoValidUpdates",
    "Reference",
    "Round",
    "RoundRefused",
    "Rule",
    "StatefulRule",
    "budget_for",
    "byzantine_budget",
    "check_f",
    "resolve_f",
]

_HALF = (torch.float16, torch.bfloat16)


class RoundRefused(ValueError):
    """A rule cannot aggregate this round for a reason the round's data gives: too few clients for its
    Byzantine budget, reported counts that sum to zero, an estimator's fit that breaks down, every
    client quarantined. A server keeps its model and records the reason (:mod:`fedtrust.server`); any
    other exception from a rule is a bug and propagates."""


class NoValidUpdates(RoundRefused):
    """Raised when every client of a round was quarantined: there is nothing left to aggregate.
    ``quarantined``: client id -> reason, where the front door quarantined them."""

    def __init__(self, message: str, quarantined: dict | None = None):
        super().__init__(message)
        self.quarantined = dict(quarantined or {})


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached (a server reads values; no rule differentiates through a round) and strided: a
    sparse update (COO, CSR, ...) is made dense, which every rule reads."""
    t = t.detach()
    return t if t.layout == torch.strided else t.to_dense()


def _per_client(field_name: str, value: Any) -> torch.Tensor:
    """``value`` as a flat tensor of one value per client: a row or column of them, or any shape with one
    axis longer than 1; a table (two or more such axes) is refused rather than read row by row."""
    t = _as_tensor(field_name, value)
    if sum(s != 1 for s in t.shape) > 1:
        raise ValueError(f"{field_name} must be one value per client, got shape {tuple(t.shape)}")
    return t.reshape(-1)


def _as_tensor(field_name: str, value: Any, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = _dense(value)
    elif isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        rows = [_dense(v) for v in value]
        for k, row in enumerate(rows):  # stacked, a bool row among floats became 1.0s and was trusted (an
            # integer update among float ones too; scalars, a client's count or metric, may mix kinds)
            if row.dtype == torch.bool or (
                row.dim() and row.is_floating_point() != rows[0].is_floating_point()
            ):
                raise TypeError(f"{field_name}[{k}] has dtype {row.dtype} among rows of {rows[0].dtype}; "
                                "every row holds real numbers of one kind")  # fmt: skip
            if row.shape != rows[0].shape:
                raise ValueError(f"{field_name}[{k}] has shape {tuple(row.shape)}, {field_name}[0] "
                                 f"{tuple(rows[0].shape)}: the rows must have one shape")  # fmt: skip
        t = torch.stack(rows)
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:  # a ragged list: numpy's words say where
            raise TypeError(
                f"{field_name} must be array-like numbers, got {type(value).__name__} ({exc})"
            ) from exc
        if not array.dtype.isnative:  # big-endian data (">f4"), which torch does not read
            array = array.astype(array.dtype.newbyteorder("="))
        odd = [v for v in array.flat if np.asarray(v).dtype == object] if array.dtype == object else []
        if odd:  # None, or an integer beyond int64 (2**70), among the numbers
            why = (
                "an integer beyond int64 (give it as a float)" if isinstance(odd[0], int) else "not a number"
            )
            raise TypeError(f"{field_name} holds {odd[0]!r} ({type(odd[0]).__name__}): {why}")
        if any(stride < 0 for stride in array.strides):  # a reversed view, which torch cannot share
            array = np.ascontiguousarray(array)
        try:
            t = torch.as_tensor(array)
        except (TypeError, ValueError) as exc:  # float128, strings
            raise TypeError(
                f"{field_name} must be array-like numbers torch reads, got {type(value).__name__} of dtype "
                f"{array.dtype}"
            ) from exc
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{field_name} must hold real numbers, got dtype {t.dtype}")
    if t.is_meta and type(t) is torch.Tensor:  # (a tensor subclass may present data as meta)
        raise ValueError(
            f"{field_name} is a meta tensor: it has a shape {tuple(t.shape)} but no values to read; give "
            "the tensor with its data (on the CPU or a GPU)"
        )
    return t if device is None else t.to(device)


def _state(model: Any, where: str) -> Mapping[str, torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return model.state_dict(keep_vars=True)
    if isinstance(model, Mapping) and all(isinstance(v, torch.Tensor) for v in model.values()):
        return model
    raise ValueError(f"Round.from_models: {where} must be a torch.nn.Module or a state dict of tensors, "
                     f"got {type(model).__name__}")  # fmt: skip


def _float_entries(model: Any, where: str) -> list[tuple[str, torch.Size]]:
    """The names and shapes of a model's floating entries, in state_dict order, a tied tensor once."""
    seen, entries = set(), []
    for name, tensor in _state(model, where).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.is_floating_point() and key not in seen:
            seen.add(key)
            entries.append((name, tensor.shape))
    return entries


def _flat_entries(model: Any, layout: list[tuple[str, torch.Size]], where: str) -> torch.Tensor:
    state = _state(model, where)
    parts = []
    for name, shape in layout:
        if name not in state:
            raise ValueError(f"Round.from_models: {where} has no entry {name!r} (models[0] has it)")
        if state[name].shape != shape:
            raise ValueError(f"Round.from_models: {where}[{name!r}] has shape {tuple(state[name].shape)}, "
                             f"models[0]'s has {tuple(shape)}")  # fmt: skip
        if not state[name].is_floating_point():
            raise ValueError(f"Round.from_models: {where}[{name!r}] holds {state[name].dtype}, models[0]'s "
                             "floats (a cast would truncate the weights)")  # fmt: skip
        parts.append(state[name].detach().reshape(-1))
    return torch.cat(parts)


@dataclass(frozen=True, eq=False)
class Round:
    """What the server knows this round (docs/architecture.md, "The contract a rule implements").

    updates:      (n, d) floating tensor, one flat vector per reporting client (parameters or deltas).
                  float16/bfloat16 are computed in float32; float64 stays float64 (float8 is refused); a
                  meta tensor, which holds no values, is refused in every field; a sparse tensor
                  (or a list of them) is made dense, and a numpy array or nested list taken as one.
    client_ids:   n distinct stable ids (rules that learn reputation key their state by id);
                  default ``0..n-1``.
    num_samples:  (n,) reported sample counts, in the updates' dtype; default all ones. A client's
                  non-finite or negative count (or one beyond the dtype: 1e300 in float32) quarantines
                  that client. ``reported_samples`` (set, not given) holds them as given.
    metrics:      name -> (n,) client-reported scalars ("train_loss" for ARFL and FOCUS).
                  Counts and metrics live on the updates' device; given on the host (a list, as a server
                  receives them), the round keeps them there too (:meth:`samples_on_host`).
    reference:    optional :class:`~fedtrust.aggregators.info.Reference`: the server's trusted benchmark
                  split, ``reference(update) -> mean loss`` of the model one update gives (FOCUS's eq 4,
                  the "benchmark" loss defence).
    previous:     optional (d,) previous global vector, when ``updates`` are the clients' models
                  (parameters): rules that read models (FLAME, CFL) measure from it; rules whose result
                  does not depend on the origin (the mean, median, Krum, ...) need not; rules whose
                  result does (norm bounding, FoolsGold, FLTrust, centred clipping, the clipping and ARC
                  pre-aggregators: ``reads_deltas``) get the updates x_i - previous and their result
                  plus previous (:meth:`as_updates`). Leave it None when ``updates`` are deltas (as the
                  simulator and the Flower strategy send).
    quarantined:  client id -> reason, for clients of this round already removed as malformed (the front
                  door, :mod:`~fedtrust.aggregators.screening`, fills it in). They are known-faulty:
                  rules with a Byzantine budget ``f`` count them against it.
    """

    updates: torch.Tensor
    client_ids: Sequence[Hashable] | None = None
    num_samples: torch.Tensor | None = None
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)
    reference: Reference | None = None
    previous: torch.Tensor | None = None
    quarantined: Mapping[Hashable, str] = field(default_factory=dict)
    reported_samples: torch.Tensor = field(init=False, repr=False)
    _host: dict[str | None, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        x = _as_tensor("Round.updates", self.updates)
        if not x.is_floating_point():
            raise TypeError(f"Round.updates must hold floating-point numbers, got dtype {x.dtype}")
        if x.dtype in _HALF:
            x = x.float()
        elif x.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"Round.updates holds {x.dtype}, which the rules cannot compute in; give float16, bfloat16, "
                "float32 or float64"
            )
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
        set_(self, "_host", {})  # a device round's per-client scalars given on the host (_keep_on_host)

        ids = tuple(range(n)) if self.client_ids is None else self._ids(self.client_ids, n)
        set_(self, "client_ids", ids)

        if self.num_samples is None:
            reported = torch.ones(n, dtype=x.dtype)
        else:
            reported = _per_client("Round.num_samples", self.num_samples)
            if reported.numel() != n:
                raise ValueError(
                    f"Round.num_samples must have one entry per client ({n}), got {reported.numel()}"
                )
        self._keep_on_host(None, reported)
        reported = reported.to(x.device)
        set_(self, "num_samples", reported.to(x.dtype))
        set_(self, "reported_samples", reported)  # as given: the front door names a count that overflowed

        if not isinstance(self.metrics, Mapping):
            raise TypeError(
                f"Round.metrics must be a mapping name -> (n,) values, got {type(self.metrics).__name__}"
            )
        metrics = {}
        for name, value in self.metrics.items():
            m = _per_client(f"Round.metrics[{name!r}]", value)
            if m.numel() != n:
                raise ValueError(
                    f"Round.metrics[{name!r}] must have one value per client ({n}), got {m.numel()}"
                )
            self._keep_on_host(str(name), m)
            metrics[str(name)] = m.to(x.device, x.dtype)
        set_(self, "metrics", metrics)

        if self.previous is not None:
            p = _as_tensor("Round.previous", self.previous, x.device).to(x.dtype).reshape(-1)
            if p.numel() != d:
                raise ValueError(f"Round.previous must have d={d} entries like each update, got {p.numel()}")
            if not torch.isfinite(p).all():
                raise ValueError("Round.previous (the previous global vector) has non-finite entries")
            set_(self, "previous", p)
        if not isinstance(self.quarantined, Mapping):
            raise TypeError(
                "Round.quarantined must be a mapping client id -> reason, got "
                f"{type(self.quarantined).__name__}"
            )
        set_(self, "quarantined", dict(self.quarantined))
        if self.reference is not None and not callable(self.reference):
            raise TypeError(
                f"Round.reference must be callable (vector -> loss), got {type(self.reference).__name__}"
            )

    @classmethod
    def from_models(cls, models: Sequence[Any], previous: Any = None, **fields: Any) -> Round:
        """A round from the clients' models: ``torch.nn.Module`` objects or their ``state_dict()`` s. Each
        becomes the flat vector of its floating-point entries (parameters and floating buffers such as
        batch norm's running statistics), in state_dict order, a tied tensor once: the layout of
        :class:`fedtrust.models.FlatModel`, so ``FlatModel(module, task).state_dict(vector)`` loads an
        aggregate back (integer buffers such as ``num_batches_tracked`` are not aggregated and keep the
        module's value). With ``previous`` (the global model, a module or state dict) the updates are
        the differences from it (deltas, so the round has no ``previous``: every rule reads deltas, and
        the aggregate is a step to add to the global model); ``fields`` are the other Round fields
        (``client_ids``, ``num_samples``, ...). Models whose entries differ from the first's in name or
        shape are refused naming the model and the entry."""
        if isinstance(models, Mapping) or not isinstance(models, Sequence) or not models:
            raise ValueError(f"Round.from_models: models must be a non-empty list of modules or state dicts, "
                             f"got {type(models).__name__}")  # fmt: skip
        layout = _float_entries(models[0], "models[0]")
        if not layout:
            raise ValueError("Round.from_models: models[0] has no floating-point entries to aggregate")
        vectors = [_flat_entries(m, layout, f"models[{i}]") for i, m in enumerate(models)]
        updates = torch.stack(vectors)
        if previous is not None:
            start = _flat_entries(previous, layout, "previous")
            return cls(updates=updates - start, **fields)
        return cls(updates=updates, **fields)

    @staticmethod
    def _ids(ids: Any, n: int) -> tuple:
        if isinstance(ids, torch.Tensor | np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"Round.client_ids must be a sequence of {n} ids, got {type(ids).__name__}")
        # numpy's integers and strings are ints and strs: state keyed by them must save (checkpoints key
        # by str or int), and np.int64(3) would be a key of its own beside 3
        ids = tuple(i.item() if isinstance(i, np.integer | np.str_) else i for i in ids)
        if len(ids) != n:
            raise ValueError(f"Round.client_ids must have one id per update ({n}), got {len(ids)}")
        others = [i for i in ids if isinstance(i, bool) or not isinstance(i, str | int)]
        if others:  # (a list, not next(..., None): None is itself an id to refuse)
            other = others[0]
            raise TypeError(
                f"Round.client_ids must be str or int (a rule keys its state and checkpoints by them), got "
                f"{other!r} ({type(other).__name__})"
            )
        unique = set(ids)
        if len(unique) != n:
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"Round.client_ids must be distinct: {dup!r} appears {ids.count(dup)} times")
        if len({str(i) for i in ids}) != n:  # records and reports name clients by str(id)
            named = [str(i) for i in ids]
            a, b = [i for i in ids if named.count(str(i)) > 1][:2]
            raise ValueError(f"Round.client_ids {a!r} and {b!r} would both be named {str(a)!r} in the "
                             "round's records; give distinct names")  # fmt: skip
        return ids

    def _keep_on_host(self, metric: str | None, given: torch.Tensor) -> None:
        """When the round lives on a device, keep per-client scalars given on the host (a list, numpy, a
        CPU tensor) there as well, in the round's dtype (``metric`` None: the counts), for
        :meth:`samples_on_host` and :meth:`metric_on_host`. (A Round's tensors are not written after it
        is made: a rule reads the counts from either copy.)"""
        if given.device.type == "cpu" and self.updates.device.type != "cpu":  # (a snapshot, as the field is)
            self._host[metric] = given.to(self.updates.dtype, copy=True)

    def samples_on_host(self) -> torch.Tensor:
        """``num_samples`` on the CPU, in the round's dtype. The front door's screen and the rules'
        arithmetic on n numbers read the per-client scalars here: on a GPU each read of a device scalar
        is a sync, and the simulator and the Flower strategy give them on the host, where the round keeps
        them (no transfer); given on a device, one transfer, kept."""
        return self._on_host(None)

    def metric_on_host(self, name: str) -> torch.Tensor:
        """``metrics[name]`` on the CPU, in the round's dtype (as :meth:`samples_on_host`)."""
        return self._on_host(name)

    def _on_host(self, metric: str | None) -> torch.Tensor:
        field = self.num_samples if metric is None else self.metrics[metric]
        if field.device.type == "cpu":  # the field itself
            return field
        if metric not in self._host:
            self._host[metric] = field.cpu()
        return self._host[metric]

    @property
    def n(self) -> int:
        return self.updates.shape[0]

    @cached_property
    def norms(self) -> torch.Tensor:
        """(n,) float64 norms of the updates (:func:`~fedtrust.aggregators.passes.row_norms`), taken
        on first use and kept."""
        return row_norms(self.updates)

    @cached_property
    def norms_on_host(self) -> torch.Tensor:
        """:attr:`norms` on the CPU (one transfer on a device, kept): the front door's screen and the
        rules' arithmetic on n numbers read them there."""
        return self.norms.cpu()

    @property
    def d(self) -> int:
        return self.updates.shape[1]

    def as_updates(self) -> Round:
        """A round of models as the clients' updates: ``updates - previous``, no ``previous``; its
        reference reads updates too (:class:`_UpdatesReference`: the same losses, the server's own update
        less ``previous``)."""
        out = Round(
            updates=self.updates - self.previous,
            client_ids=self.client_ids,
            num_samples=self.num_samples,
            metrics=self.metrics,
            reference=None if self.reference is None else _UpdatesReference(self.reference, self.previous),
            quarantined=self.quarantined,
        )
        object.__setattr__(out, "reported_samples", self.reported_samples)  # the counts as given
        out._host.update(self._host)
        return out

    def select(self, index: torch.Tensor | Sequence[int], quarantined: Mapping | None = None) -> Round:
        """The same round restricted to the clients at ``index`` (in that order); ``quarantined``, when
        given, replaces the record of clients removed as malformed."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.updates.device)
        pos = idx.tolist()

        def pick(metric: str | None, values: torch.Tensor) -> torch.Tensor:  # from a host copy if kept
            kept = self._host.get(metric)
            return values.index_select(0, idx) if kept is None else kept[pos]

        return Round(
            updates=self.updates.index_select(0, idx),
            client_ids=[self.client_ids[i] for i in pos],
            num_samples=pick(None, self.num_samples),
            metrics={k: pick(k, v) for k, v in self.metrics.items()},
            reference=self.reference,
            previous=self.previous,
            quarantined=self.quarantined if quarantined is None else quarantined,
        )


class _UpdatesReference:
    """A reference to a round of models (its rows, and its ``update()``, are models) read in updates: a
    row x is the model ``x + previous``, and the server's update is its model less ``previous``."""

    def __init__(self, reference: Any, previous: torch.Tensor):
        self.reference, self.previous = reference, previous
        self.size = getattr(reference, "size", 1)
        if callable(getattr(reference, "update", None)):
            self.update = lambda: torch.as_tensor(reference.update()).to(previous) - previous

    def __call__(self, update: torch.Tensor) -> float | torch.Tensor:
        return self.reference(update + self.previous)


@dataclass
class Aggregate:
    """What a rule returns.

    vector:  (d,) the aggregate.
    weights: (n,) non-negative, summing to 1: the effective trust given to each client this round
             (0 for quarantined clients).
    info:    diagnostics, every key optional and typed (:class:`~fedtrust.aggregators.info.Info`):
             per-client ones in ``info["clients"]`` as (n,) tensors aligned with the round's clients
             (NaN where quarantined), ``info["quarantined"]`` client id -> reason, iterations,
             convergence and its ``warning``, the sybil ``groups``, posterior variances, ...
    """

    vector: torch.Tensor
    weights: torch.Tensor
    info: Info = field(default_factory=dict)

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
    """The assumed number of Byzantine clients among ``n``: ``f``, or ``floor(f * n)`` for a float f, after
    rounding away float noise (0.29 * 100 is 28.999999999999996, meant as 29)."""
    if isinstance(f, float):
        return math.floor(round(f * n, 9))
    return f


def check_f(rule: str, f: Any) -> int | float:
    """Validate a rule's ``f`` option: a count (int >= 0) or a fraction of the clients (0 <= f < 0.5)."""
    if isinstance(f, numbers.Real) and not isinstance(f, numbers.Integral):  # numpy's float32 too
        return check_float(f"{rule}: f (as a fraction of the clients)", f, minimum=0.0, maximum=0.4999999)
    if isinstance(f, bool) or not isinstance(f, numbers.Integral):
        raise TypeError(f"{rule}: f must be a count (an integer >= 0) or a fraction of the clients (a float "
                        f"in [0, 0.5)), got {f!r} ({type(f).__name__})")  # fmt: skip
    return check_int(f"{rule}: f", f, minimum=0)


def byzantine_budget(
    rule: str, f: int | float, round: Round, need: str, minimum: Callable[[int], int]
) -> int:
    """The f to use on a screened round: ``f`` (or its fraction of all the round's clients) minus the
    clients already quarantined as malformed (``Round.quarantined``: they are known-faulty), checked
    against the rule's requirement ``n >= minimum(f)``."""
    return budget_for(rule, f, round.n, len(round.quarantined), need, minimum)


def budget_for(
    rule: str, f: int | float, n: int, n_quarantined: int, need: str, minimum: Callable[[int], int]
) -> int:
    """:func:`byzantine_budget` from the counts: ``n`` vectors left after ``n_quarantined`` clients were
    set aside (a pre-aggregator sees the vectors, not the round)."""
    f_eff = max(0, resolve_f(f, n + n_quarantined) - n_quarantined)
    if n < minimum(f_eff):
        raise RoundRefused(f"{rule}: needs {need} clients, got n={n} with f={f_eff}")
    return f_eff


def leaving_out(rule: Rule, client_ids) -> Rule:
    """``rule`` run on each round without the clients in ``client_ids`` (weight 0 in the aggregate): the
    "those clients absent" baseline an attack is measured against."""
    absent = set(client_ids)

    def without(round: Round) -> Aggregate:
        keep = [k for k, i in enumerate(round.client_ids) if i not in absent]
        if not keep:  # (a round of them only: nothing to aggregate, the server keeps its model)
            raise RoundRefused(f"every client of this round ({round.n}) is left out")
        out = rule(round.select(keep))
        weights = torch.zeros(round.n, dtype=out.weights.dtype, device=out.weights.device)
        weights[torch.as_tensor(keep, dtype=torch.long, device=out.weights.device)] = out.weights
        return Aggregate(out.vector, weights, out.info)

    return without
