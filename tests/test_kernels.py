"""The shared kernels (chunks, passes, distances, rank windows): chunked paths agree with one-shot ones;
distances stay exact under huge outliers."""

import numpy as np
import pytest
import reference as ref
import torch
from conftest import dtype_tol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_rule_properties import OPTIONS, PERMUTATION_TOL, Benchmark

from fedtrust import Round, available, rule
from fedtrust.aggregators import chunks, order_stats, passes, rank_windows
from fedtrust.aggregators.bulyan import closest_to_median, closest_to_median_by_sort
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.distances import (
    _ill_conditioned,
    pairwise_sq_distances,
    row_gram,
    sq_distances_from_gram,
)
from fedtrust.aggregators.krum import krum_order
from fedtrust.aggregators.passes import CombinationPasses
from fedtrust.aggregators.rank_windows import (
    rank_window,
    rank_window_by_sort,
    window_shares,
    window_slot_sums,
)


@pytest.mark.parametrize("name", available())
def test_chunked_and_unchunked_paths_agree(name, monkeypatch):
    g = torch.Generator().manual_seed(3)
    r = Round(
        updates=torch.randn(11, 37, generator=g, dtype=torch.float64),
        previous=torch.randn(37, dtype=torch.float64),
        metrics={"train_loss": torch.rand(11, generator=g)},
        reference=Benchmark(37),
    )
    whole = rule(name, **OPTIONS.get(name, {}))(r)
    for budget in chunks.BUDGETS:  # every kind of block: 3 columns, the last one short
        monkeypatch.setitem(chunks.BUDGETS, budget, 11 * 8 * 3)
    assert len(column_blocks(r.updates, "stream")) == len(column_blocks(r.updates, "select")) == 13
    chunked = rule(name, **OPTIONS.get(name, {}))(r)
    # blocks change only the rounding of sums; the estimators that climb a flat likelihood on N(0, 1)
    # rounds move with rounding as they do with the clients' order (test_rule_properties)
    tol = dict(rtol=PERMUTATION_TOL[name], atol=PERMUTATION_TOL[name]) if name in PERMUTATION_TOL else {}
    torch.testing.assert_close(chunked.vector, whole.vector, **tol)
    torch.testing.assert_close(chunked.weights, whole.weights, **tol)


@given(
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1.0, 1e3, 1e5, 1e7]),
    shift=st.sampled_from([0.0, 1e4]),
)
def test_float32_distances_match_float64_reference_under_huge_outliers(seed, magnitude, shift):
    """Honest-honest distances stay accurate in float32 even when outliers are 1e7 times further away
    and every vector shares a large common offset (the Gram is re-anchored at a central client)."""
    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(8, 200, generator=g, dtype=torch.float64)
    outliers = magnitude * torch.randn(3, 200, generator=g, dtype=torch.float64)
    x64 = torch.cat([outliers, honest]) + shift
    got, _ = pairwise_sq_distances(x64.float())
    want = torch.as_tensor(ref.sq_dist(x64.float().double().numpy()))
    honest_block = slice(3, 11)
    torch.testing.assert_close(
        got[honest_block, honest_block], want[honest_block, honest_block], rtol=1e-4, atol=1e-3
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * (1 + magnitude))


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(3, 30),
    offset=st.sampled_from([0.0, 0.3, 1.0, 3.0, 30.0]),
    at_the_edge=st.sampled_from([None, 1 - 1e-12, 1.0, 1 + 1e-12]),
)
def test_the_conditioning_test_decides_as_each_points_quantile_does(seed, n, offset, at_the_edge):
    """A round's distances are recomputed about a centre when some point's squared norm exceeds ``limit``
    times the 20% quantile of its distances to the others. The test first compares against each point's
    nearest and furthest distance, between which that quantile lies; it must decide exactly as the
    quantile itself, also for a limit at a point's own ratio (to 1e-12). Ties (copies) included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g, dtype=torch.float64) + offset * torch.randn(
        20, generator=g, dtype=torch.float64
    )
    x[: n // 4] = x[-1]  # copies: zero distances
    gm = x @ x.T
    dist = sq_distances_from_gram(gm)
    off = dist[~torch.eye(n, dtype=torch.bool)].reshape(n, n - 1)
    quantile = torch.quantile(off, 0.2, dim=1)
    limits = [3.0, 10.0, 100.0]
    if at_the_edge is not None:
        ratio = gm.diagonal() / quantile
        limits.append(float(ratio[torch.isfinite(ratio)].max()) * at_the_edge)
    for limit in limits:
        assert _ill_conditioned(gm, dist, limit) == bool((gm.diagonal() > limit * quantile).any())


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 30), neighbours=st.integers(1, 27))
def test_krums_order_is_by_score_then_next_nearest_distances_then_row(seed, n, neighbours):
    """Krum's order: the least score first, ties broken by the next-nearest distance, then the one after,
    ..., then the lower row; the same as stable sorts by each key from the last to the score."""
    neighbours = min(neighbours, n - 2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 3, (n, 4), generator=g).double()  # many exact ties
    dist = sq_distances_from_gram(x @ x.T)
    scores, order = krum_order(dist, neighbours)
    near = dist.masked_fill(torch.eye(n, dtype=torch.bool), torch.inf).sort(1).values[:, : n - 1]
    want = torch.arange(n)
    for key in [*near[:, neighbours:].T.flip(0), near[:, :neighbours].sum(1)]:
        want = want[torch.argsort(key[want], stable=True)]
    assert torch.equal(order, want) and torch.equal(scores, near[:, :neighbours].sum(1))


CONSTANT_FIXTURE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # small_chunks never changes


@CONSTANT_FIXTURE
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 300),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_the_selection_fast_path_agrees_with_sorting(n, d, data, dtype, small_chunks):
    """Introselect on transposed blocks (the CPU path) gives every rank window the sort would."""
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n * 1000 + d), dtype=dtype)
    values, weights, _ = rank_window(x, lo, hi)
    want_values, want_weights = rank_window_by_sort(x, lo, hi)
    torch.testing.assert_close(values, want_values)
    torch.testing.assert_close(weights, want_weights)  # no ties: the same slots


def test_clients_tied_at_the_median_share_its_weight_evenly():
    """Colluders sending one identical vector (as ALIE does) split the median's slots among themselves,
    whatever order they arrive in."""
    honest = torch.tensor([[-2.0, 5.0], [-1.0, 6.0], [3.0, 9.0], [4.0, 10.0]])
    same = torch.tensor([[0.5, 7.0]]).expand(3, 2)
    x = torch.cat([honest, same])
    values, weights, _ = rank_window(x, 3, 4)  # the median of 7
    torch.testing.assert_close(values, torch.tensor([0.5, 7.0]))
    torch.testing.assert_close(weights, torch.tensor([0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3]))
    perm = torch.tensor([4, 0, 5, 1, 2, 6, 3])
    _, permuted, _ = rank_window(x[perm], 3, 4)
    torch.testing.assert_close(permuted, weights[perm])
    # a window whose upper cut falls inside the tied block: ranks 1-3 hold -1 and two of the three 0.5s
    _, cut, _ = rank_window(x, 1, 4)
    torch.testing.assert_close(cut * 3, torch.tensor([0, 1, 0, 0, 2 / 3, 2 / 3, 2 / 3]))
    x2 = torch.tensor([[1.0], [1.0], [1.0], [2.0], [0.0]])
    _, w2, _ = rank_window(x2, 0, 2)  # ranks 0, 1: 0.0 and one of the three 1.0s
    torch.testing.assert_close(w2, torch.tensor([1 / 6, 1 / 6, 1 / 6, 0.0, 0.5]))
    assert x2[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 0.0]  # the input is never reordered in place


def test_rank_window_rejects_an_empty_window():
    with pytest.raises(ValueError, match="need 0 <= lo < hi <= n, got lo=2, hi=2, n=3"):
        rank_window(torch.zeros(3, 4), 2, 2)


@CONSTANT_FIXTURE
@given(theta=st.integers(3, 25), d=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_bulyan_closest_to_median_fast_path_agrees_with_sorting(theta, d, seed, small_chunks):
    from fedtrust.aggregators.rank_windows import map_column_blocks

    g = torch.Generator().manual_seed(seed)
    n = theta + 4
    x = torch.randn(n, d, generator=g)
    selected = torch.randperm(n, generator=g)[:theta].sort().values
    beta = theta - 2 * min(2, (theta - 1) // 2)  # theta - 2f, as Bulyan: no exact tie between two middles
    fast = map_column_blocks(x, lambda b: closest_to_median(b, selected.numpy(), beta))
    slow = closest_to_median_by_sort(x, selected, beta)
    torch.testing.assert_close(fast[0], slow[0])
    torch.testing.assert_close(fast[1], slow[1])


def windows(n):
    if n <= 17:
        return [(lo, hi) for lo in range(n) for hi in range(lo + 1, n + 1)]
    b = n // 5
    return [
        (0, n),
        (0, 1),
        (n - 1, n),
        (n // 2, n // 2 + 1),
        (n // 2 - 1, n // 2 + 1),
        (1, n - 1),
        (b, n - b),
        (3, 7),
    ]


@pytest.mark.skipif(not order_stats.COMPILED, reason="the order-statistics extension is not built")
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 17, 31, 64, 65, 100, order_stats.MAX_CLIENTS])
def test_the_compiled_selection_network_gives_every_window_the_sort_gives(n):
    """The pruned network keeps every rank a window reads, on continuous data and on data full of ties
    (values 0, 1, 2: by the 0-1 principle a comparator network that places ranks right on such inputs
    places them right on all), in a column slice of a wider matrix whose last tile is partial."""
    rng = np.random.default_rng(n)
    wide = rng.standard_normal((n, 64 * 3 + 5 + 40)).astype(np.float32)
    wide[:, 100:] = rng.integers(0, 3, (n, wide.shape[1] - 100))
    block = wide[:, 40:]
    for lo, hi in windows(n):
        values, slots, (ties, low, high) = order_stats.window_block(block, lo, hi)
        t = np.sort(block, axis=0).T
        np.testing.assert_allclose(values, t[:, lo:hi].astype(np.float64).mean(1), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(low, t[ties, lo])
        np.testing.assert_array_equal(high, t[ties, hi - 1])
        tied = ((lo > 0) & (t[:, lo - 1] == t[:, lo])) | ((hi < n) & (t[:, min(hi, n - 1)] == t[:, hi - 1]))
        np.testing.assert_array_equal(ties, np.flatnonzero(tied))
        numpy_path = rank_windows.window_slots(block, rank_windows.sorted_columns(block), lo, hi)
        got = rank_windows._window_block(block, lo, hi)[1]
        np.testing.assert_allclose(got, numpy_path, err_msg=f"window {lo}..{hi}")


def test_the_order_statistics_kernel_is_built_wherever_a_compiler_is():
    """The extension is optional so that fedtrust installs without a C compiler; with one it must build."""
    import shutil

    if shutil.which("cc") or shutil.which("gcc"):
        assert order_stats.COMPILED, (
            "a C compiler is here but fedtrust.aggregators._order_stats is not built or is stale: "
            "reinstall (make test does when order_stats.c changes)"
        )


@pytest.mark.parametrize("n", range(1, rank_windows.NETWORK_MAX_CLIENTS + 1))
def test_sorting_network_sorts_every_zero_one_input(n):
    # the 0-1 principle: a comparator network that sorts all 2^n binary inputs sorts every input
    bits = ((np.arange(2**n)[None, :] >> np.arange(n)[:, None]) & 1).astype(np.float32)
    np.testing.assert_array_equal(rank_windows.sorted_columns(bits).T, np.sort(bits, axis=0))


@pytest.mark.parametrize("n", [3, rank_windows.NETWORK_MAX_CLIENTS, rank_windows.NETWORK_MAX_CLIENTS + 1, 40])
def test_sorted_columns_on_both_paths_leaves_the_input_alone(n):
    x = np.random.default_rng(n).standard_normal((n, 257)).astype(np.float32)
    x[:, :5] = 1.0  # ties
    before = x.copy()
    np.testing.assert_array_equal(rank_windows.sorted_columns(x), np.sort(x, axis=0).T)
    np.testing.assert_array_equal(x, before)


def batched_products(monkeypatch, threads: int = 3) -> None:
    """Make the passes batch their matrix-vector products over ``threads`` blocks even for small ones."""
    monkeypatch.setattr(passes, "ALIGN", 8)
    monkeypatch.setattr(passes, "batch_size", lambda x: threads)


@pytest.mark.parametrize("batched", [False, True], ids=["block by block", "batched"])
@pytest.mark.parametrize("common", [0.0, 1e4], ids=["deltas", "raw parameters"])
@pytest.mark.parametrize(
    "shape", [(9, 1000), (1, 9, 1000), (3, 5, 1000)], ids=["points", "one task", "tasks"]
)
def test_combination_passes_give_exact_distances(common, shape, batched, monkeypatch):
    """The fused pass's expansion ||x||^2 - 2 x.z + ||z||^2 matches explicit float64 differences, also when
    every point shares a large common component (the expansion cancels: those distances are redone), with
    an offset, and with the step from a previous combination; chunked as one shot; with the blocks'
    products one block at a time or batched over the threads (groups of 3 blocks, then the rest)."""
    monkeypatch.setitem(chunks.BUDGETS, "cached", 4 * 3 * 9 * 7)  # several chunks, the last one short
    if batched:
        batched_products(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g) + common
    x[..., 0, :] *= 50  # an outlier
    w = torch.rand(*shape[:-1], generator=g, dtype=torch.float64)
    w /= w.sum(-1, keepdim=True)
    offset = torch.randn(*shape[:-2], shape[-1], generator=g)
    fused = CombinationPasses(x)
    x64 = x.double()
    first, _, _ = fused(w)
    z, sq, step = fused(w, offset=offset, previous=first)
    want = torch.einsum("...jk,...j->...k", x64, w) + offset.double()
    torch.testing.assert_close(z.double(), want, rtol=1e-5, atol=1e-4 * (1 + common))
    torch.testing.assert_close(sq, (x64 - z.double().unsqueeze(-2)).square().sum(-1), rtol=1e-4, atol=1e-3)
    assert step == pytest.approx(float((z.double() - first.double()).norm()), rel=1e-5)
    torch.testing.assert_close(fused.norms(), x64.norm(dim=-1), rtol=1e-6, atol=0)
    _, to_point, _ = fused(None, offset=offset)  # distances to a given point
    torch.testing.assert_close(
        to_point, (x64 - offset.double().unsqueeze(-2)).square().sum(-1), rtol=1e-4, atol=1e-3
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("d", [5, 24, 29, 1000])
def test_the_weighted_sum_covers_every_column_once_however_it_is_cut(threads, d, monkeypatch):
    """One product per thread over aligned runs of columns, the rest in one more: every column summed once,
    to float32 rounding of the float64 sum, whatever the thread count and the width."""
    batched_products(monkeypatch, threads)
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(7, d, generator=g), torch.rand(7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(passes.weighted_sum(x, w).double(), w @ x.double(), rtol=1e-6, atol=1e-6)
    both = torch.stack([w, w.flip(0)])  # several sums at once
    torch.testing.assert_close(passes.weighted_sum(x, both).double(), both @ x.double(), rtol=1e-6, atol=1e-6)


def test_a_rounds_norms_are_taken_once_and_follow_a_selection():
    """The front door's screening takes the updates' norms (float64 sums of chunked float32 norms) once;
    rules reuse them, and a round restricted to some clients has theirs."""
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1)) * 3 + 1
    r = Round(updates=x)
    torch.testing.assert_close(r.norms, x.double().norm(dim=1), rtol=1e-6, atol=0)
    assert r.norms is r.norms
    torch.testing.assert_close(r.select([3, 1]).norms, r.norms[[3, 1]])


def test_the_passes_that_screen_hand_over_each_rows_norm(monkeypatch):
    """Every pass a rule screens in (fused steps, the Gram matrix, the order-statistics blocks) hands
    over float64 norms of the rows; a block map stops at the first block with a non-finite row."""
    monkeypatch.setitem(chunks.BUDGETS, "select", 15 * 4 * 64)  # blocks of 64 columns
    x = torch.randn(15, 1000, generator=torch.Generator().manual_seed(3)) * 3 + 1
    exact = x.double().norm(dim=1)
    fused = CombinationPasses(x)
    fused(torch.full((15,), 1 / 15, dtype=torch.float64))
    got = [
        rank_window(x, 3, 12)[2],
        pairwise_sq_distances(x)[1],
        fused.norms(),  # taken by the fused pass, not by a pass of their own
        CombinationPasses(x).norms(),
    ]
    for norms in got:
        torch.testing.assert_close(norms, exact, rtol=1e-6, atol=0)

    bad = x.clone()
    bad[4, 70] = float("nan")  # in the second of 16 blocks
    blocks = []
    window = rank_windows._window_block
    monkeypatch.setattr(
        rank_windows, "_window_block", lambda b, lo, hi: blocks.append(1) or window(b, lo, hi)
    )
    norms = rank_window(bad, 3, 12)[2]
    assert torch.isnan(norms[4]) and torch.isfinite(norms[[0, 1, 2, 3, 5]]).all()
    assert len(blocks) < 16


@pytest.mark.parametrize("shape", [(10, 5000), (10, 4096), (3, 3000), (1, 12, 2500), (40, 3000), (10, 100)])
def test_row_gram_is_the_gram_matrix_however_it_is_split(shape):
    """Few rows: a batch of block products summed; many rows or short ones: one product. Both are
    r r^T to float32 rounding."""
    r = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    exact = r.double() @ r.double().transpose(-1, -2)
    got = row_gram(r)
    assert got.shape == exact.shape
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("window", [(3, 4), (1, 4), (0, 2), (2, 5), (0, 7)])
def test_the_torch_path_shares_ties_as_the_cpu_path_does(window):
    """One tie rule on every path: the sort-based path (every non-CPU device) gives tied clients the
    same shares as the compiled and numpy CPU paths, on columns full of ties."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-2, 3, (7, 500), generator=g).float()  # five values over seven clients: ties everywhere
    x[5] = x[2]  # and a copy
    lo, hi = window
    values, weights, _ = rank_window(x, lo, hi)
    by_sort = rank_window_by_sort(x, lo, hi)
    torch.testing.assert_close(by_sort[0], values)
    torch.testing.assert_close(by_sort[1], weights)
    assert by_sort[1][5] == by_sort[1][2]
    honest = torch.tensor([[-2.0, 5.0], [-1.0, 6.0], [3.0, 9.0], [4.0, 10.0]])
    tied = torch.cat([honest, torch.tensor([[0.5, 7.0]]).expand(3, 2)])
    torch.testing.assert_close(
        rank_window_by_sort(tied, 3, 4)[1], torch.tensor([0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3])
    )


@given(
    n=st.integers(1, 12),
    c=st.integers(1, 60),
    values=st.integers(1, 6),
    per_row=st.booleans(),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_the_torch_paths_slot_count_is_the_tie_rules_sum(n, c, values, per_row, data, dtype):
    """The device paths count slots in a few boolean passes and share only the rows a tie crosses an edge
    of: the same slots as sharing every entry (window_shares), windows per row or one for all."""
    g = torch.Generator().manual_seed(n * 7919 + c * 31 + values)
    t = torch.randint(0, values, (c, n), generator=g).to(dtype)  # few distinct values: ties cross edges
    ordered = t.sort(dim=1).values
    if per_row:
        width = data.draw(st.integers(1, n))
        lo = torch.randint(0, n - width + 1, (c, 1), generator=g)
        lo_hi = (lo, lo + width)
    else:
        lo = data.draw(st.integers(0, n - 1))
        lo_hi = (lo, data.draw(st.integers(lo + 1, n)))
    want = window_shares(t, ordered, *lo_hi).sum(0)
    torch.testing.assert_close(window_slot_sums(t, ordered, *lo_hi), want, rtol=1e-12, atol=1e-12)


def test_bulyans_torch_path_shares_ties_as_the_cpu_path_does():
    """Bulyan's second phase on the torch path (every non-CPU device) picks the same window and shares
    tied slots the same way as the CPU path, on columns full of ties."""
    from fedtrust.aggregators.rank_windows import map_column_blocks

    g = torch.Generator().manual_seed(6)
    x = torch.randint(-2, 3, (11, 400), generator=g).float()
    x[7] = x[3]
    selected = torch.tensor([0, 1, 2, 3, 4, 5, 7, 9, 10])
    cpu = map_column_blocks(x, lambda b: closest_to_median(b, selected.numpy(), 5))
    torch_path = closest_to_median_by_sort(x, selected, 5)
    torch.testing.assert_close(torch_path[0], cpu[0])
    torch.testing.assert_close(torch_path[1], cpu[1])
    assert torch_path[1][7] == torch_path[1][3]


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "mean", "fedavg", "geometric_median"])
def test_a_rule_gives_the_same_result_on_one_thread_and_on_two(name):
    """The order statistics' thread pool and the passes' batched products (one batch a thread) on two
    threads give one thread's aggregate and weights: the pool's blocks and the batch's columns are each
    computed as one thread computes them. (``make test`` runs one torch thread per worker on 2 cores,
    so these paths run here, with the pool made again for the thread count.) The means and order
    statistics agree exactly. The geometric median's distances also take the products of a block left
    outside a batch (here the third of three), which the BLAS runs itself: MKL on an Intel AVX-512 CPU
    splits such a long dot product between two threads (from about 4,096 columns at 10 clients), so
    they round differently, and the median agrees to its stopping tolerance (a distance of 520.2260 on
    one thread was 520.2259 on two)."""
    g = torch.Generator().manual_seed(5)
    r = Round(updates=torch.randn(10, 300_000, generator=g), num_samples=torch.arange(1.0, 11.0))

    def on(threads: int):
        before = torch.get_num_threads()
        rank_windows._pool.cache_clear()
        torch.set_num_threads(threads)
        try:
            assert passes.batch_size(r.updates) == threads
            return rule(name)(r)
        finally:
            torch.set_num_threads(before)
            rank_windows._pool.cache_clear()

    one, two = on(1), on(2)
    assert len(column_blocks(r.updates, "select")) > 2
    if name == "geometric_median":
        torch.testing.assert_close(two.weights, one.weights, **dtype_tol(torch.float32))
        torch.testing.assert_close(two.vector, one.vector, **dtype_tol(torch.float32))
    else:
        assert torch.equal(one.vector, two.vector) and torch.equal(one.weights, two.weights)
