"""Windows of ranks: for each coordinate the mean of the values of ranks lo..hi-1 among the clients
(the median, the trimmed mean, Bulyan's second stage) and each client's share of those (coordinate,
rank) slots, with one tie rule on every device: clients holding a value tied across a window edge
share its slots evenly, whatever their order (sybils are not told apart by position).

On the CPU, column blocks of the ``"select"`` budget (:mod:`~fedtrust.aggregators.chunks`) go to a
thread pool, through the compiled kernel (:mod:`~fedtrust.aggregators.order_stats`) or numpy's sort;
on CUDA one Triton kernel (:mod:`~fedtrust.aggregators.triton_windows`); on other devices, a torch
sort per block of the ``"stream"`` budget (:func:`rank_window_by_sort`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

from fedtrust.aggregators import order_stats, triton_windows
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.passes import row_norms
from fedtrust.cores import usable_cores


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(min(usable_cores(), torch.get_num_threads()), "fedtrust-select")


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
    blocks = column_blocks(x, "select")
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

    # one block runs on this thread: handing it to the pool and waiting for it cost a round of 10 x 650
    # 0.3 ms, ten times the work
    done = map(run, blocks) if len(blocks) == 1 else _pool().map(run, blocks)
    for cols, item in zip(blocks, done, strict=True):
        if item is None:
            break  # stopped: a block has a non-finite row
        (values, counts), block_sq = item
        out[cols] = values
        slots += counts
        if block_sq is not None:
            sq += block_sq
    total = slots.sum()  # 0 when a malformed first block stopped the map: the weights mean nothing then
    weights = torch.from_numpy(slots / total if total > 0 else np.full(n, 1.0 / n)).to(x.dtype)
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
    others transposed and sorted with numpy's SIMD sort; on CUDA one Triton kernel
    (:mod:`~fedtrust.aggregators.triton_windows`); on other devices a sort per chunk
    (:func:`rank_window_by_sort`). Also returns the rows' norms, taken in the same pass
    (:func:`map_column_blocks`; :func:`row_norms` off the CPU): the x may be unscreened, and where a row
    is not finite the values and weights are not meaningful.
    """
    n, d = x.shape
    if not 0 <= lo < hi <= n:
        raise ValueError(f"rank_window: need 0 <= lo < hi <= n, got lo={lo}, hi={hi}, n={n}")
    if triton_windows.suits(x):  # CUDA: one Triton kernel (a sort or a count of ranks)
        return triton_windows.rank_window(x, lo, hi)
    if x.device.type != "cpu":
        return (*rank_window_by_sort(x, lo, hi), row_norms(x))
    return map_column_blocks(x, lambda block: _window_block(block, lo, hi), norms=True)


def window_shares(t: torch.Tensor, ordered: torch.Tensor, lo, hi) -> torch.Tensor:
    """The torch tie rule, the CPU path's: (c, n) float64 slots of each entry of ``t`` (a row per column,
    ``ordered`` its sorted copy) in the window of ranks lo..hi-1 (ints, or (c, 1) per row). A value held by
    c entries of a row that the window keeps k times (0 < k <= c) gives each of them k / c slots, so
    entries tied across a window edge share its slots evenly, whatever their order.

    By comparisons with the window's edge values, not a search per entry: a value strictly between them
    has all its equals inside (1 slot each); one equal to an edge value v gets k / c, k the window's ranks
    holding v and c the row's entries equal to v (both edges one value: k = hi - lo)."""
    if not isinstance(lo, torch.Tensor):  # one window for every row: slices, no index tensors to copy
        lo, hi = int(lo), int(hi)
        low, high, kept = ordered[:, lo : lo + 1], ordered[:, hi - 1 : hi], ordered[:, lo:hi]
        inside = None
    else:
        low, high, kept = ordered.gather(1, lo), ordered.gather(1, hi - 1), ordered
        ranks = torch.arange(t.shape[1], device=t.device)
        inside = (ranks >= lo) & (ranks < hi)

    def share(edge: torch.Tensor) -> torch.Tensor:  # (c, 1): k / c for the rows' entries equal to edge
        held = ((kept == edge) if inside is None else (kept == edge) & inside).sum(1, keepdim=True)
        return held.to(torch.float64) / (t == edge).sum(1, keepdim=True).clamp_min(1).to(torch.float64)

    out = ((t > low) & (t < high)).to(torch.float64)
    out += (t == low) * share(low)
    return out + ((t == high) & (high != low)) * share(high)


def window_slot_sums(t: torch.Tensor, ordered: torch.Tensor, lo, hi) -> torch.Tensor:
    """(n,) float64: ``window_shares(t, ordered, lo, hi).sum(0)``, the way the CPU path counts
    (:func:`window_slots`): every entry between a row's edge values inclusive is one slot, except on the
    rows where a value at an edge also lies outside the window, which :func:`window_shares` shares. A
    few boolean passes and one sync for those rows, instead of float64 shares of every entry."""
    n = t.shape[1]
    if not isinstance(lo, torch.Tensor):
        lo, hi = int(lo), int(hi)
        low, high = ordered[:, lo : lo + 1], ordered[:, hi - 1 : hi]
        crossing = torch.zeros(len(t), 1, dtype=torch.bool, device=t.device)
        if lo > 0:
            crossing |= ordered[:, lo - 1 : lo] == low
        if hi < n:
            crossing |= ordered[:, hi : hi + 1] == high
    else:
        low, high = ordered.gather(1, lo), ordered.gather(1, hi - 1)
        below = ordered.gather(1, (lo - 1).clamp_min(0))
        above = ordered.gather(1, hi.clamp_max(n - 1))
        crossing = ((lo > 0) & (below == low)) | ((hi < n) & (above == high))
    slots = ((t >= low) & (t <= high)).sum(0, dtype=torch.float64)
    rows = torch.nonzero(crossing[:, 0]).flatten()
    if len(rows):  # a tie across an edge: those rows' entries share their slots (window_shares)
        tied = t[rows]
        slots -= ((tied >= low[rows]) & (tied <= high[rows])).sum(0, dtype=torch.float64)
        if isinstance(lo, torch.Tensor):
            lo, hi = lo[rows], hi[rows]
        slots += window_shares(tied, ordered[rows], lo, hi).sum(0)
    return slots


def rank_window_by_sort(x: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of :func:`rank_window` (any device): a sort per chunk, ties shared as on the CPU
    (:func:`window_slot_sums`)."""
    n, d = x.shape
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    slots = torch.zeros(n, dtype=torch.float64, device=x.device)
    for cols in column_blocks(x, "stream"):
        t = x[:, cols].T.contiguous()  # (c, n): a row per column
        ordered = t.sort(dim=1).values
        out[cols] = ordered[:, lo:hi].mean(1)
        slots += window_slot_sums(t, ordered, lo, hi)
    return out, (slots / slots.sum()).to(x.dtype)
