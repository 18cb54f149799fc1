"""Bulyan (El Mhamdi, Guerraoui, Rouault 2018)."""

from __future__ import annotations

import numpy as np
import torch

from fedtrust.aggregators import triton_windows
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.core import Aggregate, Round, check_f
from fedtrust.aggregators.distances import pairwise_sq_distances
from fedtrust.aggregators.krum import copies_alike, least_score
from fedtrust.aggregators.median import median_window
from fedtrust.aggregators.rank_windows import (
    map_column_blocks,
    sorted_columns,
    window_slot_sums,
    window_slots,
)
from fedtrust.aggregators.screening import FirstPass


def recursive_krum(sq_dist: torch.Tensor, f: int, count: int) -> list[int]:
    """Select ``count`` points by applying Krum repeatedly to the points not yet selected
    (El Mhamdi et al. 2018, Algorithm 1, first phase). Krum on r remaining points scores each by its
    r - f - 2 nearest neighbours (at least 1), so it stays defined for the last, smallest sets. Each step
    picks the point :func:`~fedtrust.aggregators.krum.krum_order` would put first on the remaining
    points' distances (the same sorted distances and sums, the same tie rule). The (n, n) distances are
    read on the host (a selection per step would be a device sync each) and sorted once: a step takes
    each remaining row's distances to the remaining points from that order."""
    d = sq_dist.detach().cpu().numpy().copy()
    np.fill_diagonal(d, np.inf)
    order = np.argsort(d, axis=1, kind="stable")
    ordered = np.take_along_axis(d, order, axis=1)
    left = np.ones(len(d), dtype=bool)
    chosen: list[int] = []
    for _ in range(count):
        rows = np.flatnonzero(left)
        r = len(rows)
        if r == 1:
            chosen.append(int(rows[0]))
            break
        near = ordered[rows][left[order[rows]]].reshape(r, r)[:, : r - 1]
        neighbours = max(1, r - f - 2)
        scores = torch.from_numpy(near)[:, :neighbours].sum(1).numpy()  # summed as krum_order sums
        pick = int(rows[least_score(near, scores, neighbours)])
        chosen.append(pick)
        left[pick] = False
    return chosen


class Bulyan(BaseRule):
    """Bulyan: (1) select theta = n - 2f updates by recursive Krum; (2) per coordinate, average the
    beta = theta - 2f selected values closest to their median (El Mhamdi et al. 2018, Algorithm 1;
    M[i] = argmin_{|R| = beta} sum_{X in R} |X[i] - med[i]|). Needs n >= 4f + 3.

    f: assumed number of Byzantine clients (int) or fraction of the round's clients (float). The default
       0 tolerates none: theta = beta = n, so Bulyan is then the plain mean; set f for a defence.
    Trust weight of a client: its share of the (coordinate, beta) slots of the final average, shared
    evenly within each group of copies (identical updates get identical trust, whatever their order).
    """

    name = "bulyan"
    paper = (
        "El Mhamdi, Guerraoui, Rouault 2018, The Hidden Vulnerability of Distributed Learning in Byzantium"
    )

    need = ("n >= 4f + 3", lambda f: 4 * f + 3)

    def __init__(self, f: int | float = 0):
        self.f = check_f(self.name, f)

    def first_pass(self, round: Round) -> FirstPass:  # the distances' Gram matrix has the norms
        dist, norms = pairwise_sq_distances(round.updates)
        return FirstPass(dist, norms)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        dist = first.value
        f = self.budget(round)
        theta = round.n - 2 * f
        beta = theta - 2 * f
        selected = torch.as_tensor(sorted(recursive_krum(dist, f, theta)), device=round.updates.device)

        if round.updates.device.type == "cpu":
            vector, weights, _ = map_column_blocks(
                round.updates, lambda b: closest_to_median(b, selected.numpy(), beta)
            )
        elif triton_windows.suits(round.updates, rows=theta, method="closest"):  # CUDA: one kernel
            vector, weights = triton_windows.closest_to_median(round.updates, selected, beta)
        else:
            vector, weights = closest_to_median_by_sort(round.updates, selected, beta)
        info = {
            "f": f,
            "theta": theta,
            "beta": beta,
            "selected": [round.client_ids[i] for i in selected.tolist()],
        }
        return Aggregate(vector, copies_alike(round, first, weights), info)


def closest_to_median(block: np.ndarray, selected: np.ndarray, beta: int) -> tuple[np.ndarray, np.ndarray]:
    """Bulyan's second phase on an (n, c) block: per column, the mean of the ``beta`` selected values
    closest to the selected values' median, and each client's count of (column, slot) picks.

    The beta values closest to a point are a run of consecutive ranks, so after sorting each column
    the chosen set is the window of beta ranks with the least total distance to the median."""
    sub = block[selected]
    t = sorted_columns(sub)  # (c, theta)
    theta = t.shape[1]
    lo, hi = median_window(theta)
    med = t[:, lo:hi].mean(1, dtype=np.float64, keepdims=True)
    zero = np.zeros((len(t), 1))
    distance = np.concatenate([zero, np.cumsum(np.abs(t - med), axis=1, dtype=np.float64)], axis=1)
    start = np.argmin(distance[:, beta:] - distance[:, : theta - beta + 1], axis=1)
    total = np.concatenate([zero, np.cumsum(t, axis=1, dtype=np.float64)], axis=1)
    rows = np.arange(len(t))
    values = ((total[rows, start + beta] - total[rows, start]) / beta).astype(block.dtype, copy=False)
    slots = window_slots(sub, t, start, start + beta)
    return values, np.bincount(selected, weights=slots, minlength=block.shape[0])


def closest_to_median_by_sort(x: torch.Tensor, selected: torch.Tensor, beta: int):
    """The same with torch ops on x's device, where the Triton kernel does not serve
    (:func:`~fedtrust.aggregators.triton_windows.closest_to_median`): per column, the window of ``beta``
    consecutive ranks with the least total distance to the median (the first such window, as on the
    CPU), ties shared as on the CPU (:func:`~fedtrust.aggregators.rank_windows.window_slot_sums`)."""
    theta = len(selected)
    lo, hi = median_window(theta)
    n, d = x.shape
    f64 = torch.float64
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    slots = torch.zeros(n, dtype=f64, device=x.device)
    sub = x.index_select(0, selected)
    for cols in column_blocks(sub):
        t = sub[:, cols].T.contiguous()  # (c, theta)
        ordered = t.sort(dim=1).values
        med = ordered[:, lo:hi].to(f64).mean(1, keepdim=True)
        zero = torch.zeros(len(t), 1, dtype=f64, device=x.device)
        distance = torch.cat([zero, torch.cumsum((ordered - med).abs().to(f64), dim=1)], dim=1)
        start = torch.argmin(distance[:, beta:] - distance[:, : theta - beta + 1], dim=1)[:, None]
        total = torch.cat([zero, torch.cumsum(ordered.to(f64), dim=1)], dim=1)
        out[cols] = ((total.gather(1, start + beta) - total.gather(1, start)) / beta)[:, 0].to(x.dtype)
        slots.index_add_(0, selected, window_slot_sums(t, ordered, start, start + beta))
    return out, (slots / slots.sum()).to(x.dtype)
