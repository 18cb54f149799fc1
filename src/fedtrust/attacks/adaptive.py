"""Adaptive untargeted attacks: the corrupted clients craft one vector each round, as far from the honest
ones as a defence lets through. Each works on the round's (n, d) matrix in a few torch passes.

- :class:`MinMax`, :class:`MinSum` (Shejwalkar & Houmansadr, NDSS 2021): rule-agnostic, a perturbation
  scaled as far as the benign updates' own spread allows;
- :class:`FangKrum`, :class:`FangTrimmedMean` (Fang, Cao, Jia, Gong, USENIX Security 2020): crafted
  against Krum and against the trimmed mean / median;
- :class:`OptimalALIE`, :class:`OptimalIPM`: ALIE's z and IPM's epsilon chosen each round to move the
  server's own aggregate furthest from the benign mean (ByzFL's "optimal" variants): they query the rule
  through :attr:`AttackContext.aggregate`.

All take ``knowledge``: ``"omniscient"`` (the benign updates) or ``"partial"`` (the corrupted clients'
own honest updates stand in for them, Fang et al.'s partial knowledge).
"""

from __future__ import annotations

import math

import torch

from fedtrust._checks import check_choice, check_float, check_int
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.distances import pairwise_sq_distances
from fedtrust.aggregators.krum import krum_first
from fedtrust.aggregators.passes import row_norms
from fedtrust.attacks.context import AttackContext, Knowing

__all__ = ["FangKrum", "FangTrimmedMean", "MinMax", "MinSum", "OptimalALIE", "OptimalIPM"]

#: Shejwalkar & Houmansadr's perturbation directions: inverse unit vector, inverse sign,
#: inverse standard deviation of the benign updates.
DIRECTIONS = ("unit_vec", "sign", "std")


def perturbation(mean: torch.Tensor, std: torch.Tensor, direction: str) -> torch.Tensor:
    """The perturbation grad_p of Shejwalkar & Houmansadr from the known updates' coordinate-wise mean and
    standard deviation: -mu / ||mu||, -sign(mu) or -sigma."""
    if direction == "unit_vec":
        return -mean / float(row_norms(mean[None])[0]) if bool(mean.any()) else torch.zeros_like(mean)
    if direction == "sign":
        return -torch.sign(mean)
    return -std


def spread(ctx: AttackContext, knowledge: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The known updates' rows, their float64 squared distances to each other, and each one's squared
    distance to their mean from those (||x_i - mu||^2 = mean_j D_ij - sum_jl D_jl / (2 k^2): no centred
    copy of the matrix); both on the host (:func:`pairwise_sq_distances`)."""
    rows = ctx.rows(knowledge)
    dist, _ = pairwise_sq_distances(ctx.updates.index_select(0, rows))
    k = len(rows)
    to_mean = dist.mean(1) - dist.sum() / (2 * k * k)
    return rows, dist, to_mean.clamp_min(0)


class _Agnostic(Knowing):
    """min-max / min-sum: grad_m = mean(known) + gamma * grad_p, every corrupted client sends grad_m,
    with the largest gamma its criterion allows (found in closed form: the criterion is a quadratic in
    gamma; the paper searches for the same gamma by halving steps). One read of the matrix for the
    statistics and one Gram matrix of the known updates for the distances.

    The closed form is the exact largest gamma, with no upper bound; the paper's halving search (its
    Algorithm 1) starts at gamma_init (10 or 50 in the authors' code) and so never exceeds twice that:
    where the criterion allows more, this attack goes further than a reproduction of their code."""

    def __init__(self, direction: str = "unit_vec", knowledge: str = "omniscient"):
        super().__init__(knowledge)
        self.direction = check_choice(f"attack {self.name}: direction", direction, DIRECTIONS)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        mean, std = ctx.mean_std(self.knowledge)
        p = perturbation(mean, std, self.direction)
        a = float(row_norms(p[None])[0]) ** 2
        gamma = 0.0
        if a > 0 and len(ctx.rows(self.knowledge)) > 1:
            gamma = self.gamma(ctx, mean, p, a)
        return (mean + gamma * p).expand(ctx.num_bad, -1)

    def gamma(self, ctx: AttackContext, mean: torch.Tensor, p: torch.Tensor, a: float) -> float:
        raise NotImplementedError


class MinMax(_Agnostic):
    """Min-max (Shejwalkar & Houmansadr, NDSS 2021, the AGR-agnostic Min-Max objective): the largest
    gamma with

        max_i ||grad_m - grad_i|| <= max_{i,j} ||grad_i - grad_j||,

    the crafted update no further from any benign one than the two furthest benign ones are apart. For
    each i the condition is a*g^2 + 2*b_i*g + c_i <= 0 (a = ||p||^2, b_i = <p, mu - x_i>,
    c_i = ||mu - x_i||^2 - D^2 <= 0, as the mean lies in the benign hull), so gamma = min_i of the larger
    root."""

    name = "min_max"

    def gamma(self, ctx, mean, p, a):
        rows, dist, to_mean = spread(ctx, self.knowledge)
        c = to_mean - dist.max()
        # <p, mu - x_i>, on the host with the distances
        b = float(p @ mean) - (ctx.updates.index_select(0, rows) @ p).to("cpu", torch.float64)
        roots = (-b + (b.square() - a * c).clamp_min(0).sqrt()) / a
        return max(0.0, float(roots.min()))


class MinSum(_Agnostic):
    """Min-sum (Shejwalkar & Houmansadr, NDSS 2021, the AGR-agnostic Min-Sum objective): the largest
    gamma with

        sum_i ||grad_m - grad_i||^2 <= max_i sum_j ||grad_i - grad_j||^2.

    With mu the known updates' mean the cross term vanishes (sum_i (mu - x_i) = 0), so
    gamma = sqrt((max_i sum_j ||x_i - x_j||^2 - sum_i ||mu - x_i||^2) / (n ||p||^2)).

    The threshold is the paper's text (the max over benign clients of their sums of squared distances);
    the authors' published code takes the min, a weaker attack: reproductions built on it differ."""

    name = "min_sum"

    def gamma(self, ctx, mean, p, a):
        rows, dist, to_mean = spread(ctx, self.knowledge)
        return math.sqrt(max(0.0, float(dist.sum(1).max() - to_mean.sum())) / (len(rows) * a))


class FangKrum(Knowing):
    """Local model poisoning against Krum (Fang et al., USENIX Security 2020, Section 4.2), in update space
    (the global model is the origin): the first corrupted client sends -lambda * s, s = sign of the
    (known) benign mean update, the direction the honest clients move the model; the others send copies
    of it, so Krum sees a tight group. lambda starts at the paper's upper bound

        lambda <= min_i sum_{l in G_i} ||x_l - x_i|| / ((m - 2c - 1) sqrt(d)) + max_i ||x_i|| / sqrt(d)

    (G_i: x_i's m - c - 2 nearest benign updates; m clients, c corrupted) and is halved until Krum (with
    f = c) selects the crafted update, or until it falls below ``threshold`` (then lambda = threshold).
    Krum's distances are computed once: the crafted row's distances to the benign updates are a
    quadratic in lambda. With partial knowledge the corrupted clients' own honest updates stand in for the
    benign ones (the paper's partial-knowledge attack), so Krum is simulated on 2c rows.

    Where this differs from the paper: s is the sign of the benign mean, not of the rule's own
    no-attack aggregate; the other corrupted clients send exact copies, not vectors within epsilon of it;
    the server's Krum is assumed to use f = c."""

    name = "fang_krum"

    def __init__(self, knowledge: str = "omniscient", threshold: float = 1e-5):
        super().__init__(knowledge)
        self.threshold = check_float("attack fang_krum: threshold", threshold, minimum=0.0, strict_min=True)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        known = ctx.known(self.knowledge)
        c, m, d = ctx.num_bad, len(ctx.updates), known.shape[1]  # the attacker knows n and its count
        s = torch.sign(ctx.mean(self.knowledge))
        lam = self.search(known, s, c, m, d)
        return (-lam * s).expand(c, -1)

    def search(self, known: torch.Tensor, s: torch.Tensor, c: int, m: int, d: int) -> float:
        k = len(known)
        dist, norms = pairwise_sq_distances(known)
        root_d = math.sqrt(d)
        near = max(1, min(k - 1, m - c - 2))
        if k > 1:
            d_off = dist.sqrt().clone()
            d_off.fill_diagonal_(float("inf"))
            closest = d_off.sort(dim=1).values[:, :near].sum(1)
            lam = float(closest.min()) / (max(1, m - 2 * c - 1) * root_d)
        else:
            lam = 0.0
        lam += float(norms.max()) / root_d
        # ||-lam s - x_j||^2 = lam^2 ||s||^2 + 2 lam <s, x_j> + ||x_j||^2, on the host with the distances
        proj = (known @ s).to("cpu", torch.float64)
        s2 = float(s.square().sum())
        neighbours = m - c - 2
        while lam > self.threshold:
            to_crafted = lam * lam * s2 + 2 * lam * proj + norms.square()
            full = torch.zeros(k + c, k + c, dtype=torch.float64)
            full[:k, :k] = dist
            full[:k, k:] = to_crafted[:, None]
            full[k:, :k] = to_crafted[None, :]
            if neighbours < 1:
                return lam
            if krum_first(full, min(neighbours, k + c - 1)) >= k:
                return lam
            lam /= 2
        return self.threshold


class FangTrimmedMean(Knowing):
    """Local model poisoning against the trimmed mean and the median (Fang et al., USENIX Security 2020,
    Section 4.3), in update space, coordinate by coordinate, with s_j the sign of the known benign mean
    update (the direction the honest clients move coordinate j):

    - full knowledge: where s_j > 0 the corrupted clients send values drawn uniformly from
      [w_min / b, w_min] (w_min > 0) or [b w_min, w_min] (otherwise), w_min the smallest benign value;
      where s_j <= 0 from [w_max, b w_max] (w_max > 0) or [w_max, w_max / b], w_max the largest;
    - partial knowledge: from [mu - 4 sigma, mu - 3 sigma] where s_j > 0 and [mu + 3 sigma, mu + 4 sigma]
      otherwise, mu and sigma over the corrupted clients' own honest updates.

    Each corrupted client draws its own values (``b`` = 2, the paper's choice). The paper works on
    parameters and takes s_j from the rule's own no-attack aggregate; here the signs are those of update
    values and of the benign mean (the usual adaptation to update space)."""

    name = "fang_trimmed_mean"

    def __init__(self, knowledge: str = "omniscient", b: float = 2.0):
        super().__init__(knowledge)
        self.b = check_float("attack fang_trimmed_mean: b", b, minimum=1.0, strict_min=True)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        mu, sigma = ctx.mean_std(self.knowledge)
        up = mu > 0  # s_j > 0: push coordinate j down
        if self.knowledge == "partial":
            low = torch.where(up, mu - 4 * sigma, mu + 3 * sigma)
            high = torch.where(up, mu - 3 * sigma, mu + 4 * sigma)
        else:
            w_min, w_max = column_extremes(ctx.updates, ctx.rows(self.knowledge))
            b = self.b
            low = torch.where(up, torch.where(w_min > 0, w_min / b, b * w_min), w_max)
            high = torch.where(up, w_min, torch.where(w_max > 0, b * w_max, w_max / b))
        u = ctx.draw((ctx.num_bad, len(mu)), uniform=True, dtype=mu.dtype)
        return low + u * (high - low)


def column_extremes(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coordinate-wise minimum and maximum over the rows ``rows`` of ``x``, column block by block."""
    low, high = (torch.empty(x.shape[1], dtype=x.dtype, device=x.device) for _ in range(2))
    for cols in column_blocks(x, "stream"):
        low[cols], high[cols] = torch.aminmax(x[:, cols].index_select(0, rows), dim=0)
    return low, high


def maximise(harm, high: float, grid: int, steps: int) -> float:
    """The argument in [0, high] where ``harm`` is largest: a grid of ``grid`` + 1 points, then golden-
    section steps inside the best grid cell (the harm of a strength need not be unimodal over [0, high],
    so the grid finds the right peak and the golden section refines it)."""
    xs = [high * i / grid for i in range(grid + 1)]
    values = [harm(x) for x in xs]
    best = max(range(len(xs)), key=lambda i: values[i])
    lo, hi = xs[max(0, best - 1)], xs[min(grid, best + 1)]
    best_x, best_v = xs[best], values[best]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = harm(a), harm(b)
    for _ in range(steps):
        if fa >= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = harm(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = harm(b)
    for x, v in ((a, fa), (b, fb)):
        if v > best_v:
            best_x, best_v = x, v
    return best_x


class _Optimal(Knowing):
    """A one-parameter attack whose strength is chosen each round to maximise the server aggregate's
    distance from the benign mean (:meth:`AttackContext.deviation`), over [0, ``high``]: ``grid`` + 1
    evenly spaced strengths, then ``steps`` golden-section steps (grid + 2 + steps queries of the rule)."""

    def __init__(self, high: float, grid: int = 8, steps: int = 8, knowledge: str = "omniscient"):
        super().__init__(knowledge)
        self.high = check_float(f"attack {self.name}: high", high, minimum=0.0, strict_min=True)
        self.grid = check_int(f"attack {self.name}: grid", grid, minimum=1)
        self.steps = check_int(f"attack {self.name}: steps", steps, minimum=0)
        self.last: float | None = None  # the strength chosen in the last round

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        mean, std = ctx.mean_std(self.knowledge)
        if ctx.num_bad == len(ctx.updates):
            self.last = self.high
        else:
            self.last = maximise(
                lambda s: ctx.deviation(self.craft(mean, std, s), self.knowledge),
                self.high,
                self.grid,
                self.steps,
            )
        return self.craft(mean, std, self.last).expand(ctx.num_bad, -1)

    def craft(self, mean: torch.Tensor, std: torch.Tensor, strength: float) -> torch.Tensor:
        """The one vector every corrupted client sends at this strength."""
        raise NotImplementedError


class OptimalALIE(_Optimal):
    """ALIE (Baruch et al. 2019) with z chosen each round against the server's rule: every corrupted
    client sends mu - z sigma with z in [0, ``high``] maximising ||rule(sent) - mean(benign)||. ByzFL's
    variant searches tau in both signs with no upper limit (mu + tau sigma); this one goes only against
    the spread, as ALIE does, up to ``high``."""

    name = "optimal_alie"

    def __init__(self, high: float = 5.0, grid: int = 8, steps: int = 8, knowledge: str = "omniscient"):
        super().__init__(high, grid, steps, knowledge)

    def craft(self, mean, std, strength):
        return mean - strength * std


class OptimalIPM(_Optimal):
    """IPM (Xie et al. 2020) with epsilon chosen each round against the server's rule: every corrupted
    client sends -epsilon * mean(known) with epsilon in [0, ``high``] maximising
    ||rule(sent) - mean(benign)||. ByzFL's variant sends (1 - tau) mu for any tau >= 0, so also shrunken
    positive multiples of the mean; this one only non-positive multiples, as IPM does."""

    name = "optimal_ipm"

    def __init__(self, high: float = 10.0, grid: int = 8, steps: int = 8, knowledge: str = "omniscient"):
        super().__init__(high, grid, steps, knowledge)

    def craft(self, mean, std, strength):
        return -strength * mean
