"""Geometric median by the smoothed Weiszfeld algorithm (RFA, Pillutla, Kakade, Harchaoui)."""

from __future__ import annotations

import torch

from fedtrust._checks import check_bool, check_float, check_int, check_tol, resolve_tol
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.mean import sample_weights
from fedtrust.aggregators.passes import CombinationPasses
from fedtrust.aggregators.screening import FirstPass


class GeometricMedian(BaseRule):
    """Geometric median ``argmin_z sum_i alpha_i ||z - x_i||`` by the smoothed Weiszfeld algorithm
    (Pillutla, Kakade, Harchaoui, "Robust Aggregation for Federated Learning", IEEE TSP 2022, Algorithm 2):

        beta_i = alpha_i / max(nu, ||z - x_i||),    z <- sum_i beta_i x_i / sum_i beta_i,

    started from the alpha-weighted mean. RFA's experiments run a handful of steps (``max_iter=3``
    reproduces them); by default it runs to convergence: until a step moves z by less than ``tol`` times
    the scale ``sum_i beta_i ||z - x_i||`` (the alpha-weighted harmonic mean of the distances, set by
    the points near z). RFA's own test, a small relative change of the objective, stops far too early
    under huge outliers: their distances dominate the objective. ``tol`` defaults (None) to
    :func:`~fedtrust._checks.stopping_tol` of the updates' dtype. z is held in that dtype, so a step of
    a few of its roundings (``ROUNDING_STEP * eps * ||z||``) cannot shrink further: such a step also
    ends the iterations as converged (when the points share a large common component the scale is far
    below ||z||, and no step could ever reach ``tol * scale``).

    nu:       smoothing, an absolute distance floor (> 0).
    weighted: alpha_i = n_i / sum n (RFA's sample weights, trusting reported counts) instead of 1/n.

    Trust weight of a client: its normalised beta_i, i.e. its coefficient in the returned z.
    ``info``: iterations, converged, objective (sum_i alpha_i ||z - x_i||), its trace, the last step,
    the tol used, and per client the distance to z.
    """

    name = "geometric_median"
    #: A step of at most this many eps * ||z|| is z's own rounding (steps there plateau at ~0.6).
    ROUNDING_STEP = 4
    paper = "Pillutla, Kakade, Harchaoui 2022, Robust Aggregation for Federated Learning (RFA)"

    def __init__(
        self, nu: float = 1e-6, max_iter: int = 100, tol: float | None = None, weighted: bool = False
    ):
        self.nu = check_float(f"{self.name}: nu", nu, minimum=0.0, strict_min=True)
        self.max_iter = check_int(f"{self.name}: max_iter", max_iter, minimum=1)
        self.tol = check_tol(f"{self.name}: tol", tol)
        self.weighted = check_bool(f"{self.name}: weighted", weighted)

    def first_pass(self, round: Round) -> FirstPass:  # the first step's fused pass takes the norms
        x = round.updates
        if self.weighted:
            alpha = sample_weights(round, self.name).to(torch.float64)
        else:
            alpha = torch.full((round.n,), 1.0 / round.n, dtype=torch.float64)
        passes = CombinationPasses(x, host=True)  # one fused pass a step; the n weights on the host
        z, sq, _ = passes(alpha)
        return FirstPass((passes, alpha, z, sq), passes.norms())

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        x = round.updates  # (the step's n-sized arithmetic runs on the host: CombinationPasses' host)
        passes, alpha, z, sq = first.value
        beta = alpha
        dist = sq.sqrt()
        trace = [float(alpha @ dist)]
        tol = resolve_tol(self.tol, x.dtype)
        rounding = self.ROUNDING_STEP * torch.finfo(x.dtype).eps
        converged, iterations, step = False, 0, float("nan")
        while iterations < self.max_iter:
            beta = alpha / dist.clamp_min(self.nu)
            beta = beta / beta.sum()
            scale = beta @ dist
            z, sq, step = passes(beta, previous=z)
            dist = sq.sqrt()
            iterations += 1
            scale, step, objective, size = torch.stack([scale, step, alpha @ dist, passes.z_norm]).tolist()
            trace.append(objective)
            if step <= tol * scale or step <= rounding * size:
                converged = True
                break
        info = {
            "iterations": iterations,
            "converged": converged,
            "objective": trace[-1],
            "trace": trace,
            "last_step": step,
            "tol": tol,
            "clients": {"distance": dist.to(x.device)},
        }
        return Aggregate(z, beta.to(x.device, x.dtype), info)
