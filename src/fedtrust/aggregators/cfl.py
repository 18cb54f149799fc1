"""Clustered federated learning used as a robust rule (Sattler, Mueller, Wiegand, Samek)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedtrust._checks import check_float
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, NoValidUpdates, Round
from fedtrust.aggregators.distances import gram
from fedtrust.aggregators.mean import sample_weights
from fedtrust.aggregators.passes import weighted_sum
from fedtrust.aggregators.state import Dict, Fields, Int, check_state


def _excluded_by_then(state: dict, dims: dict) -> str | None:
    late = {k: t for k, t in state.get("excluded", {}).items() if t > state.get("round", 0)}
    if late:
        cid, t = next(iter(late.items()))
        return f"client {cid!r} is excluded in round {t}, after the state's round {state.get('round', 0)}"
    return None


#: Excluded client id -> the round (1, 2, ...) it was excluded in; rounds aggregated so far.
STATE = Fields(optional={"excluded": Dict(Int(minimum=1)), "round": Int(minimum=0)}, test=_excluded_by_then)


def optimal_bipartition(similarity: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Split clients in two so that the largest similarity across the split is as small as possible
    (CFL, Sattler et al. TNNLS 2020, Algorithm 2: merge the most similar pairs until two clusters remain).

    That merge order is single linkage, so the split is the maximum spanning tree of the similarity
    graph with its weakest edge cut, and that edge's weight is the largest cross-cluster similarity.
    Built by Prim's algorithm: one vectorised step per client, on the host (each step reads a scalar: a
    device sync each). Returns a boolean mask of one side (on the similarity's device) and the
    cross-cluster maximum similarity.
    """
    n, where = similarity.shape[0], similarity.device
    similarity = similarity.cpu()
    device = similarity.device
    in_tree = torch.zeros(n, dtype=torch.bool, device=device)
    in_tree[0] = True
    best = similarity[0].clone()
    parent = torch.zeros(n, dtype=torch.long, device=device)
    edge_child, edge_weight = [], []
    for _ in range(n - 1):
        j = int(best.masked_fill(in_tree, -torch.inf).argmax())
        edge_child.append(j)
        edge_weight.append(float(best[j]))
        in_tree[j] = True
        closer = (similarity[j] > best) & ~in_tree
        best = torch.where(closer, similarity[j], best)
        parent = torch.where(closer, torch.full_like(parent, j), parent)
    cut = min(range(n - 1), key=edge_weight.__getitem__)
    side = torch.zeros(n, dtype=torch.bool, device=device)
    side[edge_child[cut]] = True
    for _ in range(n):  # everything below the cut edge in the tree rooted at client 0
        grown = side | side[parent]
        grown[0] = False
        if torch.equal(grown, side):
            break
        side = grown
    return side.to(where), edge_weight[cut]


class CFL(BaseRule):
    """Clustered FL as a robust rule: bipartition clients by the cosine similarity of their updates
    relative to the previous global vector, and exclude the smaller cluster for good
    (Sattler et al., "Clustered Federated Learning", TNNLS 2020, Algorithm 2 and eqs 30-31; used against
    corrupted clients in "On the Byzantine Robustness of Clustered FL", ICASSP 2020).

    Each round, on the clients not yet excluded: Delta_i = x_i - previous (or x_i when the round has no
    ``previous``: the updates are then deltas already); alpha_ij = cos(Delta_i, Delta_j); optimal
    bipartition. The split is accepted when the largest cross-cluster similarity is below
    ``max_cross_similarity`` and, if given, the FL criteria hold: the weighted mean update norm is below
    ``eps1`` and the largest update norm is above ``eps2``. The smaller cluster (fewer clients; a tie is
    not split, the benign side cannot be told) is remembered by client id and gets weight 0 from then on.
    The aggregate is the sample-weighted mean over the remaining clients (CFL's in-cluster average).
    """

    name = "cfl"
    per_client_state = True
    paper = "Sattler, Mueller, Samek 2020, Clustered Federated Learning (and its ICASSP 2020 Byzantine study)"

    def __init__(
        self, max_cross_similarity: float = 0.0, eps1: float | None = None, eps2: float | None = None
    ):
        self.max_cross_similarity = check_float(
            f"{self.name}: max_cross_similarity", max_cross_similarity, minimum=-1.0, maximum=1.0
        )
        self.eps1 = None if eps1 is None else check_float(f"{self.name}: eps1", eps1, minimum=0.0)
        self.eps2 = None if eps2 is None else check_float(f"{self.name}: eps2", eps2, minimum=0.0)
        self._excluded: dict[Any, int] = {}  # client id -> round it was excluded in
        self._round = 0

    def aggregate(self, round: Round) -> Aggregate:
        self._round += 1
        active = [i for i, cid in enumerate(round.client_ids) if cid not in self._excluded]
        if not active:
            raise NoValidUpdates(f"{self.name}: every client of this round was excluded in an earlier split")
        sub = round.select(active) if len(active) < round.n else round
        info: dict[str, Any] = {"split": False}
        keep = torch.ones(sub.n, dtype=torch.bool)  # the arithmetic on n (and n^2) numbers on the host
        if sub.n >= 3:
            g = gram(sub.updates, sub.previous).cpu()  # one transfer (on a GPU each scalar read is a sync)
            norms = g.diagonal().clamp_min(0).sqrt()
            cos = g / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(torch.float64).tiny)
            sw = sample_weights(sub, self.name).to(torch.float64)
            mean_norm = float((sw @ g @ sw).clamp_min(0).sqrt())
            side, cross = optimal_bipartition(cos)
            info.update(
                cross_similarity=cross, mean_update_norm=mean_norm, max_update_norm=float(norms.max())
            )
            small = side if int(side.sum()) * 2 < sub.n else ~side
            wanted = (
                cross < self.max_cross_similarity
                and int(side.sum()) * 2 != sub.n
                and (self.eps1 is None or mean_norm < self.eps1)
                and (self.eps2 is None or float(norms.max()) > self.eps2)
            )
            if wanted:
                keep = ~small
                newly = [sub.client_ids[i] for i in torch.nonzero(small).flatten().tolist()]
                self._excluded.update({cid: self._round for cid in newly})
                info.update(split=True, excluded_now=newly)
        kept = sub.select(torch.nonzero(keep).flatten()) if not bool(keep.all()) else sub
        w_kept = sample_weights(kept, self.name)
        weights = torch.zeros(round.n, dtype=round.updates.dtype)
        weights[torch.as_tensor(active)[keep]] = w_kept
        info["excluded"] = list(self._excluded)
        return Aggregate(weighted_sum(kept.updates, w_kept), weights.to(round.updates.device), info)

    def state_dict(self) -> dict[str, Any]:
        return {"excluded": dict(self._excluded), "round": self._round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = check_state(self.name, STATE, state)
        self._excluded = state.get("excluded", {})
        self._round = state.get("round", 0)
