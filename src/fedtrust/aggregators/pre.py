"""Pre-aggregators: linear maps of a round's updates stacked in front of any rule, as ByzFL has them
(docs/architecture.md, "Attacks and pre-aggregators"), and :class:`PreAggregated`, a rule made of a
list of them and an inner rule.

A pre-aggregator takes the (n, d) updates (and how many clients the front door already quarantined) and
returns ``(mixed, M)``: the (m, d) vectors the next stage sees and the (m, n) float64 mixing matrix with
``mixed = M @ x`` (to the rounding of x's dtype). Every M here is non-negative:

- :class:`NNM` (nearest-neighbour mixing): each vector replaced by the mean of its n - f nearest
  neighbours; M's rows hold 1 / (n - f) on the neighbours.
- :class:`Bucketing`: a random permutation cut into buckets of s, each bucket's mean; m = ceil(n / s).
- :class:`Clipping` (static): each vector scaled to norm at most c; M is diagonal with the scale factors.
- :class:`ARC` (adaptive robust clipping): the k largest vectors clipped to the (k+1)-th largest norm;
  M diagonal.

By name: ``fedtrust.rule("nnm+median")``, ``fedtrust.rule("arc+nnm+krum", f=2)`` or
``fedtrust.rule("median", pre=["nnm", {"name": "bucketing", "s": 3}])`` (:mod:`fedtrust.rules`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from fedtrust._checks import check_float, check_int, check_seed
from fedtrust.aggregators.base import BaseRule, Component
from fedtrust.aggregators.core import Aggregate, Round, budget_for, check_f
from fedtrust.aggregators.distances import pairwise_sq_distances
from fedtrust.aggregators.passes import row_norms
from fedtrust.aggregators.state import SeededCalls
from fedtrust.aggregators.sybils import near_duplicates

__all__ = ["ARC", "NNM", "Bucketing", "Clipping", "PreAggregated", "PreAggregator"]


class PreAggregator(Component):
    """Base of the pre-aggregators: ``pre(x, quarantined) -> (mixed, M)`` (see the module docstring).

    ``keeps_rows``: row i of the output is built around input i (NNM, clipping, ARC), so per-client
    diagnostics of the next stage still belong to client i. Stateless unless a subclass says otherwise.
    """

    name: ClassVar[str] = "pre"
    paper: ClassVar[str] = ""
    keeps_rows: ClassVar[bool] = True

    def __call__(self, x: torch.Tensor, quarantined: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def rows(self, n: int) -> int:
        """How many vectors this stage hands on from n."""
        return n


def _check_f(owner: str, f: Any) -> int | float | None:
    """A pre-aggregator's ``f``: None (the most the vectors tolerate, floor((n - 1) / 2)), a count or a
    fraction (:func:`~fedtrust.aggregators.core.check_f`)."""
    return None if f is None else check_f(owner, f)


#: The requirement of NNM's and ARC's f.
NEED = ("n > 2f", lambda f: 2 * f + 1)


def _budget(owner: str, f: int | float | None, n: int, quarantined: int) -> int:
    """The f to use on n vectors after ``quarantined`` clients were set aside (they count against f, as in
    :func:`~fedtrust.aggregators.core.byzantine_budget`); None means floor((n_all - 1) / 2) of all of
    them. Needs n > 2f (:data:`NEED`), which the default always meets."""
    if f is None:
        f = (n + quarantined - 1) // 2
    return budget_for(owner, f, n, quarantined, *NEED)


def _mix(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return m.to(device=x.device, dtype=x.dtype) @ x


def _scaled(scale: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i of x times scale[i], and the diagonal M of the scales."""
    return x * scale.to(x.dtype)[:, None], torch.diag(scale)


class NNM(PreAggregator):
    """Nearest-neighbour mixing (Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan, "Fixing by
    Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity", AISTATS 2023, Algorithm 1): each
    vector replaced by ``(1 / (n - f)) sum_{j in N_i} x_j``, N_i the n - f nearest neighbours of x_i by
    Euclidean distance, x_i itself included.

    f: assumed number of Byzantine vectors (int), a fraction of them (float), or None for
    floor((n - 1) / 2); quarantined clients count against it. Needs n > 2f.

    Distances come from one Gram matrix (:func:`~fedtrust.aggregators.distances.pairwise_sq_distances`).
    Ties: x_i comes first in its own list, then equal distances by index (deterministic), except that
    copies of one update (to the dtype's rounding: :func:`~fedtrust.aggregators.sybils.near_duplicates`)
    share their slots evenly, so the same update sent twice gets the same trust whatever the clients'
    order (the mixed vectors are the same to rounding: the copies are).
    """

    name = "nnm"
    paper = "Allouah et al. 2023, Fixing by Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity"

    need = NEED

    def __init__(self, f: int | float | None = None):
        self.f = _check_f(self.name, f)

    def __call__(self, x: torch.Tensor, quarantined: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        k = n - _budget(self.name, self.f, n, quarantined)
        dist, norms = pairwise_sq_distances(x)
        key = dist.clone()
        key.fill_diagonal_(-1.0)  # itself first, even among copies
        nearest = torch.sort(key, dim=1, stable=True).indices[:, :k]
        m = torch.zeros(n, n, dtype=torch.float64, device=dist.device)
        m.scatter_(1, nearest, 1.0 / k)
        copies = near_duplicates(x, dist, norms)
        if not copies.trivial:  # each column of a group of copies gets the group's mean column
            m = copies.expand(copies.pool(m.T)).T.contiguous()
        m = m.to(x.device)  # built on the host, with the distances
        return _mix(m, x), m


class Bucketing(SeededCalls, PreAggregator):
    """Bucketing (Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
    Bucketing", ICLR 2022, Algorithm 1): a random permutation pi of the n vectors, cut into
    ceil(n / s) buckets of s consecutive ones, each replaced by its mean.

    s: bucket size (int >= 1; 1 only shuffles), 2 by default as in the paper's experiments (ByzFL's
    default is 1). Stages after bucketing count their f in corrupted clients (each spoils at most one
    bucket): a fractional f is refused there, and f=None is half the buckets. When s does not divide n
    the last bucket holds the n mod s left over and is their mean (Algorithm 1 writes 1/s times their
    sum, which would shrink that bucket towards 0; the mean keeps every output an average of updates,
    like the others).
    seed: the permutations come from a stream keyed by (seed, rounds bucketed so far)
    (:class:`~fedtrust.aggregators.state.SeededCalls`): a run replays them, and ``state_dict`` holds the
    count, so a resumed run continues them.
    """

    name = "bucketing"
    paper = "Karimireddy, He, Jaggi 2022, Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing"
    keeps_rows = False

    def __init__(self, s: int = 2, seed: int = 0):
        self.s = check_int(f"{self.name}: s", s, minimum=1)
        self.seed = check_seed(f"{self.name}: seed", seed)

    def rows(self, n: int) -> int:
        return -(-n // self.s)

    def __call__(self, x: torch.Tensor, quarantined: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        perm = torch.randperm(n, generator=self.round_generator(self.name))
        bucket = torch.arange(n) // self.s  # the bucket of each position of the permutation
        sizes = torch.bincount(bucket).to(torch.float64)
        m = torch.zeros(math.ceil(n / self.s), n, dtype=torch.float64)
        m[bucket, perm] = 1.0 / sizes[bucket]
        m = m.to(x.device)
        return _mix(m, x), m


class Clipping(PreAggregator):
    """Static clipping, ByzFL's ``Clipping`` pre-aggregator: ``x_i <- min(1, c / ||x_i||) x_i``, each
    vector scaled to norm at most c (vectors at or below c are left as they are).

    c: the threshold (> 0). Default 2, ByzFL's default and the static threshold the ARC paper compares
    with (Allouah et al. 2025, Figure 1), so results line up with theirs; it is in the units of the
    updates, so set it for their scale (model, learning rate, local steps), or use ``arc``, which reads it
    off each round.
    """

    name = "clipping"
    reads_deltas = True
    paper = "static clipping (ByzFL's Clipping; Allouah et al. 2025, Figure 1)"

    def __init__(self, c: float = 2.0):
        self.c = check_float(f"{self.name}: c", c, minimum=0.0, strict_min=True)

    def __call__(self, x: torch.Tensor, quarantined: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        norms = row_norms(x)
        scale = torch.where(norms > self.c, self.c / norms, torch.ones_like(norms))
        return _scaled(scale, x)


class ARC(PreAggregator):
    """Adaptive robust clipping (Allouah, Guerraoui, Gupta, Jellouli, Rizk, Stephan, "Adaptive Gradient
    Clipping for Robust Federated Learning", ICLR 2025, arXiv:2405.14432, first titled "The Vital Role of
    Gradient Clipping in Byzantine-Resilient Distributed Learning"; Algorithm 2): with
    k = floor(2 (f / n) (n - f)), the k vectors of largest norm are clipped to C, the (k+1)-th largest
    norm: ``x_i <- min(1, C / ||x_i||) x_i``; the others are left as they are.

    f: as for :class:`NNM` (n and f are the vectors ARC receives, after quarantined clients are taken
    off f). Its default, None, is the most any honest majority allows, floor((n - 1) / 2), where ByzFL's
    is 0: ``arc+mean`` without f clips about half the vectors every round, attacked or not. Ties in norm
    are broken by index; a vector whose norm equals C is unchanged whichever side of the cut it falls, so
    tied vectors are treated alike.
    """

    name = "arc"
    reads_deltas = True
    paper = "Allouah et al. 2025, Adaptive Gradient Clipping for Robust Federated Learning (ARC)"

    need = NEED

    def __init__(self, f: int | float | None = None):
        self.f = _check_f(self.name, f)

    def __call__(self, x: torch.Tensor, quarantined: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        f = _budget(self.name, self.f, n, quarantined)
        k = 2 * f * (n - f) // n
        norms = row_norms(x)
        scale = torch.ones_like(norms)
        if k > 0:
            order = torch.sort(norms, descending=True, stable=True).indices
            threshold = norms[order[k]]
            top = order[:k]
            scale[top] = torch.where(norms[top] > threshold, threshold / norms[top], 1.0)
        return _scaled(scale, x)


class PreAggregated(BaseRule):
    """``rule`` applied after the pre-aggregators ``pre`` (in that order): ``inner(P_k(...P_1(x)))``.

    The inner rule sees a round of the m mixed vectors, called through its front door:

    - client ids: the round's own when every stage keeps rows (NNM, clipping, ARC: row i is client i's
      vector, mixed or scaled, so a rule that keeps state per client keeps it for the right one);
      ``"mix0"``, ``"mix1"``, ... (row i of the mixed vectors) after bucketing, where a row is a bucket;
    - ``num_samples``: each mixed row's average of its clients' counts, weighted as the row mixes them
      (M with its rows scaled to sum 1, times the counts): a mean of two clients reports their mean
      count, a clipped client its own count (the clipping is in the vector already);
    - no ``metrics``: a reported loss belongs to one client's update, not to a mixture, so a rule that
      reads metrics (ARFL, FOCUS) cannot follow pre-aggregators and is refused at construction, as is
      one that keeps state per client (FoolsGold, IVAR/ICOV, CFL) after bucketing (each round's
      buckets mix other clients: a history would add up unrelated clients), and a fractional ``f`` after
      bucketing (a fraction of the buckets is not the corrupted clients' share: give the count of
      corrupted clients, the most buckets they can spoil);
    - ``reference``, ``previous`` and ``quarantined`` as in the round (quarantined clients still count
      against the inner rule's f).

    Trust flows back through the mixing: the aggregate is ``w_inner @ mixed = (w_inner @ M) @ x`` with
    M the product of the stages' matrices, so a client's trust is its coefficient ``w_inner @ M``
    renormalised to sum 1 (non-negative: every M is). If those coefficients are all 0 (ARC clipped every
    vector the inner rule trusted to 0, and the aggregate is 0), the clients that any mixed row still
    draws on share the trust evenly.

    ``info`` is the inner rule's, with ``pre`` (the pre-aggregators' names, in order) added. Its per-client
    ``clients`` entries are kept when every stage keeps rows (NNM, clipping, ARC: row i is client i's
    vector, mixed or scaled) and dropped after bucketing (a row is a bucket, not a client); ids in other
    keys (``selected``, ``groups``, ...) name mixed rows. ``quarantined`` is the front door's, on the
    real clients.

    State (``state_dict``): ``{"rule": inner rule's state, "pre": [each stage's state, in order]}``,
    each present only when not empty (bucketing's count of rounds).
    """

    name = "pre_aggregated"  # each instance names itself "nnm+median", ...
    paper = "pre-aggregators before a rule (ByzFL; Allouah et al. 2023, 2025; Karimireddy et al. 2022)"

    def __init__(self, pre: Sequence[PreAggregator], rule: Any):
        if isinstance(pre, PreAggregator):
            pre = [pre]
        if not isinstance(pre, Sequence) or not pre or not all(isinstance(p, PreAggregator) for p in pre):
            raise TypeError(f"{self.name}: pre must be a non-empty list of pre-aggregators, got {pre!r}")
        if not callable(rule):
            raise TypeError(f"{self.name}: rule must be a fedtrust rule, got {type(rule).__name__}")
        inner = getattr(rule, "name", type(rule).__name__)
        self.name = "+".join([p.name for p in pre] + [inner])
        requires = tuple(getattr(rule, "requires", ()))
        if requires:
            raise ValueError(
                f"{self.name}: rule {inner!r} reads the clients' metrics {list(requires)}, which mixed "
                "rows do not have; use it without pre-aggregators"
            )
        self._keeps = all(p.keeps_rows for p in pre)  # row i of the mixed vectors is client i's
        # a round of models (Round.previous): stages that measure from the origin (clipping, ARC) get the
        # updates, and the rule the mixed models with previous (FLAME and CFL read models; the front door
        # gives a rule that reads updates its updates): the composition handles previous itself
        self._shift = any(p.reads_deltas for p in pre)
        if not self._keeps and getattr(rule, "per_client_state", False):
            raise ValueError(
                f"{self.name}: rule {inner!r} keeps state per client across rounds, but after "
                "bucketing its rows are random buckets of clients; use it without bucketing"
            )
        # a fraction of the buckets is not the corrupted clients' share: refused for the rule and for a stage
        # after bucketing alike (a stage's was taken, and mixed buckets with clients: ARC with f=0.2 and 2
        # clients quarantined clipped nothing)
        after = [p for k, p in enumerate(pre) if not all(q.keeps_rows for q in pre[:k])]
        for part in [*after, rule] if not self._keeps else after:
            f = getattr(part, "f", None)
            if isinstance(f, float) and f > 0:
                whose = "" if part is rule else f"{part.name}'s "
                raise ValueError(
                    f"{self.name}: {whose}f={f!r} after bucketing would be a fraction of the buckets; give f "
                    "as the number of corrupted clients (each spoils at most one bucket)"
                )
        self._pre = list(pre)
        self._rule = rule

    @property
    def pre(self) -> list[PreAggregator]:
        return list(self._pre)

    @property
    def rule(self) -> Any:
        return self._rule

    @property
    def reads_reference(self) -> tuple[str, ...]:
        return tuple(getattr(self._rule, "reads_reference", ()))

    def options(self) -> dict[str, Any]:
        inner = self._rule.options() if hasattr(self._rule, "options") else {}
        pre = [{"name": p.name, **p.options()} for p in self._pre]
        return {"pre": pre, "rule": {"name": getattr(self._rule, "name", "?"), **inner}}

    def check_clients(self, n: int) -> None:
        """Each stage's budget on the vectors it gets, then the rule's on what the stages hand on."""
        try:
            for stage in self._pre:
                stage.check_clients(n)
                n = stage.rows(n)
            if hasattr(self._rule, "check_clients"):
                self._rule.check_clients(n)
        except ValueError as exc:  # a RoundRefused, named for the rule the user built
            raise type(exc)(f"{self.name}: {exc}") from None

    def aggregate(self, round: Round) -> Aggregate:
        x = round.updates
        shift = round.previous if self._shift else None
        quarantined = len(round.quarantined)
        mixed, mixing, bucketed = x if shift is None else x - shift, None, False
        for stage in self._pre:
            try:  # f=None after bucketing: half the buckets, not of buckets and quarantined clients together
                mixed, m = stage(mixed, 0 if bucketed and getattr(stage, "f", 0) is None else quarantined)
                bucketed = bucketed or not stage.keeps_rows
            except ValueError as exc:  # (a RoundRefused too) named for the rule the user built
                raise type(exc)(f"{self.name}: {exc}") from None
            mixing = m if mixing is None else m @ mixing
        if shift is not None:
            mixed = mixed + shift  # the mixed updates as models again
        rows = mixing.sum(1, keepdim=True)
        share = mixing / torch.where(rows > 0, rows, torch.ones_like(rows))
        counts = share @ round.num_samples.to(device=share.device, dtype=torch.float64)
        inner_round = Round(
            updates=mixed,
            client_ids=round.client_ids if self._keeps else [f"mix{i}" for i in range(mixed.shape[0])],
            num_samples=counts.to(x.dtype),
            reference=round.reference,
            previous=round.previous,
            quarantined=round.quarantined,
        )
        try:
            out = self._rule(inner_round)
        except ValueError as exc:  # (a RoundRefused, or the inner rule's state refusing this round)
            raise type(exc)(f"{self.name}: {exc}") from None
        coef = out.weights.to(device=mixing.device, dtype=torch.float64) @ mixing
        if not float(coef.sum()) > 0:
            coef = (mixing.sum(0) > 0).to(torch.float64)
        weights = (coef / coef.sum()).to(device=x.device, dtype=x.dtype)
        info = {k: v for k, v in out.info.items() if k not in ("clients", "quarantined")}
        if "clients" in out.info and self._keeps:
            info["clients"] = out.info["clients"]
        info["pre"] = [p.name for p in self._pre]
        return Aggregate(out.vector, weights, info)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        inner = self._rule.state_dict() if hasattr(self._rule, "state_dict") else {}
        if inner:
            state["rule"] = inner
        stages = [p.state_dict() for p in self._pre]
        if any(stages):
            state["pre"] = stages
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The inner rule's and the stages' states, each checked by its owner; a refused state leaves
        every part as it was."""
        where = f"{self.name} state"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: expected a mapping with keys 'rule', 'pre' (optional), got {state!r}")
        unknown = [k for k in state if k not in ("rule", "pre")]
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; expected 'rule', 'pre' (optional)")
        stages = state.get("pre", [{} for _ in self._pre])
        if not isinstance(stages, list | tuple):
            raise TypeError(f"{where}['pre']: expected a list of {len(self._pre)} states, got {stages!r}")
        if len(stages) != len(self._pre):
            raise ValueError(f"{where}['pre']: holds {len(stages)} states, expected {len(self._pre)}")
        for i, entry in enumerate(stages):
            if not isinstance(entry, Mapping):
                raise TypeError(f"{where}['pre'][{i}]: expected a mapping, got {entry!r}")
        inner = state.get("rule", {})
        if not isinstance(inner, Mapping):
            raise TypeError(f"{where}['rule']: expected a mapping, got {inner!r}")
        before = [p.state_dict() for p in self._pre]
        try:
            for i, (stage, entry) in enumerate(zip(self._pre, stages, strict=True)):
                try:
                    stage.load_state_dict(entry)
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{where}['pre'][{i}]: {exc}") from None
            if hasattr(self._rule, "load_state_dict"):
                try:
                    self._rule.load_state_dict(inner)
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{where}['rule']: {exc}") from None
            elif inner:
                raise ValueError(
                    f"{where}['rule']: the rule keeps no state, got keys {sorted(map(str, inner))}"
                )
        except (ValueError, TypeError):
            for stage, old in zip(self._pre, before, strict=True):
                stage.load_state_dict(old)
            raise
