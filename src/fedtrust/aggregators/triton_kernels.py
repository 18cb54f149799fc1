"""The Triton kernels of :mod:`~fedtrust.aggregators.triton_windows` (imported only where Triton is).

Per column of an (n, d) matrix x, each kernel finds the mean of the values of ranks lo..hi-1 and each
entry's share of the window's slots, with the tie rule of
:func:`~fedtrust.aggregators.rank_windows.window_shares`: a value held by c entries of the column, k of
whose ranks the window keeps, gives each of those entries k / c (1 for a value inside the window held
once, 0 outside). Per program (a tile of BLOCK columns) it stores each client's sum of shares and sum of
squares, summed over the programs by the caller. Rows are padded to N_PAD, a power of two.
"""

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # an optional dependency: triton_windows falls back to torch without it
    raise ImportError("fedtrust's rank-window kernels need Triton (torch's CUDA builds ship it)") from exc


@triton.jit
def finish(tile, ranked, share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr, count,
           N_PAD: tl.constexpr):  # fmt: skip
    """Store a tile's window means (``ranked``: its values of ranks lo..hi-1, others 0) and per client
    the program's sum of slot shares and of squares."""
    tl.store(out_ptr + cols, tl.sum(ranked, axis=1) / count, mask=col_ok)
    at = parts_ptr + pid.to(tl.int64) * N_PAD + rows
    tl.store(at, tl.sum(tl.where(ok, share, 0.0), axis=0))
    tl.store(sq_ptr + pid.to(tl.int64) * N_PAD + rows, tl.sum(tl.where(ok, tile * tile, 0.0), axis=0))


@triton.jit
def load_tile(x_ptr, n, d, stride_row, stride_col, pad, N_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """The program's (BLOCK, N_PAD) tile of x's columns (``pad`` outside x), its columns, rows and masks."""
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.arange(0, N_PAD)
    col_ok = cols < d
    ok = col_ok[:, None] & (rows < n)[None, :]
    offsets = cols[:, None] * stride_col + rows.to(tl.int64)[None, :] * stride_row
    return tl.load(x_ptr + offsets, mask=ok, other=pad), cols, rows, col_ok, ok, pid


@triton.jit(do_not_specialize=["n", "d", "lo", "hi"])  # one build per tile shape and dtype
def sort_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, n, d, stride_row, stride_col, lo, hi,
                N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each column sorted in registers (a bitonic network over N_PAD values). The window's edge values
    low and high: an entry strictly between them has share 1, one equal to an edge value k / c, with k
    the window's ranks holding that value and c the column's entries equal to it."""
    inf = float("inf")  # the padding: sorts last
    tile, cols, rows, col_ok, ok, pid = load_tile(x_ptr, n, d, stride_row, stride_col, inf, N_PAD, BLOCK)
    ordered = tl.sort(tile, dim=1)
    ranks = tl.arange(0, N_PAD)[None, :]
    window = (ranks >= lo) & (ranks < hi)
    low = tl.sum(tl.where(ranks == lo, ordered, 0.0), axis=1)[:, None]
    high = tl.sum(tl.where(ranks == hi - 1, ordered, 0.0), axis=1)[:, None]
    k_low = tl.sum((window & (ordered == low)).to(tile.dtype), axis=1)[:, None]
    k_high = tl.sum((window & (ordered == high)).to(tile.dtype), axis=1)[:, None]
    c_low = tl.sum((ok & (tile == low)).to(tile.dtype), axis=1)[:, None]
    c_high = tl.sum((ok & (tile == high)).to(tile.dtype), axis=1)[:, None]
    share = ((tile > low) & (tile < high)).to(tile.dtype)
    share += tl.where(tile == low, k_low / tl.maximum(c_low, 1.0), 0.0)
    share += tl.where((tile == high) & (high != low), k_high / tl.maximum(c_high, 1.0), 0.0)
    finish(tile, tl.where(window, ordered, 0.0), share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr,
           sq_ptr, hi - lo, N_PAD)  # fmt: skip


@triton.jit(do_not_specialize=["n", "d", "lo", "hi"])
def count_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, n, d, stride_row, stride_col, lo, hi,
                 N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each entry's ranks counted: against every client's value of its column, read one client (row)
    at a time, it tallies the values below it and those equal to it, the equal ones of lower row apart,
    packed in one int32 (below << 20 | equal << 10 | equal of lower row; n < 1024). The entry's value
    holds ranks below .. below + equal - 1, so its share is the window's overlap with them over equal;
    in row order the entry itself has rank below + (equal of lower row), which picks the window's
    values. O(n^2) comparisons a column and no data moved between threads."""
    tile, cols, rows, col_ok, ok, pid = load_tile(x_ptr, n, d, stride_row, stride_col, 0.0, N_PAD, BLOCK)
    code = tl.zeros((BLOCK, N_PAD), dtype=tl.int32)
    row = x_ptr + cols * stride_col
    j = 0
    while j < n:  # (a while loop: Triton's interpreter cannot range over a runtime n)
        v = tl.load(row, mask=col_ok, other=0.0)[:, None]
        code += tl.where(v < tile, 1 << 20, 0)
        code += tl.where(v == tile, tl.where(rows[None, :] > j, 1025, 1024), 0)
        row += stride_row
        j += 1
    below = code >> 20
    equal = (code >> 10) & 1023  # 0 only for NaN (the caller's screening discards such a pass)
    rank = below + (code & 1023)
    held = tl.minimum(below + equal, hi) - tl.maximum(below, lo)
    share = tl.where(held > 0, held.to(tile.dtype) / tl.maximum(equal, 1).to(tile.dtype), 0.0)
    ranked = tl.where(ok & (rank >= lo) & (rank < hi), tile, 0.0)
    finish(tile, ranked, share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr, hi - lo, N_PAD)
