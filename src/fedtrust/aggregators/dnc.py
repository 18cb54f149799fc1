"""Divide-and-Conquer, DnC (Shejwalkar & Houmansadr, NDSS 2021)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedtrust._checks import check_float, check_int, check_seed
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, RoundRefused, check_f
from fedtrust.aggregators.passes import moved, weighted_sum
from fedtrust.aggregators.state import SeededCalls


def subsample(d: int, b: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random set of ``b`` of the ``d`` coordinates, sorted (all of them when b >= d). Drawn in
    O(b) by numpy's sampler without replacement, seeded from ``generator`` (a permutation of d = 1e7
    coordinates would take 0.4 s)."""
    if b >= d:
        return torch.arange(d)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    picked = np.random.default_rng(seed).choice(d, size=b, replace=False)
    return torch.from_numpy(np.sort(picked))


def outlier_scores(sub: torch.Tensor) -> torch.Tensor:
    """Algorithm 2's outlier scores of the rows of an (n, b) subsample: centred on their mean, projected on
    the top right singular vector v of the centred matrix, squared: s_i = <x_i - mu, v>^2 (float64).

    v comes from the n x n Gram matrix of the centred rows (its top eigenvector u gives v = X_c^T u /
    ||X_c^T u||), never from an SVD of the n x b matrix. The projections are taken row by row, so clients
    with identical updates get bit-identical scores. No spread at all (every row the same): all 0.

    The scores come back on the host, read with ||v|| in one transfer (no sync on a device). The n x n
    eigenproblem is solved there (on a GPU the solver takes a millisecond for what the host does in 20 us
    at n = 10)."""
    centred = sub.to(torch.float64)
    centred = centred - centred.mean(0)
    gram = centred @ centred.T
    _, vectors = torch.linalg.eigh(gram.cpu())  # ascending eigenvalues: the last vector is the top one
    v = centred.T @ vectors[:, -1].to(gram.device)
    length = v.norm()
    scores, length = moved(torch.device("cpu"), (centred * (v / length)).sum(1).square(), length)
    if not length > 0:
        return torch.zeros(sub.shape[0], dtype=torch.float64)
    return scores


def lowest(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Boolean mask of the ``keep`` clients with the lowest scores. Clients tied with the first score left
    out are left out with it, so identical clients are kept or removed together (a group of copies that
    the cut would split is removed whole); if that would leave nobody (more than ``keep`` clients tie at
    the lowest score), the tied lowest group is kept."""
    n = scores.numel()
    if keep >= n:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    cut = scores.sort().values[keep]  # the lowest score left out
    mask = scores < cut
    return mask if bool(mask.any()) else scores == cut


class DnC(SeededCalls, BaseRule):
    """Divide-and-Conquer: in each of ``niters`` iterations, sample ``b`` coordinates at random, centre the
    clients' sub-vectors on their mean, score each client by its squared projection on the top right
    singular vector of the centred sub-vectors, and keep the n - c f lowest; the good set is the clients
    kept in every iteration, and the aggregate is their mean (Shejwalkar & Houmansadr, "Manipulating the
    Byzantine: Optimizing Model Poisoning Attacks and Defenses for Federated Learning", NDSS 2021,
    Algorithm 2, whose steps are, in order):

        r = a random set of b coordinates;  x^r_i = x_i[r];  mu = mean_i x^r_i
        v = the top right singular vector of the centred rows x^r_i - mu
        s_i = <x^r_i - mu, v>^2                           outlier scores
        I = the n - c m clients of lowest score;  I_good = I_good intersected with I
        aggregate = mean of x_i over I_good               (after niters iterations)

    f:      the assumed number of Byzantine clients m (int), or a fraction of the round's clients (float,
            rounded down); malformed clients already quarantined count against it.
    c:      the filtering fraction: ceil(c f) clients are removed per iteration (1 by default).
    niters: iterations (5, our choice: Algorithm 2 leaves it open).
    b:      coordinates per subsample (10000 by default); all d coordinates when d <= b. Every client's
            b sampled coordinates are gathered (n x b values): memory does not grow with d.
    seed:   the coordinate samples of round t come from a stream keyed by (seed, t)
            (:class:`~fedtrust.aggregators.state.SeededCalls`; ``state_dict`` holds t).

    Choices the paper leaves open: scores tied with the first score cut are cut with it (identical
    clients get identical trust; see :func:`lowest`), so a round may keep fewer than n - c f clients;
    an empty intersection (possible only with several iterations) refuses the round, and the rule's
    stream stays where it was. Needs n > c f.
    Trust: 1/|good| for each client of the good set, 0 for the others; ``info["admitted"]`` lists the
    good set, ``info["clients"]["score"]`` each client's outlier score averaged over the iterations.
    """

    name = "dnc"
    paper = "Shejwalkar & Houmansadr 2021, Manipulating the Byzantine (NDSS), Algorithm 2"

    def __init__(self, f: int | float = 0.1, c: float = 1.0, niters: int = 5, b: int = 10000, seed: int = 0):
        self.f = check_f(self.name, f)
        self.c = check_float(f"{self.name}: c", c, minimum=0.0)
        self.niters = check_int(f"{self.name}: niters", niters, minimum=1)
        self.b = check_int(f"{self.name}: b", b, minimum=1)
        self.seed = check_seed(f"{self.name}: seed", seed)

    def _removed(self, f: int) -> int:
        return math.ceil(round(self.c * f, 9))  # c f = 3.0000000000000004 removes 3

    @property
    def need(self) -> tuple[str, Any]:
        return ("n > c f" if self.c != 1 else "n > f"), lambda f: self._removed(f) + 1

    def aggregate(self, round: Round) -> Aggregate:
        x = round.updates
        n, d = x.shape
        f = self.budget(round)
        keep = n - self._removed(f)
        generator = self.round_generator("dnc")
        good = torch.ones(n, dtype=torch.bool)  # the n scores' arithmetic on the host: one transfer each
        total = torch.zeros(n, dtype=torch.float64)
        for _ in range(self.niters):
            cols = subsample(d, self.b, generator).to(x.device)
            scores = outlier_scores(x.index_select(1, cols))
            good &= lowest(scores, keep)
            total += scores
        if not bool(good.any()):
            self._calls -= 1  # a refused round leaves the rule as it was: the next round draws these samples
            raise RoundRefused(
                f"{self.name}: no client was among the {keep} lowest scores in all {self.niters} iterations"
            )
        weights, score = moved(x.device, good.to(x.dtype) / good.sum(), total / self.niters)
        info = {
            "f": f,
            "admitted": [round.client_ids[i] for i in torch.nonzero(good).flatten().tolist()],
            "clients": {"score": score},
        }
        return Aggregate(weighted_sum(x, weights), weights, info)
