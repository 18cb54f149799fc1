"""The compiled order-statistics kernel (``order_stats.c``) behind the median and the trimmed mean.

:func:`window_block` gives, for a float32 (n, c) column block, each column's mean over the ranks
lo..hi-1 and each row's share of those (column, rank) slots, in one pass over the block in L1-sized
tiles: a comparator network (Batcher's odd-even merge sort on the tile's columns, pruned to the ranks the
window reads) instead of a transposed copy sorted row by row. Several times faster per thread; measured in
``benchmarks/README.md``. The windows and shares are those of the numpy path of
:func:`fedtrust.aggregators.rank_windows.rank_window`, the means to float32 rounding (their sums run in
another order: up to 2.4e-7 apart on N(0, 1) columns). A run's manifest records whether the kernel was
built (``versions["order_stats_extension"]``), beside its thread count, as what its last digits depend
on.

The extension is optional (``setup.py``): when it was not built, :data:`COMPILED` is False and callers
take the numpy path.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache

import numpy as np

#: Up to this many clients the compiled kernel runs; above it the numpy row sort of the transposed block
#: does (at n = 256 the kernel still took 0.6x numpy's time, its n x 64-float tile out of L1).
MAX_CLIENTS = 256


#: The kernel interface this module calls (``order_stats_abi`` in order_stats.c).
ABI = 1


def _load() -> ctypes.CDLL | None:
    """The built extension, or None when it was not built, does not load, or is a stale build (an older
    interface: ``make`` rebuilds it when order_stats.c changes)."""
    spec = importlib.util.find_spec("fedtrust.aggregators._order_stats")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.order_stats_abi.restype = ctypes.c_int32
        if lib.order_stats_abi() != ABI:
            return None
    except (OSError, AttributeError):
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.window_block.argtypes = [p, i64, i32, i64, p, i32, i32, i32, p, p, p, p, p, p]
    lib.window_block.restype = i64
    return lib


_LIB = _load()
#: Whether the compiled kernel is built and loaded.
COMPILED = _LIB is not None
LANES = 64  # the kernel's tile width (order_stats.c)


@cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators (i, j), i < j, of Batcher's odd-even merge sort on n inputs (the network for the next
    power of two, minus comparators that touch the padding: padded +inf inputs never move)."""
    size = 1 << max(0, (n - 1).bit_length())
    pairs: list[tuple[int, int]] = []

    def merge(lo: int, hi: int, r: int) -> None:
        step = 2 * r
        if step < hi - lo:
            merge(lo, hi, step)
            merge(lo + r, hi, step)
            pairs.extend((i, i + r) for i in range(lo + r, hi - r, step))
        else:
            pairs.append((lo, lo + r))

    def sort(lo: int, hi: int) -> None:
        if hi > lo:
            mid = (lo + hi) // 2
            sort(lo, mid)
            sort(mid + 1, hi)
            merge(lo, hi, 1)

    sort(0, size - 1)
    return tuple((i, j) for i, j in pairs if j < n)


@cache
def selection_network(n: int, lo: int, hi: int) -> np.ndarray:
    """Comparators of Batcher's odd-even merge sort on n inputs, keeping only those that decide the
    ranks the window lo..hi-1 reads: its edges lo and hi - 1, their outer neighbours lo - 1 and hi (for
    ties), and every rank outside the window (so that the window's wires hold exactly the values ranked
    inside it, in any order). A comparator whose outputs feed no such wire is dropped, walking the network
    backwards. The rest is ordered by depth, so consecutive comparators are independent.
    Returns an (m, 2) int32 array."""
    needed = set(range(0, min(lo + 1, n))) | set(range(max(hi - 1, 0), n))
    kept = []
    for i, j in reversed(sorting_network(n)):
        if i in needed or j in needed:
            kept.append((i, j))
            needed |= {i, j}
    depth = [0] * n
    layered = []
    for i, j in reversed(kept):
        depth[i] = depth[j] = max(depth[i], depth[j]) + 1
        layered.append((depth[i], i, j))
    layered.sort(key=lambda t: t[0])
    return np.array([(i, j) for _, i, j in layered], dtype=np.int32).reshape(-1, 2)


def suits(x: np.ndarray) -> bool:
    """Whether the compiled kernel takes this block: float32, unit column stride, at most
    :data:`MAX_CLIENTS` rows."""
    return (
        COMPILED
        and x.dtype == np.float32
        and x.shape[0] <= MAX_CLIENTS
        and x.strides[1] == 4
        and x.strides[0] % 4 == 0
    )


def window_block(
    x: np.ndarray, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For a float32 (n, c) block with unit column stride (a column slice of a C-ordered matrix): each
    column's mean of ranks lo..hi-1 (c,), each row's slot count #(x >= low) - #(x > high) (n,), and the
    columns whose window edge is tied across it (their counts need sharing:
    ``rank_windows._tie_shares``), with their edge values. Releases the GIL (ctypes). The values must be
    finite (the kernel is built with -ffinite-math-only; the rules' rounds are screened first, and a
    block with a non-finite row never reaches it:
    :func:`~fedtrust.aggregators.rank_windows.map_column_blocks` stops there)."""
    n, c = x.shape
    if not suits(x):
        raise ValueError(
            f"order_stats.window_block: takes float32 blocks of at most {MAX_CLIENTS} rows with unit column "
            f"stride (compiled: {COMPILED}), got dtype={x.dtype}, shape={x.shape}, strides={x.strides}"
        )
    pairs = selection_network(n, lo, hi)
    out, low, high = np.empty(c, np.float32), np.empty(c, np.float32), np.empty(c, np.float32)
    crossing = np.empty(c, np.uint8)
    slots = np.zeros(n, np.float64)
    scratch = np.empty(n * LANES + 16, np.float32)
    tied = _LIB.window_block(
        x.ctypes.data,
        x.strides[0] // 4,
        n,
        c,
        pairs.ctypes.data,
        len(pairs),
        lo,
        hi,
        out.ctypes.data,
        low.ctypes.data,
        high.ctypes.data,
        crossing.ctypes.data,
        slots.ctypes.data,
        scratch.ctypes.data,
    )
    ties = np.flatnonzero(crossing) if tied else np.empty(0, np.int64)
    return out, slots, (ties, low[ties], high[ties])
