"""The Triton kernels of :mod:`~fedtrust.aggregators.triton_windows` (imported only where Triton is):
per column of an (n, d) matrix, the mean of the values of ranks lo..hi-1, a flag where a tie crosses
an edge of that window, and per program each client's slot count and sum of squares."""

import triton
import triton.language as tl


@triton.jit
def finish(tile, ranked, low, high, crossing, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr,
           cross_ptr, count, N_PAD: tl.constexpr):  # fmt: skip
    """Store a tile's window means (``ranked``: its values of ranks lo..hi-1, others 0), its edge
    flags, and per client the program's slot count (entries between the edge values, in columns no
    tie crosses) and sum of squares."""
    tl.store(out_ptr + cols, tl.sum(ranked, axis=1) / count, mask=col_ok)
    tl.store(cross_ptr + cols, crossing.to(tl.int8), mask=col_ok)
    inside = ok & (tile >= low[:, None]) & (tile <= high[:, None]) & ~crossing[:, None]
    tl.store(parts_ptr + pid.to(tl.int64) * N_PAD + rows, tl.sum(inside.to(tl.int32), axis=0))
    squares = tl.where(ok, tile * tile, 0.0)
    tl.store(sq_ptr + pid.to(tl.int64) * N_PAD + rows, tl.sum(squares, axis=0))


@triton.jit(do_not_specialize=["n", "d", "lo", "hi"])  # one build per tile shape and dtype
def sort_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, cross_ptr, n, d, stride_row, stride_col, lo, hi,
                N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each column sorted in registers (a bitonic network over N_PAD values)."""
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.arange(0, N_PAD)
    col_ok = cols < d
    ok = col_ok[:, None] & (rows < n)[None, :]
    offsets = cols[:, None] * stride_col + rows.to(tl.int64)[None, :] * stride_row
    tile = tl.load(x_ptr + offsets, mask=ok, other=float("inf"))  # (BLOCK, N_PAD), padding sorts last
    ordered = tl.sort(tile, dim=1)
    ranks = tl.arange(0, N_PAD)[None, :]
    low = tl.sum(tl.where(ranks == lo, ordered, 0.0), axis=1)
    high = tl.sum(tl.where(ranks == hi - 1, ordered, 0.0), axis=1)
    below = tl.sum(tl.where(ranks == lo - 1, ordered, 0.0), axis=1)  # read only when lo > 0
    above = tl.sum(tl.where(ranks == hi, ordered, 0.0), axis=1)  # read only when hi < n
    crossing = ((lo > 0) & (below == low)) | ((hi < n) & (above == high))
    ranked = tl.where((ranks >= lo) & (ranks < hi), ordered, 0.0)
    finish(tile, ranked, low, high, crossing, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr,
           cross_ptr, hi - lo, N_PAD)  # fmt: skip


@triton.jit(do_not_specialize=["n", "d", "lo", "hi"])
def count_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, cross_ptr, n, d, stride_row, stride_col, lo, hi,
                 N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each entry's rank counted: against every client's value of its column, read one client (row)
    at a time, it tallies the values below it and those equal to it, the equal ones of lower row
    first, packed in one int32 (below << 20 | equal << 10 | equal of lower row; n < 1024). Entry i
    holds ranks below_i .. below_i + equal_i - 1 and, in row order, rank below_i + equal of lower
    row. O(n^2) comparisons per column and no data movement between threads."""
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.arange(0, N_PAD)
    col_ok = cols < d
    ok = col_ok[:, None] & (rows < n)[None, :]
    offsets = cols[:, None] * stride_col + rows.to(tl.int64)[None, :] * stride_row
    tile = tl.load(x_ptr + offsets, mask=ok, other=0.0)
    code = tl.zeros((BLOCK, N_PAD), dtype=tl.int32)
    row = x_ptr + cols * stride_col
    j = 0
    while j < n:  # (a while loop: Triton's interpreter cannot range over a runtime n)
        v = tl.load(row, mask=col_ok, other=0.0)
        code += tl.where(v[:, None] < tile, 1 << 20, 0)
        code += tl.where(v[:, None] == tile, tl.where(rows[None, :] > j, 1025, 1024), 0)
        row += stride_row
        j += 1
    below = code >> 20
    spans = below + ((code >> 10) & 1023)  # one past the entry's last rank
    rank = below + (code & 1023)
    kept = ok & (rank >= lo) & (rank < hi)
    cut = ok & (below < hi) & (spans > lo) & ((below < lo) | (spans > hi))  # a tie across an edge
    crossing = tl.max(cut.to(tl.int32), axis=1) > 0
    low = tl.min(tl.where(kept, tile, float("inf")), axis=1)
    high = tl.max(tl.where(kept, tile, -float("inf")), axis=1)
    finish(tile, tl.where(kept, tile, 0.0), low, high, crossing, ok, col_ok, cols, rows, pid, out_ptr,
           parts_ptr, sq_ptr, cross_ptr, hi - lo, N_PAD)  # fmt: skip
