"""Krum and Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer 2017)."""

from __future__ import annotations

import numpy as np
import torch

from fedtrust._checks import check_int
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, check_f
from fedtrust.aggregators.distances import pairwise_sq_distances
from fedtrust.aggregators.passes import weighted_sum
from fedtrust.aggregators.screening import FirstPass
from fedtrust.aggregators.sybils import near_duplicates


def _nearest(sq_dist: torch.Tensor, neighbours: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each point's distances to the other points, nearest first (r, r - 1), and its Krum score: the sum
    of the first ``neighbours`` of them."""
    r = sq_dist.shape[0]
    d = sq_dist.clone()
    d.fill_diagonal_(float("inf"))
    near = d.sort(dim=1).values[:, : r - 1]
    return near, near[:, :neighbours].sum(1)


def krum_order(sq_dist: torch.Tensor, neighbours: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Krum scores (sum of squared distances to the ``neighbours`` nearest other points) and the points
    ordered best first.

    Ties are broken by the next-nearest distances, then the ones after, so the order does not depend
    on how clients are numbered (with one neighbour, mutual nearest neighbours always tie exactly); then
    by row. One lexicographic sort on the host (NaN counting as the largest value, as in a sort):
    ``sq_dist`` is there (:func:`~fedtrust.aggregators.distances.pairwise_sq_distances`).
    """
    near, scores = _nearest(sq_dist.cpu(), neighbours)
    keys = near[:, neighbours:].numpy()[:, ::-1].T  # the last key is the primary one
    order = np.lexsort((*keys, scores.numpy()))
    return scores, torch.from_numpy(order)


def krum_first(sq_dist: torch.Tensor, neighbours: int) -> int:
    """The point :func:`krum_order` puts first, without ordering the rest (``sq_dist`` on the host)."""
    near, scores = _nearest(sq_dist, neighbours)
    return least_score(near.numpy(), scores.numpy(), neighbours)


def least_score(near: np.ndarray, scores: np.ndarray, neighbours: int) -> int:
    """The row :func:`krum_order` puts first, from :func:`_nearest`'s two arrays: the least score, its
    ties broken by the next-nearest distances, then the ones after, then the lowest row, NaN counting as
    the largest value (as in the order's stable sorts)."""
    candidates = np.arange(len(scores))
    for key in [scores, *near[:, neighbours:].T]:
        if len(candidates) == 1:
            break
        values = key[candidates]
        known = ~np.isnan(values)
        if known.any():
            candidates = candidates[known & (values == values[known].min())]
    return int(candidates[0])


class Krum(BaseRule):
    """Krum: pick the update whose n - f - 2 nearest neighbours are closest,
    ``argmin_i sum_{i -> j} ||x_i - x_j||^2`` (Blanchard et al. 2017, Section 4). Needs n > 2f + 2.

    f: assumed number of Byzantine clients (int), or a fraction of the round's clients (float).
    Squared distances come from one Gram matrix. Trust: 1 for the chosen client, shared evenly with its
    copies (identical updates get identical trust, whatever their order).
    """

    name = "krum"
    paper = "Blanchard et al. 2017, Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent"

    need = ("n > 2f + 2", lambda f: 2 * f + 3)

    def __init__(self, f: int | float = 0):
        self.f = check_f(self.name, f)

    def first_pass(self, round: Round) -> FirstPass:  # the distances' Gram matrix has the norms
        dist, norms = pairwise_sq_distances(round.updates)
        return FirstPass(dist, norms)

    def _order(self, round: Round, first: FirstPass) -> tuple[torch.Tensor, torch.Tensor, int]:
        f = self.budget(round)
        scores, order = krum_order(first.value, round.n - f - 2)
        return scores, order, f

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        scores, order, f = self._order(round, first)  # on the host, with the distances
        best = int(order[0])
        w = torch.zeros(round.n, dtype=round.updates.dtype)
        w[best] = 1.0
        w = copies_alike(round, first, w)
        info = {"f": f, "selected": [round.client_ids[best]], "clients": {"score": _there(round, scores)}}
        return Aggregate(round.updates[best].clone(), _there(round, w), info)


class MultiKrum(Krum):
    """Multi-Krum: average the m updates with the lowest Krum scores, scores computed once
    (Blanchard et al. 2017, Section 5). Needs n > 2f + 2.

    f: assumed number of Byzantine clients (int) or fraction (float).
    m: how many to average; default n - f. Trust: 1/m for each selected client (a group of copies that
    the cut splits shares its selected weight evenly: the aggregate is the same).
    """

    name = "multi_krum"

    def __init__(self, f: int | float = 0, m: int | None = None):
        super().__init__(f)
        self.m = None if m is None else check_int(f"{self.name}: m", m, minimum=1)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        scores, order, f = self._order(round, first)
        m = round.n - f if self.m is None else min(self.m, round.n)
        chosen = order[:m]
        w = torch.zeros(round.n, dtype=round.updates.dtype)
        w[chosen] = 1.0 / m
        w = _there(round, copies_alike(round, first, w))
        info = {
            "f": f,
            "m": m,
            "selected": [round.client_ids[i] for i in sorted(chosen.tolist())],
            "clients": {"score": _there(round, scores)},
        }
        return Aggregate(weighted_sum(round.updates, w), w, info)


def _there(round: Round, t: torch.Tensor) -> torch.Tensor:
    """A result computed on the host (the distances live there), on the round's device."""
    return t.to(round.updates.device)


def copies_alike(round: Round, first: FirstPass, weights: torch.Tensor) -> torch.Tensor:
    """``weights`` with each group of copies (to the dtype's rounding) sharing its total evenly."""
    return near_duplicates(round.updates, first.value, first.norms, relative=0.0).even_out(weights)
