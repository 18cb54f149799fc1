"""The Triton kernels of :mod:`~fedtrust.aggregators.triton_windows` (imported only where Triton is).

Per column of an (n, d) matrix x, ``sort_kernel``, ``count_kernel`` and ``select_kernel`` find the
mean of the values of ranks lo..hi-1 and each entry's share of the window's slots, with the tie rule
of :func:`~fedtrust.aggregators.rank_windows.window_shares`: a value held by c entries of the column, k
of whose ranks the window keeps, gives each of those entries k / c (1 for a value inside the window
held once, 0 outside). Per program (a tile of BLOCK columns) they store each client's sum of shares and
sum of squares, summed over the programs by the caller. ``closest_kernel`` is Bulyan's second phase: per
column a window of ranks of its own, chosen as the CPU path chooses it. Rows are padded to N_PAD, a
power of two.
"""

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # an optional dependency: triton_windows falls back to torch without it
    raise ImportError("fedtrust's rank-window kernels need Triton (torch's CUDA builds ship it)") from exc


@triton.jit
def finish(tile, total, share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr, count,
           N_PAD: tl.constexpr):  # fmt: skip
    """Store a tile's window means (``total``: per column the sum of its values of ranks lo..hi-1) and
    per client the program's sum of slot shares and of squares."""
    tl.store(out_ptr + cols, total / count, mask=col_ok)
    at = parts_ptr + pid.to(tl.int64) * N_PAD + rows
    tl.store(at, tl.sum(tl.where(ok, share, 0.0), axis=0))
    tl.store(sq_ptr + pid.to(tl.int64) * N_PAD + rows, tl.sum(tl.where(ok, tile * tile, 0.0), axis=0))


@triton.jit
def load_tile(x_ptr, sel_ptr, n, d, stride_row, stride_col, pad, INDEXED: tl.constexpr, N_PAD: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
    """The program's (BLOCK, N_PAD) tile of x's columns (``pad`` outside x), its columns, rows and masks.
    With ``INDEXED`` the tile's n rows are x's rows ``sel[0..n-1]`` (an int64 index), else its first n."""
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.arange(0, N_PAD)
    col_ok = cols < d
    ok = col_ok[:, None] & (rows < n)[None, :]
    if INDEXED:
        source = tl.load(sel_ptr + rows, mask=rows < n, other=0)
    else:
        source = rows.to(tl.int64)
    offsets = cols[:, None] * stride_col + source[None, :] * stride_row
    return tl.load(x_ptr + offsets, mask=ok, other=pad), cols, rows, col_ok, ok, pid


@triton.jit
def part(held, copies, like):
    """held / copies in ``like``'s float type (copies >= 1)."""
    return held.to(like.dtype) / tl.maximum(copies, 1).to(like.dtype)


@triton.jit
def tally(x_ptr, sel_ptr, tile, cols, col_ok, rows, n, stride_row, stride_col, INDEXED: tl.constexpr,
          N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each entry's tallies against every row of its column, read one row at a time: the values below it
    and those equal to it, the equal ones of lower row apart, packed in one int32 (below << 20 |
    equal << 10 | equal of lower row; n < 1024). Returns (below, equal, rank): the entry's value holds
    ranks below .. below + equal - 1, and in row order the entry itself has rank below + (equal of lower
    row). ``equal`` is 0 only for NaN (the caller's screening discards such a pass)."""
    code = tl.zeros((BLOCK, N_PAD), dtype=tl.int32)
    row = x_ptr + cols * stride_col
    j = 0
    while j < n:  # (a while loop: Triton's interpreter cannot range over a runtime n)
        if INDEXED:  # (int64 offsets: the index is int64, the pointer steps 64-bit)
            v = tl.load(row + tl.load(sel_ptr + j) * stride_row, mask=col_ok, other=0.0)[:, None]
        else:
            v = tl.load(row, mask=col_ok, other=0.0)[:, None]
            row += stride_row
        code += tl.where(v < tile, 1 << 20, 0)
        code += tl.where(v == tile, tl.where(rows[None, :] > j, 1025, 1024), 0)
        j += 1
    below = code >> 20
    return below, (code >> 10) & 1023, below + (code & 1023)


@triton.jit(do_not_specialize=["n", "d", "lo", "hi"])  # one build per tile shape and dtype
def sort_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, n, d, stride_row, stride_col, lo, hi,
                N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each column sorted in registers (a bitonic network over N_PAD values). The window's edge values
    low and high: an entry strictly between them has share 1, one equal to an edge value k / c, with k
    the window's ranks holding that value and c the column's entries equal to it."""
    inf = float("inf")  # the padding: sorts last
    tile, cols, rows, col_ok, ok, pid = load_tile(x_ptr, x_ptr, n, d, stride_row, stride_col, inf, False,
                                                  N_PAD, BLOCK)  # fmt: skip
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
    total = tl.sum(tl.where(window, ordered, 0.0), axis=1)
    finish(tile, total, share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr, hi - lo, N_PAD)


@triton.jit(do_not_specialize=["n", "d", "lo", "hi"])
def count_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, n, d, stride_row, stride_col, lo, hi,
                 N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Each entry's ranks counted (:func:`tally`): its share is the window's overlap with its value's
    ranks over their number, and its own rank picks the window's values. O(n^2) comparisons a column and
    no data moved between threads."""
    tile, cols, rows, col_ok, ok, pid = load_tile(x_ptr, x_ptr, n, d, stride_row, stride_col, 0.0, False,
                                                  N_PAD, BLOCK)  # fmt: skip
    below, equal, rank = tally(x_ptr, x_ptr, tile, cols, col_ok, rows, n, stride_row, stride_col, False,
                               N_PAD, BLOCK)  # fmt: skip
    held = tl.minimum(below + equal, hi) - tl.maximum(below, lo)
    share = tl.where(held > 0, part(held, equal, tile), 0.0)
    ranked = tl.where(ok & (rank >= lo) & (rank < hi), tile, 0.0)
    total = tl.sum(ranked, axis=1)
    finish(tile, total, share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr, hi - lo, N_PAD)


@triton.jit
def bits_of(like, ones):
    """An unsigned integer tensor of ``like``'s shape and type, with its highest bit set or (``ones``)
    every bit."""
    width: tl.constexpr = like.dtype.primitive_bitwidth
    return (like & 0) | ((1 << width) - 1 if ones else 1 << (width - 1))


@triton.jit
def ordered_keys(tile, ok):
    """Each value as an unsigned integer of its width, ordered as the values are (a non-negative value's
    sign bit set, every bit of a negative one flipped; -0.0 taken as +0.0, one value as a comparison has
    them); the padding (not ``ok``) the largest key."""
    tile = tl.where(tile == 0, 0.0, tile)
    if tile.dtype == tl.float64:
        bits = tile.to(tl.uint64, bitcast=True)
    else:
        bits = tile.to(tl.uint32, bitcast=True)
    top, ones = bits_of(bits, False), bits_of(bits, True)
    return tl.where(ok, tl.where((bits & top) != 0, bits ^ ones, bits | top), ones)


@triton.jit
def key_value(key, like):
    """The values (``like``'s float type) of keys of :func:`ordered_keys`."""
    top = bits_of(key, False)
    return tl.where((key & top) != 0, key ^ top, key ^ bits_of(key, True)).to(like.dtype, bitcast=True)


@triton.jit
def spread(col_ok, below, upper, below2, upper2, TWO: tl.constexpr):
    """The most keys any column's undecided range still holds (1 for a column outside x)."""
    keys = upper - below
    if TWO:
        keys = tl.maximum(keys, upper2 - below2)
    return tl.max(tl.where(col_ok, keys, 1), axis=0)


@triton.jit
def descend(keys, col_ok, r, r2, TWO: tl.constexpr):
    """Per column of ``keys`` (BLOCK, N_PAD) the key of rank ``r`` and the count of keys below it (with
    ``TWO`` the same for rank ``r2`` too, its counts packed beside the first's): the largest key K with
    at most r keys below K, its bits fixed from the highest down, one count of the column's keys per bit
    (the count the only data moved between a column's entries).

    The bits fixed so far leave a range of keys [prefix, prefix + 2^b) that holds the key of rank r:
    ``below`` keys lie under it and ``upper`` under its end. Once every column's range holds a single
    key (below + 1 = upper), that key is the one of rank r whatever the bits left: the descent stops
    there and takes it as the least key at or above ``prefix``. Distinct values part after a few bits
    more than log2(n) (about 16 of float32's 32 for 100 randn values, the program's slowest column);
    copies of one value never part, and their column runs every bit, as without the stop."""
    prefix = tl.zeros([keys.shape[0]], dtype=keys.dtype)
    below = tl.zeros([keys.shape[0]], dtype=tl.int32)
    upper = below + keys.shape[1]  # every key, the padding's included, lies under the whole range's end
    prefix2, below2, upper2 = prefix, below, upper
    bit = bits_of(prefix, False)
    left = keys.dtype.primitive_bitwidth
    wide = spread(col_ok, below, upper, below2, upper2, TWO)
    while (wide > 1) & (left > 0):
        candidate, candidate2 = prefix | bit, prefix2 | bit
        tallies = (keys < candidate[:, None]).to(tl.int32)
        if TWO:  # (N_PAD < 2^15: the two counts share an int32)
            tallies += (keys < candidate2[:, None]).to(tl.int32) << 16
        packed = tl.sum(tallies, axis=1)
        count, count2 = packed & 0xFFFF, packed >> 16
        prefix, below, upper = (
            tl.where(count <= r, candidate, prefix),
            tl.where(count <= r, count, below),
            tl.where(count <= r, upper, count),
        )
        if TWO:
            prefix2, below2, upper2 = (
                tl.where(count2 <= r2, candidate2, prefix2),
                tl.where(count2 <= r2, count2, below2),
                tl.where(count2 <= r2, upper2, count2),
            )
        bit = bit >> 1
        left -= 1
        wide = spread(col_ok, below, upper, below2, upper2, TWO)
    ones = bits_of(keys, True)
    prefix = tl.min(tl.where(keys >= prefix[:, None], keys, ones), axis=1)
    if TWO:
        prefix2 = tl.min(tl.where(keys >= prefix2[:, None], keys, ones), axis=1)
    return prefix, below, prefix2, below2


@triton.jit(do_not_specialize=["n", "d", "stride_col", "lo", "hi"])
def select_kernel(x_ptr, out_ptr, parts_ptr, sq_ptr, n, d, stride_row, stride_col, lo, hi,
                  N_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The window's edge values selected by their bits (:func:`descend`: the key of rank lo, then of rank
    hi - 1 unless the window's one or two values follow from it), then each entry's share from the
    counts below and at most each edge value: O(n) comparisons a bit of the values' width, against the
    count kernel's n^2."""
    tile, cols, rows, col_ok, ok, pid = load_tile(x_ptr, x_ptr, n, d, stride_row, stride_col, 0.0, False,
                                                  N_PAD, BLOCK)  # fmt: skip
    keys = ordered_keys(tile, ok)
    if hi - lo <= 2:  # the key of rank lo, and the next key unless low's copies hold rank hi - 1 too
        low, below_low, _, _ = descend(keys, col_ok, lo, lo, False)
        upto_low = tl.sum((keys <= low[:, None]).to(tl.int32), axis=1)
        beyond = tl.min(tl.where(keys > low[:, None], keys, bits_of(keys, True)), axis=1)
        high = tl.where(upto_low >= hi, low, beyond)
        below_high = upto_low  # (read only where high is the next key)
    else:
        low, below_low, high, below_high = descend(keys, col_ok, lo, hi - 1, True)
        upto_low = tl.sum((keys <= low[:, None]).to(tl.int32), axis=1)
    upto_high = tl.sum((keys <= high[:, None]).to(tl.int32), axis=1)
    held_low = tl.minimum(upto_low, hi) - tl.maximum(below_low, lo)  # the window's ranks holding low
    held_high = tl.where(high != low, tl.minimum(upto_high, hi) - tl.maximum(below_high, lo), 0)
    inside = (keys > low[:, None]) & (keys < high[:, None])
    low_value, high_value = key_value(low, tile), key_value(high, tile)
    share = inside.to(tile.dtype)
    share += tl.where(keys == low[:, None], part(held_low, upto_low - below_low, tile)[:, None], 0.0)
    share += tl.where(keys == high[:, None], part(held_high, upto_high - below_high, tile)[:, None], 0.0)
    total = tl.sum(tl.where(inside, tile, 0.0), axis=1) + held_low.to(tile.dtype) * low_value
    total += tl.where(high != low, held_high.to(tile.dtype) * high_value, 0.0)  # (0 * inf would be NaN)
    finish(tile, total, share, ok, col_ok, cols, rows, pid, out_ptr, parts_ptr, sq_ptr, hi - lo, N_PAD)


@triton.jit
def at_rank(values, rank, r):
    """(BLOCK,) each column's entry of ``values`` at rank ``r`` (rank: the row index for a history tile):
    a sum of one entry and zeros, so exact (a -0.0 reads as +0.0)."""
    return tl.sum(tl.where(rank == r, values, 0.0), axis=1)


@triton.jit(do_not_specialize=["n", "d", "beta", "mlo", "mhi"])
def closest_kernel(x_ptr, sel_ptr, out_ptr, parts_ptr, n, d, stride_row, stride_col, beta, mlo, mhi,
                   N_PAD: tl.constexpr, M_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Bulyan's second phase on the n rows ``sel`` of x: per column the mean of the ``beta`` values closest
    to their median (ranks mlo..mhi-1), each entry's share of that window (the tie rule above), with the
    CPU path's float64 arithmetic in its order (:func:`~fedtrust.aggregators.bulyan.closest_to_median`):
    the median, running sums over the ranks of |value - median| and of the values (M_PAD >= n + 1 of
    them kept), the first window of beta ranks with the least distance, its mean from the running sums."""
    tile, cols, rows, col_ok, ok, pid = load_tile(x_ptr, sel_ptr, n, d, stride_row, stride_col, 0.0, True,
                                                  N_PAD, BLOCK)  # fmt: skip
    below, equal, rank = tally(x_ptr, sel_ptr, tile, cols, col_ok, rows, n, stride_row, stride_col, True,
                               N_PAD, BLOCK)  # fmt: skip
    rank = tl.where(ok, rank, -1)  # padding holds no rank
    wide = tile.to(tl.float64)
    low = at_rank(wide, rank, mlo)
    median = tl.where(mhi - mlo == 2, (low + at_rank(wide, rank, mhi - 1)) / 2.0, low)
    steps = tl.arange(0, M_PAD)[None, :]
    distances = tl.zeros((BLOCK, M_PAD), dtype=tl.float64)  # [r]: sum over ranks < r of |value - median|
    totals = tl.zeros((BLOCK, M_PAD), dtype=tl.float64)  # [r]: sum over ranks < r of the values
    distance = tl.zeros((BLOCK,), dtype=tl.float64)
    total = tl.zeros((BLOCK,), dtype=tl.float64)
    r = 0
    while r < n:
        value = at_rank(wide, rank, r)
        distance += tl.abs(value - median)
        total += value
        distances = tl.where(steps == r + 1, distance[:, None], distances)
        totals = tl.where(steps == r + 1, total[:, None], totals)
        r += 1
    best = tl.full((BLOCK,), float("inf"), dtype=tl.float64)
    start = tl.zeros((BLOCK,), dtype=tl.int32)
    s = 0
    while s <= n - beta:  # the first window of least distance, as numpy's argmin
        cost = at_rank(distances, steps, s + beta) - at_rank(distances, steps, s)
        better = cost < best
        best = tl.where(better, cost, best)
        start = tl.where(better, s, start)
        s += 1
    lo = start[:, None]
    mean = (at_rank(totals, steps, lo + beta) - at_rank(totals, steps, lo)) / beta
    tl.store(out_ptr + cols, mean.to(out_ptr.dtype.element_ty), mask=col_ok)
    held = tl.minimum(below + equal, lo + beta) - tl.maximum(below, lo)
    share = tl.where(ok & (held > 0), part(held, equal, wide), 0.0)
    tl.store(parts_ptr + pid.to(tl.int64) * N_PAD + rows, tl.sum(share, axis=0))
