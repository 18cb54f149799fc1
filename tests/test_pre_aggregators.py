"""Pre-aggregators (NNM, bucketing, static clipping, ARC) in front of any rule: each does what its paper
says on cases small enough to compute by hand, trust flows back through the mixing to the real clients,
both spellings (``"nnm+median"``, ``pre=[...]``) build the same rule, configs accept them, and a bucketing
composition resumes exactly."""

import math

import pytest
import torch

from fedtrust import Round, RoundRefused, rule
from fedtrust.aggregators.pre import ARC, NNM, Bucketing, Clipping, PreAggregated
from fedtrust.checkpoint import load_state, save_state
from fedtrust.registry import UnknownNameError
from fedtrust.sweeps.config import ConfigError, load, validate

F64 = torch.float64


def column(*values):
    """1-D points as an (n, 1) float64 matrix."""
    return torch.tensor(values, dtype=F64)[:, None]


# ---------------------------------------------------------------- NNM


def test_nnm_replaces_each_point_by_the_mean_of_its_n_minus_f_nearest_neighbours_itself_included():
    # 0, 1, 3, 10 with f = 1: each point's 3 nearest (itself first)
    #   0 -> {0, 1, 3}, 1 -> {1, 0, 3}, 3 -> {3, 1, 0}: mean 4/3;  10 -> {10, 3, 1}: mean 14/3
    x = column(0.0, 1.0, 3.0, 10.0)
    mixed, m = NNM(f=1)(x)
    torch.testing.assert_close(mixed, column(4 / 3, 4 / 3, 4 / 3, 14 / 3))
    third = 1 / 3
    want = torch.tensor(
        [
            [third, third, third, 0],
            [third, third, third, 0],
            [third, third, third, 0],
            [0, third, third, third],
        ],
        dtype=F64,
    )
    torch.testing.assert_close(m, want)
    # the default f is floor((n - 1) / 2) = 1 for n = 4: the same mixing
    torch.testing.assert_close(NNM()(x)[1], want)


def test_nnm_quarantined_clients_count_against_f():
    x = column(0.0, 1.0, 3.0, 10.0, 11.0)
    torch.testing.assert_close(NNM(f=2)(x, quarantined=1)[1], NNM(f=1)(x)[1])
    # as a fraction of all clients: floor(0.4 * 6) = 2, minus the one quarantined
    torch.testing.assert_close(NNM(f=0.4)(x, quarantined=1)[1], NNM(f=1)(x)[1])


def test_nnm_equal_distances_go_by_index_and_copies_share_their_slots():
    # 0 is at distance 1 from both -1 and 1 and keeps f = 1 -> 2 neighbours: itself and the first by index
    x = column(-1.0, 0.0, 1.0)
    _, m = NNM(f=1)(x)
    torch.testing.assert_close(m[1], torch.tensor([0.5, 0.5, 0.0], dtype=F64))
    # two copies of 5: the point 0's last slot is shared by them, whatever their positions
    x = column(0.0, 5.0, 1.0, 5.0, 9.0)
    _, m = NNM(f=2)(x)
    assert m[0, 1] == m[0, 3] == pytest.approx(1 / 6)
    torch.testing.assert_close(m.sum(1), torch.ones(5, dtype=F64))


def test_nnm_needs_more_than_2f_vectors():
    with pytest.raises(RoundRefused, match=r"nnm: needs n > 2f clients, got n=4 with f=2"):
        NNM(f=2)(column(0.0, 1.0, 2.0, 3.0))


# ---------------------------------------------------------------- bucketing


def pairs_of(mixed, x):
    """Which two of the 1-D points 1, 10, 100, 1000 each bucket mean averages (sums are unique)."""
    by_sum = {x[i, 0].item() + x[j, 0].item(): (i, j) for i in range(4) for j in range(i + 1, 4)}
    return [by_sum[round(2 * v.item(), 6)] for v in mixed[:, 0]]


def test_bucketing_with_s_2_returns_the_means_of_the_pairs_of_a_random_permutation():
    x = column(1.0, 10.0, 100.0, 1000.0)
    mixed, m = Bucketing(s=2, seed=0)(x)
    assert mixed.shape == (2, 1) and m.shape == (2, 4)
    pairs = pairs_of(mixed, x)
    assert sorted(i for pair in pairs for i in pair) == [0, 1, 2, 3]  # the buckets partition the clients
    for b, (i, j) in enumerate(pairs):
        want = torch.zeros(4, dtype=F64)
        want[[i, j]] = 0.5
        torch.testing.assert_close(m[b], want)
    torch.testing.assert_close(mixed, m @ x)


def test_bucketing_replays_with_the_same_seed_and_call_count_and_changes_across_rounds():
    x = column(1.0, 10.0, 100.0, 1000.0)
    a = Bucketing(s=2, seed=7)
    rounds = [a(x)[0] for _ in range(6)]
    # a fresh one with the same seed replays round 1; one told it has done 3 rounds replays round 4
    torch.testing.assert_close(Bucketing(s=2, seed=7)(x)[0], rounds[0], rtol=0, atol=0)
    b = Bucketing(s=2, seed=7)
    b.load_state_dict({"calls": 3})
    torch.testing.assert_close(b(x)[0], rounds[3], rtol=0, atol=0)
    assert a.state_dict() == {"calls": 6}
    # the pairing is drawn afresh each round (3 pairings of 4 clients: 6 rounds do not all agree)
    assert len({tuple(sorted(pairs_of(r, x))) for r in rounds}) > 1


def test_bucketing_last_bucket_is_the_mean_of_the_vectors_left_over():
    x = column(1.0, 10.0, 100.0, 1000.0, 10000.0)
    mixed, m = Bucketing(s=2)(x)
    assert m.shape == (3, 5)
    torch.testing.assert_close(m.sum(1), torch.ones(3, dtype=F64))  # every bucket a mean
    assert sorted((m > 0).sum(1).tolist()) == [1, 2, 2]
    assert torch.equal((m > 0).sum(0), torch.ones(5, dtype=torch.long))  # each client in one bucket


# ---------------------------------------------------------------- clipping and ARC


def test_static_clipping_scales_only_the_vectors_above_c_to_norm_c():
    x = torch.tensor([[3.0, 4.0], [0.6, 0.8], [0.0, 0.0], [0.0, -2.0]], dtype=F64)  # norms 5, 1, 0, 2
    mixed, m = Clipping(c=2.0)(x)
    torch.testing.assert_close(
        mixed, torch.tensor([[1.2, 1.6], [0.6, 0.8], [0.0, 0.0], [0.0, -2.0]], dtype=F64)
    )
    torch.testing.assert_close(m, torch.diag(torch.tensor([0.4, 1.0, 1.0, 1.0], dtype=F64)))


def norms_along_axis(norms):
    """Vectors with the given norms, pointing in alternating directions."""
    x = torch.zeros(len(norms), 2, dtype=F64)
    for i, v in enumerate(norms):
        x[i, i % 2] = v if i % 3 else -v
    return x


@pytest.mark.parametrize(
    "norms, f, k, threshold",
    [
        ([3.0, 1.0, 10.0, 2.0, 4.0], 1, 1, 4.0),  # k = floor(2 * 1/5 * 4) = 1: 10 -> 4
        ([float(v) for v in range(10, 0, -1)], 3, 4, 6.0),  # k = floor(2 * 3/10 * 7) = 4: 10, 9, 8, 7 -> 6
        ([float(v) for v in range(1, 11)], None, 4, 6.0),  # default f = 4: k = floor(2 * 4/10 * 6) = 4
        ([1.0, 2.0, 3.0], 0, 0, None),  # f = 0: k = 0, nothing clipped
    ],
)
def test_arc_clips_exactly_the_k_largest_vectors_to_the_k_plus_first_largest_norm(norms, f, k, threshold):
    x = norms_along_axis(norms)
    mixed, m = ARC(f=f)(x)
    before, after = torch.tensor(norms, dtype=F64), mixed.norm(dim=1)
    changed = ~torch.isclose(after, before)
    assert int(changed.sum()) == k
    if k:
        largest = torch.argsort(before, descending=True)[:k]
        assert set(torch.nonzero(changed).flatten().tolist()) == set(largest.tolist())
        torch.testing.assert_close(after[changed], torch.full((k,), threshold, dtype=F64))
        # clipping keeps the direction
        torch.testing.assert_close(mixed[changed] * (before[changed] / threshold)[:, None], x[changed])
    torch.testing.assert_close(m, torch.diag(after / before))


def test_arc_leaves_a_vector_tied_with_the_threshold_alone():
    x = norms_along_axis([1.0, 5.0, 5.0, 2.0, 3.0])  # f = 1: k = 1, the (k+1)-th largest is the other 5
    mixed, _ = ARC(f=1)(x)
    torch.testing.assert_close(mixed, x)


# ---------------------------------------------------------------- composition


def test_the_two_spellings_build_the_same_rule():
    g = torch.Generator().manual_seed(0)
    r = Round(updates=torch.randn(9, 6, generator=g), num_samples=torch.arange(1.0, 10.0))
    a, b = rule("nnm+median")(r), rule("median", pre=["nnm"])(r)
    torch.testing.assert_close(a.vector, b.vector, rtol=0, atol=0)
    torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=0)
    assert rule("nnm+median").name == rule("median", pre=["nnm"]).name == "nnm+median"
    c = rule("median", pre=["nnm", {"name": "bucketing", "s": 3}])
    assert c.name == "nnm+bucketing+median"
    assert [p.options() for p in c.pre] == [{"f": None}, {"s": 3, "seed": 0}]


def test_a_budget_the_rule_cannot_take_goes_to_the_pre_aggregators_alone():
    """``rule("arc+mean", f=0.2)``: the mean has no f, ARC clips for the budget; a rule without f and no
    stage that takes one still names the option it refused."""
    composed = rule("arc+mean", f=0.2)
    assert composed.name == "arc+mean" and [p.options() for p in composed.pre] == [{"f": 0.2}]
    r = Round(
        updates=torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
        * torch.arange(1.0, 11)[:, None]
    )
    spelt_out = rule("mean", pre=[{"name": "arc", "f": 0.2}])(r)
    torch.testing.assert_close(composed(r).vector, spelt_out.vector, rtol=0, atol=0)
    assert not torch.allclose(spelt_out.vector, rule("mean")(r).vector)  # ARC clipped the two largest
    with pytest.raises(UnknownNameError, match="rule 'mean' has no option 'f'"):
        rule("clipping+mean", f=0.2)


def test_nnm_median_gives_the_far_client_no_trust_by_hand():
    # NNM (f = 1) of 0, 1, 3, 10 is 4/3, 4/3, 4/3, 14/3; their median is 4/3, the middle two ranks shared
    # by the three tied rows (1/3 each), and each of those rows mixes clients 0, 1, 2 by 1/3:
    # trust 1/3, 1/3, 1/3, 0.
    out = rule("nnm+median")(Round(updates=column(0.0, 1.0, 3.0, 10.0)))
    torch.testing.assert_close(out.vector, torch.tensor([4 / 3], dtype=F64))
    torch.testing.assert_close(out.weights, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=F64))
    assert out.info["pre"] == ["nnm"]


def test_nnm_krum_trust_maps_back_to_the_real_clients_and_the_far_one_gets_none():
    # NNM (f = 1, from krum's f) of 0, 1, 2, 3, 100: the first four mix {0, 1, 2, 3} -> 1.5 each, the far
    # one {100, 3, 2, 1} -> 26.5. Krum (f = 1) picks one of the four identical rows, the copies share
    # its weight (1/4 each), and each row gives 1/4 to clients 0..3: trust 1/4 each, 0 for 100.
    agg = rule("nnm+krum", f=1)
    assert agg.pre[0].f == 1
    out = agg(Round(updates=column(0.0, 1.0, 2.0, 3.0, 100.0), client_ids=list("abcde")))
    torch.testing.assert_close(out.vector, torch.tensor([1.5], dtype=F64))
    torch.testing.assert_close(out.weights, torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0], dtype=F64))
    assert out.info["f"] == 1 and out.info["selected"] == ["a"]  # NNM keeps rows: row i is client i's
    assert out.info["clients"]["score"].shape == (5,)  # NNM keeps rows: row i is client i's mixture


def test_clipping_then_mean_trusts_each_client_by_its_scale():
    # norms 5, 1, 1 clipped at 2: scales 0.4, 1, 1; the mean of the clipped rows gives each 1/3, so the
    # coefficients are 0.4/3, 1/3, 1/3 and the trust 0.4/2.4, 1/2.4, 1/2.4
    x = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 1.0]], dtype=F64)
    out = rule("mean", pre=[{"name": "clipping", "c": 2}])(Round(updates=x))
    torch.testing.assert_close(out.vector, torch.tensor([2.2, 2.6], dtype=F64) / 3)
    torch.testing.assert_close(out.weights, torch.tensor([0.4, 1.0, 1.0], dtype=F64) / 2.4)


def test_fedavg_after_bucketing_sees_each_buckets_mean_count():
    x = column(1.0, 10.0, 100.0, 1000.0)
    counts = torch.tensor([1.0, 2.0, 3.0, 6.0])
    out = rule("bucketing+fedavg")(Round(updates=x, num_samples=counts))
    _, m = Bucketing()(x)  # the same stream: the first round's buckets
    bucket_counts = m @ counts.double()
    w_inner = bucket_counts / bucket_counts.sum()
    torch.testing.assert_close(out.vector, w_inner @ (m @ x))
    torch.testing.assert_close(out.weights, w_inner @ m)
    assert "clients" not in out.info  # bucketing does not keep rows


def test_a_quarantined_client_keeps_weight_zero_and_counts_against_f():
    x = column(0.0, 1.0, 3.0, math.nan, 10.0)
    out = rule("median", pre=[{"name": "nnm", "f": 2}])(Round(updates=x, client_ids=list("abcde")))
    assert set(out.info["quarantined"]) == {"d"} and out.weights[3] == 0
    # f = 2 less the quarantined client: NNM mixes 3 of the 4 left, as with f = 1 on them
    want = rule("median", pre=[{"name": "nnm", "f": 1}])(Round(updates=column(0.0, 1.0, 3.0, 10.0)))
    torch.testing.assert_close(out.weights[[0, 1, 2, 4]], want.weights)


def test_a_refused_round_names_the_composed_rule():
    with pytest.raises(RoundRefused, match=r"^nnm\+krum: krum: needs n > 2f \+ 2 clients, got n=5 with f=2"):
        rule("nnm+krum", f=2)(Round(updates=torch.randn(5, 3)))
    with pytest.raises(RoundRefused, match=r"^nnm\+median: nnm: needs n > 2f"):
        rule("median", pre=[{"name": "nnm", "f": 3}])(Round(updates=torch.randn(5, 3)))


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: rule("nmm+median"), UnknownNameError, r"unknown pre-aggregator 'nmm'. Did you mean 'nnm'\?"),
        (lambda: rule("nnm+medain"), UnknownNameError, r"unknown rule 'medain'. Did you mean 'median'\?"),
        (lambda: rule("median", pre=[{"name": "bucketing", "t": 2}]), UnknownNameError,
         r"pre-aggregator 'bucketing' has no option 't'; its options: s \(default 2\), seed \(default 0\)"),
        (lambda: rule("nnm+median", pre=["arc"]), ValueError, r"in the name or in pre=, not both"),
        (lambda: rule("median", pre=[3]), TypeError, r"pre: each pre-aggregator is a name or a"),
        (lambda: rule("median", pre=[{"name": "bucketing", "s": 0}]), ValueError, r"bucketing: s must be >= 1"),
        (lambda: rule("median", pre=[{"name": "clipping", "c": 0}]), ValueError, r"clipping: c must be > 0"),
        (lambda: rule("median", pre=[{"name": "nnm", "f": -1}]), ValueError, r"nnm: f must be >= 0"),
        (lambda: rule("median", pre=[{"name": "arc", "f": 0.5}]), ValueError, r"arc: f \(as a fraction"),
        (lambda: rule("nnm+arfl"), ValueError, r"nnm\+arfl: rule 'arfl' reads the clients' metrics"),
        # the order turned round ("unknown rule 'nnm'" before), or a pre-aggregator alone
        (lambda: rule("median+nnm"), ValueError, r"'nnm' is a pre-aggregator, .* the rule last \(e.g. 'nnm\+median'\)"),
        (lambda: rule("nnm"), ValueError, r"rule 'nnm': 'nnm' is a pre-aggregator"),
    ],
)  # fmt: skip
def test_bad_compositions_are_refused_naming_the_part(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_a_bucketing_composition_resumes_exactly_from_a_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    rounds = [Round(updates=torch.randn(10, 4, generator=g)) for _ in range(4)]  # 5 buckets
    a = rule("bucketing+nnm+krum", f=1)
    for r in rounds[:3]:
        a(r)
    assert a.state_dict() == {"pre": [{"calls": 3}, {}]}
    save_state(tmp_path / "state.safetensors", a.state_dict())
    b = rule("bucketing+nnm+krum", f=1)
    b.load_state_dict(load_state(tmp_path / "state.safetensors"))
    out_a, out_b = a(rounds[3]), b(rounds[3])
    torch.testing.assert_close(out_b.vector, out_a.vector, rtol=0, atol=0)
    torch.testing.assert_close(out_b.weights, out_a.weights, rtol=0, atol=0)
    # a fresh one draws round 1's buckets: another aggregate
    assert not torch.equal(rule("bucketing+nnm+krum", f=1)(rounds[3]).weights, out_a.weights)


def test_the_inner_rules_state_and_the_stages_states_travel_under_their_own_keys():
    g = torch.Generator().manual_seed(2)
    a = rule("centered_clipping", pre=["bucketing"])
    for _ in range(2):
        a(Round(updates=torch.randn(6, 3, generator=g)))
    state = a.state_dict()
    assert (
        set(state) == {"rule", "pre"} and set(state["rule"]) == {"center"} and state["pre"] == [{"calls": 2}]
    )
    b = rule("centered_clipping", pre=["bucketing"])
    b.load_state_dict(state)
    assert b.state_dict()["pre"] == [{"calls": 2}]
    torch.testing.assert_close(b.state_dict()["rule"]["center"], state["rule"]["center"], rtol=0, atol=0)


@pytest.mark.parametrize(
    "state, error, message",
    [
        ({"pre": [{"calls": -1}]}, ValueError, r"^bucketing\+centered_clipping state\['pre'\]\[0\]: .*>= 0"),
        ({"pre": [{}, {}]}, ValueError, r"state\['pre'\]: holds 2 states, expected 1"),
        ({"rule": {"center": torch.ones(2, 2)}}, ValueError, r"state\['rule'\]: centered_clipping state"),
        ({"bogus": 1}, ValueError, r"unknown key 'bogus'"),
        ([1], TypeError, r"expected a mapping"),
    ],
)
def test_a_bad_state_is_refused_and_changes_nothing(state, error, message):
    g = torch.Generator().manual_seed(3)
    a = rule("centered_clipping", pre=["bucketing"])
    for _ in range(2):
        a(Round(updates=torch.randn(6, 3, generator=g)))
    before = a.state_dict()
    # a good stage state with a bad inner state: the stage is rolled back too
    with pytest.raises(error, match=message):
        a.load_state_dict(state if not isinstance(state, dict) else {"pre": [{"calls": 9}], **state})
    after = a.state_dict()
    assert after["pre"] == before["pre"]
    torch.testing.assert_close(after["rule"]["center"], before["rule"]["center"], rtol=0, atol=0)


def test_pre_aggregated_rejects_what_is_not_a_pre_aggregator():
    with pytest.raises(TypeError, match="pre must be a non-empty list of pre-aggregators"):
        PreAggregated([], rule("median"))


# ---------------------------------------------------------------- configs


def test_a_config_accepts_both_spellings_and_names_a_misspelt_pre_aggregator(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rule: {name: nnm+median}\n")
    assert load(path).rule.name == "nnm+median"
    cfg = validate({"rule": {"name": "krum", "f": 1, "pre": ["nnm", {"name": "bucketing", "s": 3}]}})
    assert cfg.rule.options["pre"][1] == {"name": "bucketing", "s": 3}
    path.write_text("rule: {name: nmm+median}\n")
    with pytest.raises(
        ConfigError, match=r"run.yaml: rule: unknown pre-aggregator 'nmm'. Did you mean 'nnm'\?"
    ):
        load(path)
    with pytest.raises(ConfigError, match=r"^rule: pre-aggregator 'bucketing' has no option 'size'"):
        validate({"rule": {"name": "median", "pre": [{"name": "bucketing", "size": 3}]}})


def test_a_config_run_aggregates_with_the_composed_rule():
    from fedtrust.sweeps.runner import build_simulation

    cfg = validate(
        {"data": {"clients": 6}, "train": {"rounds": 1}, "rule": {"name": "arc+nnm+trimmed_mean", "f": 1}}
    )
    sim = build_simulation(cfg)
    assert isinstance(sim.rule, PreAggregated) and sim.rule.name == "arc+nnm+trimmed_mean"
    assert [p.f for p in sim.rule.pre] == [1, 1]


def test_the_flower_strategy_builds_a_composed_rule_by_name():
    pytest.importorskip("flwr")
    from fedtrust.flower import TrustStrategy

    assert TrustStrategy(rule="nnm+median").rule.name == "nnm+median"
    assert TrustStrategy(rule="median", rule_options={"pre": ["arc"]}).rule.name == "arc+median"


def test_a_rule_with_per_client_state_keeps_it_by_client_behind_row_keeping_stages_only():
    # behind NNM row i is client i's mixture: FoolsGold's history is kept under the real ids, so a round
    # with other clients sampled does not add unrelated histories together
    gold = rule("nnm+foolsgold")
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
    gold(Round(updates=x, client_ids=list("abcdef")))
    gold(Round(updates=x[:5], client_ids=list("bcdeg")))
    assert sorted(gold.rule.state_dict()["history"]) == list("abcdefg")
    # after bucketing a row is a random bucket: such a rule, or a fraction of buckets as f, is refused
    for name in ("foolsgold", "ivar_mle", "cfl"):
        with pytest.raises(ValueError, match=f"rule '{name}' keeps state per client"):
            rule(f"bucketing+{name}")
    with pytest.raises(ValueError, match=r"f=0.2 after bucketing would be a fraction of the buckets"):
        rule("krum", f=0.2, pre=[{"name": "bucketing", "s": 2}])
    assert rule("krum", f=2, pre=[{"name": "bucketing", "s": 2}]).rule.f == 2  # a count is what it means


def test_a_stage_after_bucketing_counts_its_f_in_clients_and_its_default_in_buckets(monkeypatch):
    """A stage's fractional f after bucketing was taken (the rule's was refused) and counted buckets and
    quarantined clients together: ARC with f=0.2 on 20 clients, 2 of them quarantined, clipped nothing. It
    is refused like the rule's; a count is corrupted clients; f=None is half the buckets."""
    from fedtrust.aggregators import pre

    for spec in ("bucketing+arc+mean", "bucketing+nnm+median"):
        with pytest.raises(ValueError, match=r"(arc|nnm)'s f=0.2 after bucketing would be a fraction"):
            rule(spec, f=0.2)
    x = torch.randn(20, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    x[:2] = math.nan  # two quarantined: 18 clients, 9 buckets
    budgets = []
    budget = pre._budget
    monkeypatch.setattr(pre, "_budget", lambda *a: budgets.append(budget(*a)) or budgets[-1])
    for f in (None, 4):
        rule("bucketing+arc+mean", f=f)(Round(updates=x))
    assert budgets == [4, 2]  # half the 9 buckets; 4 corrupted clients less the 2 quarantined
