"""Scores for Gaussian predictive distributions N(mu, sigma^2), from the scoringrules library.

NLL (the negative log score), CRPS, RMSE of the mean, determinant sharpness (FedAG eq 8: for a scalar
target, the predictive standard deviation), central-interval coverage and PIT values for calibration.
"""

from __future__ import annotations

import numpy as np
import scoringrules as sr

# the standard normal's cdf and quantile, scipy.stats.norm's own, without loading scipy.stats (1.3 s of
# every start of a run or a Flower node)
from scipy.special import ndtr, ndtri

from fedtrust._checks import check_float


def _np(*arrays):
    # scores are computed on the host (scipy, scoringrules): tensors on any device come back first
    return [np.asarray(a.cpu() if hasattr(a, "cpu") else a, dtype=np.float64).reshape(-1) for a in arrays]


def _gaussian(score: str, y, mu, sigma) -> list[np.ndarray]:
    """y, mu, sigma as float64 vectors broadcast to one length, sigma >= 0 (NaN passes: a diverged
    model's prediction is scored as NaN, not refused), or an error naming the score and the value."""
    y, mu, sigma = _np(y, mu, sigma)
    try:
        y, mu, sigma = np.broadcast_arrays(y, mu, sigma)
    except ValueError:
        raise ValueError(
            f"{score}: y, mu and sigma must have one length (or 1), got {len(y)}, {len(mu)}, {len(sigma)}"
        ) from None
    negative = np.flatnonzero(sigma < 0)
    if len(negative):
        k = int(negative[0])
        raise ValueError(f"{score}: sigma[{k}] = {float(sigma[k])!r} is negative (a standard deviation)")
    return [y, mu, sigma]


def nll(y, mu, sigma) -> float:
    """Mean negative log-likelihood of y under N(mu, sigma^2) (the logarithmic score)."""
    y, mu, sigma = _gaussian("nll", y, mu, sigma)
    return float(np.mean(sr.logs_normal(y, mu, sigma)))


def crps(y, mu, sigma) -> float:
    """Mean continuous ranked probability score."""
    y, mu, sigma = _gaussian("crps", y, mu, sigma)
    return float(np.mean(sr.crps_normal(y, mu, sigma)))


def rmse(y, mu) -> float:
    y, mu = _np(y, mu)
    return float(np.sqrt(np.mean((y - mu) ** 2)))


def sharpness(sigma) -> float:
    """Determinant sharpness det(Sigma)^(1/2d) (FedAG eq 8), averaged: for d = 1 the mean sigma."""
    return float(np.mean(_np(sigma)[0]))


def coverage(y, mu, sigma, level: float = 0.9) -> float:
    """Share of observations inside the central ``level`` interval (should be close to ``level``)."""
    level = check_float("coverage: level", level, minimum=0.0, maximum=1.0, strict_min=True)
    y, mu, sigma = _gaussian("coverage", y, mu, sigma)
    half = ndtri(0.5 + level / 2) * sigma
    return float(np.mean(np.abs(y - mu) <= half))


def pit(y, mu, sigma) -> np.ndarray:
    """Probability integral transform values F(y): uniform on [0, 1] when calibrated."""
    y, mu, sigma = _gaussian("pit", y, mu, sigma)
    return ndtr((y - mu) / sigma)


def summary(y, mu, sigma) -> dict[str, float]:
    """Every score at once (the metrics a probabilistic regression run reports)."""
    return {
        "nll": nll(y, mu, sigma),
        "rmse": rmse(y, mu),
        "crps": crps(y, mu, sigma),
        "sharpness": sharpness(sigma),
        "coverage90": coverage(y, mu, sigma, 0.9),
    }
