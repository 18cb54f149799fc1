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
norms; commit 34882bb, 2026-11-26):

=====  =============  ============  ============  ============
n      torch path     ``"sort"``    ``"count"``   ``"select"``
=====  =============  ============  ============  ============
10     2.36 / 10.6    0.26 / 0.90   0.30 / 0.93   0.29 / 1.27
16     1.46 / 12.0    0.20 / 0.95   0.22 / 1.16   0.23 / 1.30
32     1.99 / 18.7    1.59 / 14.4   0.47 / 3.88   0.40 / 2.87
64     8.45 / 74.8    6.34 / 59.7   1.34 / 12.7   0.61 / 5.61
100    9.05 / 84.0    12.7 / 122    4.21 / 39.0   1.58 / 13.1
=====  =============  ============  ============  ============

A trimmed window at 100 x 1e7: ``"count"`` 39.2, ``"select"`` 17.5 (its descent counts two ranks).
float64 at d = 1e7: n = 10, ``"select"`` 2.30 against 3.00 (``"count"``), 3.31 (``"sort"``) and 12.6 (torch);
n = 100, 19.8 against 82.8, 186 and 158. ``"count"`` and ``"select"`` use 2048-value tiles and 4 warps:
4096-value tiles were slower at every n measured, 8 warps within 4%.

So (:func:`method_for`): in float32 the sort kernel serves up to :data:`SORT_CLIENTS` clients, the
count kernel up to :data:`COUNT_CLIENTS`, the select kernel above; in float64 the select kernel from
:data:`SELECT_FLOAT64` clients, the sort kernel below. The float32 edge between count and select lies
between the two sizes measured, 16 (count 5-11% faster) and 32 (select 15-26% faster). Both pad 17-31
clients to a 32-row tile, where select's cost is that of 32 rows and the count kernel's grows with the
rows counted: their issue models (below) at d = 1e7, each scaled by its kernel's measured ratio to its
model at 16 and 32 clients (count 1.4x, select 1.55x), cross at 20 clients (count 2.8 against select
2.8 ms; at 24 3.2 against 2.8), not measured. Below 10 clients in float64 the kernels were not compared.

At 100 clients ``"select"`` takes 1.8-1.9x the time the issue model of its sm_90 machine code gives
(``benchmarks/kernel_model.py``, results/kernel_model.json: 6.8 ms at 100 x 1e7, 9.7 for the trimmed
window, 10.7 in float64), the count kernel 1.3-2.4x (30 at 100 x 1e7, 34.9 in float64). Its loads
are not vectorised (``stride_col`` unspecialised): the vectorised tile's layout spread each column over
more threads and made every bit's count cost 119 instructions a thread instead of 74.
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
#: In float32, up to this many clients the sort kernel serves, above it the count kernel (the module's table).
SORT_CLIENTS = 16
#: In float32, up to this many clients the count kernel serves, above it the select kernel (the module's
#: table: measured at 16 and 32, the edge between them from the kernels' scaled issue models).
COUNT_CLIENTS = 20
#: In float64, from this many clients the select kernel serves, below it the sort kernel (measured at 10
#: and 100 clients: the module's table).
SELECT_FLOAT64 = 10
#: Values per program's tile (BLOCK columns x N_PAD clients), and warps per program, by kernel.
TILES = {"sort": 8192, "count": 2048, "select": 2048}
WARPS = {"sort": 4, "count": 4, "select": 4}


#: Why a kernel failed on this process's GPU, by method, once it has: the torch path serves instead of
#: that kernel, and the others keep serving (so Bulyan's kernel failing does not cost the median its own).
FAILURES: dict[str, str] = {}
#: What each kernel serves and what serves instead once it has failed, for the warning.
_ROUNDS = "the median and trimmed mean of"
SERVES = {
    "sort": f"{_ROUNDS} up to {SORT_CLIENTS} float32 clients ({SELECT_FLOAT64 - 1} float64) take the "
    "torch path",
    "count": f"{_ROUNDS} {SORT_CLIENTS + 1} to {COUNT_CLIENTS} float32 clients take the torch path",
    "select": f"{_ROUNDS} {COUNT_CLIENTS + 1} or more float32 clients ({SELECT_FLOAT64} or more float64) "
    "take the count kernel",
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
        and (method or method_for(rows, x.dtype)) not in FAILURES
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


def method_for(n: int, dtype: torch.dtype = torch.float32) -> str:
    """The kernel for n clients of ``dtype`` (the module's table gives the margins): in float32
    ``"sort"`` up to :data:`SORT_CLIENTS`, ``"count"`` up to :data:`COUNT_CLIENTS`, ``"select"`` above;
    in float64 ``"select"`` from :data:`SELECT_FLOAT64`, ``"sort"`` below. Where ``"select"`` has failed
    (:data:`FAILURES`) the count kernel takes its rounds: the next fastest measured, before the torch
    path."""
    selects = n >= SELECT_FLOAT64 if dtype == torch.float64 else n > COUNT_CLIENTS
    if selects:
        return "count" if "select" in FAILURES else "select"
    return "sort" if n <= SORT_CLIENTS else "count"


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
    chosen = method or method_for(n, x.dtype)
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
