"""Centered clipping (Karimireddy, He, Jaggi 2021)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedtrust._checks import check_float, check_int
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.passes import CombinationPasses, weighted_sum
from fedtrust.aggregators.screening import FirstPass
from fedtrust.aggregators.state import Fields, Tensor, check_state

#: The centre is a finite vector of the rounds' length, kept in their dtype.
STATE = Fields(optional={"center": Tensor(("d",), dtype=None)})


#: The most iterations ``n_iter`` may ask for: 10**9 had a round run for hours.
MAX_ITERATIONS = 1000


class CenteredClipping(BaseRule):
    """Centered clipping, iterated ``n_iter`` times from the previous round's output v:

        v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)

    (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021,
    eq. CC). The centre starts at zero (the paper aggregates momenta / update deltas, so use it on
    deltas) and is carried across rounds: ``state_dict`` holds it.

    The output is a combination of the old centre and the updates; a client's trust weight is its
    normalised coefficient, and ``info["center_weight"]`` is the coefficient left on the old centre;
    ``info["clients"]`` has each client's clip factor and the distance it was clipped by (to the centre
    of the last iteration).
    """

    name = "centered_clipping"
    reads_deltas = True
    paper = "Karimireddy, He, Jaggi 2021, Learning from History for Byzantine Robust Optimization"

    def __init__(self, tau: float = 10.0, n_iter: int = 1):
        self.tau = check_float(f"{self.name}: tau", tau, minimum=0.0, strict_min=True)
        # each iteration is a pass over the round; a few suffice
        self.n_iter = check_int(f"{self.name}: n_iter", n_iter, minimum=1, maximum=MAX_ITERATIONS)
        self._center: torch.Tensor | None = None

    def first_pass(self, round: Round) -> FirstPass:  # the distances to the centre take the norms
        x = round.updates
        v = self._center
        passes = CombinationPasses(x, host=True)  # the n clip factors are computed on the host
        if v is None:  # the first round: the centre is zero (None here) and the distances are the norms
            dist = passes.norms()
        elif v.numel() != round.d:
            raise ValueError(
                f"{self.name}: the stored centre has d={v.numel()} but this round has d={round.d}"
            )
        else:
            v = v.to(device=x.device, dtype=x.dtype)
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"{self.name}: the stored centre does not fit in this round's {x.dtype}")
            _, sq, _ = passes(None, offset=v)
            dist = sq.sqrt()
        return FirstPass((passes, v, dist), passes.norms())

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        x = round.updates
        n = round.n
        passes, v, dist = first.value
        coef = torch.zeros(n, dtype=torch.float64)  # on the host, with dist (CombinationPasses' host)
        center_weight = 1.0
        for it in range(self.n_iter):
            clip = (self.tau / dist.clamp_min(torch.finfo(torch.float64).tiny)).clamp(max=1.0)
            keep = 1.0 - float(clip.mean())
            coef = keep * coef + clip / n
            center_weight *= keep
            if it + 1 < self.n_iter:  # the next iteration clips by the distances to the new centre
                v, sq, _ = passes(clip / n, offset=None if v is None else keep * v)
                dist = sq.sqrt()
            else:  # the last one needs only the sum: two passes over x for the usual n_iter = 1
                s = weighted_sum(x, clip / n)
                v = s if v is None else s.add_(v, alpha=keep)
        self._center = v.detach().clone()
        total = coef.sum()
        weights = coef / total if total > 0 else torch.full_like(coef, 1.0 / n)
        info = {
            "center_weight": center_weight,
            "clients": {"clip": clip.to(x.device), "distance": dist.to(x.device)},
        }
        return Aggregate(v, weights.to(x.device, x.dtype), info)

    def state_dict(self) -> dict[str, Any]:
        return {} if self._center is None else {"center": self._center.cpu().clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = check_state(self.name, STATE, state)
        self._center = state.get("center")
