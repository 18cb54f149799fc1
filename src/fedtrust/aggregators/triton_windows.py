"""Rank windows on a CUDA device in one Triton kernel: per column, the mean of the values of ranks
lo..hi-1 and each client's count of those slots, with the CPU path's tie rule
(:mod:`~fedtrust.aggregators.rank_windows`), and the rows' norms in the same read.

A program loads a (BLOCK, N_PAD) tile: BLOCK columns of x, each column's n values padded to the next
power of two. Three kernels (:mod:`~fedtrust.aggregators.triton_kernels`) find the window:

- ``"sort"`` (up to :data:`SORT_CLIENTS` clients) sorts each column in registers (``tl.sort``, a
  bitonic network);
- ``"count"`` (up to :data:`COUNT_CLIENTS`) counts, for each entry, the
  column's values below it and equal to it, reading one client's row at a time: n^2 comparisons a
  column but no data moved between threads, which a bitonic network over 32 or more values spends its
  time (and registers) on;
- ``"select"`` (above) finds the window's edge values by their bits: the value of rank r is the
  largest key (the float's bits, reordered as an unsigned integer) with at most r keys below it, fixed
  a bit at a time from the highest by one count of the column's keys a bit, until the bits fixed leave
  one key in range (about 16 of float32's 32 bits and 19 of float64's 64 for 100 ``randn`` values,
  the slowest of a program's columns), both edges at once for a wide window: O(n) a bit against the
  count kernel's n^2. Each entry's share then follows from the counts below and at most each edge
  value.

Each writes the window's mean and, per client, its share of the window's slots with the CPU path's tie
rule (an entry whose value the window keeps k of its c copies of holds k / c; see
:mod:`~fedtrust.aggregators.triton_kernels`), and the sum of squares of its entries. So the window, the
tie shares (sybils' copies straddling an edge included) and the norms take one read of x and no sync,
where the torch path (:func:`~fedtrust.aggregators.rank_windows.rank_window_by_sort`) transposes x and
sorts it in global memory. A kernel that fails to build or launch (a GPU or toolchain Triton does not
serve) is reported once as a warning and the torch path serves its rounds from then on (the count
kernel the select kernel's).

Bulyan's second phase (:func:`closest_to_median`) is one more kernel, on the count kernel's tallies: per
column the window of beta ranks closest to the median, chosen with the CPU path's float64 arithmetic
in its order, so its values are the CPU's to the bit.

Runs for float32/float64 CUDA tensors of at most :data:`MAX_CLIENTS` rows when Triton imports (torch's
CUDA builds ship it); ``FEDTRUST_TRITON=0`` turns it off. Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors in Triton's interpreter, which is how the tests check the kernels on a machine without a GPU.

Measured on an H200 (``benchmarks/gpu_rank_windows.py``, results/gpu_rank_windows.json: a median window
of float32 ``randn``, ms, d = 1e6 / 1e7; the torch path's time includes its separate pass for the
norms; the kernels of commit ec22266, before they shared tied slots themselves):

=====  =============  ============  ===========
n      torch path     ``"sort"``    ``"count"``
=====  =============  ============  ===========
10     1.70 / 10.3    0.63 / 1.50   0.99 / 1.99
16     1.50 / 11.6    0.30 / 1.43   0.37 / 2.03
32     2.12 / 18.3    1.72 / 14.8   0.55 / 4.47
64     8.17 / 71.7    6.57 / 60.2   1.93 / 15.2
100    8.96 / 80.7    12.9 / 120    4.80 / 39.8
=====  =============  ============  ===========

(float64 at d = 1e7: n = 10, 1.58 by either kernel against 12.3; n = 100, 57 by ``"count"`` against
157 and 159 by ``"sort"``.) ``"count"`` used 2048-value tiles and 4 warps; 4096- and 8192-value tiles
and 8 warps were slower at every n measured.

``"select"`` has not run on a GPU yet. Its routing is from the instructions the kernels issue, read
from their sm_90 machine code as a launch specialises them (``benchmarks/kernel_model.py``,
results/kernel_model.json: warp-instructions over the H200's issue rate at d = 1e7, the descent's trips
from ``randn`` columns): for a float32 median window 6.8 ms at n = 100, where the count kernel issues
30 ms (it measured 39.8), 3.3 against 10.0 at n = 64 (measured 15.2), 1.8 against 2.8 at n = 32
(measured 4.5); in float64 10.7 against 34.9 at n = 100 (measured 57.2). The count kernel measured
1.3-1.6x its model at 32-100 clients and 3.3x at 10, where its code outside the tally loop dominates;
``"select"``, whose loop synchronises the program's warps three times a bit, may run further from its
own. So it serves where the model gives it at least 2x on a median window: above
:data:`COUNT_CLIENTS`, in float32 (3.0x at 65 clients, 4.4x at 100; a trimmed window, whose descent
counts two ranks, 2.1x and 3.1x) and float64 (2.3x and 3.3x; trimmed 1.6x and 2.3x). Its loads are not
vectorised (``stride_col`` unspecialised): the vectorised tile's layout spread each column over more
threads and made every bit's count cost 119 instructions a thread instead of 74.
``benchmarks/gpu_rank_windows.py`` times all three.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from functools import cache

import torch

#: The most clients the kernels serve; above, the torch path. The count kernel's comparisons grow as n^2
#: (its time went x2.5 from 64 to 100 clients, the torch path's x1.1), so it serves the sizes measured to
#: win (the module's table), though its packing would hold 1023.
MAX_CLIENTS = 100
#: Up to this many clients the sort kernel serves, above it the count kernel (the module's table).
SORT_CLIENTS = 16
#: Up to this many clients the count kernel serves, above it the select kernel, float32 and float64 (the
#: module docstring: chosen from the kernels' issue model, to be measured).
COUNT_CLIENTS = 64
#: Values per program's tile (BLOCK columns x N_PAD clients), and warps per program, by kernel.
TILES = {"sort": 8192, "count": 2048, "select": 2048}
WARPS = {"sort": 4, "count": 4, "select": 4}


#: Why a kernel failed on this process's GPU, by method, once it has: the torch path serves instead of
#: that kernel, and the others keep serving (so Bulyan's kernel failing does not cost the median its own).
FAILURES: dict[str, str] = {}
#: What each kernel serves and what serves instead once it has failed, for the warning.
SERVES = {
    "sort": "the median and trimmed mean of up to 16 clients take the torch path",
    "count": "the median and trimmed mean of 17 to 64 clients take the torch path",
    "select": "the median and trimmed mean of 65 or more clients take the count kernel",
    "closest": "Bulyan's second phase takes the torch path",
}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: ``TRITON_INTERPRET`` set to a value Triton
    reads as true (1, true, on)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def suits(x: torch.Tensor, rows: int | None = None, method: str | None = None) -> bool:
    """Whether kernel ``method`` (:func:`method_for` the rows by default) serves ``x``: a float32/float64
    (n, d) CUDA tensor (a CPU one under the interpreter), 1 <= ``rows`` (the rows a window ranks: n by
    default) <= MAX_CLIENTS, d >= 1, Triton importable, not turned off, and that kernel not failed."""
    rows = x.shape[0] if rows is None else rows
    return (
        x.dim() == 2
        and 1 <= rows <= MAX_CLIENTS
        and x.shape[1] > 0
        and x.dtype in (torch.float32, torch.float64)
        and (x.is_cuda or (interpreting() and x.device.type == "cpu"))
        and os.environ.get("FEDTRUST_TRITON", "1") != "0"
        and (method or method_for(rows)) not in FAILURES
        and _kernels() is not None
    )


@cache
def _kernels() -> dict | None:
    """The jitted kernels by method (``"sort"``, ``"count"``, ``"select"``, ``"closest"``), or None where
    Triton does not import."""
    try:
        from fedtrust.aggregators import triton_kernels
    except ImportError:
        return None
    return {"sort": triton_kernels.sort_kernel, "count": triton_kernels.count_kernel,
            "select": triton_kernels.select_kernel, "closest": triton_kernels.closest_kernel}  # fmt: skip


def method_for(n: int) -> str:
    """The kernel for n clients, float32 and float64 alike (the module docstring gives the margins):
    ``"sort"`` up to :data:`SORT_CLIENTS`, ``"count"`` up to :data:`COUNT_CLIENTS`,
    ``"select"`` above; the count kernel there too once ``"select"`` has failed (:data:`FAILURES`): the
    measured kernel before the torch path."""
    if n <= SORT_CLIENTS:
        return "sort"
    return "select" if n > COUNT_CLIENTS and "select" not in FAILURES else "count"


def _padded(n: int) -> int:
    """The next power of two >= n (at least 2): a tile's rows."""
    return 1 << max(1, (n - 1).bit_length())


def _grid(method: str, rows: int, d: int) -> tuple[int, int, int]:
    """(N_PAD, BLOCK, programs) of kernel ``method`` over ``rows`` rows and d columns: TILES[method]
    values a program, at least 16 columns."""
    n_pad = _padded(rows)
    block = max(16, TILES[method] // n_pad)
    return n_pad, block, -(-d // block)


def _launch(method: str, x: torch.Tensor, programs: int, *args, **meta) -> bool:
    """Run kernel ``method`` on ``programs`` programs on x's GPU (Triton launches on the current one);
    False, with the failure recorded (:data:`FAILURES`) and said once, when it does not build or launch."""
    try:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _kernels()[method][(programs,)](*args, **meta)
        return True
    except Exception as exc:  # noqa: BLE001 - any build or launch failure: the torch path, said once
        FAILURES[method] = f"{type(exc).__name__}: {exc}"[:300]
        warnings.warn(f"fedtrust's Triton {method} kernel failed ({FAILURES[method]}); {SERVES[method]} from "
                      "now on", RuntimeWarning, stacklevel=3)  # fmt: skip
        return False


def rank_window(x: torch.Tensor, lo: int, hi: int, method: str | None = None) -> tuple[torch.Tensor, ...]:
    """(d,) means of ranks lo..hi-1 per column of ``x`` (n, d), (n,) each client's share of the
    window's slots (ties across an edge shared evenly) and (n,) float64 row norms, all from one read of
    ``x``: what :func:`~fedtrust.aggregators.rank_windows.rank_window` returns, for ``x`` that
    :func:`suits`. ``method``: the kernel (:func:`method_for` by default, and if that fails to build or
    launch, the next that serves: the select kernel's rounds go to the count kernel). No sync."""
    from fedtrust.aggregators.passes import row_norms
    from fedtrust.aggregators.rank_windows import rank_window_by_sort

    n, d = x.shape
    chosen = method or method_for(n)
    n_pad, block, programs = _grid(chosen, n, d)
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    parts = torch.empty(programs, n_pad, dtype=x.dtype, device=x.device)
    sq = torch.empty(programs, n_pad, dtype=x.dtype, device=x.device)
    if not _launch(chosen, x, programs, x, out, parts, sq, n, d, x.stride(0), x.stride(1), int(lo), int(hi),
                   N_PAD=n_pad, BLOCK=block, num_warps=WARPS[chosen]):  # fmt: skip
        if method is None and suits(x):  # the next kernel for n, the failed one now passed over
            return rank_window(x, lo, hi)
        return (*rank_window_by_sort(x, lo, hi), row_norms(x))
    slots = parts.sum(0, dtype=torch.float64)[:n]
    return out, (slots / slots.sum()).to(x.dtype), sq.sum(0, dtype=torch.float64)[:n].sqrt()


def closest_to_median(
    x: torch.Tensor, selected: torch.Tensor, beta: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bulyan's second phase (:func:`~fedtrust.aggregators.bulyan.closest_to_median`, the CPU's float64
    arithmetic in its order) in one kernel over the ``selected`` rows of ``x`` (n, d), for ``x`` that
    :func:`suits` with at most :data:`MAX_CLIENTS` selected: the (d,) means of the ``beta`` values closest
    to each column's median and the (n,) clients' shares of those slots. No sync."""
    from fedtrust.aggregators.bulyan import closest_to_median_by_sort
    from fedtrust.aggregators.median import median_window

    n, d = x.shape
    theta = len(selected)
    n_pad, block, programs = _grid("count", theta, d)
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    parts = torch.empty(programs, n_pad, dtype=torch.float64, device=x.device)
    index = selected.to(device=x.device, dtype=torch.int64)
    mlo, mhi = median_window(theta)
    if not _launch("closest", x, programs, x, index, out, parts, theta, d, x.stride(0), x.stride(1),
                   int(beta), mlo, mhi, N_PAD=n_pad, M_PAD=_padded(theta + 1), BLOCK=block,
                   num_warps=WARPS["count"]):  # fmt: skip
        return closest_to_median_by_sort(x, selected, beta)
    slots = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(0, index, parts.sum(0)[:theta])
    return out, (slots / slots.sum()).to(x.dtype)
