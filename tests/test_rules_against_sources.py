"""Each classical rule on small hand-computed cases, and against a plain reference on random inputs."""

import math

import numpy as np
import pytest
import reference as ref
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedtrust import Round, rule


def col(*values):
    """A round of 1-D updates, one client per value."""
    return Round(updates=torch.tensor(values, dtype=torch.float64)[:, None])


def random_updates(seed, n, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype)


# ---------------------------------------------------------------- hand-computed cases


def test_mean_and_fedavg_by_hand():
    r = Round(updates=torch.tensor([[0.0, 2.0], [4.0, 6.0]]), num_samples=[1, 3])
    assert rule("mean")(r).vector.tolist() == [2.0, 4.0]
    out = rule("fedavg")(r)
    assert out.vector.tolist() == [3.0, 5.0]
    assert out.weights.tolist() == [0.25, 0.75]


def test_median_by_hand_odd_and_even():
    out = rule("median")(col(1.0, 2.0, 10.0))
    assert out.vector.item() == 2.0 and out.weights.tolist() == [0.0, 1.0, 0.0]
    out = rule("median")(col(1.0, 2.0, 3.0, 10.0))
    assert out.vector.item() == 2.5 and out.weights.tolist() == [0.0, 0.5, 0.5, 0.0]


def test_trimmed_mean_by_hand():
    out = rule("trimmed_mean", f=1)(col(1.0, 2.0, 3.0, 100.0))
    assert out.vector.item() == 2.5
    assert out.weights.tolist() == [0.0, 0.5, 0.5, 0.0]


def test_krum_and_multi_krum_by_hand():
    # 1-D points 0, 1, 3, 10 with f = 0: each point scores its n - f - 2 = 2 nearest squared distances:
    # 0 -> 1 + 9 = 10, 1 -> 1 + 4 = 5, 3 -> 4 + 9 = 13, 10 -> 49 + 81 = 130.
    out = rule("krum", f=0)(col(0.0, 1.0, 3.0, 10.0))
    assert out.vector.item() == 1.0
    assert out.info["clients"]["score"].tolist() == [10.0, 5.0, 13.0, 130.0]
    assert out.weights.tolist() == [0.0, 1.0, 0.0, 0.0]
    out = rule("multi_krum", f=0, m=2)(col(0.0, 1.0, 3.0, 10.0))
    assert out.vector.item() == 0.5 and out.weights.tolist() == [0.5, 0.5, 0.0, 0.0]


def test_bulyan_by_hand():
    # n = 7, f = 1 -> theta = 5, beta = 3. Recursive Krum on 0..5 and 1000 (k = max(1, r - f - 2)
    # neighbours; ties go to the point whose farther distances are smaller):
    #   r=7, k=4: 2 and 3 tie at 10, 3 is nearer 1000 -> 3;   r=6, k=3: 2 scores 9 -> 2;
    #   r=5, k=2: 1 and 4 tie at 10 -> 4;   r=4, k=1: 0 and 1 tie at 1, 1 is nearer 5 -> 1;
    #   r=3, k=1: 0 and 5 tie at 25 -> 5.   Selected {1, 2, 3, 4, 5}, median 3,
    # the 3 values closest to it are 2, 3, 4 -> 3.
    out = rule("bulyan", f=1)(col(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1000.0))
    assert out.vector.item() == 3.0
    assert out.info["selected"] == [1, 2, 3, 4, 5]
    assert out.weights.tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 1 / 3, 0, 0])


def test_geometric_median_of_equilateral_triangle_is_its_centroid():
    h = math.sqrt(3) / 2
    r = Round(updates=torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, h]], dtype=torch.float64))
    out = rule("geometric_median", tol=1e-12)(r)
    assert out.vector.tolist() == pytest.approx([0.5, h / 3], abs=1e-9)
    assert out.weights.tolist() == pytest.approx([1 / 3] * 3, abs=1e-9)


def test_geometric_median_of_collinear_points_is_the_middle_point():
    out = rule("geometric_median", nu=1e-9, max_iter=1000, tol=1e-14)(col(0.0, 1.0, 10.0))
    assert out.vector.item() == pytest.approx(1.0, abs=1e-6)
    assert out.weights[1] > 0.99


def test_centered_clipping_by_hand():
    # tau = 1, centre 0: distances 3 and 0.5 -> clip factors 1/3 and 1 -> v = ((1, 0) + (0, 0.5)) / 2.
    r = Round(updates=torch.tensor([[3.0, 0.0], [0.0, 0.5]], dtype=torch.float64))
    out = rule("centered_clipping", tau=1.0)(r)
    assert out.vector.tolist() == pytest.approx([0.5, 0.25])
    assert out.info["center_weight"] == pytest.approx(1 - (1 / 3 + 1) / 2)
    assert out.weights.tolist() == pytest.approx([0.25, 0.75])


def test_cfl_excludes_the_smaller_dissimilar_cluster():
    prev = torch.tensor([1.0, 1.0], dtype=torch.float64)
    deltas = torch.tensor(
        [[1.0, 0.1], [1.0, -0.1], [0.9, 0.0], [-1.0, 0.05], [-1.0, -0.05]], dtype=torch.float64
    )
    r = Round(updates=prev + deltas, client_ids=list("abcde"), num_samples=[1, 1, 2, 5, 5], previous=prev)
    out = rule("cfl")(r)
    assert out.info["split"] and sorted(out.info["excluded_now"]) == ["d", "e"]
    assert out.weights.tolist() == pytest.approx([0.25, 0.25, 0.5, 0, 0])
    assert out.vector.tolist() == pytest.approx(
        (prev + (deltas[:3] * torch.tensor([[1.0], [1.0], [2.0]])).sum(0) / 4).tolist()
    )


# ---------------------------------------------------------------- against the references on random inputs

seeds = st.integers(0, 2**31 - 1)


@given(seeds, st.integers(1, 12), st.integers(1, 30))
def test_median_matches_reference(seed, n, d):
    x = random_updates(seed, n, d)
    out = rule("median")(Round(updates=x))
    np.testing.assert_allclose(out.vector.numpy(), ref.median(x.numpy()), rtol=1e-12)


@given(seeds, st.integers(1, 12), st.integers(1, 30), st.integers(0, 5))
def test_trimmed_mean_matches_reference(seed, n, d, b):
    b = min(b, (n - 1) // 2)
    x = random_updates(seed, n, d)
    out = rule("trimmed_mean", f=b)(Round(updates=x))
    np.testing.assert_allclose(out.vector.numpy(), ref.trimmed_mean(x.numpy(), b), rtol=1e-10, atol=1e-12)


@given(seeds, st.integers(3, 14), st.integers(1, 20), st.integers(0, 5))
def test_krum_and_multi_krum_match_reference(seed, n, d, f):
    f = min(f, (n - 3) // 2)
    x = random_updates(seed, n, d)
    r = Round(updates=x)
    np.testing.assert_allclose(rule("krum", f=f)(r).vector.numpy(), ref.krum(x.numpy(), f))
    np.testing.assert_allclose(
        rule("krum", f=f)(r).info["clients"]["score"].numpy(), ref.krum_scores(x.numpy(), f), rtol=1e-9
    )
    m = max(1, n - f)
    np.testing.assert_allclose(
        rule("multi_krum", f=f)(r).vector.numpy(), ref.multi_krum(x.numpy(), f, m), rtol=1e-10, atol=1e-12
    )


@given(seeds, st.integers(3, 15), st.integers(1, 12), st.integers(0, 3))
def test_bulyan_matches_reference(seed, n, d, f):
    f = min(f, (n - 3) // 4)
    x = random_updates(seed, n, d)
    out = rule("bulyan", f=f)(Round(updates=x))
    np.testing.assert_allclose(out.vector.numpy(), ref.bulyan(x.numpy(), f), rtol=1e-10, atol=1e-12)


@given(seeds, st.integers(2, 12), st.integers(2, 20), st.booleans())
def test_geometric_median_matches_reference(seed, n, d, weighted):
    x = random_updates(seed, n, d)
    counts = torch.arange(1, n + 1, dtype=torch.float64)
    out = rule("geometric_median", weighted=weighted, nu=1e-12, max_iter=2000, tol=1e-15)(
        Round(updates=x, num_samples=counts)
    )
    expected = ref.geometric_median(x.numpy(), counts.numpy() if weighted else None)
    np.testing.assert_allclose(out.vector.numpy(), expected, atol=1e-6)
    assert out.info["converged"]


@given(seeds, st.integers(1, 10), st.integers(1, 10), st.floats(0.05, 5.0), st.integers(1, 4))
def test_centered_clipping_matches_reference_over_rounds(seed, n, d, tau, iters):
    cc = rule("centered_clipping", tau=tau, n_iter=iters)
    v = np.zeros(d)
    for t in range(3):
        x = random_updates(seed + t, n, d) * 3 + 1
        out = cc(Round(updates=x))
        old, v = v, ref.centered_clipping(x.numpy(), v, tau, iters)
        np.testing.assert_allclose(out.vector.numpy(), v, rtol=1e-9, atol=1e-12)
        # the vector is the reported mixture: center_weight on the old centre, the rest on the clients
        assert out.weights.sum().item() == pytest.approx(1.0)
        keep = out.info["center_weight"]
        mixture = keep * old + (1 - keep) * (out.weights.numpy() @ x.numpy())
        np.testing.assert_allclose(out.vector.numpy(), mixture, rtol=1e-9, atol=1e-9 * (1 + np.abs(v).max()))


@given(seeds, st.integers(3, 9), st.integers(2, 8))
def test_cfl_bipartition_is_the_min_max_one(seed, n, d):
    from fedtrust.aggregators.cfl import optimal_bipartition

    x = random_updates(seed, n, d)
    u = x / x.norm(dim=1, keepdim=True)
    sim = u @ u.T
    side, cross = optimal_bipartition(sim)
    best_cross, _ = ref.min_max_bipartition(sim.numpy())
    assert cross == pytest.approx(best_cross, abs=1e-12)
    a = torch.nonzero(side).flatten()
    b = torch.nonzero(~side).flatten()
    assert 0 < len(a) < n
    assert sim[a][:, b].max().item() == pytest.approx(cross, abs=1e-12)


def krum_again_and_again(sq_dist, f, count):
    """Bulyan's first phase as the paper states it: Krum's best point on the points left, count times."""
    from fedtrust.aggregators.krum import krum_order

    left, chosen = list(range(len(sq_dist))), []
    while len(chosen) < count:
        idx = torch.as_tensor(left)
        _, order = krum_order(sq_dist[idx][:, idx], max(1, len(left) - f - 2))
        chosen.append(left.pop(int(order[0])))
    return chosen


@pytest.mark.parametrize("seed", range(60))
def test_recursive_krum_is_krum_applied_again_and_again(seed):
    """The sort-once selection picks what repeated Krum picks, ties and all: copies and rounded values tie
    exactly, and a NaN or an infinite distance counts as the largest, as in Krum's order."""
    from fedtrust.aggregators.bulyan import recursive_krum
    from fedtrust.aggregators.distances import pairwise_sq_distances
    from fedtrust.aggregators.krum import krum_first, krum_order

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 40, (1,), generator=g))
    f = int(torch.randint(0, n // 2, (1,), generator=g))
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    if seed % 2:  # copies
        x = x[torch.randint(0, max(1, n // 3), (n,), generator=g)]
    sq, _ = pairwise_sq_distances(x.round(decimals=seed % 3))
    if seed % 5 == 0:  # one client's distances all NaN: its score is NaN
        sq[0, :] = sq[:, 0] = float("nan")
    if seed % 5 == 1:
        sq[0, 1] = sq[1, 0] = float("nan")
    if seed % 7 == 0:
        sq[2, :] = sq[:, 2] = float("inf")
    count = int(torch.randint(1, n + 1, (1,), generator=g))
    assert recursive_krum(sq, f, count) == krum_again_and_again(sq, f, count)
    neighbours = max(1, n - f - 2)
    assert krum_first(sq, neighbours) == int(krum_order(sq, neighbours)[1][0])
