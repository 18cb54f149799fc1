"""FOCUS: credibility-weighted aggregation with a trusted benchmark split (Chen et al.; papers/002)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedtrust._checks import check_choice, check_float
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.loss_defences import DEFENCES, defend, reference_losses
from fedtrust.aggregators.mean import normalised
from fedtrust.aggregators.passes import moved, weighted_sum
from fedtrust.aggregators.screening import FirstPass
from fedtrust.aggregators.state import Dict, Fields, Float, check_state
from fedtrust.aggregators.sybils import SYBILS, find_groups, grouping_pass

#: Each client's latest benchmark loss LS (eq 4), by id; +inf where it could not be measured.
STATE = Fields(optional={"ls": Dict(Float(infinite=True))})


def credibility(e: torch.Tensor, alpha: float) -> torch.Tensor:
    """C^k = 1 - exp(alpha E^k) / sum_i exp(alpha E^i) (eq 6), computed stably.

    E^k = +inf (a loss too large to represent, or one that could not be measured: NaN counts as +inf)
    takes eq 6's limit: the clients at +inf share the whole softmax mass (their C is 1 - 1/m for m of
    them, so 0 for one) and every other client gets C = 1. alpha = 0 gives every client 1 - 1/n."""
    z = e.to(torch.float64).nan_to_num(nan=math.inf)
    if alpha == 0:
        return torch.full_like(z, 1.0 - 1.0 / len(z))
    top = z == math.inf
    if bool(top.any()):
        return 1.0 - top.to(torch.float64) / top.sum()
    return 1.0 - torch.softmax(alpha * z, 0)


class FOCUS(BaseRule):
    """FOCUS (Algorithm 1). For client k, E^k = LS^k + LL^k (eq 3): LS^k is the loss of its local model
    on the server's benchmark split (eq 4, ``Round.reference``), LL^k the loss of the global model on its
    data (eq 5, the reported ``train_loss``). Credibility C^k from eq 6, weights
    W^k = n_k C^k / sum_i n_i C^i (eq 8), applied one round late (eq 7): round t's models are averaged
    with W_{t-1}, built from round t-1's LS and the LL clients report for the model that round made
    (which is what they report at the start of round t). The first round uses W_0 = n_k / sum n.

    alpha:     eq 6's sharpness.
    reduction: "sum" (the paper: cross-entropy summed over each dataset, so a client with more data has
               a larger LL) or "mean" (per sample, comparable across client sizes; raise alpha to match).
    defence:   "none", "clip" (floor reported LL at median - 3 MAD) or "benchmark" (floor it at the
               benchmark loss of the client's update).

    With partial participation a client's LS is its latest; a client seen for the first time gets the
    mean credibility of the others. Degenerate rounds never give a NaN model: when every weight n_k C^k
    is 0 the weights fall back to n_k / sum n (every credibility 0: a single known client), then to the
    credibilities alone (every count 0), then to 1/n; a benchmark loss that is not finite counts as +inf
    (see :func:`credibility`). ``info``: per client credibility, E, LS and LL.

    sybils:    "share" (default): clients whose updates this round are near-duplicates, or whose deviations
               from the round's centre correlate above 0.95 (copies with noise added), are one source
               (:mod:`fedtrust.aggregators.sybils`); "copies": near-duplicates only. Eq 6 normalises over
               sources, so k copies of one bad model would split the softmax mass that suppresses it and each
               keep a credibility of 1 - 1/k: identical updates would buy trust by their number. The group
               enters eq 6 once, with its members' mean E, and eq 8 once, with their mean count; its weight is
               split evenly among them (``info["groups"]``). "off": every client its own source (the paper).
    """

    name = "focus"
    per_client_state = True
    paper = "Chen et al. 2020, FOCUS: Dealing with Label Quality Disparity in Federated Learning"
    requires = ("train_loss",)
    reads_reference = ("loss",)

    def __init__(
        self, alpha: float = 1.0, reduction: str = "sum", defence: str = "none", sybils: str = "share"
    ):
        self.alpha = check_float(f"{self.name}: alpha", alpha, minimum=0.0)
        self.reduction = check_choice(f"{self.name}: reduction", reduction, ("sum", "mean"))
        self.defence = check_choice(f"{self.name}: defence", defence, DEFENCES)
        self.sybils = check_choice(f"{self.name}: sybils", sybils, SYBILS)
        self._ls: dict[Any, float] = {}

    def first_pass(self, round: Round) -> FirstPass:
        """The norms (the front door screens on them) and the sketch the search for copies reads, in one
        pass (:func:`~fedtrust.aggregators.sybils.grouping_pass`)."""
        norms, sketch = grouping_pass(round.updates, self.sybils)
        return FirstPass(sketch, norms)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        if round.reference is None:
            raise ValueError(f"{self.name}: needs Round.reference, the loss on the server's benchmark split")
        # the arithmetic on n numbers runs on the host, with the counts and reports the round keeps there
        # (on a GPU each scalar read is a sync); the weights and per-client info move at the end
        n = round.samples_on_host().to(torch.float64)
        bench_size = float(getattr(round.reference, "size", 1))
        ll = defend(self.defence, round, round.metric_on_host("train_loss"))
        if self.reduction == "sum":
            ll = ll * n
        known = torch.tensor([cid in self._ls for cid in round.client_ids])
        ls_prev = torch.tensor([self._ls.get(cid, math.nan) for cid in round.client_ids], dtype=torch.float64)
        e = ls_prev + ll
        groups = find_groups(round.updates, first.norms, sketch=first.value, sybils=self.sybils)
        # one source per group: its members' mean E (over those known) and mean count
        e_g, n_g = groups.pool(torch.where(known, e, math.nan)), groups.pool(n)
        known_g = ~torch.isnan(e_g) if not groups.trivial else known
        cred_g = torch.ones(groups.count, dtype=torch.float64)
        if known_g.any():
            cred_g[known_g] = credibility(e_g[known_g], self.alpha)
            cred_g[~known_g] = cred_g[known_g].mean()
        w = n_g * cred_g
        for fallback in (n_g, cred_g, torch.ones_like(cred_g)):  # every count or every credibility is 0
            if w.sum() > 0:
                break
            w = fallback
        weights = groups.split(normalised(w)).to(round.updates.dtype)
        cred = groups.expand(cred_g)
        ls = reference_losses(round) * (
            bench_size if self.reduction == "sum" else 1.0
        )  # eq 4, for next round
        ls = torch.where(torch.isfinite(ls), ls, math.inf)  # unmeasurable: the worst loss (eq 6's limit)
        self._ls.update(zip(round.client_ids, ls.tolist(), strict=True))
        weights, *clients = moved(round.updates.device, weights, cred, e, ls_prev, ll, ls)
        vector = weighted_sum(round.updates, weights)
        info = {"clients": dict(zip(("credibility", "E", "LS_previous", "LL", "LS"), clients, strict=True))}
        if self.sybils == "share":
            info["groups"] = groups.info(round.client_ids)
        return Aggregate(vector, weights, info)

    def state_dict(self) -> dict[str, Any]:
        return {"ls": dict(self._ls)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._ls = check_state(self.name, STATE, state).get("ls", {})
