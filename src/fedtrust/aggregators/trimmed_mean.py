"""Coordinate-wise trimmed mean (Yin et al. 2018)."""

from __future__ import annotations

from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, RoundRefused, check_f
from fedtrust.aggregators.rank_windows import rank_window
from fedtrust.aggregators.screening import FirstPass


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
    paper = "Yin et al. 2018, Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates"

    need = ("n > 2f", lambda f: 2 * f + 1)

    def __init__(self, f: int | float = 0.1):
        self.f = check_f(self.name, f)

    def first_pass(self, round: Round) -> FirstPass:  # the whole rule: one selection pass takes the norms
        try:
            b = self.budget(round)
        except RoundRefused:  # too few clients for f; quarantined ones would count against f: screen first
            return FirstPass(None, round.norms)
        vector, weights, norms = rank_window(round.updates, b, round.n - b)
        return FirstPass((vector, weights, b), norms)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        if first.value is None:  # too few clients for f, and the screen removed none: its error stands
            self.budget(round)
        vector, weights, b = first.value
        return Aggregate(vector, weights, {"trimmed_per_side": b})
