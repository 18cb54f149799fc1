"""Groups of near-duplicate updates, which share one vote in the trust rules (issue 17, "trust that
colluders cannot buy").

Rules that read agreement as reliability (IVAR, ICOV) give k identical updates the trust of k
independent witnesses that agree perfectly: each copy's residual to the consensus shrinks as the copies
pull the consensus towards themselves, so a group of copies buys itself most of the weight (a mimic
group of 30% ends near the accuracy of the one client it copies; a crafted vector sent by all of them
takes the model to chance). The estimators' own model says what the copies are worth: k perfectly
correlated sources carry the information of one (Nguyen et al. eq 3, x_j ~ N(y, Phi): with Phi's k
copies' rows equal, the GLS weights 1' Phi^-1 give the group together what one of them alone would get),
and FoolsGold (Fung, Yoon, Beschastnikh, RAID 2020, "The Limitations of Federated Learning in Sybil
Settings") discounts clients by how similar their updates are for the same reason. Here the grouping is
discrete and the estimator's own judgement is kept: the near-duplicates are found, the estimator runs on
one representative per group (the group's mean) and the representative's coefficient is split evenly
among the members. Two honest clients that merely land close together lose next to nothing: the mean of
two independent estimates has half their noise, which the estimator sees in the representative's
residual, so the pair keeps about the weight the two would have had apart.

Near-duplicates are copies: two updates whose squared distance is at most the dtype's rounding
(``FLOOR_ULPS`` units in the last place per coordinate, relative to the larger norm), whatever their
scale. ``near_duplicates(..., relative=r)`` also links updates within ``r`` times the smaller of their
median squared distances to the others, but no default does, because no scale read off the round
separates copies with a little noise from honest clients that merely agree: five honest clients trained
on IID shares (Fashion-MNIST one-round task, 5 local epochs) sat at 0.0016 of that scale once five
N(0, 1) adversaries made up half the round, were merged into one vote, and IVAR-VB then followed the
adversaries (accuracy 0.82 -> 0.15; the median scale is the adversaries' to set, so far-off noise would
make any honest cluster look like copies). Groups are the connected components of the relation.

Copies with noise added are found by what they share instead of by how close they are
(:func:`correlated_groups`, ``sybils="share"``, the default): k copies of one vector t, each with
independent noise e_i, deviate from any centre c by (t - c) + e_i, so their deviations correlate at |t -
c|^2 / (|t - c|^2 + |e|^2), near 1 whenever the noise is small beside the offset that makes the copies worth
sending; that is eq 3's Phi with k nearly equal rows, which its GLS weights count as about one source.
Honest clients' deviations are their own data's and their own sampling noise's, and do not. The centre
starts at the coordinate-wise median of the groups (breakdown 1/2): a minority cannot drag it so far that
the honest clients' deviations share one large offset and correlate (with the mean as centre, far-off noise
from a large minority would). It can drag it some way: a minority of fraction e on one side of every
coordinate moves the median to the honest clients' 1 / (2 (1 - e)) quantile there (0.83 at 40%), an offset
as large as their own spread that the tightest honest clients' deviations then share. On Fashion-MNIST, 20
boosted backdoor attackers beside 30 honest clients (FOCUS, seed 0) made 15-20 honest clients one vote in
rounds 16-24, and in rounds 29-30 the attackers' own correlation about the dragged median fell below the
threshold: their group split and took 26% of the last round, backdoored (ASR 1.00). The copies are what
drags it, so where groups correlate about the median the centre is read again as the coordinate-wise median
of the sources so found, each merged group's mean counted once (one source, one vote, for the centre too;
one selection pass over the sources and one product of the rows with the centre's shift, :func:`recentred`,
no further Gram pass), and the groups are read about that. There the attackers were one group of 18-20 from
round 8 to 30, with at most 1.2% of the weight from round 9 on, no honest group was larger than 9, and the
run ended at accuracy 0.680, ASR 0.001. Where nothing correlates about the median (independent noise,
however much of it: Nguyen et al.'s one-round task, 5 parties beside 10 Gaussian adversaries) the centre is
not read again. Two other second centres were measured and not kept (``experiments/robustness/README.md``,
"Tried and not kept"): the mean of the half of the groups nearest the median, which that task's adversaries
enter (the parties became one vote, IVAR-VB 0.819 -> 0.324), and the half's coordinate-wise median, which
seven noisy copies of one honest update (35%) take over (the copies are then the centre, their deviations
only their noise, and they keep seven votes). Groups whose deviations correlate above ``CORRELATION``
(connected components) share one vote when they hold fewer than half the round's clients; a larger component
is left apart (the honest majority is what every rule here assumes). Without this an attacker who adds
independent noise of 1e-6 times the honest spread to each copy gets its k votes back (digits, robustness
setting, 2 seeds: IPM's one crafted vector at 40% took screened IVAR-MLE and ICOV-VB from 0.88 to 0.00;
``experiments/robustness/README.md``, "Noisy copies"). ``sybils="copies"`` merges exact copies only.

Candidate pairs come from the Gram kernel where a rule has it anyway (Krum, NNM:
:func:`near_duplicates`; :func:`~fedtrust.aggregators.distances.pairwise_sq_distances`), otherwise from a
sketch taken in the pass that takes the norms (:func:`sketched_duplicates`: IVAR, ICOV, FOCUS; one read of
the updates instead of n^2 d products). Every candidate is measured again by explicit differences, so
float32 cancellation neither splits exact copies nor joins distinct updates, and both searches give the
same groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.distances import Moments, moments_about, pairwise_sq_distances
from fedtrust.aggregators.median import median_window
from fedtrust.aggregators.passes import moved, norms_and_sketch, row_norms
from fedtrust.aggregators.rank_windows import rank_window

#: What the trust rules (IVAR, ICOV, FOCUS) group: "share" (default) copies and correlated groups
#: (:func:`correlated_groups`), "copies" copies to the dtype's rounding only, "off" nothing (every client
#: its own source, the papers' setting).
SYBILS = ("share", "copies", "off")

#: Near-duplicates by distance: squared distance at most this fraction of the smaller median squared
#: distance to the others. 0: only copies to the rounding (see the module docstring for why).
RELATIVE = 0.0
#: ... or at most this many units in the last place of the dtype per coordinate (relative to the
#: larger of the two norms): copies that differ only by rounding.
FLOOR_ULPS = 4
#: Groups whose deviations from the round's centre correlate above this share one vote
#: (:func:`correlated_groups`). In the noisy-sybil review (digits, Dir(0.5), 50 clients, 30 rounds) the
#: most correlated honest pair reached 0.93, and copies with independent noise of up to 0.1 times the
#: honest spread 0.93 to 0.999 about the equal-vote mean.
CORRELATION = 0.95
#: Correlated groups are merged only where independent updates would link by chance fewer than this many
#: times a round (:func:`chance_links`): over few coordinates a correlation above ``CORRELATION`` says
#: nothing (7 independent clients over d = 3 coordinates linked in 56 of 200 rounds, over d = 5 in 5).
CHANCE_LINKS = 1e-3
#: Gram-based distances within this many eps * sqrt(d) * (||x_i||^2 + ||x_j||^2) of the threshold are
#: measured again by differences (the Gram's float32 cancellation is about that size).
GRAM_SLACK = 8.0
#: Without the Gram matrix (:func:`find_groups`, the inference rules' first pass) candidate pairs come from
#: a sketch: each update's sums over runs of this many coordinates (n x d / SKETCH_WIDTH numbers, taken in
#: the pass that takes the norms). Distinct updates' sketches are about 1 / sqrt(SKETCH_WIDTH) of their
#: distance apart, so pairs closer than ~0.1% of their norm are measured by differences, the rest never.
SKETCH_WIDTH = 4096
#: Candidate pairs are measured by differences in batches of at most this many entries (pairs x d): the
#: softmax regression's updates sum to 0, so on a 650-coordinate model every pair's one-number sketch
#: agreed and every pair was a candidate, each measured alone (2.2 s of a 2.6 s IVAR-MLE run on digits).
PAIR_BATCH_ENTRIES = 1 << 22
#: Sketch distances within this many eps * (||x_i|| + ||x_j||) beyond the rounding threshold are
#: candidates: the float32 run sums' rounding (measured about 1.4 eps * the norm, all-positive rows).
SKETCH_SLACK = 64.0


@dataclass(frozen=True)
class Groups:
    """A partition of a round's n clients (positions) into groups that share one vote: ``members`` one
    tuple of positions per group (singletons included), ordered by first member; ``reasons`` group index ->
    why its members were grouped (for groups of two or more); ``moments`` the representatives' (each
    group's mean update's) second moments about the round's coordinate-wise median where the grouping took
    them (:func:`correlated_groups`), which the inference estimators iterate on instead of taking their
    own Gram pass."""

    members: tuple[tuple[int, ...], ...]
    reasons: dict[int, str]
    n: int
    moments: Moments | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def singletons(n: int) -> Groups:
        return Groups(tuple((i,) for i in range(n)), {}, n)

    @staticmethod
    def one(n: int, reason: str) -> Groups:
        return Groups((tuple(range(n)),), {0: reason} if n > 1 else {}, n)

    @property
    def trivial(self) -> bool:
        """Every client its own group (nothing to share)."""
        return len(self.members) == self.n

    @property
    def count(self) -> int:
        return len(self.members)

    @cached_property
    def index(self) -> torch.Tensor:
        """(n,) long: each client's group."""
        out = torch.empty(self.n, dtype=torch.long)
        for g, members in enumerate(self.members):
            out[list(members)] = g
        return out

    @cached_property
    def sizes(self) -> torch.Tensor:
        """(groups,) float64 group sizes."""
        return torch.tensor([len(m) for m in self.members], dtype=torch.float64)

    @cached_property
    def first(self) -> list[int]:
        """Each group's first member (its position)."""
        return [m[0] for m in self.members]

    def means(self, x: torch.Tensor) -> torch.Tensor:
        """(groups, d) the representatives: each group's mean update (summed in float64, so a group of
        exact float32 copies is represented by the copy itself, bit for bit)."""
        out = x[self.first].clone()
        for g, members in enumerate(self.members):
            if len(members) > 1:
                rows = x[list(members)].to(torch.float64)
                out[g] = (rows.sum(0) / len(members)).to(x.dtype)
        return out

    def split(self, coefficients: torch.Tensor) -> torch.Tensor:
        """(groups, ...) -> (n, ...): each group's coefficient shared evenly among its members."""
        if self.trivial:
            return coefficients
        index = self.index.to(coefficients.device)
        sizes = self.sizes.to(device=coefficients.device, dtype=coefficients.dtype)
        return coefficients[index] / sizes[index].reshape(-1, *([1] * (coefficients.dim() - 1)))

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """(groups, ...) -> (n, ...): each member gets its group's value."""
        if self.trivial:
            return values
        return values[self.index.to(values.device)]

    def pooling(self, present: torch.Tensor | None = None) -> torch.Tensor:
        """(groups, n) float64 averaging matrix: row g averages group g's ``present`` members (all by
        default; a row is zero where none is present)."""
        a = torch.zeros(self.count, self.n, dtype=torch.float64)
        a[self.index, torch.arange(self.n)] = 1.0
        if present is not None:
            a = a * present.to(torch.float64).cpu()[None]
        total = a.sum(1, keepdim=True)
        return a / torch.where(total > 0, total, torch.ones_like(total))

    def pool(self, values: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (groups, ...): the mean over each group's members, NaN entries left out (NaN where
        every member's is); a group with an infinite member has that infinity as its mean (NaN with both
        signs). The sums are products with the 0/1 membership matrix over finite entries only: an infinity
        times another group's 0 was NaN in that group's mean (FOCUS read every group's loss as unknown when
        one client's benchmark loss was +inf, and gave every group its count weight)."""
        if self.trivial:
            return values
        flat = values.reshape(self.n, -1)
        known = ~torch.isnan(flat)
        a = torch.zeros(self.count, self.n, dtype=flat.dtype, device=flat.device)
        a[self.index.to(flat.device), torch.arange(self.n, device=flat.device)] = 1.0
        total = a @ torch.where(torch.isfinite(flat), flat, torch.zeros_like(flat))
        count = a @ known.to(flat.dtype)
        out = torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, math.nan))
        up, down = (a @ (flat == sign * math.inf).to(flat.dtype) > 0 for sign in (1, -1))
        out = torch.where(up, math.inf, out)
        out = torch.where(down, -math.inf, out)
        out = torch.where(up & down, math.nan, out)
        return out.reshape(self.count, *values.shape[1:])

    def even_out(self, weights: torch.Tensor) -> torch.Tensor:
        """(n,) -> (n,): each member gets its group's mean weight, the group's total unchanged. For a rule
        that picks among copies by position (Krum, Bulyan): copies get identical trust, so sybils are not
        told apart by their order, and the aggregate is the same (the copies' updates are)."""
        return weights if self.trivial else self.expand(self.pool(weights))

    def info(self, client_ids) -> list[dict]:
        """The groups of two or more as ``{"clients": [ids], "reason": text}``."""
        return [
            {"clients": [client_ids[i] for i in self.members[g]], "reason": reason}
            for g, reason in sorted(self.reasons.items())
        ]


def near_duplicates(
    x: torch.Tensor, sq_dist: torch.Tensor, norms: torch.Tensor, relative: float = RELATIVE
) -> Groups:
    """Group the rows of ``x`` (n, d) whose squared distance (``sq_dist``, (n, n) from the Gram kernel;
    ``norms`` the rows' (n,) norms) is at most ``relative`` times the median pairwise squared distance or
    within the dtype's rounding; see the module docstring. For rules that have the distances anyway
    (Krum, NNM); :func:`find_groups` finds copies without them."""
    n, d = x.shape
    if n < 2:
        return Groups.singletons(n)
    sq_dist = sq_dist.to(torch.float64).cpu()
    norms = norms.to(torch.float64).cpu()
    off = sq_dist[~torch.eye(n, dtype=torch.bool)].reshape(n, n - 1)
    spread = off.median(dim=1).values  # each update's median squared distance to the others (lower median)
    tol = relative * torch.minimum(spread[:, None], spread[None, :])
    eps = torch.finfo(x.dtype).eps
    limit = torch.maximum(_floor(x.dtype, norms), tol)
    slack = GRAM_SLACK * eps * math.sqrt(d) * (norms[:, None] ** 2 + norms[None, :] ** 2)
    candidate = (sq_dist <= limit + slack) | (norms[:, None] == norms[None, :])
    return _link(x, candidate, limit, spread, relative)


def sketched_duplicates(x: torch.Tensor, sketch: torch.Tensor, norms: torch.Tensor) -> Groups:
    """The copies among the rows of ``x`` (n, d), to the dtype's rounding (``relative`` 0: what every
    rule's default groups), with candidate pairs from the rows' ``sketch`` (n, k) and ``norms`` (n,)
    (:func:`~fedtrust.aggregators.passes.norms_and_sketch`): the sketch is an orthonormal projection, so
    a pair of copies is never further apart there than the rounding threshold plus the sums' rounding
    (``SKETCH_SLACK``); updates that are merely close are measured by differences, as in
    :func:`near_duplicates`, and far ones never. The same groups as from the Gram matrix, without its
    n^2 d products."""
    n = x.shape[0]
    if n < 2:
        return Groups.singletons(n)
    sketch, norms = sketch.to(torch.float64).cpu(), norms.to(torch.float64).cpu()
    limit = _floor(x.dtype, norms)
    eps = torch.finfo(x.dtype).eps
    reach = limit.sqrt() + SKETCH_SLACK * eps * (norms[:, None] + norms[None, :])
    # by explicit differences (no expansion to cancel, underflow or overflow: exact copies are 0 apart)
    near = torch.cdist(sketch, sketch, compute_mode="donot_use_mm_for_euclid_dist")
    return _link(x, near <= reach * (1 + 1e-9), limit, None, 0.0)


def _floor(dtype: torch.dtype, norms: torch.Tensor) -> torch.Tensor:
    """(n, n) squared distances within the dtype's rounding: ``FLOOR_ULPS`` units in the last place per
    coordinate, relative to the larger of the two norms."""
    big = torch.maximum(norms[:, None], norms[None, :]) ** 2
    return (FLOOR_ULPS * torch.finfo(dtype).eps) ** 2 * big


class _Forest:
    """Union-find over n items: connected components of the pairs joined."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def root(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(self, i: int, j: int) -> None:
        self.parent[self.root(j)] = self.root(i)

    def components(self) -> list[list[int]]:
        """The components, each ascending, ordered by first member."""
        by_root: dict[int, list[int]] = {}
        for i in range(len(self.parent)):
            by_root.setdefault(self.root(i), []).append(i)
        return sorted(by_root.values())


def _link(
    x: torch.Tensor,
    candidate: torch.Tensor,
    limit: torch.Tensor,
    spread: torch.Tensor | None,
    relative: float,
) -> Groups:
    """The groups: connected components of the ``candidate`` pairs (n, n) whose squared distance, measured
    by explicit differences (exact copies give 0), is at most ``limit`` (n, n). Pairs are tried in
    row-major order, skipping those already joined, so any candidate set that holds every linking pair
    gives the same groups and reasons."""
    n, d = x.shape
    forest = _Forest(n)
    linked: dict[tuple[int, int], float] = {}
    pairs = torch.nonzero(torch.triu(candidate, 1)).tolist()
    batch = max(1, PAIR_BATCH_ENTRIES // max(d, 1))
    start = 0
    while start < len(pairs):
        # the next pairs not already one group: k long copies take k - 1 checks, not k (k - 1) / 2
        todo: list[tuple[int, int]] = []
        while start < len(pairs) and len(todo) < batch:
            i, j = pairs[start]
            start += 1
            if forest.root(i) != forest.root(j):
                todo.append((i, j))
        if not todo:
            continue
        first, second = zip(*todo, strict=True)
        # by differences: exact copies give 0
        exact = (row_norms(x[list(first)] - x[list(second)]) ** 2).tolist()
        for (i, j), distance in zip(todo, exact, strict=True):
            if forest.root(i) != forest.root(j) and distance <= float(limit[i, j]):
                linked[(i, j)] = distance
                forest.join(i, j)
    if not linked:
        return Groups.singletons(n)
    members = tuple(tuple(m) for m in forest.components())
    dtype = str(x.dtype).removeprefix("torch.")
    reasons = {}
    for g, group in enumerate(members):
        if len(group) < 2:
            continue
        largest = max(v for (i, j), v in linked.items() if i in group)
        if largest == 0.0:
            reasons[g] = f"{len(group)} identical updates share one vote"
        elif spread is None or relative == 0:
            reasons[g] = (
                f"{len(group)} near-identical updates share one vote (linked at distance up to "
                f"{math.sqrt(largest):.3g}, within {dtype} rounding)"
            )
        else:
            scale = float(spread[list(group)].max().sqrt())
            reasons[g] = (
                f"{len(group)} near-identical updates share one vote (linked at distance up to "
                f"{math.sqrt(largest):.3g}, at most {math.sqrt(relative):.2g} x their median distance to the "
                f"others, up to {scale:.3g}, or within {dtype} rounding)"
            )
    return Groups(members, reasons, n)


def chance_links(count: int, d: int, threshold: float = CORRELATION) -> float:
    """How many of ``count`` independent sources' pairs would correlate above ``threshold`` by chance over
    ``d`` coordinates, in expectation: the correlation r of two independent isotropic vectors in k
    dimensions has r^2 ~ Beta(1/2, (k - 1)/2), so P(r > t) = I_{1 - t^2}((k - 1)/2, 1/2) / 2, with k = d - 1
    (the centre is taken from the rows themselves). A pair: 0.10 at d = 3, 1.3e-5 at d = 10, 2e-33 at
    d = 64."""
    from scipy.special import betainc

    k = d - 1
    if k < 2:
        return math.inf
    return count * (count - 1) / 2 * 0.5 * float(betainc((k - 1) / 2, 0.5, 1 - threshold * threshold))


def recentred(x: torch.Tensor, centre: torch.Tensor, gram: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(n, n) the Gram matrix of the rows of ``x`` (n, d) about ``new`` (d,), given ``gram`` (n, n, float64
    on the host) about ``centre`` (d,): with r_i = x_i - centre and delta = new - centre, (r_i - delta) .
    (r_j - delta) = g_ij - a_i - a_j + |delta|^2, a_i = r_i . delta. One product of the rows with delta,
    block by block in float64 on x's device, in place of another Gram pass."""
    delta = (new - centre).to(torch.float64)
    a = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    for cols in column_blocks(x, "stream"):
        a += (x[:, cols] - centre[cols]).to(torch.float64) @ delta[cols]
    a, shift = moved(gram.device, a, delta.dot(delta))
    return gram - a[:, None] - a[None, :] + shift


def _correlated(groups: Groups, gram: torch.Tensor, threshold: float, centre: str) -> Groups | None:
    """``groups`` with the groups whose deviations (Gram matrix ``gram``, about the ``centre`` the reasons
    name) correlate above ``threshold`` merged, components of fewer than half the clients; None where none
    is merged."""
    spread = gram.diagonal().sqrt()
    scale = spread[:, None] * spread[None, :]
    corr = torch.where(scale > 0, gram / torch.where(scale > 0, scale, torch.ones_like(scale)), 0.0)
    forest = _Forest(groups.count)
    pairs = torch.nonzero(torch.triu(corr > threshold, 1)).tolist()
    for i, j in pairs:
        forest.join(i, j)
    members: list[tuple[int, ...]] = []
    merged: dict[tuple[int, ...], str] = {}
    for component in forest.components():
        clients = tuple(sorted(m for k in component for m in groups.members[k]))
        if len(component) > 1 and 2 * len(clients) < groups.n:
            weakest = min(float(corr[i, j]) for i, j in pairs if i in component)
            members.append(clients)
            merged[clients] = (
                f"{len(clients)} updates share one vote: their deviations from the round's {centre} "
                f"correlate (linked at {weakest:.3f} or more, above {threshold:g}), the information of about "
                "one source"
            )
        else:
            members.extend(groups.members[k] for k in component)
    if not merged:
        return None
    ordered = tuple(sorted(members))
    old = {groups.members[k]: reason for k, reason in groups.reasons.items()}
    reasons = {g: merged.get(m) or old[m] for g, m in enumerate(ordered) if m in merged or m in old}
    return Groups(ordered, reasons, groups.n)


def correlated_groups(x: torch.Tensor, groups: Groups, threshold: float = CORRELATION) -> Groups:
    """``groups`` (a partition of the rows of ``x``, (n, d): the copies) with the groups whose deviations
    from the round's centre correlate above ``threshold`` merged, where a component holds fewer than half
    the n clients; see the module docstring. The centre is the coordinate-wise median of the groups' means;
    where groups correlate about it, the median of the sources so found (each merged group's mean once),
    and the groups are read again about that. One selection pass for the median and one Gram pass over the
    groups' deviations (n^2 d products, on x's device), whose moments the groups returned keep
    (``Groups.moments``, for their own representatives); where groups merged, one more selection pass over
    the sources and one product of the rows with the centre's shift (:func:`recentred`). Over so few
    coordinates that independent updates would correlate above ``threshold`` by chance
    (:func:`chance_links` above ``CHANCE_LINKS``) nothing is merged: the groups stay the copies."""
    count = groups.count
    if count < 3:
        return groups
    reps = x if groups.trivial else groups.means(x)
    centre, moments = median_moments(reps)
    if moments is None:
        return groups
    if chance_links(count, x.shape[1], threshold) > CHANCE_LINKS:
        return replace(groups, moments=moments)
    first = _correlated(groups, moments.gram, threshold, "coordinate-wise median")
    if first is None:
        return replace(groups, moments=moments)
    sources = first.means(x)
    again = rank_window(sources, *median_window(first.count))[0]
    out = _correlated(
        groups,
        recentred(reps, centre, moments.gram, again),
        threshold,
        "centre (the coordinate-wise median of the sources: the groups that correlate about the clients' "
        "median counted once)",
    )
    if out is None:
        return replace(groups, moments=moments)
    # each new representative is its members' mean: the old representatives' mean weighted by their sizes
    before = torch.nn.functional.one_hot(groups.index, count).to(torch.float64)
    return replace(out, moments=moments.combined(out.pooling() @ before))


def median_moments(reps: torch.Tensor) -> tuple[torch.Tensor, Moments | None]:
    """The coordinate-wise median of the rows of ``reps`` (one selection pass) and the rows' second
    moments about it (one Gram pass, n^2 d products), those on the host: the n^2 + n + 1 numbers in one
    transfer, where the grouping and the estimators' iterations read them. None for the moments where
    they are not finite (updates whose squares overflow)."""
    centre = rank_window(reps, *median_window(reps.shape[0]))[0]
    moments = Moments(*moved(torch.device("cpu"), *moments_about(reps, centre)))
    return centre, moments if all(bool(torch.isfinite(t).all()) for t in moments) else None


def all_identical(x: torch.Tensor) -> bool:
    """Whether every row of ``x`` equals the first, bit for bit (NaN never does). Chunk by chunk, so rows
    that differ are usually told apart in the first chunk."""
    return all(bool((x[:, cols] == x[:1, cols]).all()) for cols in column_blocks(x))


def grouping_pass(x: torch.Tensor, sybils: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A grouping rule's first pass over its round's updates ``x`` (n, d): their (n,) norms (the front door
    screens on them) and, unless ``sybils`` is "off", in the same pass their sketch (:func:`find_groups`'
    candidate pairs; None when off)."""
    if sybils == "off":
        return row_norms(x), None
    return norms_and_sketch(x, SKETCH_WIDTH)


def find_groups(
    x: torch.Tensor,
    norms: torch.Tensor | None = None,
    relative: float = RELATIVE,
    *,
    sketch: torch.Tensor | None = None,
    sybils: str = "share",
) -> Groups:
    """The groups that share a vote among the rows of ``x`` (a round's updates) under ``sybils``
    (:data:`SYBILS`): the copies from one sketching pass (:func:`sketched_duplicates`; ``sketch`` when
    taken already, with ``norms`` the rows' norms when known), from one Gram matrix when ``relative`` > 0;
    with "share" also the correlated groups (:func:`correlated_groups`)."""
    if sybils == "off":
        return Groups.singletons(x.shape[0])
    if relative > 0:
        sq_dist, gram_norms = pairwise_sq_distances(x)
        groups = near_duplicates(x, sq_dist, gram_norms if norms is None else norms, relative)
    else:
        if sketch is None:
            own, sketch = norms_and_sketch(x, SKETCH_WIDTH)
            norms = own if norms is None else norms
        groups = sketched_duplicates(x, sketch, row_norms(x) if norms is None else norms)
    return correlated_groups(x, groups) if sybils == "share" else groups
