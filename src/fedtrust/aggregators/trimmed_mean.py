"""Coordinate-wise trimmed mean (Yin et al. 2018)."""

from __future__ import annotations

from fedtrust.aggregators.core import Aggregate, BaseRule, Round, byzantine_budget, check_f
from fedtrust.aggregators.kernels import rank_window


class TrimmedMean(BaseRule):
    """Coordinate-wise trimmed mean: for each coordinate drop the ``b`` largest and ``b`` smallest values
    and average the remaining n - 2b (Yin et al. 2018, Definition 2, with b = beta * n).

    f: values trimmed from each side, as a count (int) or as a fraction beta of the round's clients
       (float, rounded down). Malformed clients already quarantined count against it. Needs 2b < n.
       ``f=0`` is the plain mean.

    Trust weight of a client: the share of (coordinate, kept value) slots it filled; clients tied at a
    cut share the slots at that value evenly.
    """

    name = "trimmed_mean"
    screens_in_first_pass = True
    paper = "Yin et al. 2018, Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates"

    def __init__(self, f: int | float = 0.1):
        self.f = check_f(self.name, f)

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        n = round.n
        b = byzantine_budget(self.name, self.f, round, n_quarantined, "n > 2f", lambda f: 2 * f + 1)
        vector, weights = rank_window(round.updates, b, n - b, round.norms_for_pass().get("on_norms"))
        return Aggregate(vector, weights, {"trimmed_per_side": b})
