"""Norm bounding (Sun, Kairouz, Suresh, McMahan 2019)."""

from __future__ import annotations

import torch

from fedtrust._checks import check_float
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.mean import normalised, sample_weights
from fedtrust.aggregators.passes import weighted_sum


def clip_factors(norms: torch.Tensor, bound: float) -> torch.Tensor:
    """min(1, bound / ||x_i||) per client (1 for a zero update): the factor that brings each update's norm
    to at most ``bound``."""
    return torch.where(norms > bound, bound / norms.clamp_min(torch.finfo(norms.dtype).tiny), 1.0)


def median_norm(norms: torch.Tensor) -> float:
    """The median of the norms (the mean of the two middle ones for an even count, as ``numpy.median``)."""
    return float(torch.quantile(norms.to(torch.float64), 0.5))


class NormBounding(BaseRule):
    """Norm bounding: clip each update to norm at most M, then take the sample-weighted mean of the clipped
    updates (FedAvg of them):

        Delta = sum_i (n_i / N) x_i / max(1, ||x_i|| / M),     N = sum_i n_i

    (Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated Learning?", 2019, the defence
    "norm thresholding of updates": each update Delta w_k scaled by 1 / max(1, ||Delta w_k|| / M); the
    paper's other defence, weak differential privacy, adds Gaussian noise and is not part of this rule).

    bound: M. None (the default): the median norm of the round's updates (after quarantine), a bound
           that adapts to the round and that fewer than half the clients can move (the paper fixes M by
           hand; the median is FLAME's adaptive choice, Nguyen et al. 2022). The updates are clipped as
           given: use it on deltas (the simulator and the Flower strategy pass deltas).

    Trust weight of a client: its normalised coefficient n_i min(1, M / ||x_i||) / sum_j (same). The
    coefficients themselves sum to less than 1 when some update was clipped: the aggregate is shorter,
    not re-normalised. ``info["clients"]["clip"]`` is each client's factor min(1, M / ||x_i||);
    ``info["clip_bound"]`` is M.
    """

    name = "norm_bounding"
    reads_deltas = True
    paper = "Sun, Kairouz, Suresh, McMahan 2019, Can You Really Backdoor Federated Learning?"

    def __init__(self, bound: float | None = None):
        if bound is not None:
            bound = check_float(f"{self.name}: bound", bound, minimum=0.0, strict_min=True)
        self.bound = bound

    def aggregate(self, round: Round) -> Aggregate:
        x = round.updates
        # the norms (float64) as the front door's screen read them: the rule's arithmetic on n numbers runs
        # on the host with the counts (on a GPU it was 30 kernels and 4 syncs)
        norms = round.norms_on_host
        bound = median_norm(norms) if self.bound is None else self.bound
        clip = clip_factors(norms, bound)
        samples = sample_weights(round, self.name).to(torch.float64)
        coef = samples * clip
        vector = weighted_sum(x, coef)
        # every coefficient 0: only a median bound of 0 clips the counted updates to nothing (the aggregate
        # is then 0); the unclipped clients, whose counts are 0, share the trust
        weights = normalised(coef) if coef.sum() > 0 else normalised(clip)
        info = {"clip_bound": bound, "clients": {"clip": clip.to(x.device)}}
        return Aggregate(vector, weights.to(x.device, x.dtype), info)
