"""ARFL (Theorem 4.3, Algorithm 1) and FOCUS (eqs 3-8, Algorithm 1), checked against their papers."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import minimize

from fedtrust import Round, rule
from fedtrust.aggregators.arfl import arfl_objective, arfl_weights
from fedtrust.aggregators.loss_defences import reference_losses
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation

seeds = st.integers(0, 2**31 - 1)


def qp_reference(losses, samples, lam):
    """Eq 6 over the simplex by a generic solver (SLSQP)."""
    n = len(losses)
    objective = lambda a: a @ losses + lam / 2 * np.sum(a**2 / samples)  # noqa: E731
    gradient = lambda a: losses + lam * a / samples  # noqa: E731
    res = minimize(objective, np.full(n, 1 / n), jac=gradient, method="SLSQP", bounds=[(0, 1)] * n,
                   constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1, "jac": lambda a: np.ones(n)}],
                   options={"ftol": 1e-14, "maxiter": 1000})  # fmt: skip
    return res.x, res.fun


@given(seeds, st.integers(2, 30), st.floats(0.05, 50.0))
def test_theorem_4_3_matches_a_generic_qp_solver(seed, n, lam_factor):
    rng = np.random.default_rng(seed)
    losses = rng.gamma(2.0, 1.0, n)
    samples = rng.integers(1, 200, n).astype(float)
    lam = lam_factor * samples.sum()
    alpha, p = arfl_weights(torch.tensor(losses), torch.tensor(samples), lam)
    ref, ref_value = qp_reference(losses, samples, lam)
    value = arfl_objective(alpha, torch.tensor(losses), torch.tensor(samples), lam)
    assert value <= ref_value + 1e-9 * max(1.0, abs(ref_value))  # closed form is at least as good
    np.testing.assert_allclose(alpha.numpy(), ref, atol=1e-5)


@given(seeds, st.integers(1, 40), st.floats(1e-3, 1e3))
def test_alpha_sums_to_one_with_exactly_p_nonzeros_on_the_smallest_losses(seed, n, lam_factor):
    rng = np.random.default_rng(seed)
    losses = torch.tensor(rng.gamma(2.0, 1.0, n))
    samples = torch.tensor(rng.integers(1, 100, n).astype(float))
    alpha, p = arfl_weights(losses, samples, lam_factor * float(samples.sum()))
    assert float(alpha.sum()) == pytest.approx(1.0)
    assert int((alpha > 0).sum()) == p
    assert set(torch.nonzero(alpha > 0).flatten().tolist()) == set(torch.argsort(losses)[:p].tolist())


def test_lambda_to_infinity_gives_fedavg_weights_and_to_zero_the_best_client():
    losses = torch.tensor([0.3, 2.0, 0.7, 5.0])
    samples = torch.tensor([10.0, 30.0, 20.0, 40.0])
    alpha, p = arfl_weights(losses, samples, 1e12)
    torch.testing.assert_close(alpha, samples.double() / 100, rtol=1e-9, atol=1e-9)
    alpha, p = arfl_weights(losses, samples, 1e-9)
    assert p == 1 and alpha.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_arfl_rule_follows_algorithm_1():
    """Losses kept by id; a round is averaged by eq 11 with the alpha known before it; unselected
    clients keep their last loss; the initial report covers every client."""
    arfl = rule("arfl", lam=1.0)
    ids = ["a", "b", "c", "d"]
    arfl.observe(ids, [10, 10, 10, 10], {"train_loss": torch.tensor([1.0, 1.0, 1.0, 9.0])})
    x = torch.eye(4, dtype=torch.float64)[:3]  # a, b, c take part; d is the high-loss client, absent
    out = arfl(
        Round(
            updates=x, client_ids=ids[:3], num_samples=[10, 10, 10], metrics={"train_loss": [1.0, 1.0, 8.0]}
        )
    )
    # alpha from the initial losses (1, 1, 1, 9): d is outside the consensus group, a, b, c equal
    assert out.info["p"] == 3
    torch.testing.assert_close(out.weights, torch.full((3,), 1 / 3, dtype=torch.float64))
    # this round's report (c now has loss 8) shapes the next round; d keeps its initial 9
    assert arfl.state_dict()["loss"] == {"a": 1.0, "b": 1.0, "c": 8.0, "d": 9.0}
    out = arfl(
        Round(
            updates=x, client_ids=ids[:3], num_samples=[10, 10, 10], metrics={"train_loss": [1.0, 1.0, 8.0]}
        )
    )
    assert out.weights[2] == 0 and out.info["p"] == 2
    alpha = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert out.info["objective"] == pytest.approx(
        arfl_objective(alpha, torch.tensor([1.0, 1.0, 8.0, 9.0]), torch.full((4,), 10.0), 40.0)
    )


def test_arfl_fresh_averages_a_round_with_its_own_losses():
    """``fresh=True``: this round's reports enter alpha before the round is averaged, where the paper's
    order (the default) averages it with the alpha its earlier reports gave. One client's loss jumps
    from 1 to 8: the default keeps its weight for that round and drops it the next; fresh drops it at
    once, with the alpha of Theorem 4.3 on the new losses."""
    ids, x = ["a", "b", "c"], torch.eye(3, dtype=torch.float64)
    before = {"train_loss": torch.tensor([1.0, 1.0, 1.0])}
    now = Round(updates=x, client_ids=ids, num_samples=[10, 10, 10], metrics={"train_loss": [1.0, 1.0, 8.0]})
    paper, fresh = rule("arfl", lam=1.0), rule("arfl", lam=1.0, fresh=True)
    for r in (paper, fresh):
        r.observe(ids, [10, 10, 10], before)
    torch.testing.assert_close(paper(now).weights, torch.full((3,), 1 / 3, dtype=torch.float64))
    alpha, p = arfl_weights(torch.tensor([1.0, 1.0, 8.0]), torch.full((3,), 10.0), 30.0)
    out = fresh(now)
    assert out.weights[2] == 0 and out.info["p"] == p == 2
    torch.testing.assert_close(out.weights, alpha / alpha.sum())
    torch.testing.assert_close(paper(now).weights, out.weights)  # the default catches up a round later


def test_a_client_whose_update_is_quarantined_is_forgotten_and_the_round_goes_on():
    """Alpha spans every known client (Theorem 4.3), so a client that once reported a very low loss
    holds all of it. When that client then crashes (its update NaN, quarantined at the front door), the
    rule forgets its stored loss, as it forgets one whose loss cannot be measured, and the round's
    healthy clients share the weight instead of the round being refused for all-zero weights."""
    ids = list(range(6))
    losses = [0.0, 2.3, 2.3, 2.4, 2.2, 2.3]
    arfl = rule("arfl")
    arfl.observe(ids, [100] * 6, {"train_loss": losses})
    x = 0.01 * torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0] = float("nan")
    for _ in range(2):
        out = arfl(Round(updates=x, client_ids=ids, num_samples=[100] * 6, metrics={"train_loss": losses}))
        assert set(out.info["quarantined"]) == {0} and out.weights[0] == 0
        assert 0 not in arfl.state_dict()["loss"]
        alpha, _ = arfl_weights(torch.tensor(losses[1:], dtype=torch.float64), torch.full((5,), 100.0), 500.0)
        torch.testing.assert_close(out.weights[1:], alpha / alpha.sum())


def test_a_negative_training_loss_is_refused_not_trusted():
    """Eq 9 gives alpha_i growing without bound as L_i falls: one client of four reporting a
    cross-entropy of -1e6 took the whole round (weight 1.0). No training loss is below 0: the front
    door quarantines the report, and the initial report (observe) leaves it out, naming it."""
    ids, x = [0, 1, 2, 3], torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    arfl = rule("arfl")
    left_out = arfl.observe(ids, [10] * 4, {"train_loss": [0.5, 0.6, 0.4, -1.0]})
    assert left_out == {3: "metric train_loss=-1.0 is below 0, which a training loss (cross-entropy, "
                           "squared error) never is"}  # fmt: skip
    out = arfl(Round(updates=x, client_ids=ids, num_samples=[10] * 4,
                     metrics={"train_loss": [0.5, 0.6, 0.4, -1e6]}))  # fmt: skip
    assert out.weights[3] == 0 and "train_loss=-1000000.0 is below 0" in out.info["quarantined"][3]
    assert float(out.weights.sum()) == pytest.approx(1.0)


def focus_by_hand(ls, ll, n, alpha):
    """Eqs 3, 6 and 8 written out directly."""
    e = [a + b for a, b in zip(ls, ll, strict=True)]
    z = sum(np.exp(alpha * v) for v in e)
    c = [1 - np.exp(alpha * v) / z for v in e]
    total = sum(ni * ci for ni, ci in zip(n, c, strict=True))
    return [ni * ci / total for ni, ci in zip(n, c, strict=True)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_focus_weights_are_eqs_3_to_8_one_round_late(reduction):
    def reference(vector):  # the benchmark loss of the model an update produces
        return float(vector.square().sum())

    reference.size = 20
    focus = rule("focus", alpha=0.5, reduction=reduction)
    n = [10.0, 20.0, 30.0]
    x1 = torch.tensor([[0.1, 0.2], [0.3, 0.1], [2.0, 1.0]], dtype=torch.float64)
    out1 = focus(
        Round(updates=x1, num_samples=n, metrics={"train_loss": [0.5, 0.6, 0.4]}, reference=reference)
    )
    torch.testing.assert_close(out1.weights, torch.tensor(n, dtype=torch.float64) / 60)  # W_0 = n_k / sum n
    ll = [0.7, 0.8, 3.0]  # what the clients report for the model round 1 produced
    x2 = torch.tensor([[0.2, 0.2], [0.1, 0.1], [1.0, 1.0]], dtype=torch.float64)
    out2 = focus(Round(updates=x2, num_samples=n, metrics={"train_loss": ll}, reference=reference))
    scale = 20 if reduction == "sum" else 1
    ls = [reference(u) * scale for u in x1]  # eq 4 on round 1's local models
    ll_used = [v * m for v, m in zip(ll, n, strict=True)] if reduction == "sum" else ll  # eq 5
    np.testing.assert_allclose(out2.weights.numpy(), focus_by_hand(ls, ll_used, n, 0.5), rtol=1e-12)
    assert out2.weights[2] < out2.weights[0]


def test_copies_whose_benchmark_loss_cannot_be_measured_get_no_weight():
    """Three identical huge updates whose benchmark loss overflows (+inf, eq 6's worst) among five honest
    clients: eq 6 gives their one group (sybils="share", the default) credibility 0. Pooling the groups'
    losses by a 0/1 matrix product made 0 x inf NaN in every honest group; FOCUS read every loss as unknown
    and gave the attackers 1/6 of the weight (an aggregate of 1.7e5). (Counted apart, sybils="off", eq 6
    shares its one unit of distrust among them: 1 - 1/3 each, the paper's formula.)"""

    def reference(vector):
        mean_square = float(vector.double().square().mean())
        return math.exp(mean_square) if mean_square < 700 else math.inf

    reference.size = 100
    g = torch.Generator().manual_seed(2)
    x = torch.cat([0.1 * torch.randn(5, 50, generator=g, dtype=torch.float64), torch.full((3, 50), 1e6)])
    focus = rule("focus", alpha=1.0, reduction="mean")
    for _ in range(2):  # the benchmark losses of round 1's updates weigh round 2 (eq 7)
        out = focus(
            Round(updates=x, num_samples=[50.0] * 8, metrics={"train_loss": [2.0] * 8}, reference=reference)
        )
    assert [g["clients"] for g in out.info["groups"]] == [[5, 6, 7]]
    assert float(out.weights[5:].sum()) == 0.0
    assert float(out.vector.abs().max()) < 1.0


def test_a_reference_may_give_its_losses_as_tensors_and_must_give_one_each():
    """Round.reference may return a number or a one-element real tensor (read together with the others: on a
    GPU one transfer instead of a sync a client); the weights are the same either way. A reference that
    returns several numbers for one update is refused, naming the client, before any weight is formed."""

    def as_float(vector):
        return float(vector.square().sum())

    def as_tensor(vector):
        return vector.square().sum().reshape(1)

    def mixed(vector):
        return as_tensor(vector) if vector[0] > 0.2 else as_float(vector)

    x = torch.tensor([[0.1, 0.2], [0.3, 0.1], [1.0, 0.5]], dtype=torch.float64)
    rounds = [
        dict(updates=x, num_samples=[10.0, 20.0, 30.0], metrics={"train_loss": loss})
        for loss in ([0.5, 0.6, 0.4], [0.7, 0.8, 0.9])
    ]
    weights = {}
    for reference in (as_float, as_tensor, mixed):
        focus = rule("focus", alpha=0.5)
        weights[reference.__name__] = [focus(Round(**r, reference=reference)).weights for r in rounds][-1]
    by_counts = x.new_tensor([1, 2, 3]) / 6  # W_0: eq 8 with every credibility equal
    assert 0 < weights["as_float"].min() and not torch.allclose(weights["as_float"], by_counts)
    torch.testing.assert_close(weights["as_tensor"], weights["as_float"], rtol=0, atol=0)
    torch.testing.assert_close(weights["mixed"], weights["as_float"], rtol=0, atol=0)
    # losses of several dtypes are each read exactly, as float() read them (stacked together, 2049 in
    # int64 beside a float16 loss became 2048.0 and 16777217 became inf)
    exact = [torch.tensor(2049), torch.tensor(0.5, dtype=torch.float16), torch.tensor(16777217)]
    ref = Round(updates=x, reference=lambda v: exact[int(torch.nonzero((x == v).all(1))[0])])
    assert reference_losses(ref).tolist() == [2049.0, 0.5, 16777217.0]
    vectors = Round(**rounds[0], reference=lambda v: v.square() if v[0] > 0.2 else v.sum())
    with pytest.raises(ValueError, match=r"returned a torch.float64 tensor of shape \(2,\) for client 1; it"):
        rule("focus")(vectors)
    complex_loss = Round(**rounds[0], reference=lambda v: v.square().sum().to(torch.complex128))
    with pytest.raises(ValueError, match=r"complex128 tensor of shape \(\) for client 0; it must"):
        rule("focus")(complex_loss)


def test_focus_needs_the_benchmark_split():
    with pytest.raises(ValueError, match="focus: needs Round.reference"):
        rule("focus")(Round(updates=torch.randn(3, 2), metrics={"train_loss": [1.0, 1.0, 1.0]}))


# ---------------------------------------------------------------- in a simulated federation


def run(rule_cfg, corruption, rounds=25, lie=None, seed=0, clients=10, fraction=0.3):
    c = {"name": corruption, "fraction": fraction}
    if lie is not None:
        c["lie"] = {"value": lie}
    cfg = validate({"name": "t", "seed": seed, "data": {"name": "digits", "clients": clients, "benchmark": 100},
                    "train": {"rounds": rounds, "lr": 0.5}, "corruption": c, "rule": rule_cfg})  # fmt: skip
    return build_simulation(cfg).run()


def corrupted_weight(records, last=5):
    tail = records[-last:]
    return np.mean([sum(w for w, b in zip(r["weights"], r["corrupted"], strict=True) if b) for r in tail])


def test_arfl_down_weights_planted_bad_clients():
    records = run({"name": "arfl"}, "random_labels")
    assert corrupted_weight(records) < 0.05  # their share would be 0.3
    assert records[-1]["metrics"]["accuracy"] > 0.85


def test_focus_down_weights_the_noisy_client_among_four():
    """FOCUS's setting: a benchmark split on the server, four clients, one with random labels."""
    records = run({"name": "focus"}, "random_labels", clients=4, fraction=0.25)
    assert corrupted_weight(records) < 0.05  # its share would be 0.25
    assert records[-1]["metrics"]["accuracy"] > 0.85


def test_a_liar_games_arfl_and_the_benchmark_check_stops_it():
    honest = run({"name": "arfl"}, "label_flip")
    lying = run({"name": "arfl"}, "label_flip", lie=0.0)
    defended = run({"name": "arfl", "defence": "benchmark"}, "label_flip", lie=0.0)
    assert corrupted_weight(honest) < 0.05
    assert corrupted_weight(lying) > 0.5  # reporting loss 0 puts the liars in charge
    assert corrupted_weight(defended) < 0.05
    assert defended[-1]["metrics"]["accuracy"] > lying[-1]["metrics"]["accuracy"] + 0.2
