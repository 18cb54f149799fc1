"""Property-based fuzzing of every registered rule (issue 16, item 8).

Random shapes and dtypes, NaN/Inf patterns in random rows, huge (up to the dtype's limit) and tiny
(subnormal) magnitudes, duplicated clients, garbage counts and metrics: each call either returns an
Aggregate whose vector is finite and whose weights are finite, non-negative and sum to 1, with every
malformed client quarantined (weight 0, a reason), or raises the library's documented errors
(NoValidUpdates, or a ValueError / TypeError whose message names the rule or the field). Garbage state
trees are refused with ValueError / TypeError, or accepted and the rule still aggregates finitely.
"""

import functools
import math
import re

import pytest
import torch
from conftest import assert_tree_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedtrust.inference.rules as inference_rules
from fedtrust import Round, rule
from fedtrust.aggregators import Aggregate, BaseRule, NoValidUpdates
from fedtrust.rules import available

#: Fewer iterations for the iterative fits: robustness, not accuracy, is under test.
FAST = {
    "icov_mle": {"max_iter": 3, "steps": 3},
    "icov_vb": {"max_iter": 10},
    "ivar_vb": {"max_iter": 30},
    "geometric_median": {"max_iter": 20},
}
#: Examples per rule (the ICOV fits cost far more per call than the rest).
EXAMPLES = {"icov_mle": 6, "icov_vb": 8}
#: Every registered rule, and pre-aggregated ones covering each pre-aggregator (bucketing: a stateful one).
RULES = [*available(), "nnm+median", "arc+bucketing+krum", "clipping+mean"]


def make(name, **options):
    return rule(name, **{**FAST.get(name, {}), **options})


class Benchmark:
    """The server's benchmark for a d-coordinate model: a loss, and its own update (FLTrust's g_0)."""

    def __init__(self, d: int):
        self.d = d

    def __call__(self, v):
        return float(v.double().square().mean())

    def update(self):
        return torch.linspace(-1.0, 1.0, self.d)


ROW_KINDS = ["normal", "normal", "normal", "nan", "inf", "-inf", "huge", "tiny", "zero", "copy"]
SCALES = [1.0, 1e-3, 1e6, 1e-40, 1e30, 1e38, 3e38, 1e300]
COUNTS = [0.0, 1.0, 7.0, 100.0, math.nan, -1.0, math.inf, 1e30, 3e38, 1e-40]
LOSSES = [0.0, 0.1, 1.0, 2.3, -5.0, math.nan, math.inf, 1e30, 1e-40]


@st.composite
def rounds(draw, d=None, dtype=None):
    n = draw(st.integers(1, 12))
    d = d if d is not None else draw(st.integers(1, 40))
    dtype = dtype or draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from(SCALES))
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * scale + draw(st.sampled_from([0.0, 1.0]))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=n, max_size=n))
    for i, kind in enumerate(kinds):
        cols = torch.rand(d, generator=g) < 0.3
        cols[int(torch.randint(d, (1,), generator=g))] = True
        if kind == "nan":
            x[i, cols] = math.nan
        elif kind in ("inf", "-inf"):
            x[i, cols] = math.inf if kind == "inf" else -math.inf
        elif kind == "huge":
            x[i] = torch.randn(d, generator=g, dtype=torch.float64).sign() * torch.finfo(dtype).max / 2
        elif kind == "tiny":
            x[i] = torch.randn(d, generator=g, dtype=torch.float64).sign() * 1e-40
        elif kind == "zero":
            x[i] = 0.0
        elif kind == "copy":
            x[i] = x[0]
    x = x.to(dtype)  # values past the dtype's range become +-inf here: also malformed updates
    ids = draw(
        st.lists(
            st.one_of(st.integers(0, 30), st.text("abc", max_size=3)), min_size=n, max_size=n, unique=True
        )
    )
    counts = draw(st.one_of(st.none(), st.lists(st.sampled_from(COUNTS), min_size=n, max_size=n)))
    losses = draw(st.lists(st.sampled_from(LOSSES), min_size=n, max_size=n))
    previous = draw(st.sampled_from([None, 0.0, 1.0]))
    return Round(
        updates=x,
        client_ids=ids,
        num_samples=None if counts is None else torch.tensor(counts, dtype=torch.float64),
        metrics={"train_loss": torch.tensor(losses, dtype=torch.float64)},
        reference=Benchmark(d),
        previous=None if previous is None else torch.full((d,), previous, dtype=dtype),
    )


def check_outcome(name: str, r: Round, call) -> Aggregate | None:
    """Run ``call`` and check the contract: a finite Aggregate with valid weights, or a documented error."""
    try:
        out = call()
    except NoValidUpdates as exc:
        assert str(exc).startswith(name), exc
        return None
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert name in message or "Round." in message, (
            f"{type(exc).__name__} names no rule or field: {message}"
        )
        return None
    assert isinstance(out, Aggregate)
    dtype = r.updates.dtype
    assert out.vector.shape == (r.d,) and out.vector.dtype == dtype
    assert bool(torch.isfinite(out.vector).all()), f"{name}: non-finite aggregate {out.vector}"
    w = out.weights
    assert w.shape == (r.n,) and w.dtype == dtype
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all()), f"{name}: weights {w}"
    tol = 8 * r.n * torch.finfo(dtype).eps
    assert abs(float(w.double().sum()) - 1.0) <= tol, f"{name}: weights sum to {float(w.double().sum())}"
    quarantined = out.info.get("quarantined", {})
    position = {cid: i for i, cid in enumerate(r.client_ids)}
    for cid, reason in quarantined.items():
        assert isinstance(reason, str) and reason
        assert float(w[position[cid]]) == 0.0
    malformed = ~torch.isfinite(r.updates).all(1)
    for i in torch.nonzero(malformed).flatten().tolist():
        assert r.client_ids[i] in quarantined, (
            f"{name}: client {r.client_ids[i]!r} sent NaN/Inf, not quarantined"
        )
    return out


def _fuzz_settings(name):
    return settings(max_examples=EXAMPLES.get(name, 20), suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", RULES)
def test_every_rule_aggregates_finitely_or_raises_a_documented_error(name):
    @_fuzz_settings(name)
    @given(data=st.data())
    def run(data):
        first = data.draw(rounds(), label="round 1")
        agg = make(name)
        check_outcome(name, first, lambda: agg(first))
        # a second round of the same width: the state learnt from garbage must not poison it
        second = data.draw(rounds(d=first.d, dtype=first.updates.dtype), label="round 2")
        check_outcome(name, second, lambda: agg(second))

    run()


# ---------------------------------------------------------------- garbage state

#: Wrappers keep their inner rule's state: they are fuzzed around a rule that keeps one (around a
#: stateless one they would learn nothing to spoil).
AROUND_STATE = {"nnm+median": "nnm+centered_clipping", "clipping+mean": "clipping+centered_clipping"}
#: ... and FedAG around a stateful base.
STATE_OPTIONS = {"fedag": {"base": "ivar_vb"}}
STATEFUL = [
    AROUND_STATE.get(n, n) for n in RULES if type(rule(n)).load_state_dict is not BaseRule.load_state_dict
]


def make_stateful(name):
    return make(name, **STATE_OPTIONS.get(name, {}))


KEYS = ["center", "ls", "loss", "samples", "excluded", "round", "history", "clients", "shared", "noise", "v"]
KEYS += ["psi", "gram", "ids", "A", "b", "c", "yterm", "uterm", "k", "tau", "tau2", "sigma_u2", "sigma_v2"]

TENSORS = st.builds(
    lambda shape, dtype, fill: torch.full(shape, fill, dtype=torch.float64).to(dtype),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.complex64]),
    st.sampled_from([0.0, 1.0, -1.0, 1e-40, 1e30, 1e300, math.nan, math.inf]),
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 12),
    st.sampled_from([0.0, 0.5, -1.0, 1e-300, 1e300, math.nan, math.inf, -math.inf]),
    st.text("abc", max_size=3),
    TENSORS,
)
TREES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.integers(0, 3)), children, max_size=4),
    ),
    max_leaves=12,
)

CLEAN = Round(
    updates=torch.randn(6, 5, generator=torch.Generator().manual_seed(0)),
    client_ids=[0, 1, 2, "c0", "c1", "c2"],
    num_samples=torch.arange(1.0, 7.0),
    metrics={"train_loss": torch.linspace(0.2, 1.0, 6)},
    reference=Benchmark(5),
    previous=torch.zeros(5),
)


def accepts_then_aggregates(name, agg, state):
    before = agg.state_dict()
    try:
        agg.load_state_dict(state)
    except (ValueError, TypeError) as exc:
        assert str(exc).startswith(name), exc
        assert_tree_equal(agg.state_dict(), before)  # a refused state changes nothing
        return
    check_outcome(name, CLEAN, lambda: agg(CLEAN))


@pytest.mark.parametrize("name", STATEFUL)
@settings(max_examples=30, suppress_health_check=list(HealthCheck))
@given(tree=st.one_of(TREES, st.dictionaries(st.sampled_from(KEYS), TREES, max_size=3)))
def test_garbage_state_trees_are_refused_or_harmless(name, tree):
    accepts_then_aggregates(name, make_stateful(name), tree)


@functools.cache
def _learnt(name):
    agg = make_stateful(name)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        agg(Round(updates=torch.randn(6, 5, generator=g), client_ids=CLEAN.client_ids, num_samples=CLEAN.num_samples,
                  metrics=CLEAN.metrics, reference=CLEAN.reference, previous=CLEAN.previous))  # fmt: skip
    return agg.state_dict()


def _paths(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, (*path, i))
    else:
        yield path


SPOILERS = st.one_of(
    LEAVES,
    st.sampled_from(["scale-huge", "scale-tiny", "negate", "drop", "nan-one", "transpose"]),
)


@pytest.mark.parametrize("name", STATEFUL)
@settings(max_examples=30, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_learnt_state_with_one_entry_spoilt_is_refused_or_harmless(name, data):
    state = _learnt(name)
    paths = list(_paths(state))
    assert paths and paths != [()], f"{name} learnt no state to spoil"
    path = data.draw(st.sampled_from(paths), label="path")
    spoil = data.draw(SPOILERS, label="spoil")
    agg = make_stateful(name)
    agg.load_state_dict(state)
    spoilt = agg.state_dict()
    node = spoilt
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    if spoil == "drop":
        del node[path[-1]]
    elif isinstance(spoil, str) and isinstance(old, torch.Tensor | float):
        t = torch.as_tensor(old, dtype=torch.float64).clone()
        if spoil == "scale-huge":
            t = t * 1e300
        elif spoil == "scale-tiny":
            t = t * 1e-300
        elif spoil == "negate":
            t = -t
        elif spoil == "nan-one" and t.numel():
            t.view(-1)[0] = math.nan
        elif spoil == "transpose":
            t = t.mT if t.dim() == 2 else t.reshape(-1, 1)
        node[path[-1]] = t if isinstance(old, torch.Tensor) else float(t.reshape(-1)[0]) if t.numel() else 0.0
    elif not isinstance(spoil, str):
        node[path[-1]] = spoil
    accepts_then_aggregates(name, agg, spoilt)


@pytest.mark.parametrize("name", ["icov_mle", "icov_vb"])
@pytest.mark.parametrize("n, d", [(1, 3), (2, 1), (3, 2), (5, 20)])
def test_icov_fits_updates_of_1e150_after_updates_of_1e_3(name, n, d):
    """A jump of 153 orders of magnitude is an ordinary round for both ICOV estimators: ICOV-MLE's
    restricted likelihood sees only the updates' contrasts and its quasi-Newton fit works on
    log-variances (it broke down on the joint likelihood); ICOV-VB broke down at 1e38 before its ARD
    variances took MacKay's update."""
    g = torch.Generator().manual_seed(0)
    small = Round(updates=torch.randn(n, d, generator=g, dtype=torch.float64) * 1e-3)
    huge = Round(updates=torch.randn(n, d, generator=g, dtype=torch.float64) * 1e150)
    a = rule(name)
    a(small)
    out = a(huge)
    assert "fallback" not in out.info and out.info["converged"]
    assert torch.isfinite(out.vector).all() and out.weights.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("name, fallback", [("icov_mle", "ivar_mle"), ("icov_vb", "ivar_vb")])
@pytest.mark.parametrize("fallback_breaks", [False, True])
def test_a_fit_that_breaks_down_is_a_clear_error_and_leaves_the_state_as_it_was(
    monkeypatch, name, fallback, fallback_breaks
):
    """When ICOV's fit breaks down on a round (here forced: its estimator raises torch's LinAlgError, as a
    singular system would), the rule fits the round with IVAR instead (ICOV without its correlated part),
    naming the breakdown in info["fallback"], or, where that breaks down too, refuses the round naming
    itself; either way it keeps its state, and the next ordinary round aggregates exactly as if the
    broken one had never come. Never a NaN model, never torch's own error."""
    g = torch.Generator().manual_seed(0)
    small, broken, after = (
        Round(updates=torch.randn(4, 6, generator=g, dtype=torch.float64)) for _ in range(3)
    )
    a, b = rule(name, max_iter=50), rule(name, max_iter=50)
    a(small), b(small)
    before = a.state_dict()

    def singular(*args, **kwargs):
        raise torch.linalg.LinAlgError(
            "linalg.inv: The diagonal element 2 is zero, the inversion could not be completed"
        )

    monkeypatch.setattr(inference_rules, name, singular)
    if fallback_breaks:
        monkeypatch.setattr(inference_rules, fallback, singular)
    breakdown = rf"{name}: the fit broke down on this round \(linalg.inv: .*state is unchanged"
    if fallback_breaks:
        with pytest.raises(ValueError, match=breakdown):
            a(broken)
    else:
        out = a(broken)
        assert re.search(breakdown, out.info["fallback"]) and torch.isfinite(out.vector).all()
        assert f"fitted by {fallback} instead" in out.info["fallback"]
    monkeypatch.undo()
    torch.testing.assert_close(a.state_dict(), before, rtol=0, atol=0)
    torch.testing.assert_close(a(after).vector, b(after).vector, rtol=0, atol=0)
