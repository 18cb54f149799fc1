"""weighting="screen": the IVAR/ICOV fit drops a minority of clients far from its consensus and every
other source gets one equal vote (fedtrust.inference.screen)."""

import pytest
import torch

from fedtrust import Round, rule
from fedtrust.aggregators.distances import gram
from fedtrust.inference.screen import (
    APART_RATIO,
    drop_followers,
    observed_spread,
    spread_screen,
    standing_apart,
    two_sample,
)

TRUST = ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"]


def log_spread(*parts):
    """Spreads whose logs are the given (mean, sd, count) normal samples, drawn with a fixed seed."""
    g = torch.Generator().manual_seed(0)
    return torch.cat([(m + s * torch.randn(k, generator=g, dtype=torch.float64)).exp() for m, s, k in parts])


def test_a_tight_minority_of_high_spread_is_dropped_and_nothing_else():
    # Fang's attack at 40% on digits (seed 0) looks like this (IVAR-MLE's noise, which the spread
    # tracks): 30 honest clients' log noise with sd
    # about 0.75, the 20 attackers' within 0.1 of each other, about 1.95 (2.6 honest sd) above the
    # honest median
    spread = log_spread((0.0, 0.75, 30), (1.95, 0.03, 20))
    keep, found = spread_screen(spread, torch.ones(50))
    assert found["split"] and found["bic_gain"] >= 6
    assert keep[:30].all() and not keep[30:].any()


def test_one_population_of_honest_clients_is_kept_whole():
    for seed_sd in (0.3, 0.5, 1.0):
        keep, found = spread_screen(log_spread((0.0, seed_sd, 50)), torch.ones(50))
        assert keep.all() and not found["split"], seed_sd


def test_a_high_spread_majority_is_never_dropped():
    """The honest-majority assumption: the screen drops fewer than half of the round's clients, counting
    each group's members (one group of 30 copies outweighs 20 singletons)."""
    spread = log_spread((0.0, 0.5, 20), (2.0, 0.05, 30))
    assert spread_screen(spread, torch.ones(50))[0].all()
    groups = torch.cat([log_spread((0.0, 0.5, 20)), torch.tensor([7.4])])  # 30 copies in the last group
    assert spread_screen(groups, torch.cat([torch.ones(20), torch.tensor([30.0])]))[0].all()
    assert spread_screen(torch.tensor([1.0, 1.1, 50.0, 0.9]), torch.ones(4))[0].all()  # too few to split


def test_the_spread_is_each_updates_mean_squared_deviation_from_the_consensus():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 1.0]])
    spread = observed_spread(x, torch.tensor([1.0, 1.0]))
    assert spread.dtype == torch.float64
    torch.testing.assert_close(spread, torch.tensor([0.5, 6.5, 0.0], dtype=torch.float64))


def spread_round(n_honest=12, n_bad=5, d=400, copies=0, seed=0):
    """Honest updates around a common direction with client-specific spread; the last ``n_bad`` far off
    (the last ``copies`` of them one identical vector)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(d, generator=g)
    scales = torch.linspace(0.5, 1.5, n_honest)
    honest = truth + scales[:, None] * torch.randn(n_honest, d, generator=g)
    bad = -truth + 4.0 * torch.randn(n_bad, d, generator=g)
    if copies:
        bad[-copies:] = bad[-1]
    x = torch.cat([honest, bad])
    return Round(updates=x, client_ids=[f"c{i}" for i in range(len(x))])


@pytest.mark.parametrize("name", TRUST)
def test_screened_trust_is_an_equal_vote_for_every_client_kept(name):
    r = spread_round()
    out = rule(name, weighting="screen")(r)
    kept = out.weights > 0
    assert kept[:12].all() and not kept[12:].any(), out.weights
    torch.testing.assert_close(out.weights[:12], torch.full((12,), 1 / 12))
    torch.testing.assert_close(out.vector, r.updates[:12].mean(0))
    assert out.info["screen"]["dropped"] == [f"c{i}" for i in range(12, 17)]
    # the estimator's own precision coefficients stay in the info: honest clients' differ widely
    coefficient = out.info["clients"]["coefficient"][:12]
    assert coefficient.max() > 2 * coefficient.min()


def test_copies_keep_one_vote_between_them_when_kept():
    x = spread_round(n_bad=0).updates
    x = torch.cat([x, x[:1].expand(4, -1)])  # four copies of client 0: with it, one group of five
    out = rule("ivar_mle", weighting="screen")(Round(updates=x, client_ids=[f"c{i}" for i in range(16)]))
    group = [0, 12, 13, 14, 15]
    assert out.weights[group].sum() == pytest.approx(1 / 12)  # twelve sources, twelve votes
    assert out.weights[1:12] == pytest.approx(torch.full((11,), 1 / 12))


@pytest.mark.parametrize("name", ["ivar_mle", "icov_vb"])
def test_the_screen_changes_how_estimates_are_used_never_the_estimates(name):
    precision, screen = rule(name), rule(name, weighting="screen")
    for seed in range(3):
        r = spread_round(seed=seed)
        a, b = precision(r), screen(r)
        torch.testing.assert_close(a.info["clients"]["noise"], b.info["clients"]["noise"])
    sa, sb = precision.state_dict(), screen.state_dict()
    assert sa["clients"].keys() == sb["clients"].keys()
    for cid in sa["clients"]:
        assert sa["clients"][cid]["noise"] == pytest.approx(sb["clients"][cid]["noise"])


def test_weighting_is_checked_like_every_other_option():
    with pytest.raises(
        ValueError, match="ivar_vb: weighting must be one of .*'precision', 'screen'.*got 'equal'"
    ):
        rule("ivar_vb", weighting="equal")


def test_the_screen_reads_the_updates_not_the_models_variance():
    """ICOV's model variance Phi_jj can swell for honest clients where colluders need large factors (on
    Fashion-MNIST under a boosted backdoor it overlapped the attackers' and the round went to the mean);
    the screen reads how far each update is from the fitted consensus. Here the fit's variances say
    nothing (all equal), the updates do: the far minority is dropped."""
    from fedtrust.aggregators.sybils import Groups
    from fedtrust.inference.rules import _WindowRule

    r = spread_round()
    fit = rule("icov_vb")(r)
    uninformative = {**fit.info, "clients": {**fit.info["clients"], "noise": torch.ones(r.n)}}
    fit = type(fit)(fit.vector, fit.weights, uninformative)
    out = _WindowRule._screened(r, Groups.singletons(r.n), fit, r)
    assert out.info["screen"]["dropped"] == [f"c{i}" for i in range(12, 17)]
    torch.testing.assert_close(out.vector, r.updates[:12].mean(0))


def colluders_round(seed=0, d=300):
    """30 honest updates (a common direction plus noise of client-specific scale, 0.7 to 1.3), 19
    colluders far along one direction (large spread), and one colluder pushed only a little along it: its
    spread is within the honest clients', its position along the colluders' direction is not."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(d, generator=g)
    push = torch.randn(d, generator=g)
    push /= push.norm()
    honest = truth + torch.linspace(0.7, 1.3, 30)[:, None] * torch.randn(30, d, generator=g)
    loud = truth + torch.randn(19, d, generator=g) + 60.0 * push
    quiet = (
        truth + torch.randn(1, d, generator=g) + 8.0 * push
    )  # ||8 push||^2 = 64 ~ 0.2 d: in the honest spread
    x = torch.cat([honest, loud, quiet])
    return Round(updates=x, client_ids=[f"c{i}" for i in range(50)])


def test_a_kept_client_far_along_the_dropped_groups_direction_is_dropped_too():
    r = colluders_round()
    sizes = torch.ones(50)
    keep = torch.ones(50, dtype=torch.bool)
    keep[30:49] = False  # what the spread screen drops: the 19 loud colluders
    spread = observed_spread(r.updates, r.updates[keep].mean(0))
    assert spread[49] < spread[:30].max()  # the quiet one hides in the honest spread
    after, followers = drop_followers(r.updates, keep, sizes)
    assert followers == 1 and not after[49] and after[:30].all() and not after[30:49].any()


def test_the_second_look_changes_nothing_without_a_dropped_group_or_past_the_honest_majority():
    r = colluders_round()
    everyone = torch.ones(50, dtype=torch.bool)
    assert drop_followers(r.updates, everyone, torch.ones(50)) == (everyone, 0)
    keep = torch.ones(50, dtype=torch.bool)
    keep[30:49] = False
    # counted by members: were the quiet colluder a group of 11 copies, dropping it would drop half the
    # round's clients (19 + 11 of 60)
    sizes = torch.ones(50)
    sizes[49] = 11.0
    after, followers = drop_followers(r.updates, keep, sizes)
    assert followers == 0 and torch.equal(after, keep)


@pytest.mark.parametrize("name", ["ivar_mle", "icov_vb"])
def test_a_screened_rule_drops_the_colluder_its_spread_alone_would_keep(name):
    out = rule(name, weighting="screen")(colluders_round())
    assert out.info["screen"]["split"] and out.info["screen"]["followers"] == 1
    assert out.info["screen"]["dropped"] == [f"c{i}" for i in range(30, 50)]
    torch.testing.assert_close(out.weights[:30], torch.full((30,), 1 / 30))


def noisy_sybils_round(noise: float, seed: int = 0, d: int = 400) -> Round:
    """IPM's vector (-3 x the honest mean) sent by 20 of 50 clients, each adding its own noise of ``noise``
    x the honest clients' typical spread (the robustness table's ``noisy_sybil_ipm``): 30 honest updates
    about a small common mean, with client-specific spread 0.5 to 1.5."""
    g = torch.Generator().manual_seed(seed)
    truth = 0.3 * torch.randn(d, generator=g)
    honest = truth + torch.linspace(0.5, 1.5, 30)[:, None] * torch.randn(30, d, generator=g)
    bad = -3.0 * truth + noise * torch.randn(20, d, generator=g)
    x = torch.cat([honest, bad])
    return Round(updates=x, client_ids=[f"c{i}" for i in range(50)])


def populations_round(sizes, offset: float, seed: int = 0, d: int = 400) -> Round:
    """Honest clients in populations of the given sizes, each population's centre ``offset`` per coordinate
    from the common mean, each client with its own spread (0.5 to 1.5): data of their own, not copies."""
    g = torch.Generator().manual_seed(seed)
    truth = 0.3 * torch.randn(d, generator=g)
    rows = []
    for k in sizes:
        centre = truth + offset * torch.randn(d, generator=g)
        rows.append(centre + (0.5 + torch.rand(k, 1, generator=g)) * torch.randn(k, d, generator=g))
    x = torch.cat(rows)
    return Round(updates=x, client_ids=[f"c{i}" for i in range(len(x))])


@pytest.mark.parametrize("name", ["ivar_mle", "icov_vb"])
@pytest.mark.parametrize("noise", [0.3, 0.6])
def test_noisy_sybils_that_the_fit_takes_for_its_best_sources_are_dropped(name, noise):
    """Their tightness buys them precision: the fit's consensus sits on them, the honest clients look like
    the outliers and are the majority, so the spread alone drops no one and the mean points against the
    honest clients' (cosine -0.36 here before the look). Their mean stands apart from the others' far
    beyond the honest clients' own differences, and they agree with each other: they are dropped."""
    r = noisy_sybils_round(noise)
    out = rule(name, weighting="screen")(r)
    apart = out.info["screen"]["apart"]
    assert apart["dropped"] == 20 and apart["ratio"] > APART_RATIO and apart["tightness"] < 0.5
    assert out.info["screen"]["dropped"] == [f"c{i}" for i in range(30, 50)]
    torch.testing.assert_close(out.vector, r.updates[:30].mean(0))


def test_honest_populations_with_data_of_their_own_are_kept():
    """A minority population standing apart (offset 0.5-0.8 of the per-client spread per coordinate) is
    as spread as the rest: not a group that agrees with itself, so the look leaves it; several
    populations set their own scale, so nothing stands apart from them."""
    for sizes, offset in [((30, 20), 0.5), ((35, 15), 0.8), ((20, 15, 15), 0.5), ((10,) * 5, 0.5)]:
        r = populations_round(sizes, offset)
        block, apart = standing_apart(gram(r.updates, "mean"), torch.ones(r.n))
        assert block is None and apart["dropped"] == 0, (sizes, offset, apart)
        assert rule("ivar_mle", weighting="screen")(r).info["screen"]["dropped"] == [], (sizes, offset)


def test_copies_as_spread_as_honest_clients_are_left_to_the_other_looks():
    """At noise 1.0 the copies scatter as much as honest clients do about a crafted centre: the ordinary
    Byzantine case. Their mean still stands apart, but the group does not agree with itself more than
    honest clients do, so this look leaves them."""
    r = noisy_sybils_round(1.0)
    block, apart = standing_apart(gram(r.updates, "mean"), torch.ones(50))
    assert block is None and apart["ratio"] > APART_RATIO and apart["tightness"] > 0.5


def test_a_coordinated_majority_is_never_dropped():
    g = torch.Generator().manual_seed(0)
    truth = 0.3 * torch.randn(400, generator=g)
    honest = truth + torch.randn(20, 400, generator=g)
    x = torch.cat([honest, -3.0 * truth + 0.3 * torch.randn(30, 400, generator=g)])
    block, apart = standing_apart(gram(x, "mean"), torch.ones(50))
    assert block is None and apart["ratio"] > APART_RATIO and apart["tightness"] < 0.5
    # counted by members: the 20 attackers' groups holding 30 of the round's 60 clients
    r = noisy_sybils_round(0.3)
    sizes = torch.ones(50)
    sizes[30:] = 1.5
    assert standing_apart(gram(r.updates, "mean"), sizes)[0] is None


def test_the_two_sample_statistic_is_the_distance_of_the_means_over_its_standard_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 30, generator=g, dtype=torch.float64)
    side = torch.zeros(12, dtype=torch.bool)
    side[:5] = True
    b, r = x[side], x[~side]
    expected = (b.mean(0) - r.mean(0)).square().sum() / (
        b.var(0).sum() / 5 + r.var(0).sum() / 7
    )  # per coordinate unbiased variances summed: the trace of each side's covariance
    for centre in (torch.zeros(30, dtype=torch.float64), x.mean(0), x[3]):
        dev = x - centre
        assert two_sample(dev @ dev.T, side) == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("name", ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"])
def test_two_clients_sending_opposite_huge_updates_are_dropped_not_a_crash(name):
    """+v and -v with |v| = 1e12, far below the size screen's limit: centring the Gram matrix left the other
    clients' variances negative by cancellation, their correlations past 1e300, and torch's eigh failed:
    the round, and a simulated run, died. The pair is now dropped and the rest averaged."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = 0.1 * torch.randn(10, 50, generator=g)
        u = torch.randn(50, generator=g)
        x[3], x[4] = 1e12 * u / u.norm(), -1e12 * u / u.norm()
        out = rule(name, weighting="screen")(Round(updates=x))
        assert out.weights[3] == 0 and out.weights[4] == 0
        torch.testing.assert_close(out.vector, x[[0, 1, 2, 5, 6, 7, 8, 9]].mean(0))
