"""Bad input gets a clear error naming the field and the value; a client's malformed update is
quarantined with a recorded reason and the round goes on."""

import math

import numpy as np
import pytest
import torch
from conftest import dtype_tol
from test_rule_properties import OPTIONS, Benchmark, make

from fedtrust import NoValidUpdates, Round, available, rule
from fedtrust.aggregators import RoundRefused
from fedtrust.aggregators.screening import has_first_pass
from fedtrust.rules import UnknownRuleError
from fedtrust.server import server_step


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"updates": torch.zeros(5)},
            ValueError,
            r"Round.updates must be a 2-D \(n_clients, d\) array, got shape \(5,\)",
        ),
        ({"updates": torch.zeros(2, 3, 4)}, ValueError, r"got shape \(2, 3, 4\)"),
        ({"updates": torch.zeros(0, 3)}, ValueError, r"Round.updates is empty"),
        ({"updates": torch.zeros(3, 0)}, ValueError, r"zero coordinates"),
        (
            {"updates": torch.zeros(2, 3, dtype=torch.int64)},
            TypeError,
            r"floating-point numbers, got dtype torch.int64",
        ),
        ({"updates": torch.zeros(2, 3, dtype=torch.bool)}, TypeError, r"real numbers, got dtype torch.bool"),
        ({"updates": torch.zeros(2, 3, dtype=torch.complex64)}, TypeError, r"real numbers"),
        (  # one client's row in a list: stacked, a bool row became 1.0s and got the mean's share
            {"updates": [torch.zeros(3), torch.ones(3, dtype=torch.bool)]},
            TypeError,
            r"^Round.updates\[1\] has dtype torch.bool among rows of torch.float32",
        ),
        (
            {"updates": [torch.zeros(3), torch.zeros(2)]},
            ValueError,
            r"^Round.updates\[1\] has shape \(2,\), Round.updates\[0\] \(3,\): the rows must have one shape$",
        ),
        ({"updates": [[0.0, 1.0], [2.0]]}, TypeError, r"got list \(setting an array element with a sequence"),
        ({"updates": "garbage"}, TypeError, r"Round.updates"),
        # each failed inside torch, or with "must be array-like numbers, got list"
        (
            {"updates": torch.zeros(2, 3, dtype=torch.float8_e4m3fn)},
            TypeError,
            r"^Round.updates holds torch.float8_e4m3fn, which the rules cannot compute in; give float16, "
            r"bfloat16, float32 or float64$",
        ),
        (
            {"updates": torch.zeros(2, 3), "num_samples": [2**70, 1]},
            TypeError,
            r"^Round.num_samples holds 1180591620717411303424 \(int\): an integer beyond int64 \(give it as "
            r"a float\)$",
        ),
        ({"updates": torch.zeros(2, 3), "num_samples": [1, None]}, TypeError, r"holds None \(NoneType\)"),
        pytest.param(
            {"updates": np.zeros((2, 3), dtype=np.longdouble)},
            TypeError,
            r"^Round.updates must be array-like numbers torch reads, got ndarray of dtype float128$",
            marks=pytest.mark.skipif(
                np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is float64 here"
            ),
        ),
        (
            {"updates": torch.zeros(2, 3), "client_ids": ["a"]},
            ValueError,
            r"client_ids must have one id per update \(2\), got 1",
        ),
        ({"updates": torch.zeros(2, 3), "client_ids": ["a", "a"]}, ValueError, r"'a' appears 2 times"),
        (  # both quarantined, the round's record kept one reason (it names clients by str(id))
            {"updates": torch.zeros(2, 3), "client_ids": [1, "1"]},
            ValueError,
            r"client_ids 1 and '1' would both be named '1' in the round's records",
        ),
        (
            {"updates": torch.zeros(4, 3), "client_ids": [1, "1", 2, "2"]},
            ValueError,
            r"client_ids 1 and '1' would both be named '1'",
        ),
        ({"updates": torch.zeros(2, 3), "client_ids": "ab"}, TypeError, r"client_ids must be a sequence"),
        (
            {"updates": torch.zeros(2, 3), "client_ids": [("site", 1), ("site", 2)]},
            TypeError,
            r"client_ids must be str or int \(a rule keys its state and checkpoints by them\), got \('site', 1\)",
        ),
        ({"updates": torch.zeros(2, 3), "client_ids": [None, 2]}, TypeError, r"got None \(NoneType\)"),
        (  # a table of six counts for six clients is not read row by row
            {"updates": torch.zeros(6, 3), "num_samples": torch.ones(2, 3)},
            ValueError,
            r"^Round.num_samples must be one value per client, got shape \(2, 3\)$",
        ),
        (
            {"updates": torch.zeros(6, 3), "metrics": {"train_loss": torch.ones(3, 2)}},
            ValueError,
            r"^Round.metrics\['train_loss'\] must be one value per client, got shape \(3, 2\)$",
        ),
        (
            {"updates": torch.zeros(2, 3), "num_samples": [1, 2, 3]},
            ValueError,
            r"num_samples must have one entry per client \(2\), got 3",
        ),
        (
            {"updates": torch.zeros(2, 3), "metrics": {"train_loss": [1.0]}},
            ValueError,
            r"metrics\['train_loss'\] must have one value per client \(2\), got 1",
        ),
        ({"updates": torch.zeros(2, 3), "metrics": [1, 2]}, TypeError, r"Round.metrics must be a mapping"),
        (
            {"updates": torch.zeros(2, 3), "previous": torch.zeros(4)},
            ValueError,
            r"previous must have d=3 entries",
        ),
        (
            {"updates": torch.zeros(2, 3), "previous": torch.tensor([0.0, math.nan, 0.0])},
            ValueError,
            r"previous .* non-finite",
        ),
        ({"updates": torch.zeros(2, 3), "reference": 3}, TypeError, r"reference must be callable"),
    ],
)
def test_malformed_rounds_name_the_field_and_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        Round(**kwargs)


def test_numpy_ids_are_ints_and_a_rules_state_keyed_by_them_saves(tmp_path):
    """ids taken from a numpy array as a list (np.int64) worked every round but failed at checkpoint
    time ("dict keys must be str or int"), far from where they came in (a hostile-input review)."""
    from fedtrust import rule
    from fedtrust.checkpoint import load_state, save_state

    arfl = rule("arfl")
    arfl(
        Round(updates=torch.randn(5, 3), client_ids=list(np.arange(5)), metrics={"train_loss": torch.rand(5)})
    )
    save_state(tmp_path / "arfl.safetensors", arfl.state_dict())
    assert set(load_state(tmp_path / "arfl.safetensors")["loss"]) == {0, 1, 2, 3, 4}


def test_round_accepts_numpy_lists_and_half_precision():
    r = Round(updates=np.ones((3, 2)), num_samples=[1, 2, 3], client_ids=np.array([7, 8, 9]))
    assert r.updates.dtype == torch.float64 and r.client_ids == (7, 8, 9)
    assert Round(updates=torch.ones(2, 2, dtype=torch.float16)).updates.dtype == torch.float32
    assert Round(updates=[[1.0, 2.0]]).n == 1
    x = np.arange(6.0).reshape(3, 2)
    flipped = Round(updates=x[::-1], num_samples=np.array([1, 2, 3])[::-1])  # views torch cannot share
    assert flipped.updates.tolist() == x[::-1].tolist() and flipped.num_samples.tolist() == [3, 2, 1]


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_updates_are_read_as_dense(layout):
    """A sparse round (torch's COO or CSR layout, as a sparse gradient gives) failed inside numpy or a
    kernel ("Sparse CSR tensors do not have strides"); it is the same round dense."""
    x = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))
    x[x.abs() < 0.8] = 0
    sparse = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    for updates in (sparse, list(sparse.to_dense().to_sparse())):
        out = rule("median")(Round(updates=updates, client_ids=list("abcde")))
        torch.testing.assert_close(out.vector, rule("median")(Round(updates=x)).vector)


def test_rule_rejects_something_that_is_not_a_round():
    with pytest.raises(TypeError, match="expected a fedtrust Round, got ndarray"):
        rule("median")(np.zeros((3, 3)))


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_update_is_quarantined_not_fatal(name, poison):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 6, generator=g)
    x[4, 2] = poison
    ids = [f"client-{i}" for i in range(12)]
    losses = torch.linspace(0.1, 1.0, 12)
    extra = {"metrics": {"train_loss": losses}, "reference": Benchmark(6)}
    out = make(name)(Round(updates=x, client_ids=ids, **extra))
    assert torch.isfinite(out.vector).all()
    assert out.weights[4] == 0 and out.weights.sum().item() == pytest.approx(1.0)
    assert list(out.info["quarantined"]) == ["client-4"]
    assert "non-finite" in out.info["quarantined"]["client-4"]
    for values in out.info.get("clients", {}).values():
        assert values.shape == (12,) and math.isnan(values[4])
    # and it equals the rule on the other clients alone, with the quarantined (known-faulty) client
    # counted against the Byzantine budget f
    keep = [i for i in range(12) if i != 4]
    options = dict(OPTIONS.get(name, {}))
    if "f" in options:
        options["f"] -= 1
    extra["metrics"] = {"train_loss": losses[keep]}
    clean = rule(name, **options)(Round(updates=x[keep], client_ids=[ids[i] for i in keep], **extra))
    torch.testing.assert_close(out.vector, clean.vector)


def test_overflowing_update_is_quarantined():
    x = torch.randn(5, 4)
    x[1] = 3e19  # finite in float32, but its squared norm is not
    out = rule("geometric_median")(Round(updates=x))
    assert "too large to square in float32" in out.info["quarantined"][1]
    assert torch.isfinite(out.vector).all()
    # the mean screens by its result (one pass): a large finite update is harmless to it and is kept
    out = rule("mean")(Round(updates=x))
    assert "quarantined" not in out.info
    torch.testing.assert_close(out.vector, x.mean(0))


def test_quarantine_reasons_name_what_overflowed():
    """The reasons said 'update norm 2.83e+19 overflows float32' (the norm fits; its square does not),
    the same of a bfloat16 update (squared in float32, the round's dtype), and 'num_samples=inf' of a
    client that reported 1e300 (float32 made it inf)."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    x[5] = 1e19
    assert rule("median")(Round(updates=x)).info["quarantined"] == {
        5: "update norm 2.83e+19 is too large to square in float32, the round's dtype (its square exceeds "
        "3.4e+38; the norm limit is 1.84e+19)"
    }
    x = x.bfloat16()
    x[5] = 1e30
    assert (
        rule("krum")(Round(updates=x))
        .info["quarantined"][5]
        .startswith("update norm 2.83e+30 is too large to square in float32, the round's dtype")
    )
    x = x.double()  # the norm is taken without squaring entries past float64's range
    x[5] = 1e300
    assert (
        rule("median")(Round(updates=x))
        .info["quarantined"][5]
        .startswith("update norm 2.83e+300 is too large to square in float64")
    )
    out = rule("median")(Round(updates=torch.randn(6, 8), num_samples=[1e300, math.inf, 1, 1, 1, 1]))
    assert out.info["quarantined"] == {
        0: "num_samples=1e+300 overflows float32, the round's dtype (max 3.4e+38)",
        1: "num_samples=inf is not a finite non-negative count",
    }


@pytest.mark.parametrize("name", ["mean", "fedavg"])
def test_the_mean_keeps_finite_updates_of_any_size_whatever_else_the_round_holds(name):
    """The mean and FedAvg quarantine an update for a NaN or Inf, never for its size: two clients at 3e38
    (the mean's entries, 1.2e38, sum past float32's range over four coordinates), or beside a client
    with a NaN, are kept (both were quarantined for their norms before)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    x[:2] = 3e38
    out = rule(name)(Round(updates=x))
    assert "quarantined" not in out.info
    torch.testing.assert_close(out.vector, x.double().mean(0).float())  # (x.mean(0) itself overflows)
    x[2, 0] = math.nan
    out = rule(name)(Round(updates=x))
    assert list(out.info["quarantined"]) == [2] and "non-finite entries" in out.info["quarantined"][2]
    torch.testing.assert_close(out.vector, x[[0, 1, 3, 4]].double().mean(0).float())


def test_bad_sample_count_and_bad_metric_are_quarantined():
    x = torch.randn(5, 4)
    out = rule("fedavg")(Round(updates=x, num_samples=[1, -2, 3, math.nan, 5]))
    assert set(out.info["quarantined"]) == {1, 3}
    assert out.weights.tolist() == pytest.approx([1 / 9, 0, 3 / 9, 0, 5 / 9])


def test_all_clients_quarantined_is_a_clear_error():
    with pytest.raises(NoValidUpdates, match="all 2 clients were quarantined"):
        rule("mean")(Round(updates=torch.full((2, 3), math.nan)))


def test_quarantined_clients_count_against_the_byzantine_budget():
    # Krum with f = 2 needs n >= 7; one of 7 clients sends NaN: it was faulty, so f drops to 1 and
    # the remaining 6 clients still satisfy n > 2f + 2.
    x = torch.randn(7, 3)
    x[0, 0] = math.nan
    out = rule("krum", f=2)(Round(updates=x))
    assert out.info["f"] == 1 and 0 in out.info["quarantined"]


def test_a_round_refused_after_the_quarantine_still_names_the_quarantined_clients():
    """Krum with f = 2 on 5 clients, one of them NaN: the rest (4, f now 1) are too few, and the refusal
    carries the front door's reason, so the server's record of the refused round names the client."""
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    x[0, 0] = math.nan
    with pytest.raises(RoundRefused, match=r"needs n > 2f \+ 2 clients, got n=4 with f=1") as refused:
        rule("krum", f=2)(Round(updates=x))
    assert set(refused.value.quarantined) == {0}
    step = server_step(rule("krum", f=2), Round(updates=x), torch.zeros(3), lambda a: a)
    assert step.error.startswith("RoundRefused") and set(step.quarantined) == {"0"}


def test_too_few_clients_for_f_is_a_clear_error():
    with pytest.raises(ValueError, match=r"krum: needs n > 2f \+ 2 clients, got n=5 with f=2"):
        rule("krum", f=2)(Round(updates=torch.randn(5, 3)))
    with pytest.raises(ValueError, match=r"bulyan: needs n >= 4f \+ 3 clients, got n=10 with f=2"):
        rule("bulyan", f=2)(Round(updates=torch.randn(10, 3)))
    with pytest.raises(ValueError, match=r"trimmed_mean: needs n > 2f clients, got n=4 with f=2"):
        rule("trimmed_mean", f=2)(Round(updates=torch.randn(4, 3)))


def test_fraction_f_resolves_against_the_round_size():
    out = rule("trimmed_mean", f=0.2)(Round(updates=torch.randn(10, 3)))
    assert out.info["trimmed_per_side"] == 2


def test_zero_total_samples_is_a_clear_error():
    with pytest.raises(ValueError, match="num_samples sum to 0"):
        rule("fedavg")(Round(updates=torch.randn(3, 2), num_samples=[0, 0, 0]))


def test_missing_required_metric_is_a_clear_error():
    class NeedsLoss(type(rule("mean"))):
        requires = ("train_loss",)

    with pytest.raises(ValueError, match=r"mean needs metric 'train_loss' in Round.metrics; got none"):
        NeedsLoss()(Round(updates=torch.randn(3, 2)))
    with pytest.raises(ValueError, match=r"^arfl needs metric 'train_loss'"):
        rule("arfl")(Round(updates=torch.randn(3, 2)))
    out = NeedsLoss()(Round(updates=torch.randn(3, 2), metrics={"train_loss": [0.1, math.inf, 0.3]}))
    assert "metric train_loss=inf is not finite" in out.info["quarantined"][1]


# ---------------------------------------------------------------- the registry


def test_unknown_rule_lists_the_valid_names_and_suggests_one():
    with pytest.raises(
        UnknownRuleError, match=r"unknown rule 'krumm'. Did you mean 'krum'\? Valid rules: mean, fedavg"
    ):
        rule("krumm")


def test_unknown_option_lists_the_valid_options():
    with pytest.raises(
        UnknownRuleError, match=r"rule 'krum' has no option 'g'; its options: f \(default 0\)"
    ):
        rule("krum", g=1)


def test_an_option_yaml_read_as_one_key_is_named_as_such():
    """``--set 'rule={name:bogus}'`` (no space after the colon) is YAML's key "name:bogus" with no value:
    the error said only that the rule has no option 'name:bogus'."""
    from fedtrust.registry import yaml_value

    options = yaml_value("{f:1}")
    assert options == {"f:1": None}
    with pytest.raises(UnknownRuleError, match=r"no option 'f:1' \(YAML reads \"f:1\" with no space after "
                       r"the colon as one key; write \"f: 1\"\); its options: f"):  # fmt: skip
        rule("krum", **options)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("krum", {"f": -1}, r"krum: f must be >= 0, got -1"),
        (
            "krum",
            {"f": "two"},
            r"krum: f must be a count \(an integer >= 0\) or a fraction of the clients .* got 'two'",
        ),
        ("krum", {"f": 0.7}, r"krum: f \(as a fraction of the clients\) must be <= 0.4999999, got 0.7"),
        ("multi_krum", {"m": 0}, r"multi_krum: m must be >= 1, got 0"),
        ("geometric_median", {"nu": 0.0}, r"geometric_median: nu must be > 0.0, got 0.0"),
        ("geometric_median", {"max_iter": 2.5}, r"geometric_median: max_iter must be an integer, got 2.5"),
        ("geometric_median", {"weighted": "yes"}, r"weighted must be True or False, got 'yes'"),
        ("centered_clipping", {"tau": math.inf}, r"centered_clipping: tau must be finite, got inf"),
        ("cfl", {"max_cross_similarity": 2.0}, r"cfl: max_cross_similarity must be <= 1.0, got 2.0"),
        (
            "centered_clipping",
            {"n_iter": 10**9},
            r"centered_clipping: n_iter must be <= 1000, got 1000000000",
        ),
    ],
)
def test_bad_option_values_name_the_option_and_value(name, options, message):
    with pytest.raises((TypeError, ValueError), match=message):
        rule(name, **options)


@pytest.mark.parametrize("name", available())
def test_every_rule_builds_with_defaults_and_says_where_it_comes_from(name):
    r = rule(name)
    assert r.name == name and r.paper
    assert isinstance(r.state_dict(), dict)


SCREEN_IN_FIRST_PASS = [name for name in available() if has_first_pass(rule(name))]


def test_which_rules_screen_in_their_first_pass():
    """Every rule whose first pass can take the norms before it uses them declares ``first_pass``; the
    mean and FedAvg screen by their result (``FirstPass.finite``), FedAG by its base rule's pass. ARFL
    and CFL read the norms the front door's own screening pass takes."""
    assert set(SCREEN_IN_FIRST_PASS) == {
        "geometric_median", "centered_clipping", "ivar_mle", "ivar_vb", "icov_mle", "icov_vb",
        "krum", "multi_krum", "bulyan", "median", "trimmed_mean", "mean", "fedavg", "fedag", "focus",
    }  # fmt: skip
    x = torch.randn(4, 6)
    first = rule("mean").first_pass(Round(updates=x))
    assert first.norms is None and first.finite


def _inputs(name: str, n: int, keep: list[int] | None = None) -> dict:
    """What a rule reads beside the updates, for a round of n clients (``keep``: of those clients only):
    the training losses it requires and a benchmark to score on (FOCUS)."""
    r, out = rule(name), {}
    if "train_loss" in r.requires:
        loss = torch.linspace(1.0, 2.0, n)
        out["metrics"] = {"train_loss": loss if keep is None else loss[keep]}
    if getattr(r, "reads_reference", ()):
        out["reference"] = _bench
    return out


@pytest.mark.parametrize("name", SCREEN_IN_FIRST_PASS)
@pytest.mark.parametrize("n", [8, 14])  # IVAR-MLE: the Gram path and the direct passes
def test_a_rule_that_screens_in_its_first_pass_costs_no_screening_pass_and_quarantines_the_same(
    name, n, monkeypatch
):
    """On a clean round the front door takes no norms itself: the rule's first pass hands them over. On a
    poisoned round the rule is stopped after that pass and run on the rest: over two rounds its
    aggregate and trust weights equal the clean clients' alone (its state was not touched by the stopped
    run). The quarantined client counts against a Byzantine budget f, as always.

    "Equal" for an iterative rule means within its stopping tolerance of the same fixed point: the two
    paths take the norms in differently sized chunks (the screening sees n clients, the rule's pass
    n - 1), which moves them by a rounding and may move the stopping iteration by one."""
    import fedtrust.aggregators.core as core

    options = {"f": 1} if "f" in rule(name).options() else OPTIONS.get(name, {})
    clean_options = {"f": 0} if "f" in options else options

    screening = []
    real_row_norms = core.row_norms  # counted, not replaced: both paths get the same norms function
    monkeypatch.setattr(core, "row_norms", lambda x: screening.append(1) or real_row_norms(x))
    g = torch.Generator().manual_seed(2)
    rounds = [torch.randn(n, 50, generator=g) + 0.1 * k for k in range(2)]
    clean_round = Round(updates=rounds[0], **_inputs(name, n))
    rule(name, **options)(clean_round)
    assert not screening
    first = rule(name, **options).first_pass(clean_round)
    if first.norms is not None:
        exact = rounds[0].double().norm(dim=1)
        torch.testing.assert_close(first.norms, exact, **dtype_tol(torch.float32))

    poisoned, clean = rule(name, **options), rule(name, **clean_options)
    keep = [i for i in range(n) if i != 3]
    for x in rounds:
        bad = x.clone()
        bad[3, 7] = math.nan
        out = poisoned(Round(updates=bad, **_inputs(name, n)))
        assert screening and "non-finite" in out.info["quarantined"][3]
        ref = clean(Round(updates=x[keep], client_ids=keep, **_inputs(name, n, keep)))
        scale = float(x[keep].abs().max())
        torch.testing.assert_close(out.vector, ref.vector, **dtype_tol(x.dtype, 4, scale))
        torch.testing.assert_close(out.weights[keep], ref.weights, **dtype_tol(x.dtype, 4))


# ---------------------------------------------------------------- degenerate weights (issue 16, item 6)


def _weights_ok(out, n):
    assert torch.isfinite(out.vector).all() and torch.isfinite(out.weights).all()
    assert (out.weights >= 0).all() and float(out.weights.double().sum()) == pytest.approx(1.0, abs=1e-6)
    assert out.weights.shape == (n,)


def _bench(v):
    return float(v.double().square().mean())


def test_focus_with_every_count_zero_falls_back_to_credibility_not_nan():
    focus = rule("focus")
    x = torch.tensor([[1.0], [2.0], [1.5]])
    for _ in range(2):  # the second round has credibilities
        out = focus(
            Round(
                updates=x, num_samples=torch.zeros(3), metrics={"train_loss": torch.ones(3)}, reference=_bench
            )
        )
        _weights_ok(out, 3)


def test_focus_counts_a_benchmark_loss_it_cannot_measure_as_the_worst():
    focus = rule("focus")
    x = torch.tensor([[1.0], [2.0], [1.5]])
    losses = iter([math.nan, 1.0, 2.0] * 2)
    r = Round(updates=x, metrics={"train_loss": torch.ones(3)}, reference=lambda v: next(losses))
    focus(r)
    assert focus.state_dict()["ls"][0] == math.inf
    out = focus(r)
    _weights_ok(out, 3)
    assert out.weights[0] == 0 and out.info["clients"]["credibility"][0] == 0


@pytest.mark.parametrize("name", ["mean", "fedavg"])
@pytest.mark.parametrize("rows", [[1e38], [3e38, 3e38], [3e38, 3e38, -3e38, 1e38]])
def test_a_mean_of_huge_float32_clients_is_finite_or_quarantines(name, rows):
    out = rule(name)(Round(updates=torch.tensor(rows)[:, None]))
    _weights_ok(out, len(rows))


def test_fedavg_counts_whose_sum_overflows_still_weigh():
    out = rule("fedavg")(Round(updates=torch.tensor([[1.0], [3.0]]), num_samples=torch.tensor([3e38, 3e38])))
    _weights_ok(out, 2)
    assert out.weights.tolist() == [0.5, 0.5] and out.vector.item() == 2.0


def test_arfl_with_counts_and_losses_near_the_float64_limit_is_finite():
    arfl = rule("arfl")
    r = Round(
        updates=torch.randn(4, 3, dtype=torch.float64),
        num_samples=torch.tensor([1e300, 1e300, 1e300, 1.0], dtype=torch.float64),
        metrics={"train_loss": torch.tensor([1e300, 1.0, 2.0, 0.0], dtype=torch.float64)},
    )
    for _ in range(2):
        _weights_ok(arfl(r), 4)
    spread = Round(
        updates=torch.randn(2, 3, dtype=torch.float64),
        metrics={"train_loss": torch.tensor([1.7e308, 0.0], dtype=torch.float64)},
    )
    out = rule("arfl")(spread)  # the limit of eq 9: all weight on the lower loss
    _weights_ok(out, 2)
    assert out.weights.tolist() == [0.0, 1.0]


def test_arfl_weighs_an_update_it_cannot_measure_on_the_benchmark_at_zero_and_goes_on():
    """An update whose loss on the trusted split is NaN (a huge but finite update through an MLP) gets
    weight 0 that round; the rule's state stays finite, so later rounds and its checkpoint still work."""
    arfl = rule("arfl", defence="benchmark")

    def reference(v):
        return math.nan if v.abs().max() > 1e4 else float(v.square().mean())

    x = torch.randn(8, 20)
    x[3] *= 1e6
    out = arfl(Round(updates=x, metrics={"train_loss": torch.ones(8)}, reference=reference))
    _weights_ok(out, 8)
    assert out.weights[3] == 0 and "benchmark split is nan" in out.info["left_out"][3]
    later = Round(updates=torch.randn(5, 20), client_ids=list("abcde"), metrics={"train_loss": torch.ones(5)},
                  reference=reference)  # fmt: skip
    _weights_ok(arfl(later), 5)
    rule("arfl", defence="benchmark").load_state_dict(arfl.state_dict())


@pytest.mark.parametrize("name", ["geometric_median", "flame", "ivar_mle", "icov_vb", "median"])
def test_updates_that_require_grad_are_read_as_values(name):
    x = torch.randn(8, 20, requires_grad=True)
    out = rule(name)(Round(updates=x))
    assert not out.vector.requires_grad and torch.isfinite(out.vector).all()
    rows = Round(updates=[r for r in torch.randn(3, 4, requires_grad=True)])
    assert rows.updates.shape == (3, 4)


def test_inference_estimators_refuse_bad_options_and_data_naming_them():
    from fedtrust.inference import icov_mle, icov_vb, ivar_mle, ivar_vb

    e = torch.randn(6, 5, 3)
    big = e.clone()
    big[2, 1] = 1e30
    huge = e.double()
    huge[1, 3, 0] = 1e160
    for call, error, message in [
        (lambda: ivar_mle(e, max_iter=0), ValueError, r"ivar_mle: max_iter must be >= 1, got 0"),
        (lambda: ivar_vb(e, max_iter=True), TypeError, r"ivar_vb: max_iter must be an integer"),
        (lambda: ivar_mle(e, eps=math.nan), ValueError, r"ivar_mle: eps must be finite"),
        (lambda: ivar_vb(e, tau2=0.0), ValueError, r"ivar_vb: tau2 must be > 0"),
        (lambda: ivar_mle(e, init_noise=torch.ones(7)), ValueError, r"one variance per source \(5\), got 7"),
        (lambda: ivar_mle(e, init_noise=torch.zeros(5)), ValueError, r"init_noise\[0\] = 0.0"),
        (lambda: ivar_vb(e.to(torch.complex64)), TypeError, r"real numbers, got dtype torch.complex64"),
        (
            lambda: ivar_vb(big),
            ValueError,
            r"estimates\[2, 1\] reaches 1e\+30: its square, summed over the 6 x 5 "
            r"estimates, overflows torch.float32 \(rescale the estimates, or give them in float64\)",
        ),
        # finite, and so is its norm, but not the sums of squares every estimator forms: refused, not NaN
        (
            lambda: ivar_vb(huge),
            ValueError,
            r"estimates\[1, 3\] reaches 1e\+160: its square, summed over the "
            r"6 x 5 estimates, overflows torch.float64 \(rescale the estimates\)$",
        ),
        (lambda: ivar_mle(e, mask=torch.full((6, 5), 0.5)), ValueError, r"mask must be bool"),
        (lambda: icov_mle(e, latent_dim=0), ValueError, r"icov_mle: latent_dim must be >= 1"),
        (lambda: icov_mle(e, steps=0), ValueError, r"icov_mle: steps must be >= 1"),
        (lambda: icov_mle(e, init=[1]), TypeError, r"icov_mle: init must be a dict"),
        (lambda: icov_vb(e, source_keys=[1, 2]), ValueError, r"source_keys needs one id per source \(5\)"),
        (lambda: icov_vb(e, ard="yes"), TypeError, r"icov_vb: ard must be True or False"),
    ]:
        with pytest.raises(error, match=message):
            call()
    assert ivar_mle(e, mask=torch.ones(6, 5, dtype=torch.int64)).iterations >= 1  # 0/1 integers are a mask


def test_one_line_specs_read_numbers_lists_and_refuse_what_is_ambiguous():
    from fedtrust.registry import parse_spec

    assert parse_spec("geometric_median(nu=1e-6)") == ("geometric_median", {"nu": 1e-6})
    assert parse_spec("median(pre=[nnm, bucketing])") == ("median", {"pre": ["nnm", "bucketing"]})
    assert parse_spec("a(s='x,y', b=2)") == ("a", {"s": "x,y", "b": 2})
    for spec, message in [("multi_krum(m=)", "option 'm' has no value"), ("krum(f=1, f=2)", "'f' is given twice"),
                          ("krum(f=[1)", "'f': '\\[1' is not a YAML value")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_spec(spec)


def test_an_attack_context_refuses_a_mask_that_is_not_bool_and_mimic_survives_a_round_without_finite_rows():
    from fedtrust.attacks import AttackContext, attack, sent_by

    x = torch.randn(8, 4)
    with pytest.raises(
        TypeError, match=r"AttackContext.bad must be an \(8,\) bool tensor .* got torch.int64"
    ):
        AttackContext(x, torch.tensor([0, 1, 1, 0, 0, 0, 0, 0]), torch.zeros(4), "params", torch.Generator())
    bad = torch.tensor([0, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    nan = torch.full((8, 4), math.nan)
    sent = sent_by(attack("mimic"), AttackContext(nan, bad, torch.zeros(4), "params", torch.Generator()))
    assert sent.shape == (2, 4)  # a copy of a NaN row: the server quarantines it; the round goes on


@pytest.mark.parametrize("name", ["ivar_mle", "icov_vb"])
def test_a_window_longer_than_any_run_keeps_every_round(name):
    """window=10**30 overflowed the history's deque (OverflowError in every round); it means every round,
    and the state round-trips."""
    agg = rule(name, window=10**30, **({"max_iter": 20} if name == "icov_vb" else {}))
    x = torch.randn(6, 30, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        agg(Round(updates=x, client_ids=list("abcdef")))
    assert len(agg.state_dict()["history"]) == 3  # every round so far, for the next
    again = rule(name, window=10**30)
    again.load_state_dict(agg.state_dict())


def test_a_loss_beyond_float32_is_quarantined_saying_it_overflowed():
    """Metrics take the updates' dtype, so a float32 round reads a reported loss of 1e300 as inf: the
    reason says so, rather than that the client sent inf."""
    r = Round(
        updates=torch.randn(5, 10, generator=torch.Generator().manual_seed(0)),
        client_ids=list("abcde"),
        metrics={"train_loss": torch.tensor([0.5, 0.6, 0.7, 1e300, 0.4], dtype=torch.float64)},
    )
    out = rule("arfl")(r)
    assert out.info["quarantined"] == {
        "d": "metric train_loss=inf is not finite in float32, the round's dtype (a value beyond 3.4e+38 "
        "overflows it)"
    }


def test_big_endian_updates_are_read_as_their_numbers():
    """A big-endian numpy array (">f4", as some file formats store floats) was refused ("dtype >f4")."""
    x = np.arange(6, dtype=">f4").reshape(2, 3)
    assert torch.equal(Round(updates=x).updates, torch.arange(6.0).reshape(2, 3))


def test_counts_given_as_scalar_tensors_may_mix_integers_and_floats():
    """The same-kind check of a list of rows is for updates' rows: a client's count or metric as a 0-d
    integer tensor beside a float one is a number like any other."""
    r = Round(updates=torch.zeros(2, 3), num_samples=[torch.tensor(10), torch.tensor(2.5)])
    assert r.num_samples.tolist() == [10.0, 2.5]
