"""FedAvg-Gaussian (Algorithm 1, eqs 3-6), its baselines and the scoring rules."""

import math

import numpy as np
import pytest
import torch

from fedtrust import Round, rule
from fedtrust.data import cubic_toy, synthetic_linear
from fedtrust.models import build_model
from fedtrust.probabilistic import (
    bootstrap_predictive,
    fit_posterior,
    linear_predictive,
    noise_precision,
    omc_predictive,
    scoring_rules,
)
from fedtrust.probabilistic.baselines import BayesByBackprop, BayesianLinearRegression, DeepEnsemble
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation

G = torch.Generator


def test_gaussian_fit_is_the_sample_mean_and_variance_of_the_client_weights():
    w = torch.randn(10, 7, generator=G().manual_seed(0), dtype=torch.float64)
    post = fit_posterior(w)
    np.testing.assert_allclose(post.mean.numpy(), w.numpy().mean(0))
    np.testing.assert_allclose(post.var.numpy(), w.numpy().var(0))  # population variance, as eq 5


def test_weighted_fit_for_robust_fedag():
    w = torch.randn(6, 4, generator=G().manual_seed(1), dtype=torch.float64)
    trust = torch.tensor([0.5, 0.2, 0.3, 0.0, 0.0, 0.0], dtype=torch.float64)
    post = fit_posterior(w, trust)
    mu = (trust[:, None] * w).sum(0)
    np.testing.assert_allclose(post.mean.numpy(), mu.numpy())
    np.testing.assert_allclose(post.var.numpy(), (trust[:, None] * (w - mu) ** 2).sum(0).numpy())
    # clients with zero trust do not count at all
    torch.testing.assert_close(post.var, fit_posterior(w[:3], trust[:3]).var)


def test_bootstrap_predictive_moments_are_eqs_4_and_5():
    data = cubic_toy()
    model = build_model("mlp", data, hidden=8)
    members = torch.stack([model.init(k) for k in range(6)])
    post = fit_posterior(members)
    mu, sigma = bootstrap_predictive(model, post, data.x_test)
    preds = np.stack([model.forward(w, data.x_test).detach().numpy().reshape(-1) for w in members])
    np.testing.assert_allclose(mu.numpy(), preds.mean(0), rtol=1e-5, atol=1e-6)  # eq 4
    np.testing.assert_allclose(
        sigma.numpy() ** 2, (preds**2).mean(0) - preds.mean(0) ** 2, rtol=1e-4, atol=1e-6
    )  # eq 5


def test_an_ensemble_that_nearly_agrees_keeps_its_spread_in_float32():
    """Eq 5 in float32 as the second moment less the squared mean loses every digit once the members
    agree to a part in 1e4 (sigma off by up to 3.4x here, or 0); its value is the members' spread."""
    data = cubic_toy()
    model = build_model("mlp", data, hidden=8)
    base = model.init(0)
    scale = 1e-4 * base.abs().max()
    members = base + scale * torch.randn(10, base.numel(), generator=G().manual_seed(0))
    trust = torch.linspace(1.0, 1.01, 10)  # weights that differ by about 1e-3, as a robust fit gives
    mu, sigma = bootstrap_predictive(model, fit_posterior(members, trust), data.x_test)
    preds = torch.stack([model.forward(w, data.x_test).reshape(-1) for w in members]).double()
    w = (trust / trust.sum()).double()
    exact_mu = w @ preds
    exact = (w @ (preds - exact_mu).square()).sqrt()
    assert sigma.dtype == torch.float32 and bool((exact > 0).all())
    # the spread of these very (float32) predictions, rounded once to float32
    torch.testing.assert_close(sigma.double(), exact, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_a_quarantined_client_model_has_no_say_in_the_posterior_or_its_predictions():
    """Robust FedAG gives a quarantined client (a non-finite model) zero trust: it must not count at all,
    neither in the fitted Gaussian nor in the bootstrap ensemble (0 x NaN is NaN; before this a single
    NaN member turned every prediction of a finite posterior into NaN)."""
    data = cubic_toy()
    model = build_model("mlp", data, hidden=8)
    members = torch.stack([model.init(k) for k in range(5)])
    trust = torch.tensor([0.3, 0.0, 0.3, 0.4, 0.0])
    broken = members.clone()
    broken[1] = float("nan")
    broken[4, :3] = float("inf")
    post, clean = fit_posterior(broken, trust), fit_posterior(members, trust)
    torch.testing.assert_close(post.mean, clean.mean)
    torch.testing.assert_close(post.var, clean.var)
    mu, sigma = bootstrap_predictive(model, post, data.x_test)
    want_mu, want_sigma = bootstrap_predictive(
        model, fit_posterior(members[[0, 2, 3]], trust[[0, 2, 3]]), data.x_test
    )
    torch.testing.assert_close(mu, want_mu)
    torch.testing.assert_close(sigma, want_sigma)


def test_linear_closed_form_matches_monte_carlo():
    data = synthetic_linear(parties=3, samples=30, dim=4)
    model = build_model("linear", data)
    members = torch.stack([model.init(k) for k in range(8)]).double()
    post = fit_posterior(members)
    beta = 2.5
    mu, sigma = linear_predictive(post, data.x_test[:50], beta)  # eq 6
    mc_mu, mc_sigma = omc_predictive(
        model, post, data.x_test[:50].double(), 40000, G().manual_seed(0), noise_var=1 / beta
    )
    np.testing.assert_allclose(mc_mu.numpy(), mu.numpy(), atol=0.02 * float(sigma.mean()))
    np.testing.assert_allclose(mc_sigma.numpy(), sigma.numpy(), rtol=0.02)


def test_the_data_noise_is_the_trusted_clients_residual_variance():
    """Eq 6's 1/beta from the clients' training residuals, pooled by sample count, or weighed by the round's
    trust: with robust FedAG's, three of ten clients with noisy targets (sd 3 against the others' 0.5)
    have no say in it."""
    data = synthetic_linear(parties=3, samples=30, dim=4)
    model = build_model("linear", data)
    at = torch.zeros(model.size)  # predicts 0: the residuals are the targets
    g = G().manual_seed(0)
    clients = [(torch.randn(n, 4, generator=g), sd * torch.randn(n, generator=g))
               for n, sd in zip([40] * 7 + [20] * 3, [0.5] * 7 + [3.0] * 3, strict=True)]  # fmt: skip
    sq = [float(y.square().mean()) for _, y in clients]
    pooled = sum(40 * v for v in sq[:7]) + sum(20 * v for v in sq[7:])
    assert noise_precision(model, at, clients) == pytest.approx(340 / pooled, rel=1e-6)
    trust = torch.tensor([1 / 7] * 7 + [0.0] * 3)
    assert noise_precision(model, at, clients, trust) == pytest.approx(7 / sum(sq[:7]), rel=1e-6)
    # a count-weighted rule's trust (FedAvg's n_k / N) pools by count once, not by n_k squared
    shares = torch.tensor([40.0] * 7 + [20.0] * 3) / 340
    assert noise_precision(model, at, clients, shares) == pytest.approx(340 / pooled, rel=1e-6)
    assert 1 / noise_precision(model, at, clients, trust) == pytest.approx(0.25, rel=0.15)


def test_robust_fedag_reads_the_data_noise_from_the_clients_it_trusts(tmp_path):
    """A run of robust FedAG (Multi-Krum's trust) with three of ten clients' targets noisy: the data noise
    of the linear predictive (eq 6) is the trusted clients' residual variance, not every client's."""
    from fedtrust.sim.store import RunStore

    cfg = validate({"name": "noisy", "data": {"name": "synthetic_linear", "clients": 10, "parties": 10,
                                              "noise": [0.5] * 10},
                    "model": {"name": "linear"}, "train": {"rounds": 1, "lr": 0.05, "predictive": "linear"},
                    "corruption": {"name": "target_noise", "fraction": 0.3, "std": 3.0},
                    "rule": {"name": "fedag", "base": "multi_krum", "base_options": {"f": 3}}})  # fmt: skip
    sim = build_simulation(cfg)
    sim.run(RunStore(tmp_path / "run"))
    ev = sim.evaluation
    trust = ev.posterior.weights
    assert (trust[sim.fed.corrupted] == 0).all() and (trust[~sim.fed.corrupted] > 0).all()
    honest = [d for d, bad in zip(ev._data, sim.fed.corrupted.tolist(), strict=True) if not bad]
    want = noise_precision(sim.model, sim.vector, honest)
    assert ev.noise_precision(sim.vector) == pytest.approx(want, rel=1e-9)
    assert noise_precision(sim.model, sim.vector, ev._data) < 0.5 * want  # every client's: noisier


def test_scoring_rules_known_values():
    assert scoring_rules.crps(0.0, 0.0, 1.0) == pytest.approx((math.sqrt(2) - 1) / math.sqrt(math.pi))
    assert scoring_rules.nll(0.0, 0.0, 1.0) == pytest.approx(0.5 * math.log(2 * math.pi))
    assert scoring_rules.nll(3.0, 1.0, 2.0) == pytest.approx(0.5 * math.log(2 * math.pi * 4) + 0.5)
    assert scoring_rules.sharpness([1.0, 3.0]) == 2.0  # DS = det(Sigma)^(1/2d) = sigma for d = 1
    rng = np.random.default_rng(0)
    y = rng.normal(2.0, 3.0, 20000)
    assert scoring_rules.coverage(y, 2.0 * np.ones_like(y), 3.0 * np.ones_like(y), 0.9) == pytest.approx(
        0.9, abs=0.01
    )
    assert np.histogram(scoring_rules.pit(y, 2.0, 3.0), bins=5, range=(0, 1))[0] / len(y) == pytest.approx(
        np.full(5, 0.2), abs=0.01
    )


def test_fedags_helpers_refuse_what_has_no_meaning_naming_it():
    """A negative sigma scored a negative CRPS, level 1.5 a coverage of 0, zero trust a posterior of
    variance 0, integer models a mean of 0, beta 0 a ZeroDivisionError (a hostile-input review)."""
    models, y = torch.randn(4, 3), np.ones(3)
    for call, error, message in [
        (lambda: scoring_rules.crps(y, y, -y), ValueError, r"crps: sigma\[0\] = -1.0 is negative"),
        (
            lambda: scoring_rules.nll(y, y, np.ones(2)),
            ValueError,
            r"nll: y, mu and sigma must have one length",
        ),
        (lambda: scoring_rules.coverage(y, y, y, level=1.5), ValueError, r"coverage: level must be <= 1.0"),
        (
            lambda: fit_posterior(models, torch.zeros(4)),
            ValueError,
            r"weights must be finite, >= 0 and not all 0",
        ),
        (lambda: fit_posterior(models, torch.tensor([2.0, -1, 0, 0])), ValueError, r">= 0 and not all 0"),
        (lambda: fit_posterior(models, torch.ones(3)), ValueError, r"weights must be one per model \(4\)"),
        (lambda: fit_posterior(torch.tensor([[1, 3], [3, 5]])), TypeError, r"models must be floating point"),
        (
            lambda: linear_predictive(fit_posterior(models), torch.randn(2, 2), 0.0),
            ValueError,
            r"beta must be > 0",
        ),
    ]:
        with pytest.raises(error, match=message):
            call()


def test_blr_is_the_conjugate_posterior():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3 + rng.normal(0, 0.4, 40)
    blr = BayesianLinearRegression(alpha=1.0, beta=6.0).fit(torch.tensor(x), torch.tensor(y))
    phi = np.hstack([x, np.ones((40, 1))])
    cov = np.linalg.inv(np.eye(4) + 6.0 * phi.T @ phi)
    mean = 6.0 * cov @ phi.T @ y
    np.testing.assert_allclose(blr.mean.numpy(), mean, rtol=1e-10)
    np.testing.assert_allclose(blr.cov.numpy(), cov, rtol=1e-10)
    xs = rng.normal(size=(5, 3))
    mu, sigma = blr.predict(torch.tensor(xs))
    ps = np.hstack([xs, np.ones((5, 1))])
    np.testing.assert_allclose(mu.numpy(), ps @ mean, rtol=1e-10)
    np.testing.assert_allclose(
        sigma.numpy() ** 2, 1 / 6.0 + np.einsum("ij,jk,ik->i", ps, cov, ps), rtol=1e-10
    )


@pytest.mark.parametrize(
    "model", [DeepEnsemble(members=3, epochs=60), BayesByBackprop(epochs=150, samples=50)]
)
def test_neural_baselines_beat_a_constant_predictor(model):
    data = cubic_toy()
    model.fit(data.x_train, data.y_train)
    mu, sigma = model.predict(data.x_train)
    constant = scoring_rules.nll(data.y_train, data.y_train.mean(), data.y_train.std())
    assert scoring_rules.nll(data.y_train, mu, sigma) < constant - 0.5


def test_fedag_rule_reports_the_trust_weighted_posterior():
    g = G().manual_seed(2)
    x = torch.randn(10, 5, generator=g, dtype=torch.float64) * 0.1
    x[:3] = 50 * torch.randn(3, 5, generator=g, dtype=torch.float64)  # three garbage clients
    plain = rule("fedag")(Round(updates=x))
    torch.testing.assert_close(plain.info["posterior_var"], x.var(0, unbiased=False))
    # Multi-Krum gives the garbage zero trust: the posterior is the honest clients' alone
    krum = rule("fedag", base="multi_krum", base_options={"f": 3})(Round(updates=x))
    torch.testing.assert_close(krum.info["posterior_var"], x[3:].var(0, unbiased=False))
    torch.testing.assert_close(krum.vector, x[3:].mean(0))
    # the geometric median leaves them a little weight (proportional to 1/distance): far less inflation
    geo = rule("fedag", base="geometric_median")(Round(updates=x))
    torch.testing.assert_close(
        geo.info["posterior_var"], (geo.weights[:, None] * (x - geo.vector) ** 2).sum(0)
    )
    assert geo.info["posterior_var"].max() < 0.05 * plain.info["posterior_var"].min()


def test_regression_runs_report_probabilistic_scores_and_save_predictions(tmp_path):
    from fedtrust.sim.store import RunStore

    cfg = validate({"name": "toy", "data": {"name": "cubic_toy", "clients": 10, "partition": {"name": "natural"}},
                    "model": {"name": "mlp", "hidden": 20}, "train": {"rounds": 2, "local_epochs": 5, "batch_size": 4, "lr": 0.05},
                    "rule": {"name": "fedag"}})  # fmt: skip
    records = build_simulation(cfg).run(RunStore(tmp_path / "run"))
    assert set(records[-1]["metrics"]) == {"nll", "rmse", "crps", "sharpness", "coverage90"}
    saved = np.load(tmp_path / "run" / "predictions.npz")
    assert saved["mu"].shape == saved["y"].shape == (200,) and (saved["sigma"] > 0).all()
    # targets are standardised for training, scores come back in the original units
    assert abs(saved["y"]).max() == pytest.approx(216, rel=1e-3)
