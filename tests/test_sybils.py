"""Trust that colluders cannot buy (issue 17): a group of identical or near-identical updates gets, all
together, the trust one client would get for the same information, and the aggregate stays where the
honest clients put it; no rule fails on identical, collinear or rank-deficient rounds."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import runs
import torch
from conftest import dtype_tol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtrust import Round, rule
from fedtrust.aggregators import Aggregate, chunks, leaving_out, sybils
from fedtrust.aggregators.distances import pairwise_sq_distances
from fedtrust.aggregators.passes import norms_and_sketch, row_norms
from fedtrust.aggregators.sybils import find_groups
from fedtrust.attacks import AttackContext, attack
from fedtrust.report import write_report
from fedtrust.rules import available
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation, run_experiment

CONSTANT_FIXTURE = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

SHARING = ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb", "focus"]
#: ICOV at fewer iterations (ICOV-MLE 10 of 5 quasi-Newton steps, ICOV-VB 50): their defaults take
#: seconds a round here; both runs a claim compares share the options.
OPTIONS = {"icov_mle": {"max_iter": 10, "steps": 5}, "icov_vb": {"max_iter": 50}}


def honest(n=14, d=300, seed=0):
    """n honest updates around a common direction with different noise levels (IVAR's model)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(d, generator=g)
    sd = torch.linspace(0.2, 1.0, n)[:, None]
    return truth, truth + sd * torch.randn(n, d, generator=g)


def attacked(x, name, bad=6, **options):
    """x with ``bad`` more clients running the update attack ``name`` (they see the honest updates)."""
    full = torch.cat([x, torch.zeros(bad, x.shape[1])])
    mask = torch.zeros(len(full), dtype=torch.bool)
    mask[len(x) :] = True
    ctx = AttackContext(full, mask, torch.zeros(x.shape[1]), "params", torch.Generator().manual_seed(1))
    full[mask] = attack(name, **options)(ctx)
    return full


def two_rounds(name, x, **options):
    """The rule's output on the second of two rounds with these updates (FOCUS weighs by the benchmark
    loss of the previous round; the window rules carry their noise over)."""
    n = len(x)
    r = Round(
        updates=x,
        client_ids=[f"c{i}" for i in range(n)],
        num_samples=torch.full((n,), 50.0),
        metrics={"train_loss": torch.full((n,), 1.0)},
        reference=lambda v: float((v - TRUTH).square().mean()),
    )
    agg = rule(name, **OPTIONS.get(name, {}), **options)
    agg(r)
    return agg(r)


TRUTH, HONEST = honest()


@pytest.mark.parametrize("name", SHARING)
def test_mimic_copies_together_get_the_trust_of_the_one_client_they_copy(name):
    """Six clients send a copy of honest client 3's update (mimic): the seven identical updates share
    one vote, together exactly the weight client 3 gets alone, and the aggregate is the honest round's.
    Without sharing, IVAR gives the copies nearly all of it."""
    x = attacked(HONEST, "mimic", target=3)
    alone = two_rounds(name, HONEST)
    out = two_rounds(name, x)
    group = [3, *range(14, 20)]
    assert out.info["groups"] == [
        {"clients": [f"c{i}" for i in group], "reason": "7 identical updates share one vote"}
    ]
    torch.testing.assert_close(out.weights[group].sum(), alone.weights[3], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.weights[group], out.weights[group][:1].expand(7))  # split evenly
    torch.testing.assert_close(out.vector, alone.vector, atol=1e-4, rtol=1e-4)
    if name.startswith("ivar"):  # without sharing, agreement read as reliability: the copies take the round
        before = two_rounds(name, x, sybils="off")
        assert before.weights[group].sum() > 0.9 > 10 * alone.weights[3]


@pytest.mark.parametrize("name", SHARING)
def test_honest_clients_that_agree_closely_keep_their_votes_when_noise_outnumbers_them(name):
    """Five honest clients that agree to 0.1% of their distance to five N(0, 1) adversaries (the one-round
    task, where a distance threshold merged them into one vote and IVAR-VB followed the adversaries):
    nobody is grouped, and IVAR gives the honest clients the weight."""
    g = torch.Generator().manual_seed(5)
    honest = 0.3 * torch.randn(1, 300, generator=g) + 0.01 * torch.randn(5, 300, generator=g)
    x = torch.cat([honest, torch.randn(5, 300, generator=g)])
    out = two_rounds(name, x)
    assert not out.info["groups"]
    if name.startswith("ivar"):
        assert float(out.weights[:5].sum()) > 0.9


@pytest.mark.parametrize("name", SHARING)
def test_one_crafted_vector_sent_by_many_gets_the_trust_of_one_client_sending_it(name):
    """Six clients send -3 x the honest mean (IPM, epsilon = 3): together they get the weight one client
    sending that vector gets, and the aggregate stays near the honest one."""
    x = attacked(HONEST, "ipm", epsilon=3.0)
    one = two_rounds(name, x[:15])  # a single client sends the crafted vector
    out = two_rounds(name, x)
    (group,) = out.info["groups"]
    assert group["clients"] == [f"c{i}" for i in range(14, 20)]
    assert group["reason"].startswith("6 identical")
    assert float(out.weights[14:].sum()) <= float(one.weights[14]) + 1e-3
    assert float(out.weights[14:].sum()) < 0.05
    honest_mean = HONEST.mean(0)
    assert (out.vector - one.vector).norm() < 0.05 * honest_mean.norm()
    assert (out.vector - honest_mean).norm() < 0.5 * (x[14] - honest_mean).norm() / 6


@pytest.mark.parametrize("base", ["ivar_mle", "ivar_vb", "icov_vb"])
def test_copies_neither_sharpen_nor_drag_robust_fedags_posterior(base):
    """Robust FedAG fits N(mu, sigma^2) with its base rule's trust weights, so the base's sharing reaches
    the posterior: six copies of honest client 3 leave mean and per-weight variance where the honest
    round puts them. With every client its own source the copies take the weight and the posterior
    collapses onto client 3's update (an over-confident predictive, and one client's model)."""
    x = attacked(HONEST, "mimic", target=3)
    options = {"base": base, "base_options": OPTIONS.get(base, {})}
    alone = two_rounds("fedag", HONEST, **options)
    out = two_rounds("fedag", x, **options)
    torch.testing.assert_close(out.vector, alone.vector, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.info["posterior_var"], alone.info["posterior_var"], atol=1e-4, rtol=1e-3)
    if base.startswith("ivar"):
        off = two_rounds("fedag", x, base=base, base_options={"sybils": "off"})
        assert off.info["posterior_spread"] < 0.3 * alone.info["posterior_spread"]
        assert (off.vector - HONEST[3]).norm() < 0.3 * (alone.vector - HONEST[3]).norm()


# ---------------------------------------------------------------- copies with noise added


def noisy(x, bad, scale, seed=2):
    """x with independent noise on its last ``bad`` rows: N(0, (scale x the honest rows' per-coordinate
    standard deviation)^2), drawn for each row and coordinate."""
    g = torch.Generator().manual_seed(seed)
    out = x.clone()
    out[-bad:] += scale * x[:-bad].std(0) * torch.randn(bad, x.shape[1], generator=g)
    return out


#: The copy attacks: options, and who ends up in the one group (mimic's copies join the client they copy).
COPY_ATTACKS = {"mimic": ({"target": 3}, [3, *range(14, 20)]), "ipm": ({"epsilon": 3.0}, list(range(14, 20)))}


@pytest.mark.parametrize("scale", [1e-4, 1e-2, 0.05])
@pytest.mark.parametrize("attack_name", COPY_ATTACKS)
@pytest.mark.parametrize("name", SHARING)
def test_copies_with_independent_noise_share_one_vote_as_exact_copies_do(name, attack_name, scale):
    """Eq 3 with k nearly equal rows of Phi: six clients send one vector (a copy of client 3's, or IPM's),
    each with its own noise of up to a twentieth of the honest spread, too far apart to be copies. Their
    deviations from the round's median correlate near 1, so they are one source again: the group's weight
    and the aggregate are where exact copies leave them. (At a tenth, one noisy copy of client 3 here
    correlates below 0.95: a mimic's deviation is one honest client's, no larger.) Grouping exact copies only
    (``sybils="copies"``), IVAR hands the noisy copies of client 3 nearly the whole round."""
    options, group = COPY_ATTACKS[attack_name]
    exact = attacked(HONEST, attack_name, **options)
    x = noisy(exact, 6, scale)
    copies = two_rounds(name, exact)
    out = two_rounds(name, x)
    assert [g["clients"] for g in out.info["groups"]] == [[f"c{i}" for i in group]]
    assert out.info["groups"][0]["reason"].startswith(
        f"{len(group)} updates share one vote: their deviations"
    )
    torch.testing.assert_close(out.weights[group].sum(), copies.weights[group].sum(), rtol=0.1, atol=2e-3)
    assert (out.vector - copies.vector).norm() < 0.02 * HONEST.mean(0).norm()
    if name.startswith("ivar") and attack_name == "mimic":
        apart = two_rounds(name, x, sybils="copies")
        assert apart.info["groups"] == []
        assert float(apart.weights[group].sum()) > 0.9 > 5 * float(out.weights[group].sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("bad", "scale"), [(0, 0.0), (6, 0.0), (6, 1e-2)])
def test_the_groups_carry_their_representatives_moments_for_the_estimators(bad, scale, dtype):
    """The search's Gram pass serves the estimators (``Groups.moments``): its statistics about the median
    give every inner product of the representatives (each group's mean update) that a Gram pass over the
    representatives gives, whether no group formed, exact copies did, or noisy copies were merged."""
    from fedtrust.inference.tasks import TaskGram, Tasks

    x = (noisy(attacked(HONEST, "ipm", epsilon=3.0), 6, scale) if bad else HONEST).to(dtype)
    groups = find_groups(x)
    assert groups.count == len(HONEST) + (1 if bad else 0)
    reps = groups.means(x)
    present = torch.ones(1, groups.count, dtype=torch.bool)
    given, own = TaskGram.of_moments(groups.moments), TaskGram.of(Tasks(reps[None], present))
    g = torch.Generator().manual_seed(0)
    p, q = (torch.randn(1, groups.count, k, generator=g, dtype=torch.float64) for k in (3, 2))
    scale_sq = float(reps.double().norm(dim=1).max()) ** 2
    tol = {"rtol": 0, "atol": 64 * torch.finfo(dtype).eps * scale_sq * groups.count}
    torch.testing.assert_close(given.form(p, q), own.form(p, q), **tol)
    w = torch.softmax(torch.randn(1, groups.count, generator=g, dtype=torch.float64), 1)
    torch.testing.assert_close(given.residuals(w, present), own.residuals(w, present), **tol)


@pytest.mark.parametrize("scale", [1.0, 1e2, 1e4])
def test_a_minority_of_far_noise_does_not_make_honest_clients_look_like_copies(scale):
    """Correlation is read about the coordinate-wise median, which a minority cannot carry off: five
    adversaries' noise, however large, beside six honest clients (four within 0.01 of a common update, two
    within 0.05) leaves every client its own source. About the mean, the adversaries' pull would be a
    common offset of the honest deviations, as large as the adversaries make it."""
    g = torch.Generator().manual_seed(4)
    d = 300
    common = 0.3 * torch.randn(d, generator=g)
    honest = common + torch.tensor([0.01] * 4 + [0.05] * 2)[:, None] * torch.randn(6, d, generator=g)
    x = torch.cat([honest, scale * torch.randn(5, d, generator=g)])
    assert find_groups(x).trivial
    median = x.median(0).values  # (odd n: the middle value) as far-off noise moves, it stays among the honest
    assert float((median - common).abs().max()) < 0.2


def test_a_coherent_minority_does_not_make_the_tightest_honest_clients_look_like_copies():
    """Eight noisy copies of one far vector (40%) drag the coordinate-wise median to the honest clients'
    0.83 quantile on their side of every coordinate, an offset as large as the loose honest clients'
    spread: about the median the six tight honest clients' deviations share it and correlate above 0.95
    (Fashion-MNIST's boosted backdoor made 15-20 honest clients one vote this way). The copies correlate
    there too, and counted once they drag no median: about the sources' median only the copies are one
    vote."""
    g = torch.Generator().manual_seed(0)
    d = 300
    common = 0.3 * torch.randn(d, generator=g)
    spread = torch.tensor([0.01] * 6 + [0.1] * 6)[:, None]
    honest = common + spread * torch.randn(12, d, generator=g)
    far = common + 0.9 * torch.randn(d, generator=g)
    copies = far + 0.01 * torch.randn(8, d, generator=g)
    x = torch.cat([honest, copies])

    def correlations(rows, centre):
        r = torch.nn.functional.normalize(rows - centre, dim=1)
        return (r @ r.T)[~torch.eye(len(rows), dtype=torch.bool)]

    median = x.median(0).values
    assert float(correlations(x[:6], median).min()) > sybils.CORRELATION
    assert float(correlations(copies, median).min()) > sybils.CORRELATION
    sources = torch.cat([honest, copies.mean(0, keepdim=True)]).median(0).values
    assert float(correlations(x[:6], sources).max()) < 0.9
    assert find_groups(x).members == (*((i,) for i in range(12)), tuple(range(12, 20)))


def test_a_majority_of_independent_noise_leaves_the_parties_apart():
    """Nguyen et al.'s one-round task: 5 parties beside 10 Gaussian adversaries (ten times their spread).
    About the median, which stays among the parties, independent noise on both sides cancels: nothing
    correlates, nothing is merged, and the centre is not read again. (A second centre that the
    adversaries can reach does not leave them apart: the mean of the half nearest the median, which must
    hold 3 adversaries, made the parties one vote on Fashion-MNIST, IVAR-VB 0.819 -> 0.324.)"""
    g = torch.Generator().manual_seed(1)
    d = 300
    parties = 0.3 * torch.randn(d, generator=g) + 0.1 * torch.randn(5, d, generator=g)
    x = torch.cat([parties, torch.randn(10, d, generator=g)])
    assert find_groups(x).members == tuple((i,) for i in range(15))


def test_the_gram_matrix_about_a_new_centre_needs_no_second_gram_pass():
    """recentred: from the deviations' Gram matrix about one centre and one product of the rows with the
    shift, the Gram matrix about another, to float32 rounding."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 50, generator=g) * torch.arange(1.0, 10.0)[:, None]
    first, new = x.median(0).values, x[:5].median(0).values
    r = (x - first).double()
    about = (x - new).double()
    got = sybils.recentred(x, first, r @ r.T, new)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(got, about @ about.T, rtol=0, atol=64 * eps * float(got.abs().max()))


def test_correlated_groups_never_merge_half_the_round():
    """The honest majority is every rule's premise: a correlated component of half the clients or more is
    left apart (six noisy copies beside six honest clients), one of fewer is merged."""
    x = noisy(attacked(HONEST[:6], "ipm", epsilon=3.0, bad=6), 6, 0.01)
    assert find_groups(x).trivial
    merged = find_groups(x[:-1])
    assert merged.members == ((0,), (1,), (2,), (3,), (4,), (5,), tuple(range(6, 11)))
    assert find_groups(x[:-1], sybils="copies").trivial


@pytest.mark.parametrize("d", [3, 5, 10])
def test_independent_clients_over_few_coordinates_are_not_linked_by_chance(d):
    """Over a handful of coordinates independent updates correlate above the threshold by chance (7
    clients over d = 3 linked in 56 of 200 rounds before), which says nothing about copying: there the
    groups stay the exact copies. The chance is I_{1-t^2}((d-2)/2, 1/2) / 2 a pair; over 64 coordinates
    it is nil, and noisy copies are merged as at any size."""
    g = torch.Generator().manual_seed(d)
    for _ in range(100):
        x = torch.randn(7, d, generator=g)
        assert find_groups(x).trivial
        x[4:] = x[3]  # exact copies are still one vote
        assert find_groups(x).members == ((0,), (1,), (2,), (3, 4, 5, 6))
    assert sybils.chance_links(7, 3) > sybils.CHANCE_LINKS > sybils.chance_links(50, 16)
    assert sybils.chance_links(1000, 64) < 1e-25
    x = noisy(attacked(HONEST[:8, :64], "ipm", epsilon=3.0, bad=5), 5, 0.01)
    assert find_groups(x).members[-1] == tuple(range(8, 13))


@pytest.mark.parametrize("name", ["ivar_mle", "ivar_vb"])
def test_honest_clients_that_share_one_offset_are_one_source_as_eq_3_says(name):
    """Four honest clients that share one offset from the truth (one data distribution among a few) look
    like noisy copies, and by eq 3 they are: errors that agree carry one error's information. Together they
    get what one of them alone would; apart, IVAR read their agreement as reliability and gave them
    nearly the whole round, the price FoolsGold's similarity discount also pays."""
    g = torch.Generator().manual_seed(6)
    d = HONEST.shape[1]
    x = HONEST.clone()
    x[:4] = TRUTH + 0.5 * torch.randn(d, generator=g) + 0.05 * torch.randn(4, d, generator=g)
    out = two_rounds(name, x)
    assert [grp["clients"] for grp in out.info["groups"]] == [["c0", "c1", "c2", "c3"]]
    one = two_rounds(name, x[3:])
    torch.testing.assert_close(out.weights[:4].sum(), one.weights[0], rtol=0.25, atol=0)
    assert float(two_rounds(name, x, sybils="copies").weights[:4].sum()) > 0.9


def test_honest_clients_are_not_grouped_and_an_outlier_does_not_make_two_of_them_alike():
    """Independent noisy updates share no vote; nor do two honest clients that are close compared with a
    far outlier (each update's own spread sets the scale, not the round's)."""
    assert find_groups(HONEST).trivial
    x = torch.tensor([[0.0, 0.0], [0.1, -0.1], [5.0, 5.0]])
    assert find_groups(x).trivial


def test_the_window_state_follows_each_member_as_groups_form_and_dissolve():
    """Round 1: clients 5-7 copy client 0. Round 2: everyone sends their own update. Each member keeps
    the representative's noise from round 1; the state round-trips through state_dict (every entry
    checked); with no groups the round is the estimator's ordinary one."""
    for name in ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"]:
        options = {"window": 3, **FAST.get(name, {})}
        agg = rule(name, **options)
        ids = [f"c{i}" for i in range(8)]
        x = HONEST[:8].clone()
        x[5:] = x[0]
        out = agg(Round(updates=x, client_ids=ids))
        assert out.info["groups"][0]["clients"] == ["c0", "c5", "c6", "c7"]
        state = agg.state_dict()
        noise = [state["clients"][i]["noise"] for i in ("c0", "c5", "c6", "c7")]
        assert noise == noise[:1] * 4
        second = Round(updates=HONEST[:8], client_ids=ids[::-1])  # another order: keyed by id
        copy = rule(name, **options)
        copy.load_state_dict(state)
        a, b = agg(second), copy(second)
        assert a.info["groups"] == []
        torch.testing.assert_close(a.vector, b.vector, rtol=0, atol=0)


def test_sybils_option_is_checked_like_every_other_option():
    with pytest.raises(
        ValueError, match="ivar_vb: sybils must be one of 'share', 'copies', 'off'; got 'drop'"
    ):
        rule("ivar_vb", sybils="drop")
    with pytest.raises(ValueError, match="focus: sybils must be one of 'share', 'copies', 'off'; got 1"):
        rule("focus", sybils=1)


# ---------------------------------------------------------------- degenerate rounds, every rule


def _degenerate():
    g = torch.Generator().manual_seed(3)
    n, d = 8, 40
    base = torch.randn(n, d, generator=g)
    v = torch.randn(d, generator=g)
    return {
        "all identical": v.expand(n, -1).clone(),
        "all zero": torch.zeros(n, d),
        "two identical": torch.cat([base[:1], base[: n - 1]]),
        "n > d (rank-deficient Gram)": torch.randn(n, 3, generator=g),
        "collinear (multiples of one vector)": torch.arange(1.0, n + 1)[:, None] * v,
        "one zero update": torch.cat([torch.zeros(1, d), base[1:]]),
    }


DEGENERATE = _degenerate()


class Norm:
    """A benchmark whose loss is the norm, and whose own update (FLTrust's g_0) is all ones."""

    def __init__(self, d: int):
        self.d = d

    def __call__(self, u):
        return float(u.double().norm())

    def update(self):
        return torch.ones(self.d)


#: ICOV's fits take seconds on these rounds (unconverged at their iteration limits on collinear and
#: rank-deficient updates); what the test is after shows in the first iterations.
FAST = {"icov_mle": {"max_iter": 5, "steps": 5}, "icov_vb": {"max_iter": 20}}


@pytest.mark.parametrize("case", list(DEGENERATE))
@pytest.mark.parametrize("name", available())
def test_no_rule_fails_on_identical_collinear_or_rank_deficient_updates(name, case):
    """Two rounds of each: a finite aggregate and weights that are a distribution, never an error. The
    trust rules return an all-identical round's update with the reason; where ICOV's fit breaks down
    (collinear updates drive its latent variance to 0) they say so and fit IVAR instead."""
    x = DEGENERATE[case]
    n = len(x)
    r = Round(
        updates=x,
        client_ids=[f"c{i}" for i in range(n)],
        num_samples=torch.arange(1.0, n + 1),
        metrics={"train_loss": torch.linspace(0.5, 1.5, n)},
        reference=Norm(x.shape[1]),
        previous=torch.zeros(x.shape[1]),
    )
    agg = rule(name, **FAST.get(name, {}))
    for _ in range(2):
        out = agg(r)
        assert isinstance(out, Aggregate)
        assert torch.isfinite(out.vector).all() and out.vector.shape == (x.shape[1],)
        assert (out.weights >= 0).all() and abs(float(out.weights.sum()) - 1) < 1e-5
    if name.startswith(("ivar", "icov")):
        if case.startswith("all"):
            assert out.info["degenerate"].startswith("all 8 updates are identical")
            torch.testing.assert_close(out.vector, x[0])
        if "fallback" in out.info:
            assert "-> fitted by ivar_" in out.info["fallback"]
        other = rule(name, sybils="off", **FAST.get(name, {}))  # the papers' setting does not fail either
        for _ in range(2):
            assert torch.isfinite(other(r).vector).all()


# ---------------------------------------------------------------- short simulations


def _sybils_experiment():
    """experiments/ivar_icov/sybils.py, whose federation these runs share (at fewer rounds)."""
    path = Path(__file__).parent.parent / "experiments" / "ivar_icov" / "sybils.py"
    spec = importlib.util.spec_from_file_location("sybils_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXPERIMENT = _sybils_experiment()


def final_accuracy(rule_name, attack_name, colluders=None):
    """Final test accuracy of the experiment's run at 12 rounds, seed 0; ``colluders=1``: the same run
    (same data, same training noise) with every colluder's update but the first left out of every round."""
    cfg = validate(EXPERIMENT.config({"name": rule_name}, attack_name, seed=0, rounds=12))
    sim = build_simulation(cfg)
    if colluders is not None:
        bad = [i for i, b in zip(sim.fed.ids, sim.fed.corrupted.tolist(), strict=True) if b]
        sim.rule = leaving_out(sim.rule, bad[colluders:])
    records = sim.run()
    assert not any(r["error"] for r in records)
    return records[-1]["metrics"]["accuracy"]


@pytest.mark.parametrize(
    "name, attack_name", [("ivar_mle", "mimic"), ("ivar_mle", "ipm3"), ("ivar_vb", "mimic"), ("ivar_vb", "ipm3"),
                          ("icov_vb", "ipm3")],
)  # fmt: skip
def test_six_colluders_sending_one_update_end_where_one_of_them_would(name, attack_name):
    """digits, 20 clients, Dirichlet(0.5), softmax, 12 rounds, 30% colluders all sending one update
    (mimic: a copy of benign client 0's; IPM: -3 x the benign mean): each trust rule ends within 2 points
    of the same run with a single colluder (before issue 17, at 30 rounds, IVAR and ICOV-VB ended at
    0.1-0.55 here; clean runs end at 0.89-0.93). ICOV-MLE (over a second a round here) and ICOV-VB under
    mimic are left to the round-level tests above (a group of exact copies is the one client it copies)
    and to experiments/ivar_icov/sybils.py."""
    one = final_accuracy(name, attack_name, colluders=1)
    six = final_accuracy(name, attack_name)
    assert six > one - 0.02, (six, one)
    assert one > 0.6


def test_a_run_keeps_each_rounds_groups_and_the_report_counts_them(tmp_path):
    """Three of six digits clients send copies of client 0's update each round: every round's record in
    rounds.jsonl lists the group (the four clients, why), and the report says in how many rounds votes
    were shared; a run without copies adds no such section."""
    spec = {"name": "t", "data": {"name": "digits", "clients": 6}, "train": {"rounds": 2, "lr": 0.5},
            "corruption": {"name": "mimic", "target": 0, "fraction": 0.5},
            "sweep": {"rule": [{"name": "ivar_vb"}, {"name": "ivar_vb", "sybils": "off"}]}}  # fmt: skip
    run_experiment(runs.config(spec), tmp_path, progress=False)
    shared, off = (tmp_path / "t" / name for name in ("rule=ivar_vb", "rule=ivar_vb,sybils=off"))
    for line in (shared / "rounds.jsonl").open():
        record = json.loads(line)
        bad = [c for c, b in zip(record["clients"], record["corrupted"], strict=True) if b]
        (group,) = record["info"]["groups"]
        assert len(group["clients"]) == 4 and set(bad) < set(group["clients"])
        assert group["reason"] == "4 identical updates share one vote"
    assert all("groups" not in json.loads(line)["info"] for line in (off / "rounds.jsonl").open())
    text = write_report(tmp_path / "t").read_text()
    assert "## Copies and degenerate rounds" in text
    assert "- rule=ivar_vb: in 2 of 2 rounds copies shared one vote (largest group: 4 clients)" in text
    assert "rule=ivar_vb,sybils=off:" not in text


def _structured_round(seed: int, dtype: torch.dtype, shift: float, d: int) -> torch.Tensor:
    """Honest updates, exact copies, copies a few units in the last place off, copies at 0.5, 0.99, 1.01
    and 2 times the rounding threshold, copies with 1e-3 noise, two distinct updates of equal norm whose
    difference sums to zero over every pair of coordinates, all shifted by a common offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, d, generator=g, dtype=torch.float64) + shift
    eps = torch.finfo(dtype).eps
    rows = [x[i] for i in range(8)]
    rows += [x[0], x[0]]  # exact copies
    nudged = x[1].to(dtype)
    flip = torch.rand(d, generator=g) < 0.5
    rows.append(
        torch.where(flip, torch.nextafter(nudged, torch.full_like(nudged, math.inf)), nudged).double()
    )
    # constant over aligned runs of 16 coordinates (the sketch's runs in the test, or halves of them): the
    # sketch sees the whole displacement, so only its margin keeps the pairs at 0.99 candidates
    direction = torch.randn(-(-d // 16), generator=g, dtype=torch.float64).repeat_interleave(16)[:d]
    direction /= direction.norm()
    for i, c in enumerate([0.5, 0.99, 1.01, 2.0]):
        rows.append(x[2 + i] + c * sybils.FLOOR_ULPS * eps * x[2 + i].norm() * direction)
    rows.append(x[6] + 1e-3 * torch.randn(d, generator=g, dtype=torch.float64))
    swapped = x[7].clone()  # adjacent coordinates swapped: same norm, same run sums (the sketch's blind spot)
    swapped[0 : d - d % 2 : 2], swapped[1 : d - d % 2 : 2] = x[7][1 : d - d % 2 : 2], x[7][0 : d - d % 2 : 2]
    rows.append(swapped)
    return torch.stack(rows).to(dtype)


@CONSTANT_FIXTURE
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    shift=st.sampled_from([0.0, 30.0, 1e4]),
    d=st.sampled_from([7, 300, 5000]),
    chunked=st.booleans(),
)
def test_the_sketch_finds_exactly_the_groups_the_gram_matrix_finds(
    seed, dtype, shift, d, chunked, monkeypatch
):
    """IVAR, ICOV and FOCUS find copies from a sketch taken with the norms (one read), Krum and NNM from
    their Gram matrix: the same groups and reasons, including copies that differ by rounding, pairs on
    either side of the rounding threshold, noisy copies (separate sources), distinct updates of equal
    norm and equal sketch, and a large common offset; the pass's norms are row_norms' to the bit."""
    x = _structured_round(seed, dtype, shift, d)
    if chunked:  # column blocks of 8 columns: runs of 16 cross block boundaries
        for budget in chunks.BUDGETS:
            monkeypatch.setitem(chunks.BUDGETS, budget, x.shape[0] * 8 * x.element_size())
    norms, sketch = norms_and_sketch(x, 16)
    assert torch.equal(norms, row_norms(x))
    sq_dist, gram_norms = pairwise_sq_distances(x)
    by_gram = sybils.near_duplicates(x, sq_dist, norms)
    by_sketch = sybils.sketched_duplicates(x, sketch, norms)
    assert by_sketch == by_gram
    groups = by_sketch.members
    # (0.99 and 1.01 times the threshold fall either side only up to the copies' own rounding)
    assert {(0, 8, 9), (1, 10), (2, 11), (5,), (14,), (16,)} <= set(groups)
    if shift < 1e3:  # (1e-3 noise on values near 1e4 is below float32's rounding of them)
        assert (15,) in groups  # the noisy copy


@given(seed=st.integers(0, 2**31 - 1), width=st.sampled_from([1, 5, 64, 4096]))
def test_sketches_are_never_further_apart_than_the_updates(seed, width):
    """The sketch is an orthonormal projection: its distances are at most the updates' (to float32
    rounding of the run sums), which is what makes a pair of copies always a candidate."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 1000, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    norms, sketch = norms_and_sketch(x, width)
    true = torch.cdist(x.double(), x.double())
    got = torch.cdist(sketch, sketch)
    slack = 4 * torch.finfo(torch.float32).eps * (norms[:, None] + norms[None, :])
    assert bool((got <= true + slack).all())


@pytest.mark.parametrize("name", ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"])
def test_a_round_without_copies_gives_the_same_numbers_shared_or_not(name):
    """Where the search for copies finds none the estimator fits the same updates: sharing costs a round
    without copies nothing. Not to the bit: the shared fit iterates on the search's Gram statistics
    (about the round's median), the unshared on its own (about the mean), which round differently."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, 60_000, generator=g) * torch.linspace(0.3, 2.0, 20)[:, None]
    shared = rule(name, **FAST.get(name, {}))(Round(updates=x))
    off = rule(name, sybils="off", **FAST.get(name, {}))(Round(updates=x))
    assert shared.info["groups"] == []
    torch.testing.assert_close(shared.vector, off.vector, **dtype_tol(x.dtype, 1, x.abs().max()))
    torch.testing.assert_close(shared.weights, off.weights, **dtype_tol(x.dtype))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale", [1e-161, 1e-159, 1.0, 1.2e152])  # norms up to 1.2e154 (the limit 1.34e154)
def test_copies_are_found_at_any_magnitude_the_screen_lets_through(scale, seed):
    """float64 rows near underflow or near the screen's overflow limit: exact copies are one group, the
    others their own (the sketch's distances are explicit differences, which neither cancel nor
    overflow for copies)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 10_000, generator=g, dtype=torch.float64) * scale)[[0, 0, 1, 2]]
    assert find_groups(x).members == ((0, 1), (2,), (3,))


def test_a_group_mean_leaves_nan_out_and_keeps_a_members_infinity_to_its_own_group():
    """Groups.pool: the members' mean, NaN left out; an infinity is its group's mean and no other's (0 x inf
    in a membership product had made every other group NaN: FOCUS then read every loss as unknown)."""
    from fedtrust.aggregators.sybils import Groups

    groups = Groups(((0, 1), (2,), (3, 4), (5, 6), (7,)), {0: "copies", 2: "copies", 3: "copies"}, 8)
    values = torch.tensor(
        [1.0, 3.0, math.inf, 2.0, math.nan, math.inf, -math.inf, math.nan], dtype=torch.float64
    )
    pooled = groups.pool(values)
    assert pooled[:3].tolist() == [2.0, math.inf, 2.0]
    assert math.isnan(pooled[3]) and math.isnan(pooled[4])  # +inf and -inf; no known member
    two = groups.pool(torch.stack([values, torch.arange(8.0, dtype=torch.float64)], 1))  # (n, 2): per column
    assert two[:, 1].tolist() == [0.5, 2.0, 3.5, 5.5, 7.0]


def test_a_round_of_left_out_clients_only_is_refused_and_the_model_kept():
    """leaving_out's baseline on a round that samples only the left-out clients: nothing to aggregate. It
    raised Round's ValueError ("Round.updates is empty"), which a server does not catch: the run died."""
    from fedtrust.server import server_step

    model = torch.zeros(8)
    step = server_step(leaving_out(rule("median"), ["a", "b"]),
                       Round(updates=torch.randn(2, 8), client_ids=["a", "b"]), model, lambda a: a)  # fmt: skip
    assert not step.applied and torch.equal(step.vector, model)
    assert "every client of this round (2) is left out" in step.error
