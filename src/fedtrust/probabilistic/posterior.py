"""The FedAG posterior and its predictive distributions (Thorgeirsson, Gauterin; papers/003).

Each round the server fits a Gaussian N(mu_w, sigma_w^2) per weight to the client models (Algorithm 1,
line 9); clients continue from mu_w. Predictions for new inputs come from the client models as a
bootstrap ensemble (eqs 3-5), from M weight sets drawn from the posterior (ordinary Monte Carlo), or,
for a linear model, in closed form (eq 6). Robust FedAG fits the same Gaussian with the trust weights
of any fedtrust rule, so clients a rule distrusts neither drag the mean nor inflate the variance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedtrust._checks import check_float
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.passes import weighted_sum
from fedtrust.models import FlatModel


@dataclass(frozen=True)
class GaussianPosterior:
    """Per-weight mean and variance (d,), and the weighted ensemble of client models it was fitted to."""

    mean: torch.Tensor
    var: torch.Tensor
    members: torch.Tensor | None = None  # (n, d) client models
    weights: torch.Tensor | None = None  # (n,) their trust (uniform for plain FedAG)

    def sample(self, m: int, g: torch.Generator) -> torch.Tensor:
        """(m, d) weight sets drawn from N(mean, diag(var))."""
        eps = torch.randn(m, len(self.mean), generator=g, dtype=self.mean.dtype, device=g.device)
        eps = eps.to(self.mean.device)  # drawn where the generator lives: the same draws on every device
        return self.mean + eps * self.var.clamp_min(0).sqrt()


def fit_posterior(
    models: torch.Tensor, weights: torch.Tensor | None = None, mean: torch.Tensor | None = None
) -> GaussianPosterior:
    """N(mu, sigma^2) per weight from (n, d) client models: the sample mean and (population) variance
    (Algorithm 1, line 9), or with trust weights w (summing to 1) mu = sum_k w_k x_k and
    sigma^2 = sum_k w_k (x_k - mu)^2. ``mean`` overrides mu (e.g. a robust rule's aggregate).

    sigma^2 is taken by column blocks (:mod:`~fedtrust.aggregators.chunks`): the squared deviations are a
    block-sized temporary, not two (n, d) ones (at 100 x 1e7 float32, 4 GB each), and their weighted sum
    :func:`~fedtrust.aggregators.passes.weighted_sum`'s (the same sums as one matrix-vector product)."""
    w, kept = _weights(models, weights)
    w_rows = w if kept is None else w[kept]
    if mean is None:
        mu = w_rows @ (models if kept is None else models[kept])
    else:
        mu = mean.to(models.dtype)
    var = torch.empty_like(mu)
    for cols in column_blocks(models, "stream"):
        block = models[:, cols] if kept is None else models[:, cols].index_select(0, kept)
        var[cols] = weighted_sum((block - mu[cols]).square_(), w_rows)
    return GaussianPosterior(mu, var, models, w)


def _weights(rows: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (n,) weights of the n ``rows`` (n, ...) summing to 1 in their dtype (uniform without
    ``weights``), and the positions of the members that count (None: all of them, read in one flag):
    the members of zero weight do not count at all, also when not finite (a quarantined client's model;
    0 x NaN is NaN in a weighted sum)."""
    n = rows.shape[0]
    if not rows.is_floating_point():
        raise TypeError(f"fit_posterior: models must be floating point, got {rows.dtype}")
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=rows.dtype, device=rows.device), None
    # n numbers, checked and normalised on the host after one transfer (on a GPU each check was a sync)
    weights = torch.as_tensor(weights).detach().cpu()
    if weights.shape != (n,):
        raise ValueError(
            f"fit_posterior: weights must be one per model ({n}), got shape {tuple(weights.shape)}"
        )
    if not bool(torch.isfinite(weights).all() and (weights >= 0).all() and weights.sum() > 0):
        raise ValueError(
            f"fit_posterior: weights must be finite, >= 0 and not all 0, got {weights[:8].tolist()}"
            + ("..." if n > 8 else "")
        )
    w = (weights / weights.sum()).to(rows.dtype)
    kept = w > 0
    return w.to(rows.device), None if bool(kept.all()) else torch.nonzero(kept).flatten().to(rows.device)


def _members(
    rows: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (n,) weights of the n ``rows`` (:func:`_weights`), and the rows and weights that count (the
    inputs themselves when every member counts: no copy)."""
    w, kept = _weights(rows, weights)
    if kept is None:
        return w, rows, w
    return w, rows[kept], w[kept]


def _predictions(model: FlatModel, weight_sets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(M, N) scalar predictions of each weight set on each input."""
    with torch.no_grad():
        return torch.stack([model.forward(w, x).reshape(-1) for w in weight_sets])


def ensemble_predictive(
    model: FlatModel, weight_sets: torch.Tensor, x: torch.Tensor, weights=None, noise_var: float = 0.0
):
    """(mu, sigma) of N(mu_y, sigma_y^2) from an ensemble (eqs 4-5): the (weighted) mean of the members'
    predictions and their (weighted) second moment minus the squared mean, plus ``noise_var``. Members of
    zero weight do not count, whatever their predictions. Eq 5's second moment less the squared mean is
    taken as the equal sum of squared deviations from the mean (the weights sum to 1), in float64: members
    that agree to a part in 1e4 would leave float32's difference of two near-equal squares with no correct
    digit (sigma off by 5-25%, or 0)."""
    preds = _predictions(model, weight_sets, x)
    _, preds, w = _members(preds, weights)  # a member of zero weight has no say
    exact, w64 = preds.to(torch.float64), w.to(torch.float64)
    mu = w64 @ exact
    var = w64 @ (exact - mu).square() + noise_var
    return mu.to(preds.dtype), var.sqrt().to(preds.dtype)


def bootstrap_predictive(
    model: FlatModel, posterior: GaussianPosterior, x: torch.Tensor, noise_var: float = 0.0
):
    """The client models themselves as the ensemble (eqs 3-5; the paper's choice), trust-weighted."""
    return ensemble_predictive(model, posterior.members, x, posterior.weights, noise_var)


def omc_predictive(
    model: FlatModel,
    posterior: GaussianPosterior,
    x: torch.Tensor,
    m: int,
    g: torch.Generator,
    noise_var: float = 0.0,
):
    """Ordinary Monte Carlo: M weight sets drawn from the posterior, moments as in eqs 4-5."""
    return ensemble_predictive(model, posterior.sample(m, g), x, None, noise_var)


def linear_predictive(posterior: GaussianPosterior, x: torch.Tensor, beta: float):
    """Eq 6 for a linear model y = w'x + b: N(mu_w' [x, 1], 1 / beta + [x, 1] diag(sigma_w^2) [x, 1]').
    Parameters are laid out as nn.Linear(F, 1) flattens them: the F weights, then the bias."""
    beta = check_float("linear_predictive: beta", beta, minimum=0.0, strict_min=True)
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], 1).to(posterior.mean.dtype)
    mu = xa @ posterior.mean
    var = 1.0 / beta + xa.square() @ posterior.var
    return mu, var.sqrt()


def noise_precision(
    model: FlatModel, at: torch.Tensor, data: list[tuple[torch.Tensor, torch.Tensor]], weights=None
) -> float:
    """beta = 1 / the residual variance of ``at`` on the clients' training data (eq 6's noise precision,
    read from the training data as the paper's Sec. 4 does): each client reports its mean squared
    residual, and the server averages them with ``weights``, the clients' trust in the round (as the rule
    weighs their models: a count-weighted rule's trust already holds the counts), or by sample count
    when none are given (every sample counts alike). With robust FedAG's trust, a client the rule sets
    aside (weight 0) has no say in the data noise either: three of ten clients with noisy targets would
    otherwise set it. A client without rows has none."""
    # every client's residual where the data are, read in one transfer (not a sync each)
    with torch.no_grad():
        each = [((model.forward(at, x).reshape(-1) - y) ** 2).mean() for x, y in data if len(y)]
        read = iter(torch.stack(each).tolist() if each else [])
        mse = torch.tensor([next(read) if len(y) else 0.0 for _, y in data])
    counts = torch.tensor([len(y) for _, y in data], dtype=torch.float64)
    w = counts if weights is None else weights.detach().to(torch.float64).cpu() * (counts > 0)
    return float(w.sum() / (w * mse.to(torch.float64)).sum().clamp_min(1e-12))
