"""Coordinate-wise median (Yin et al. 2018)."""

from __future__ import annotations

from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.rank_windows import rank_window
from fedtrust.aggregators.screening import FirstPass


def median_window(n: int) -> tuple[int, int]:
    """The ranks whose mean is the median of n values: the middle one, or the two middle ones."""
    return (n // 2, n // 2 + 1) if n % 2 else (n // 2 - 1, n // 2 + 1)


class CoordinateMedian(BaseRule):
    """Coordinate-wise median: ``med{x_1[j], ..., x_n[j]}`` for each coordinate j (Yin, Chen, Ramchandran,
    Bartlett 2018, Definition 1); for even n the mean of the two middle values, the ordinary median.

    Trust weight of a client: the share of coordinates whose median it supplied (half a share for each
    of the two middle values when n is even; clients tied at the median share its slots evenly).
    """

    name = "median"
    paper = "Yin et al. 2018, Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates"

    def first_pass(self, round: Round) -> FirstPass:  # the whole rule: one selection pass takes the norms
        vector, weights, norms = rank_window(round.updates, *median_window(round.n))
        return FirstPass((vector, weights), norms)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        vector, weights = first.value
        return Aggregate(vector, weights, {})
