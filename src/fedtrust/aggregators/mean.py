"""Uniform mean and FedAvg, the non-robust baselines."""

from __future__ import annotations

import math

import torch

from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, RoundRefused
from fedtrust.aggregators.passes import weighted_sum
from fedtrust.aggregators.screening import FirstPass


class Mean(BaseRule):
    """Uniform average: every reporting client gets weight 1/n.

    Its one pass is its first pass: the result is a positive combination of every update, so a NaN or Inf
    anywhere reaches it, and only then are the updates screened one by one (``FirstPass.finite``)."""

    name = "mean"
    paper = "uniform average (the 'Uniform avg' baseline of Nguyen et al., Table 1)"
    keeps_large = True  # it only adds: a finite update of any size is kept (BaseRule)

    def weights(self, round: Round) -> torch.Tensor:
        return torch.full((round.n,), 1.0 / round.n, dtype=round.updates.dtype, device=round.updates.device)

    def first_pass(self, round: Round) -> FirstPass:
        w = self.weights(round)
        vector = weighted_sum(round.updates, w)
        # NaN/Inf anywhere: a non-finite sum, which finite entries give too when it overflows: then a look
        # at each entry (a float64 sum is 50x slower on the CPU at d = 1e7)
        finite = math.isfinite(float(vector.sum())) or bool(torch.isfinite(vector).all())
        return FirstPass((vector, w), finite=finite)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        vector, w = first.value
        return Aggregate(vector, w, {})


class FedAvg(Mean):
    """FedAvg: weight proportional to the reported sample count, w_k = n_k / sum_i n_i
    (McMahan et al. 2017, eq. in Algorithm 1; eq 2 of Nguyen et al.)."""

    name = "fedavg"
    paper = "McMahan et al. 2017, Communication-Efficient Learning of Deep Networks from Decentralized Data"

    def weights(self, round: Round) -> torch.Tensor:
        return sample_weights(round, self.name).to(round.updates.device)


def sample_weights(round: Round, rule: str) -> torch.Tensor:
    """n_k / sum_i n_i (:func:`normalised`) of the round's reported counts, on the host
    (:meth:`Round.samples_on_host`: no sync on a GPU), with a clear error when every reported count is
    zero."""
    counts = round.samples_on_host()
    total = counts.sum()
    read = float(total)
    if not read > 0:
        raise RoundRefused(
            f"{rule}: the reported num_samples sum to {read}; sample weights need a positive total"
        )
    return normalised(counts, total, read)


def normalised(w: torch.Tensor, total: torch.Tensor | None = None, read: float | None = None) -> torch.Tensor:
    """``w / w.sum()`` for non-negative ``w`` with a positive sum (``total``, and ``read`` its value when
    already read). When the sum overflows the dtype, or is too small to divide by accurately (subnormal),
    ``w`` is first scaled by its largest entry. The division is by the sum as a tensor: CUDA divides by a
    host scalar through its reciprocal, a bit off."""
    if total is None:
        total = w.sum()
    if not torch.finfo(w.dtype).tiny <= (total if read is None else read) < torch.inf:
        w = w / w.max()
        total = w.sum()
    return w / total
