"""Gram matrices and pairwise distances between the rows of an (n, d) matrix: float32 GEMMs per column
block (:mod:`~fedtrust.aggregators.chunks`), accumulated in float64, with the cancellation checks that
keep small distances exact when the rows share a large common component."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fedtrust.aggregators.chunks import column_blocks

#: Up to this many rows, :func:`row_gram` splits the long dimension into batched blocks: a GEMM with a
#: 10 x 10 output and 1e5-long inner dimension parallelises poorly (n = 10: 2x faster split).
SPLIT_GRAM_MAX_ROWS = 16
#: Columns per block of the split.
SPLIT_GRAM_BLOCK = 1024


def row_gram(r: torch.Tensor) -> torch.Tensor:
    """``r @ r.T`` of a (J, W) float tensor (or (1, J, W) -> (1, J, J)): for few rows as a batch of
    products over blocks of columns, summed (same float32 products, grouped differently)."""
    *batch, j, w = r.shape
    if math.prod(batch) != 1 or j > SPLIT_GRAM_MAX_ROWS or w < 2 * SPLIT_GRAM_BLOCK:
        return r @ r.transpose(-1, -2)
    flat = r.reshape(j, w)
    nb = w // SPLIT_GRAM_BLOCK
    head = flat[:, : nb * SPLIT_GRAM_BLOCK].unflatten(1, (nb, SPLIT_GRAM_BLOCK)).transpose(0, 1)
    out = torch.bmm(head, head.transpose(1, 2)).sum(0)
    if w > nb * SPLIT_GRAM_BLOCK:
        tail = flat[:, nb * SPLIT_GRAM_BLOCK :]
        out += tail @ tail.T
    return out.reshape(*batch, j, j)


def gram(x: torch.Tensor, center: str | torch.Tensor | None = None) -> torch.Tensor:
    """(n, n) float64 Gram matrix of the rows of ``x`` after subtracting a centre.

    center: None (raw rows), ``"mean"`` (each coordinate's mean over clients, which removes the
    common component and with it most of the float32 cancellation), or a (d,) anchor vector
    (:func:`moments_about`). Each chunk's product is a float32 GEMM; chunks accumulate in float64.
    """
    if isinstance(center, torch.Tensor):
        return moments_about(x, center).gram
    n = x.shape[0]
    g = torch.zeros(n, n, dtype=torch.float64, device=x.device)
    for cols in column_blocks(x, "stream"):
        c = x[:, cols]
        if center == "mean":
            c = c - c.mean(0)
        g += row_gram(c).to(torch.float64)
    return g


class Moments(NamedTuple):
    """The second moments of the rows x_i of an (n, d) matrix about a centre c, float64: ``gram`` (n, n)
    r_i . r_j of the deviations r_i = x_i - c, ``cross`` (n,) r_i . c, ``centre_sq`` () ||c||^2. Every
    inner product of combinations of the rows follows (sum_i b_i x_i = sum_i b_i r_i + (sum_i b_i) c), so
    an estimator iterating on them needs no further pass over the rows
    (:class:`~fedtrust.inference.tasks.TaskGram` is the same three per task)."""

    gram: torch.Tensor
    cross: torch.Tensor
    centre_sq: torch.Tensor

    def combined(self, a: torch.Tensor) -> Moments:
        """The moments of the rows of ``a @ x`` about the same centre, for ``a`` (m, n) whose rows sum to 1
        (each new row a weighted mean of the old: its deviation is the same mean of their deviations)."""
        a = a.to(self.gram)
        return Moments(a @ self.gram @ a.T, a @ self.cross, self.centre_sq)


def moments_about(x: torch.Tensor, centre: torch.Tensor) -> Moments:
    """The rows' :class:`Moments` about ``centre`` (d,), in one pass over ``x`` (n, d) on its device: per
    column block the deviations' float32 Gram (one GEMM) and their products with the centre, summed in
    float64. A centre among the rows (a median) leaves no large common component to cancel."""
    n = x.shape[0]
    f64 = dict(dtype=torch.float64, device=x.device)
    g, cross, centre_sq = torch.zeros(n, n, **f64), torch.zeros(n, **f64), torch.zeros((), **f64)
    for cols in column_blocks(x, "stream"):
        c = centre[cols]
        r = x[:, cols] - c
        g += row_gram(r).to(torch.float64)
        cross += (r @ c).to(torch.float64)
        centre_sq += c.dot(c).to(torch.float64)
    return Moments(g, cross, centre_sq)


def sq_distances_from_gram(g: torch.Tensor) -> torch.Tensor:
    """Squared distances ||x_i||^2 + ||x_j||^2 - 2 <x_i, x_j>, made exactly symmetric (so equal
    distances compare equal whichever way round they were summed)."""
    diag = g.diagonal()
    g = (g + g.T) / 2
    dist = (diag[:, None] + diag[None, :] - 2 * g).clamp_min_(0)
    dist.fill_diagonal_(0)
    return dist


#: Distances come from the raw Gram matrix when no point's squared norm exceeds this many times its
#: typical squared distance (update deltas: norms and distances are alike); otherwise from a centred one.
_RAW_LIMIT = 10.0
#: Relative margin of the bounds :func:`_ill_conditioned` tests before it takes a quantile.
_QUANTILE_MARGIN = 1e-9
#: Re-anchor the centred Gram matrix when points lie this many times further from the centre than
#: typical pairwise distances (float32 cancellation would then swamp the small distances).
_CONDITION_LIMIT = 100.0


def _ill_conditioned(g: torch.Tensor, dist: torch.Tensor, limit: float) -> bool:
    """Whether some point's squared norm exceeds ``limit`` times its own typical squared distance (the
    20% quantile of its distances to the others): the float32 cancellation in that point's small
    distances is then too large. Per point, so far-away outliers (large norms, large distances) do not
    force a recomputation; a common component shared by all points does.

    The quantile lies between a point's nearest and furthest distance, so the test is first made against
    those (a margin of 1e-9 for the quantile's rounding): only a point between the two needs the
    quantile (a sort of its distances, most of a small round's time)."""
    n = g.shape[0]
    sq = g.diagonal()
    diagonal = torch.eye(n, dtype=torch.bool, device=dist.device)
    nearest = dist.masked_fill(diagonal, torch.inf).min(1).values
    if bool((sq <= limit * nearest * (1 - _QUANTILE_MARGIN)).all()):
        return False
    if bool((sq > limit * dist.max(1).values * (1 + _QUANTILE_MARGIN)).any()):
        return True
    off = dist[~diagonal].reshape(n, n - 1)
    return bool((sq > limit * torch.quantile(off, 0.2, dim=1)).any())


def pairwise_sq_distances(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) float64 squared Euclidean distances between the rows of ``x`` from one Gram matrix, and the
    (n,) float64 norms of the rows (the raw Gram's diagonal: a rule's first pass screens on them). Both on
    the CPU whatever x's device: the Gram matrices are taken on x's device and moved in one transfer
    each, and every caller turns the n^2 numbers into a choice of clients (sorts, quantiles, argmins),
    which on the host costs neither kernel launches nor a sync each.

    First from the raw Gram (one GEMM pass). If some point's squared norm exceeds ``_RAW_LIMIT`` times
    the 20% quantile of the pairwise distances (a large common component, as with raw parameters), float32
    cancellation could blur the small distances, so the Gram is recomputed around the coordinate-wise mean;
    and if huge outliers drag that mean far from the honest points (centred norms above
    ``_CONDITION_LIMIT`` times the typical distance), once more around the most central client (least
    median distance to the others).
    """
    n = x.shape[0]

    def host_gram(center: str | torch.Tensor | None = None) -> torch.Tensor:
        return gram(x, center).cpu()

    g = host_gram()
    norms = g.diagonal().sqrt()
    if n < 3:  # too few points for the conditioning test: centred at once
        return sq_distances_from_gram(host_gram("mean")), norms
    dist = sq_distances_from_gram(g)
    if not _ill_conditioned(g, dist, _RAW_LIMIT):
        return dist, norms
    g = host_gram("mean")
    dist = sq_distances_from_gram(g)
    if _ill_conditioned(g, dist, _CONDITION_LIMIT):
        anchor = int(dist.median(dim=1).values.argmin())
        dist = sq_distances_from_gram(host_gram(x[anchor]))
    return dist, norms
