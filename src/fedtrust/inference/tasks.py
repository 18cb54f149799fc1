"""Estimates on a tasks x sources x K grid with a participation mask, and the chunked primitives the
estimators share. Missing entries are normal: sources skip tasks."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TypeVar

import numpy as np
import torch

from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.distances import Moments, row_gram
from fedtrust.aggregators.passes import CombinationPasses


@dataclass(frozen=True)
class Tasks:
    """x: (I, J, K) estimates (zero where missing); mask: (I, J), True where source j reported on task i;
    norms: optional (I, J) float64 norms of the estimates when already known (an aggregation rule's first
    pass takes them), so passes over the data need not; gram: optional :class:`TaskGram` of the estimates
    when already taken (an aggregation rule's grouping pass takes it: ``Groups.moments``), which
    :meth:`TaskGram.of` then returns instead of taking another."""

    x: torch.Tensor
    mask: torch.Tensor
    norms: torch.Tensor | None = None
    gram: TaskGram | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.x.shape)  # type: ignore[return-value]

    @property
    def m(self) -> torch.Tensor:
        """The mask as float64 (I, J)."""
        return self.mask.to(torch.float64)

    def chunks(self) -> list[slice]:
        """Blocks of coordinates whose temporaries stay in cache (the ``"cached"`` budget)."""
        return column_blocks(self.x, "cached")


def as_tasks(estimates, mask=None) -> Tasks:
    """Normalise user input: (I, J) or (I, J, K) numbers, NaN marking a missing entry unless ``mask``
    (I, J) is given. An infinite value is refused (as ``fedtrust infer`` refuses it in a CSV): it is no
    estimate, and reading it as missing would hide it. Every task needs at least one source. A
    :class:`Tasks` passes through unchecked."""
    if isinstance(estimates, Tasks):
        return estimates
    x = torch.as_tensor(np.asarray(estimates) if not isinstance(estimates, torch.Tensor) else estimates)
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"estimates must hold real numbers, got dtype {x.dtype}")
    if not x.is_floating_point():
        x = x.to(torch.float64)
    x = x.detach()
    if x.dim() == 2:
        x = x[:, :, None]
    if x.dim() != 3:
        raise ValueError(
            f"estimates must be (tasks, sources) or (tasks, sources, K), got shape {tuple(x.shape)}"
        )
    i, j, k = x.shape
    if min(i, j, k) == 0:
        raise ValueError(f"estimates are empty (shape {(i, j, k)})")
    # one pass: NaN, Inf, or a square too large for the sums of squares over the tasks and sources
    finite = torch.isfinite(torch.linalg.vector_norm(x, dim=-1).square() * (i * j))
    suspect = ~finite
    if suspect.any():  # check those entries exactly
        entries = x[suspect]
        finite[suspect] = torch.isfinite(entries).all(-1)
        if mask is None:  # with a mask, only an entry marked present must be finite (checked below)
            infinite = torch.zeros_like(suspect)
            infinite[suspect] = torch.isinf(entries).any(-1)
            if infinite.any():
                t, s = torch.nonzero(infinite)[0].tolist()
                value = float(x[t, s][torch.isinf(x[t, s])][0])
                raise ValueError(
                    f"estimates[{t}, {s}] holds {value}: not an estimate; NaN marks a missing one"
                )
        large = suspect & finite
        if large.any():
            t, s = torch.nonzero(large)[0].tolist()
            raise ValueError(
                f"estimates[{t}, {s}] reaches {float(x[t, s].abs().max()):.3g}: its square, summed over "
                f"the {i} x {j} estimates, overflows {x.dtype} (rescale the estimates"
                + (", or give them in float64)" if x.dtype != torch.float64 else ")")
            )
    if mask is None:
        mask = finite
    else:
        given = torch.as_tensor(mask)
        if given.dtype != torch.bool and not bool(((given == 0) | (given == 1)).all()):
            raise ValueError(f"mask must be bool (True: the entry is present), got {given.dtype} values")
        mask = given.to(dtype=torch.bool, device=x.device)
        if mask.shape != (i, j):
            raise ValueError(f"mask must be (tasks, sources) = {(i, j)}, got {tuple(mask.shape)}")
        bad = mask & ~finite
        if bad.any():
            t, s = torch.nonzero(bad)[0].tolist()
            raise ValueError(f"estimates[{t}, {s}] is marked present but is not finite")
    empty = ~mask.any(1)
    if empty.any():
        raise ValueError(
            f"task {int(torch.nonzero(empty)[0])} has no source: every task needs at least one estimate"
        )
    if not bool(mask.all()):
        x = torch.where(mask[:, :, None], x, torch.zeros((), dtype=x.dtype))
    return Tasks(x, mask)


S = TypeVar("S")


def stats_on(stats: S, device: torch.device | str) -> S:
    """A dataclass of statistics (:class:`TaskGram`, an estimator's past) with its tensors on ``device``:
    the estimators iterate on the host after their pass over the data, where the scalar reads of an
    iteration are free (on a GPU each is a sync), and send their results back where the data are."""
    return replace(stats, **{f.name: getattr(stats, f.name).to(device) for f in fields(stats)
                             if isinstance(getattr(stats, f.name), torch.Tensor)})  # fmt: skip


def weighted_sums(t: Tasks, w: torch.Tensor) -> torch.Tensor:
    """(I, K): sum_j w_ij x_ij (w is zero where missing)."""
    return torch.einsum("ijk,ij->ik", t.x, w.to(t.x.dtype))


@dataclass(frozen=True)
class TaskGram:
    """Second moments of each task's estimates, from one pass over them: everything the estimators'
    iterations need, so an iteration costs O(J^2) (or O(J^3)) instead of a pass over the I x J x K data.

    With c_i a centre of task i's estimates (the plain mean here; an aggregation rule's grouping pass
    takes the coordinate-wise median: :meth:`of_moments`) and r_ij = x_ij - c_i (zero where missing), it
    keeps centred (I, J, J) = r_i r_i', cross (I, J) = r_ij . c_i and mean_sq (I,) = ||c_i||^2. A
    combination sum_j b_ij x_ij = sum_j b_ij r_ij + (sum_j b_ij) c_i, so every inner product of
    combinations is a form in these three, each computed in float32 chunks and summed in float64: a large
    common component (raw parameters rather than updates) costs no precision, and residuals (coefficients
    summing to 0) never touch ``mean_sq``.
    """

    centred: torch.Tensor
    cross: torch.Tensor
    mean_sq: torch.Tensor
    #: Whether the centre is a robust location of the sources (:meth:`of_moments`, or :meth:`of` where a far
    #: source would drag the mean), which no outlier drags: each source's distance to it is then its
    #: starting noise (:func:`mean_noise`)
    robust: bool = False
    #: (I, J) float64, 1 where source j reported on task i, when some did not (a robust :meth:`of`); None:
    #: every source reported on every task
    present: torch.Tensor | None = None

    #: A residual below this fraction of the terms it is formed from (:meth:`unresolved`) is not resolved
    #: by the Gram's float32 products, as in :class:`~fedtrust.aggregators.passes.CombinationPasses`.
    EXPANSION_FLOOR = CombinationPasses.EXPANSION_FLOOR

    @staticmethod
    def of(t: Tasks) -> TaskGram:
        """The tasks' Gram statistics: ``t.gram`` when given, else one pass over the data about the plain
        per-task mean, and a second about the per-task coordinate-wise median where some task holds an
        estimate whose squared norm is :data:`FAR` times the median one of its task (:func:`far_entries`,
        read from the first pass's statistics): the test a rule makes on its round's updates. About a
        mean that a far source drags, the honest residuals are differences of the far source's terms: one
        source at 1e9 per coordinate among four of spread 0.1 (20 tasks, float64), even with the sources
        started from their distances to the median, put the honest variances at 1.4-4.3 instead of
        0.007-0.014 in IVAR-VB's fit and collapsed IVAR-MLE onto one of them (its consensus twice the
        honest mean's error from the truth)."""
        if t.gram is not None:
            return t.gram
        plain = TaskGram._about(t, median=False)
        return TaskGram._about(t, median=True) if far_entries(plain.sq_norms(), t.mask) else plain

    @staticmethod
    def _about(t: Tasks, median: bool) -> TaskGram:
        """One pass: the statistics about each task's plain mean or, with ``median``, its coordinate-wise
        median over the sources present (the lower middle value for an even count)."""
        i, j, _ = t.x.shape
        like = dict(dtype=t.x.dtype, device=t.x.device)
        missing = None if bool(t.mask.all()) else ~t.mask[:, :, None]
        centre = coordinate_median(t) if median else None
        plain = (t.m / t.m.sum(1, keepdim=True)).to(t.x.dtype) if centre is None else None
        chunks = list(t.chunks())
        # per-chunk float32 products land in buffers summed in float64 once; the residuals reuse one buffer
        parts = len(chunks)
        centred, cross = torch.empty(parts, i, j, j, **like), torch.empty(parts, i, j, 1, **like)
        mean_sq = torch.empty(parts, i, **like)
        residual = torch.empty(i, j, chunks[0].stop - chunks[0].start, **like)
        for b, cols in enumerate(chunks):
            x = t.x[:, :, cols]
            c = torch.einsum("ijk,ij->ik", x, plain) if centre is None else centre[:, cols]
            r = torch.sub(x, c[:, None, :], out=residual[:, :, : x.shape[2]])
            if missing is not None:
                r.masked_fill_(missing, 0)
            centred[b] = row_gram(r)
            torch.bmm(r, c[:, :, None], out=cross[b])
            torch.linalg.vector_norm(c, dim=1, out=mean_sq[b]).square_()
        f64 = torch.float64
        return TaskGram(centred.to(f64).sum(0), cross[..., 0].to(f64).sum(0), mean_sq.to(f64).sum(0),
                        robust=median, present=t.m if median else None)  # fmt: skip

    @staticmethod
    def of_moments(moments: Moments) -> TaskGram:
        """One task's statistics from the :class:`~fedtrust.aggregators.distances.Moments` of its estimates
        about a robust centre (every source present): an aggregation rule's grouping takes them about the
        round's coordinate-wise median (:func:`~fedtrust.aggregators.sybils.correlated_groups`)."""
        return TaskGram(moments.gram[None], moments.cross[None], moments.centre_sq.reshape(1), robust=True)

    def sq_norms(self) -> torch.Tensor:
        """(I, J): ||x_ij||^2 = ||r_ij||^2 + 2 r_ij . c_i + ||c_i||^2 (meaningless where missing)."""
        return self.centred.diagonal(dim1=1, dim2=2) + 2 * self.cross + self.mean_sq[:, None]

    def unresolved(self, residuals: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether some present residual (:meth:`residuals` with weights ``w``, summing to 1 per task) is
        below ``EXPANSION_FLOOR`` of ||r_ij||^2 + ||sum_l w_il r_il||^2, the terms its expansion cancels:
        the products' float32 rounding (about eps sqrt(K) of those terms) then decides its digits, as when
        the consensus sits on one source. A caller that needs such residuals exactly (IVAR-MLE's collapse
        test) takes them by a pass over the data instead."""
        w = w.to(self.centred.device)
        consensus = (w[:, None, :] @ self.centred @ w[:, :, None])[:, :, 0]  # (I, 1): ||sum_l w_il r_il||^2
        spread = self.centred.diagonal(dim1=1, dim2=2) + consensus
        low = residuals.to(spread.device) < self.EXPANSION_FLOOR * spread
        return bool((low & (mask.to(low.device) > 0)).any())

    def form(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """(I, a, b): P_i' X_i X_i' Q_i for coefficient matrices P (I, J, a) and Q (I, J, b)."""
        sp, sq = p.sum(1), q.sum(1)  # (I, a), (I, b)
        cp = torch.einsum("ija,ij->ia", p, self.cross)
        cq = torch.einsum("ijb,ij->ib", q, self.cross)
        out = p.transpose(1, 2) @ self.centred @ q
        out += cp[:, :, None] * sq[:, None, :] + sp[:, :, None] * cq[:, None, :]
        return out + self.mean_sq[:, None, None] * sp[:, :, None] * sq[:, None, :]

    def sq_norm(self, w: torch.Tensor) -> torch.Tensor:
        """(I,): ||sum_j w_ij x_ij||^2 (from the Gram matrix, whose cancellation can leave a tiny negative
        number where the norm is ~0 beside huge updates: floored at 0, as a squared norm is)."""
        return self.form(w[:, :, None], w[:, :, None])[:, 0, 0].clamp_min(0)

    def residuals(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(I, J): ||x_ij - sum_l w_il x_il||^2 where present, zero elsewhere, in O(J^2) per task (where
        the statistics are: ``w`` and ``mask`` are moved there)."""
        w, mask = w.to(self.centred.device), mask.to(self.centred.device)
        gw = (self.centred @ w[:, :, None])[:, :, 0]  # (I, J)
        delta = 1 - w.sum(1)  # the coefficient of c_i in each residual (the same for every j)
        quad = self.centred.diagonal(dim1=1, dim2=2) - 2 * gw + (w * gw).sum(1, keepdim=True)
        cross = self.cross - (w * self.cross).sum(1, keepdim=True)
        out = quad + 2 * delta[:, None] * cross + (delta.square() * self.mean_sq)[:, None]
        return out.clamp_min(0) * mask


class TaskPasses:
    """The direct alternative to :class:`TaskGram`: each evaluation of the residuals is one fused pass
    over the data (:class:`~fedtrust.aggregators.passes.CombinationPasses`: per cache-sized chunk of
    coordinates, form the combination, then the distances to it). Cheaper than a Gram matrix for many
    sources and few iterations, as in IVAR-MLE. The last combination formed is kept (``combination``,
    where the data are), so the consensus of the final weights costs no further pass. The residuals
    come back on the host (one transfer a pass), where an estimator iterates on them."""

    def __init__(self, t: Tasks):
        self.passes = CombinationPasses(t.x, norms=t.norms, host=True)
        self.combination: torch.Tensor | None = None

    def residuals(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(I, J) on the host: ||x_ij - sum_l w_il x_il||^2 where present, zero elsewhere (one fused pass;
        the combination reuses one buffer: a fresh 40 MB buffer a pass costs its page faults)."""
        self.combination, sq, _ = self.passes(w, out=self.combination)
        return sq * mask.to(sq.device)


def residual_sq(t: Tasks, y: torch.Tensor) -> torch.Tensor:
    """(I, J) float64: ||x_ij - y_i||^2, zero where missing."""
    out = torch.zeros(t.mask.shape, dtype=torch.float64, device=t.x.device)
    for cols in t.chunks():
        out += torch.linalg.vector_norm(t.x[:, :, cols] - y[:, None, cols], dim=-1).to(torch.float64).square()
    return out * t.m


def residual_gram(t: Tasks, y: torch.Tensor) -> torch.Tensor:
    """(I, J, J) float64: S_i = sum_k r_ijk r_ij'k with r_ij = x_ij - y_i, zero rows/columns where missing."""
    i, j, _ = t.x.shape
    s = torch.zeros(i, j, j, dtype=torch.float64, device=t.x.device)
    for cols in t.chunks():
        r = (t.x[:, :, cols] - y[:, None, cols]) * t.mask[:, :, None].to(t.x.dtype)
        s += torch.bmm(r, r.transpose(1, 2)).to(torch.float64)
    return s


#: A typical value dragged beyond this many times its robust counterpart (a mean beyond FAR times the
#: median; the plain mean's distances beyond FAR times the median's) is a far source's doing, and the
#: robust one is taken. Far above what ordinary rounds show (an ICOV-MLE fit whose sources collapse
#: passed 100 in the demo's federation), far below what one update 100 times the others' norm does (1e4
#: in variance). A round where half the sources or more collapsed to a variance near 0 (exact copies with
#: sybils="off") also passes it in :func:`typical`: ICOV's jitter and floor then follow the collapsed
#: median (the golden copies round, float64: the five distinct clients' weights 1.5e-25 -> 1.3e-15, the
#: five copies' 0.2 -> 0.2 - 2e-15).
FAR = 1e4


def typical(values: torch.Tensor) -> float:
    """The mean of ``values``, or their median where a far value drags the mean beyond :data:`FAR` times it
    (one source of variance 1e24 beside four of 1e-4 puts the mean at 2e23)."""
    mean, median = float(values.mean()), float(values.median())
    return median if mean > FAR * median else mean


def mean_noise(t: Tasks, gram: TaskGram | TaskPasses | None = None) -> torch.Tensor:
    """(J,) float64: each source's mean squared distance (per coordinate) to the plain per-task mean, a
    starting point for the noise variances (sources with no data get 1; zeros are floored); to a robust
    centre instead where a far source drags the plain mean (:func:`dragged_start`). One update of 1e9 per
    coordinate among four of 0.1 drags the plain mean, and with it every source's distance, to 2e8 per
    coordinate; the iterations then brought the honest variances down a few-fold at a time, the far
    weight with them, and stopped with it far from its end (IVAR-VB in float32: at 1.6e-11, its consensus
    0.25 of the signal's norm from the honest mean; at 1e12 per coordinate, 16 per coordinate from the far
    source). From the median the far source starts with about the weight it ends with."""
    plain = _plain_noise(t, gram)
    robust = dragged_start(t, gram, plain)
    return plain if robust is None else robust


def dragged_start(
    t: Tasks, gram: TaskGram | TaskPasses | None, plain: torch.Tensor | None = None
) -> torch.Tensor | None:
    """(J,): each source's mean squared distance (per coordinate) to a robust centre where a far source
    drags the plain per-task mean, else None: the statistics' own centre where it is robust (a rule's
    median, or :meth:`TaskGram.of`'s where some estimate is far: :func:`dragged`), else, for
    :class:`TaskPasses` whose estimates include a far one (:func:`far_entries`), the per-task
    coordinate-wise median (one more pass). ``plain``: the distances to the plain mean, if already taken."""
    if not _may_drag(t, gram):
        return None
    return _robust_start(t, gram, _plain_noise(t, gram) if plain is None else plain)


def _may_drag(t: Tasks, gram: TaskGram | TaskPasses | None) -> bool:
    """Whether a far source may drag the plain mean: statistics about a robust centre, or passes over
    estimates one of which is far (their norms: the passes' first pass, which they take anyway)."""
    if isinstance(gram, TaskGram):
        return gram.robust
    if not isinstance(gram, TaskPasses):
        return False
    return far_entries(gram.passes.norms().reshape(t.mask.shape).square(), t.mask)


def _plain_noise(t: Tasks, gram: TaskGram | TaskPasses | None) -> torch.Tensor:
    m = t.m
    if gram is None:
        r = residual_sq(t, weighted_sums(t, m / m.sum(1, keepdim=True))) / t.shape[2]
    else:
        r = gram.residuals(m / m.sum(1, keepdim=True), m) / t.shape[2]
    return _per_source(r, m)


def _robust_start(t: Tasks, gram: TaskGram | TaskPasses, plain: torch.Tensor) -> torch.Tensor | None:
    """:func:`dragged` for statistics about a robust centre; for passes, the same test on the distances to
    the per-task coordinate-wise median."""
    if isinstance(gram, TaskGram):
        return dragged(plain, gram, t.shape[2])
    return _drags(plain, _per_source(residual_sq(t, coordinate_median(t)) / t.shape[2], t.m))


def dragged(plain: torch.Tensor, gram: TaskGram | TaskPasses | None, k: int) -> torch.Tensor | None:
    """Each source's mean squared distance (over its ``k`` coordinates) to the statistics' centre, (J,),
    where that is robust (:attr:`TaskGram.robust`: an aggregation rule's coordinate-wise median) and the
    sources' typical distance to the plain mean, ``plain``, is :data:`FAR` times their typical distance to
    it: a far source has dragged the plain mean. None otherwise."""
    if not (isinstance(gram, TaskGram) and gram.robust):
        return None
    m = _present(gram)
    return _drags(plain, _per_source(gram.centred.diagonal(dim1=1, dim2=2) * m / k, m))


def _drags(plain: torch.Tensor, robust: torch.Tensor) -> torch.Tensor | None:
    """``robust``, the sources' distances to a robust centre, where their typical distance to the plain
    mean, ``plain``, is :data:`FAR` times their typical distance to it; None otherwise."""
    return robust if float(plain.median()) > FAR * upper_median(robust) else None


def upper_median(x: torch.Tensor) -> float:
    """The upper median of a vector: of sources' distances to a coordinate-wise median, the lower one can
    be a source's distance to itself (in one coordinate the median is one of the values), floored near 0;
    of IVAR-MLE's, the one a collapse takes to 0 with two sources."""
    return float(x.sort().values[len(x) // 2])


def coordinate_median(t: Tasks) -> torch.Tensor:
    """(I, K): each task's coordinate-wise median over the sources present (the lower middle value for an
    even count), a chunk of coordinates at a time."""
    out = torch.empty(t.shape[0], t.shape[2], dtype=t.x.dtype, device=t.x.device)
    missing = None if bool(t.mask.all()) else ~t.mask[:, :, None]
    for cols in t.chunks():
        x = t.x[:, :, cols]
        out[:, cols] = (x if missing is None else x.masked_fill(missing, torch.nan)).nanmedian(1).values
    return out


def _present(gram: TaskGram) -> torch.Tensor:
    """The observation mask of statistics about a robust centre, where they are (the host, for a rule's,
    whose every source is present in its one task: :meth:`TaskGram.of_moments`, so none moves from the
    data's device)."""
    if gram.present is not None:
        return gram.present.to(gram.centred.device)
    return torch.ones(gram.centred.shape[:2], dtype=gram.centred.dtype, device=gram.centred.device)


def far_entries(sq: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether some task holds an estimate whose squared norm, ``sq`` (I, J), is :data:`FAR` times the
    (lower) median one of the estimates present in its task (``mask``, None: all; per task: tasks may
    differ in scale by any factor). One read from the device."""
    if mask is None:
        return bool((sq > FAR * sq.median(-1, keepdim=True).values).any())
    present = mask.to(sq.device)
    median = torch.where(present, sq, torch.nan).nanmedian(1, keepdim=True).values
    return bool(((sq > FAR * median) & present).any())


def _per_source(r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(J,): each source's mean of its (I, J) squared distances ``r`` over the tasks it reports on (1 for a
    source with none), zeros floored at 1e-3 of the smallest positive one."""
    m = m.to(r.device)  # (where the statistics are: the host, for moved or host-returning ones)
    count = m.sum(0)
    noise = torch.where(count > 0, r.sum(0) / count.clamp_min(1), torch.ones_like(count))
    positive = noise[noise > 0]
    return noise.clamp_min((float(positive.min()) if len(positive) else 1.0) * 1e-3)


def not_below_centre(noise: torch.Tensor, gram: TaskGram | TaskPasses | None, k: int) -> torch.Tensor:
    """Starting variances ``noise`` (J,) of sources of ``k`` coordinates a task, known from earlier rounds,
    where a far source drags this round's
    plain mean (:func:`dragged`): each replaced by the source's distance to the robust centre where that
    is :data:`FAR` times its past variance. A client that sent updates like the others' and now sends
    one 1e12 away would otherwise start with the weight of its past, which the iterations took down only
    a few-fold at a time (IVAR-VB in float32 stopped with its consensus 0.20 of the signal's norm from the
    honest mean)."""
    if not (isinstance(gram, TaskGram) and gram.robust):
        return noise
    m = _present(gram)
    plain = _per_source(gram.residuals(m / m.sum(1, keepdim=True), m) / k, m)
    robust = dragged(plain, gram, k)
    if robust is None:
        return noise
    robust = robust.to(noise)
    return torch.where(robust > FAR * noise, robust, noise)
