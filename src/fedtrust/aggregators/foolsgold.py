"""FoolsGold (Fung, Yoon, Beschastnikh, RAID 2020)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from fedtrust._checks import check_float, stopping_tol
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.distances import row_gram
from fedtrust.aggregators.passes import weighted_sum
from fedtrust.aggregators.state import Dict, Fields, Tensor, check_state

#: Each client's history: a finite vector of the rounds' length (one d for all), in the rounds' dtype.
STATE = Fields(optional={"history": Dict(Tensor(("d",), dtype=None))})


def rows_gram(rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(n, n) float64 Gram matrix of the rows of an (n, d) matrix (the clients' histories), each divided by
    its ``scale`` if given: float GEMMs by column blocks, accumulated in float64."""
    g = torch.zeros(rows.shape[0], rows.shape[0], dtype=torch.float64, device=rows.device)
    for cols in column_blocks(rows, "stream"):
        block = rows[:, cols]
        g += row_gram(block if scale is None else block / scale[:, None]).to(torch.float64)
    return g


def cosine_similarities(rows: torch.Tensor) -> torch.Tensor | None:
    """(n, n) float64 cosine similarities of the rows of an (n, d) matrix (:func:`rows_gram`), or None when
    one of them has a non-finite entry. A zero row has similarity 0 with every other.

    Where some product overflows the rows' dtype (a history of huge updates) or some squared norm comes
    near its underflow (one of tiny updates, or a zero row), the Gram matrix is taken again with each row
    divided by its largest entry, which leaves the cosines as they are."""
    g = rows_gram(rows)
    sq = g.diagonal()
    finfo = torch.finfo(rows.dtype)
    if not bool(torch.isfinite(g).all()) or bool((sq < finfo.tiny / finfo.eps).any()):
        scale = torch.linalg.vector_norm(rows, ord=math.inf, dim=1)
        if not bool(torch.isfinite(scale).all()):
            return None
        g = rows_gram(rows, torch.where(scale > 0, scale, 1.0))
    norms = g.diagonal().sqrt()
    cs = g / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(torch.float64).tiny)
    return ((cs + cs.T) / 2).clamp(-1.0, 1.0)


def foolsgold_weights(cs: torch.Tensor, kappa: float, copies: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1's weights alpha (float64, in [0, 1]) from the (n, n) cosine similarities of the
    histories, and each client's largest similarity v_i.

    Similarities within ``copies`` of 1 count as 1: such histories point the same way up to the rounding
    of the similarities (exact copies come out near 1 - 1e-7 in float32), and rounding must not make one
    copy look less similar than another.

    v_i = max_{j != i} cs_ij, counted as 0 when negative (the authors' code zeroes the diagonal of cs
    and takes the maximum over the whole row: a client unlike every other is similar to nobody, and the
    pardoning ratio v_i / v_j stays in [0, 1)); pardoning cs_ij *= v_i / v_j where v_j > v_i;
    alpha_i = 1 - max_j cs_ij clipped to [0, 1]; alpha / max(alpha); alpha_i = kappa (ln(alpha_i /
    (1 - alpha_i)) + 0.5) clipped to [0, 1]. The logit's limits are taken as they are (ln of 0 is -inf,
    of 1/0 is +inf, clipped to 0 and 1), where the authors' code replaces an alpha of 1 by 0.99 first (which
    also gives 1 for kappa >= 0.2)."""
    cs = torch.where(cs >= 1 - copies, 1.0, cs)
    cs.fill_diagonal_(0.0)
    v = cs.max(dim=1).values.clamp_min(0.0)
    pardon = v[None, :] > v[:, None]
    cs = torch.where(pardon, cs * v[:, None] / torch.where(pardon, v[None, :], 1.0), cs)
    alpha = (1 - cs.max(dim=1).values).clamp(0.0, 1.0)
    top = alpha.max()
    if not top > 0:
        return torch.zeros_like(alpha), v
    alpha = alpha / top
    logit = torch.log(alpha / (1 - alpha))
    return (kappa * (logit + 0.5)).clamp(0.0, 1.0), v


class FoolsGold(BaseRule):
    """FoolsGold: weigh clients down by how similar their update histories are, so that sybils pushing
    one objective share one client's influence or less (Fung, Yoon, Beschastnikh, "The Limitations of
    Federated Learning in Sybil Settings", RAID 2020, Algorithm 1, whose steps are, in order):

        H_i = sum over rounds of client i's updates       the update history, kept across rounds
        cs_ij = cos(H_i, H_j),  v_i = max_j cs_ij         similarities and each client's largest
        cs_ij *= v_i / v_j  where v_j > v_i               pardoning
        alpha_i = 1 - max_j cs_ij, clipped to [0, 1]
        alpha = alpha / max_i alpha
        alpha_i = kappa (ln[alpha_i / (1 - alpha_i)] + 0.5), clipped to [0, 1]      the logit
        aggregate = sum_i alpha_i x_i / sum_i alpha_i

    The paper's server step is w_t + sum_i alpha_i Delta_i; the aggregate here is normalised (the
    weighted mean), so that it is an update of the usual size and the trust weights are alpha / sum alpha.
    The paper's feature importance (weighing the histories' coordinates by the output layer's magnitudes)
    needs the model's layout and is left out (importance off): the similarities are over every
    coordinate. Similarities within 64 machine epsilons of the round's dtype of 1 count as 1, so that
    rounding cannot tell exact copies apart (:func:`foolsgold_weights`).

    kappa: the logit's confidence, > 0 (1 by default: the authors' code has none, which is kappa = 1).

    State: every client's history, keyed by client id (``state_dict()["history"]``); a client's history
    grows only in rounds it reports in (and is not quarantined). The similarities are between the
    round's clients. A zero history is similar to nobody. When every alpha is 0 (every client's history
    points exactly like another's, as when all updates are the same) the rule has no client to prefer: it
    returns the plain mean and says so in ``info["degenerate"]``. ``info["clients"]`` has each client's
    ``alpha`` and its largest similarity ``similarity`` (v_i).
    """

    name = "foolsgold"
    reads_deltas = True
    per_client_state = True
    paper = "Fung, Yoon, Beschastnikh 2020, The Limitations of Federated Learning in Sybil Settings (RAID)"

    def __init__(self, kappa: float = 1.0):
        self.kappa = check_float(f"{self.name}: kappa", kappa, minimum=0.0, strict_min=True)
        # every client's history as a row of one matrix (a round gathers and writes its clients' rows in
        # a few kernels, not one or two a client), and each client's row
        self._histories: torch.Tensor | None = None
        self._row: dict[Hashable, int] = {}

    def _round_histories(self, round: Round) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """The round's clients' histories with this round's updates added (n, d), not yet kept; the
        positions of the clients with a history, and the stored histories on the round's device and dtype
        (None when nobody has one)."""
        x = round.updates
        known = [k for k, cid in enumerate(round.client_ids) if cid in self._row]
        if not known:
            return x.clone(), known, None
        stored = self._histories
        if stored.shape[1] != round.d:
            raise ValueError(
                f"{self.name}: the stored history of client {round.client_ids[known[0]]!r} has "
                f"d={stored.shape[1]} but this round has d={round.d}"
            )
        stored = stored.to(device=x.device, dtype=x.dtype)
        rows = torch.tensor([self._row[round.client_ids[k]] for k in known], device=x.device)
        if len(known) == round.n:
            return stored.index_select(0, rows) + x, known, stored
        histories = x.clone()
        at = torch.tensor(known, device=x.device)
        histories.index_copy_(0, at, stored.index_select(0, rows) + x.index_select(0, at))
        return histories, known, stored

    def _keep(self, round: Round, histories: torch.Tensor, known: list[int], stored: torch.Tensor | None):
        """Write the round's histories into the matrix: the known clients' rows replaced, the new ones'
        appended."""
        ids = round.client_ids
        seen = set(known)
        new = [k for k in range(round.n) if k not in seen]
        if stored is None:
            stored = histories  # (a copy of the round's updates: every client is new)
        else:
            if known:
                rows = torch.tensor([self._row[ids[k]] for k in known], device=stored.device)
                stored.index_copy_(0, rows, histories[known] if len(known) < round.n else histories)
            if new:
                stored = torch.cat([stored, histories[new]])
        first = len(self._row)
        self._row.update((ids[k], first + j) for j, k in enumerate(new))
        self._histories = stored

    def aggregate(self, round: Round) -> Aggregate:
        x = round.updates
        histories, known, stored = self._round_histories(round)
        cs = cosine_similarities(histories)
        if cs is None:
            bad = int(torch.nonzero(~torch.isfinite(histories).all(1))[0])
            raise ValueError(
                f"{self.name}: the history of client {round.client_ids[bad]!r} plus this round's update does "
                f"not fit in {x.dtype}; the state is unchanged"
            )
        alpha, v = foolsgold_weights(cs, self.kappa, copies=stopping_tol(x.dtype))
        info: dict[str, Any] = {"clients": {"alpha": alpha, "similarity": v}}
        if alpha.sum() > 0:
            weights = alpha / alpha.sum()
        else:
            weights = torch.full_like(alpha, 1.0 / round.n)
            info["degenerate"] = (
                f"every alpha is 0 (each of the {round.n} clients' histories points exactly like another's): "
                "no client to prefer, the plain mean instead"
            )
        self._keep(round, histories, known, stored)
        return Aggregate(weighted_sum(x, weights), weights.to(x.dtype), info)

    def state_dict(self) -> dict[str, Any]:
        if not self._row:
            return {}
        host = self._histories.detach().cpu()  # one transfer, then a copy of each client's row
        return {"history": {cid: host[row].clone() for cid, row in self._row.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        history = check_state(self.name, STATE, state).get("history", {})
        self._row = {cid: row for row, cid in enumerate(history)}
        self._histories = torch.stack(list(history.values())) if history else None
