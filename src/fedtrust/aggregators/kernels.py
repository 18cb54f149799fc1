"""Vectorised building blocks shared by the rules.

Everything works on an (n, d) tensor on its own device, in its own dtype, and walks the coordinates in
column chunks so no temporary is larger than ``CHUNK_BYTES`` times a small constant: n = 100 clients x
d = 10 million float32 coordinates (4 GB) aggregates inside 24 GB.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

from fedtrust.aggregators import order_stats

#: Bytes of the input one chunk covers. Sorting a chunk holds values + int64 indices (3x this).
#: 16 MiB: temporaries stay below glibc's 32 MiB mmap threshold, so they reuse heap pages instead of
#: faulting in fresh ones every chunk (twice as fast as 32 MiB for the pass-based rules).
CHUNK_BYTES = 1 << 24


def column_chunks(x: torch.Tensor) -> Iterator[slice]:
    """Column slices of ``x`` covering about ``CHUNK_BYTES`` of it each."""
    n, d = x.shape
    width = max(1, CHUNK_BYTES // max(1, n * x.element_size()))
    for start in range(0, d, width):
        yield slice(start, min(d, start + width))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """float64 Euclidean norms over the last dimension of ``x`` ((n, d) -> (n,), (I, J, K) -> (I, J)):
    float32 norms per column chunk (one vectorised kernel, no temporary) summed in float64; one float32
    norm over 1e7 entries at once is off by up to 4e-4. A chunk whose norm overflows the dtype gives inf."""
    k = x.shape[-1]
    width = max(1, CHUNK_BYTES // max(1, x[..., :1].numel() * x.element_size()))
    sq = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    for start in range(0, k, width):
        sq += torch.linalg.vector_norm(x[..., start : start + width], dim=-1).to(torch.float64).square()
    return sq.sqrt()


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i x_i`` as one matrix-vector product (a single pass over ``x``)."""
    return w.to(x.dtype) @ x


class CombinationPasses:
    """Repeated "combine, then every point's distance to the combination" passes over one data set: the
    Weiszfeld steps of the geometric median, centred clipping, IVAR-MLE's iterations.

    x: (n, d), or (I, J, K) for I independent groups of J points (tasks of the inference module). Each
    call is one fused pass: per cache-sized chunk of coordinates, z = offset + sum_j w_j x_j (one
    matrix-vector product) and, while the chunk is in cache, each x_j . z (another); the squared
    distances follow from ||x_j||^2 - 2 x_j . z + ||z||^2, with the norms taken in the first pass and
    kept. Per-chunk float32 partial sums are added in float64. Where the expansion cancels (a distance
    below ``EXPANSION_FLOOR`` of ||x_j||^2 + ||z||^2, as when the points share a large common component)
    those distances are redone by explicit differences.
    """

    #: Squared distances below this fraction of ||x_j||^2 + ||z||^2 are recomputed by differences.
    EXPANSION_FLOOR = 1e-2
    #: Bytes of x per chunk (read twice, the second time from cache).
    CHUNK = 1 << 22

    def __init__(self, x: torch.Tensor, norms: torch.Tensor | None = None):
        """``norms``: the points' norms if already known, else the first pass takes them
        (:meth:`norms` returns them, which makes that pass a rule's first pass: the front door screens
        on them)."""
        self.flat = x.dim() == 2
        self.x = x if x.dim() == 3 else x[None]
        i, j, k = self.x.shape
        # (I, J) float64 squared norms, given or from the first pass
        self.sq_norms = None if norms is None else norms.to(torch.float64).square().reshape(i, j)
        width = max(1, self.CHUNK // max(1, i * j * x.element_size()))
        self.blocks = [slice(s, min(k, s + width)) for s in range(0, k, width)]

    def norms(self) -> torch.Tensor:
        """(n,) or (I, J) float64 norms of the points (:func:`row_norms`): one pass the first time unless
        they were given or a call took them, then kept."""
        if self.sq_norms is None:
            self.sq_norms = row_norms(self.x).square()
        out = self.sq_norms.sqrt()
        return out[0] if self.flat else out

    def __call__(
        self,
        w: torch.Tensor | None,
        offset: torch.Tensor | None = None,
        previous: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """z = offset + sum_j w_j x_j, the float64 squared distances ||x_j - z||^2 and ||z - previous||
        (0 without ``previous``), in one pass. Shapes follow x: w (n,) or (I, J), or None for z = offset
        (distances to a given point); offset, previous and ``out`` (a buffer for z, which must not be
        ``previous``) (d,) or (I, K)."""
        x = self.x
        i, j, k = x.shape
        like = dict(dtype=x.dtype, device=x.device)
        w = None if w is None else w.reshape(i, j).to(x.dtype)
        offset = None if offset is None else offset.reshape(i, k)
        previous = None if previous is None else previous.reshape(i, k)
        z = torch.empty(i, k, **like) if out is None else out.reshape(i, k)
        parts = len(self.blocks)
        dots, z_sq = torch.empty(parts, i, j, **like), torch.empty(parts, i, **like)
        norms = torch.empty(parts, i, j, **like) if self.sq_norms is None else None
        steps = torch.zeros(parts, **like)
        for b, cols in enumerate(self.blocks):
            c, zc = x[:, :, cols], z[:, cols]
            if w is None:
                zc.copy_(offset[:, cols])
            elif i == 1:
                torch.mv(c[0].T, w[0], out=zc[0])
            else:
                zc.copy_(torch.einsum("ijk,ij->ik", c, w))
            if w is not None and offset is not None:
                zc += offset[:, cols]
            if i == 1:
                torch.mv(c[0], zc[0], out=dots[b, 0])
                torch.dot(zc[0], zc[0], out=z_sq[b, 0])
            else:
                torch.bmm(c, zc[:, :, None], out=dots[b, :, :, None])
                torch.linalg.vector_norm(zc, dim=1, out=z_sq[b]).square_()
            if norms is not None:
                torch.linalg.vector_norm(c, dim=-1, out=norms[b])
            if previous is not None:
                steps[b] = torch.linalg.vector_norm(zc - previous[:, cols])
        if norms is not None:
            self.sq_norms = norms.to(torch.float64).square().sum(0)
        dots, z_sq = dots.to(torch.float64).sum(0), z_sq.to(torch.float64).sum(0)[:, None]
        sq = (self.sq_norms - 2 * dots + z_sq).clamp_min(0)
        unresolved = sq < self.EXPANSION_FLOOR * (self.sq_norms + z_sq)
        if unresolved.any():
            exact = torch.zeros(i, j, dtype=torch.float64, device=x.device)
            for cols in self.blocks:
                diff = x[:, :, cols] - z[:, None, cols]
                exact += torch.linalg.vector_norm(diff, dim=-1).to(torch.float64).square()
            sq = torch.where(unresolved, exact, sq)
        step = float(steps.to(torch.float64).square().sum().sqrt())
        if self.flat:
            return z[0], sq[0], step
        return z, sq, step


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
    common component and with it most of the float32 cancellation), or a (d,) anchor vector.
    Each chunk's product is a float32 GEMM; chunks accumulate in float64.
    """
    n = x.shape[0]
    g = torch.zeros(n, n, dtype=torch.float64, device=x.device)
    for cols in column_chunks(x):
        c = x[:, cols]
        if isinstance(center, torch.Tensor):
            c = c - center[cols]
        elif center == "mean":
            c = c - c.mean(0)
        g += row_gram(c).to(torch.float64)
    return g


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
#: Re-anchor the centred Gram matrix when points lie this many times further from the centre than
#: typical pairwise distances (float32 cancellation would then swamp the small distances).
_CONDITION_LIMIT = 100.0


def _ill_conditioned(g: torch.Tensor, dist: torch.Tensor, limit: float) -> bool:
    """Whether some point's squared norm exceeds ``limit`` times its own typical squared distance (the
    20% quantile of its distances to the others): the float32 cancellation in that point's small
    distances is then too large. Per point, so far-away outliers (large norms, large distances) do not
    force a recomputation; a common component shared by all points does."""
    n = g.shape[0]
    off = dist[~torch.eye(n, dtype=torch.bool, device=dist.device)].reshape(n, n - 1)
    return bool((g.diagonal() > limit * torch.quantile(off, 0.2, dim=1)).any())


def pairwise_sq_distances(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) float64 squared Euclidean distances between the rows of ``x`` from one Gram matrix, and the
    (n,) float64 norms of the rows (the raw Gram's diagonal: a rule's first pass screens on them).

    First from the raw Gram (one GEMM pass). If some point's squared norm exceeds ``_RAW_LIMIT`` times
    the 20% quantile of the pairwise distances (a large common component, as with raw parameters), float32
    cancellation could blur the small distances, so the Gram is recomputed around the coordinate-wise mean;
    and if huge outliers drag that mean far from the honest points (centred norms above
    ``_CONDITION_LIMIT`` times the typical distance), once more around the most central client (least
    median distance to the others).
    """
    n = x.shape[0]
    g = gram(x)
    norms = g.diagonal().sqrt()
    if n < 3:  # too few points for the conditioning test: centred at once
        return sq_distances_from_gram(gram(x, "mean")), norms
    dist = sq_distances_from_gram(g)
    if not _ill_conditioned(g, dist, _RAW_LIMIT):
        return dist, norms
    g = gram(x, "mean")
    dist = sq_distances_from_gram(g)
    if _ill_conditioned(g, dist, _CONDITION_LIMIT):
        anchor = int(dist.median(dim=1).values.argmin())
        dist = sq_distances_from_gram(gram(x, x[anchor]))
    return dist, norms


# ---------------------------------------------------------------- order statistics (median, trimmed mean)

#: Bytes of the input one selection block covers: small enough that it (and on the numpy path its
#: transposed copy) stays in L2 while it is worked on.
SELECT_CHUNK_BYTES = 1 << 21


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, torch.get_num_threads())), "fedtrust-select")


def map_column_blocks(
    x: torch.Tensor, fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], norms: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run ``fn`` on cache-sized (n, c) column blocks of a CPU tensor, on a thread pool (numpy releases
    the GIL); ``fn`` returns the block's (c,) values and (n,) slot counts. Returns the (d,) values, the
    (n,) weights (slot counts normalised to sum to one) and, with ``norms``, the rows' float64 norms.

    With ``norms`` the rows may hold NaN or Inf (a rule's first pass on an unscreened round): each
    block's float32 sums of squares are taken while it is in cache (summed in float64) before ``fn``
    sees it, and a block with a non-finite sum stops the map (blocks not yet started are skipped); the
    norms returned are then that block's, non-finite for the malformed rows, and the values are not
    meaningful."""
    n, d = x.shape
    xn = x.detach().numpy()
    width = max(1, SELECT_CHUNK_BYTES // max(1, n * x.element_size()))
    blocks = [slice(s, min(d, s + width)) for s in range(0, d, width)]
    out = np.empty(d, dtype=xn.dtype)
    slots = np.zeros(n, dtype=np.float64)
    sq = np.zeros(n, dtype=np.float64)
    stop, flagged = threading.Event(), []

    def run(cols: slice):
        if stop.is_set():
            return None
        block = xn[:, cols]
        if not norms:
            return fn(block), None
        block_sq = np.einsum("ij,ij->i", block, block)
        if not np.isfinite(block_sq).all():
            flagged.append(block_sq)
            stop.set()
            return None
        return fn(block), block_sq

    for cols, item in zip(blocks, _pool().map(run, blocks), strict=True):
        if item is None:
            break  # stopped: a block has a non-finite row
        (values, counts), block_sq = item
        out[cols] = values
        slots += counts
        if block_sq is not None:
            sq += block_sq
    weights = torch.from_numpy(slots / slots.sum()).to(x.dtype)
    if not norms:
        return torch.from_numpy(out), weights, None
    return torch.from_numpy(out), weights, torch.from_numpy(np.sqrt(flagged[0] if stop.is_set() else sq))


#: Up to this many clients a block is sorted by a comparator network on whole rows (elementwise
#: min/max, no transposition); above it by numpy's SIMD row sort of the transposed block.
NETWORK_MAX_CLIENTS = 12


def sorted_columns(x: np.ndarray) -> np.ndarray:
    """(c, n): each column of the (n, c) block ``x`` sorted (a copy: the caller's block never moves).
    Few clients: a comparator network on the rows (a transposed view is returned). More: the contiguous
    transpose with each row sorted by numpy's SIMD sort, several times faster than selecting along the
    strided axis."""
    n = x.shape[0]
    if n <= NETWORK_MAX_CLIENTS:
        s = np.array(x, order="C")
        low = np.empty_like(s[0])
        for i, j in order_stats.sorting_network(n):
            np.minimum(s[i], s[j], out=low)
            np.maximum(s[i], s[j], out=s[j])
            s[i] = low
        return s.T
    t = np.array(x.T, order="C")
    t.sort(axis=1)
    return t


def window_slots(x: np.ndarray, t: np.ndarray, lo: int | np.ndarray, hi: int | np.ndarray) -> np.ndarray:
    """Each client's count of the (column, rank) slots of the windows ``lo..hi-1`` (per column, or one
    window for all), given the block ``x`` (n, c) and its sorted transpose ``t``. A value tied across a
    window's edge shares the slots at that value evenly among the clients holding it."""
    n = x.shape[0]
    rows = np.arange(t.shape[0])
    lo_b, hi_b = np.broadcast_to(lo, rows.shape), np.broadcast_to(hi, rows.shape)
    if np.ndim(lo) == 0 and np.ndim(hi) == 0:  # one window for every column: plain slices
        # contiguous copies: comparing x against a strided edge is 4x slower than against a packed one
        low, high = np.ascontiguousarray(t[:, lo]), np.ascontiguousarray(t[:, hi - 1])
        crossing = np.zeros(rows.shape, dtype=bool)  # a value equal on both sides of an edge
        if lo > 0:
            crossing |= t[:, lo - 1] == low
        if hi < n:
            crossing |= t[:, hi] == high
    else:
        low, high = t[rows, lo_b], t[rows, hi_b - 1]
        crossing = np.zeros(rows.shape, dtype=bool)
        inner = lo_b > 0
        crossing[inner] |= t[rows[inner], lo_b[inner] - 1] == low[inner]
        outer = hi_b < n
        crossing[outer] |= t[rows[outer], hi_b[outer]] == high[outer]
    mask = np.greater_equal(x, low)  # slots = #(x >= low) - #(x > high), counted row by row
    slots = _row_counts(mask)
    slots -= _row_counts(np.greater(x, high, out=mask))
    ties = np.flatnonzero(crossing)
    if ties.size:
        slots += _tie_shares(x[:, ties], low[ties], high[ties], lo_b[ties], hi_b[ties])
    return slots


def _row_counts(mask: np.ndarray) -> np.ndarray:
    """True entries of each row of a 2-D mask, as float64 (a popcount per contiguous row is several times
    faster than numpy's count along an axis)."""
    return np.fromiter((np.count_nonzero(row) for row in mask), np.float64, mask.shape[0])


def _tie_shares(
    x: np.ndarray, low: np.ndarray, high: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """The correction to the counts #(x >= low) - #(x > high) for columns whose window edge cuts through a
    block of equal values: the clients sharing the value share the window's slots at that value evenly."""
    slots = -np.count_nonzero((x == low) | (x == high), axis=1).astype(np.float64)
    for value in (low, np.where(high == low, np.nan, high)):  # one tied block is counted once
        below = np.count_nonzero(x < value, axis=0)
        equal = x == value
        count = np.count_nonzero(equal, axis=0)
        kept = np.maximum(np.minimum(hi, below + count) - np.maximum(lo, below), 0)
        slots += equal @ np.where(count > 0, kept / np.maximum(count, 1), 0.0)
    return slots


def _window_block(x: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    if order_stats.suits(x):
        values, slots, (ties, low, high) = order_stats.window_block(x, lo, hi)
        if ties.size:
            slots += _tie_shares(x[:, ties], low, high, np.full(ties.size, lo), np.full(ties.size, hi))
        return values, slots
    t = sorted_columns(x)
    values = t[:, lo:hi] @ np.full(hi - lo, 1 / (hi - lo), dtype=x.dtype)  # BLAS: 5x a row-wise sum
    return values, window_slots(x, t, lo, hi)


def rank_window(x: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every coordinate j, the mean of the values of rank lo..hi-1 (0-based, ascending) among
    x[0, j], ..., x[n-1, j], and each client's weight: its share of the (coordinate, rank) slots, with
    clients tied across a window edge sharing those slots evenly. The median is the window
    (n // 2, n // 2 + 1) for odd n and (n/2 - 1, n/2 + 1) for even n; the b-trimmed mean is (b, n - b).

    On the CPU cache-sized column blocks go to a thread pool: float32 blocks of up to
    :data:`order_stats.MAX_CLIENTS` rows through the compiled selection network (:mod:`order_stats`),
    others transposed and sorted with numpy's SIMD sort; on other devices a sort per chunk does it
    (:func:`rank_window_by_sort`). Also returns the rows' norms, taken in the same pass
    (:func:`map_column_blocks`; :func:`row_norms` off the CPU): the x may be unscreened, and where a row
    is not finite the values and weights are not meaningful.
    """
    n, d = x.shape
    if not 0 <= lo < hi <= n:
        raise ValueError(f"rank_window: need 0 <= lo < hi <= n, got lo={lo}, hi={hi}, n={n}")
    if x.device.type != "cpu":
        return (*rank_window_by_sort(x, lo, hi), row_norms(x))
    return map_column_blocks(x, lambda block: _window_block(block, lo, hi), norms=True)


def window_shares(t: torch.Tensor, ordered: torch.Tensor, lo, hi) -> torch.Tensor:
    """The torch tie rule, the CPU path's: (c, n) float64 slots of each entry of ``t`` (a row per column,
    ``ordered`` its sorted copy) in the window of ranks lo..hi-1 (ints, or (c, 1) per row). A value held by
    c entries of a row that the window keeps k times (0 < k <= c) gives each of them k / c slots, so
    entries tied across a window edge share its slots evenly, whatever their order."""
    below = torch.searchsorted(ordered, t, right=False)  # each entry's first rank among its equals
    count = torch.searchsorted(ordered, t, right=True) - below
    kept = torch.minimum(below + count, torch.as_tensor(hi)) - torch.maximum(below, torch.as_tensor(lo))
    return kept.clamp_min(0).to(torch.float64) / count.clamp_min(1).to(torch.float64)


def rank_window_by_sort(x: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of :func:`rank_window` (any device): a sort per chunk, ties shared as on the CPU
    (:func:`window_shares`)."""
    n, d = x.shape
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    slots = torch.zeros(n, dtype=torch.float64, device=x.device)
    for cols in column_chunks(x):
        t = x[:, cols].T.contiguous()  # (c, n): a row per column
        ordered = t.sort(dim=1).values
        out[cols] = ordered[:, lo:hi].mean(1)
        slots += window_shares(t, ordered, lo, hi).sum(0)
    return out, (slots / slots.sum()).to(x.dtype)
