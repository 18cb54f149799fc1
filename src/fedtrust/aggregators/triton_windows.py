"""Rank windows on a CUDA device in one Triton kernel: per column, the mean of the values of ranks
lo..hi-1 and each client's count of those slots, with the CPU path's tie rule
(:mod:`~fedtrust.aggregators.rank_windows`).

A program loads a (BLOCK, N_PAD) tile: BLOCK columns of x, each column's n values padded with +inf to
the next power of two. It sorts each column in registers (``tl.sort``, a bitonic network), writes the
window's mean, flags the columns where a value at an edge of the window also lies outside it (a tie
across the edge), and counts per client the entries between the edge values of the other columns: the
slots they hold, as :func:`~fedtrust.aggregators.rank_windows.window_slots` counts them on the CPU. The
flagged columns (rare for real-valued updates; every column when sybils' copies straddle an edge) then
get :func:`~fedtrust.aggregators.rank_windows.window_shares`' exact shares through torch. So the
window takes one read of x (the rows' norms, which the caller also takes, another), where the torch path
(:func:`~fedtrust.aggregators.rank_windows.rank_window_by_sort`) transposes x and sorts it in global
memory. A kernel that fails to build or launch (a GPU or toolchain Triton does not serve) is reported
once as a warning and the torch path serves from then on.

Runs for float32/float64 CUDA tensors of at most :data:`MAX_CLIENTS` rows (where it was measured to
beat the torch path) when Triton imports (torch's CUDA builds ship it); ``FEDTRUST_TRITON=0`` turns it
off. Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors in Triton's interpreter, which is how the tests check the kernel on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from functools import cache

import torch

#: The most clients the kernel serves; above, the torch path. Measured on an H200 (benchmarks/gpu.py):
#: at n = 10 the kernel took a median in 0.53 ms at d = 1e6 and 1.09 ms at d = 1e7, against 1.49 and
#: 9.76 ms by the torch path; at n = 100 (a 128-wide sort per column) 12.6 and 120 ms, against 8.3 and
#: 80 ms. Between 16 and 100 nothing was measured, so the kernel stops at the size measured to win.
MAX_CLIENTS = 16
#: Values per program's tile (BLOCK columns x N_PAD clients).
TILE = 8192


#: Why the kernel failed on this process's GPU, once it has: the torch path serves instead.
FAILURE: list[str] = []


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: ``TRITON_INTERPRET`` set to a value Triton
    reads as true (1, true, on)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def suits(x: torch.Tensor) -> bool:
    """Whether the kernel serves ``x``: a float32/float64 (n, d) CUDA tensor (a CPU one under the
    interpreter), 1 <= n <= MAX_CLIENTS, d >= 1, Triton importable and not turned off."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_CLIENTS
        and x.shape[1] > 0
        and x.dtype in (torch.float32, torch.float64)
        and (x.is_cuda or (interpreting() and x.device.type == "cpu"))
        and os.environ.get("FEDTRUST_TRITON", "1") != "0"
        and not FAILURE
        and _kernel() is not None
    )


@cache
def _kernel():
    """The jitted kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n", "d", "lo", "hi"])  # one build per tile shape and dtype
    def window_kernel(x_ptr, out_ptr, parts_ptr, cross_ptr, n, d, stride_row, stride_col, lo, hi,
                      N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        rows = tl.arange(0, N_PAD)
        col_ok = cols < d
        ok = col_ok[:, None] & (rows < n)[None, :]
        offsets = cols[:, None] * stride_col + rows.to(tl.int64)[None, :] * stride_row
        tile = tl.load(x_ptr + offsets, mask=ok, other=float("inf"))  # (BLOCK, N_PAD), padding sorts last
        ordered = tl.sort(tile, dim=1)
        ranks = tl.arange(0, N_PAD)[None, :]
        total = tl.sum(tl.where((ranks >= lo) & (ranks < hi), ordered, 0.0), axis=1)
        tl.store(out_ptr + cols, total / (hi - lo), mask=col_ok)
        low = tl.sum(tl.where(ranks == lo, ordered, 0.0), axis=1)
        high = tl.sum(tl.where(ranks == hi - 1, ordered, 0.0), axis=1)
        below = tl.sum(tl.where(ranks == lo - 1, ordered, 0.0), axis=1)  # read only when lo > 0
        above = tl.sum(tl.where(ranks == hi, ordered, 0.0), axis=1)  # read only when hi < n
        crossing = ((lo > 0) & (below == low)) | ((hi < n) & (above == high))
        tl.store(cross_ptr + cols, crossing.to(tl.int8), mask=col_ok)
        inside = ok & (tile >= low[:, None]) & (tile <= high[:, None]) & ~crossing[:, None]
        tl.store(parts_ptr + pid.to(tl.int64) * N_PAD + rows, tl.sum(inside.to(tl.int32), axis=0))

    return window_kernel


def rank_window(x: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d,) means of ranks lo..hi-1 per column of ``x`` (n, d) and (n,) each client's share of the
    window's slots (ties across an edge shared evenly): what
    :func:`~fedtrust.aggregators.rank_windows.rank_window_by_sort` returns, for ``x`` that
    :func:`suits`. One sync: the count of columns with a tie across an edge."""
    from fedtrust.aggregators.chunks import column_width
    from fedtrust.aggregators.rank_windows import rank_window_by_sort, window_shares

    n, d = x.shape
    n_pad = 1 << max(1, (n - 1).bit_length())
    block = max(16, TILE // n_pad)
    programs = -(-d // block)
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    parts = torch.empty(programs, n_pad, dtype=torch.int32, device=x.device)
    cross = torch.empty(d, dtype=torch.int8, device=x.device)
    try:  # on x's GPU: Triton launches on the current device
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _kernel()[(programs,)](x, out, parts, cross, n, d, x.stride(0), x.stride(1), int(lo), int(hi),
                                   N_PAD=n_pad, BLOCK=block)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any build or launch failure: the torch path, said once
        FAILURE.append(f"{type(exc).__name__}: {exc}"[:300])
        warnings.warn(f"fedtrust's Triton rank-window kernel failed ({FAILURE[0]}); the median and trimmed "
                      "mean take the torch path from now on", RuntimeWarning, stacklevel=2)  # fmt: skip
        return rank_window_by_sort(x, lo, hi)
    slots = parts.sum(0, dtype=torch.float64)[:n]
    tied = torch.nonzero(cross).flatten()
    if len(tied):  # the columns a tie crosses an edge of: exact shares
        for cols in tied.split(column_width(x, "stream")):
            t = x.index_select(1, cols).T.contiguous()
            slots += window_shares(t, t.sort(dim=1).values, lo, hi).sum(0)
    return out, (slots / slots.sum()).to(x.dtype)
