"""Uniform mean and FedAvg, the non-robust baselines."""

from __future__ import annotations

import torch

from fedtrust.aggregators.core import Aggregate, BaseRule, Round
from fedtrust.aggregators.kernels import weighted_sum


class Mean(BaseRule):
    """Uniform average: every reporting client gets weight 1/n."""

    name = "mean"
    screen_by_result = True
    paper = "uniform average (the 'Uniform avg' baseline of Nguyen et al., Table 1)"

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        w = torch.full((round.n,), 1.0 / round.n, dtype=round.updates.dtype, device=round.updates.device)
        return Aggregate(weighted_sum(round.updates, w), w, {})


class FedAvg(BaseRule):
    """FedAvg: weight proportional to the reported sample count, w_k = n_k / sum_i n_i
    (McMahan et al. 2017, eq. in Algorithm 1; eq 2 of Nguyen et al.)."""

    name = "fedavg"
    screen_by_result = True
    paper = "McMahan et al. 2017, Communication-Efficient Learning of Deep Networks from Decentralized Data"

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        w = sample_weights(round, self.name)
        return Aggregate(weighted_sum(round.updates, w), w, {})


def sample_weights(round: Round, rule: str) -> torch.Tensor:
    """n_k / sum_i n_i (:func:`normalised`), with a clear error when every reported count is zero."""
    total = round.num_samples.sum()
    if not total > 0:
        raise ValueError(
            f"{rule}: the reported num_samples sum to {total.item()}; sample weights need a positive total"
        )
    return normalised(round.num_samples)


def normalised(w: torch.Tensor) -> torch.Tensor:
    """``w / w.sum()`` for non-negative ``w`` with a positive sum. When the sum overflows the dtype, or is
    too small to divide by accurately (subnormal), ``w`` is first scaled by its largest entry."""
    total = w.sum()
    if not torch.finfo(w.dtype).tiny <= total < torch.inf:
        w = w / w.max()
        total = w.sum()
    return w / total
