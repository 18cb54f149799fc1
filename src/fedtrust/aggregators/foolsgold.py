"""FoolsGold (Fung, Yoon, Beschastnikh, RAID 2020)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
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


def rows_gram(rows: Sequence[torch.Tensor], scale: torch.Tensor | None = None) -> torch.Tensor:
    """(n, n) float64 Gram matrix of n vectors of length d kept apart (the clients' histories), each divided
    by its ``scale`` if given: float GEMMs by column blocks of the stacked rows (no n x d copy),
    accumulated in float64."""
    n, like = len(rows), rows[0]
    g = torch.zeros(n, n, dtype=torch.float64, device=like.device)
    for cols in column_blocks(torch.empty(n, like.numel(), dtype=like.dtype, device="meta"), "stream"):
        block = torch.stack([r[cols] for r in rows])
        g += row_gram(block if scale is None else block / scale[:, None]).to(torch.float64)
    return g


def cosine_similarities(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """(n, n) float64 cosine similarities of n vectors kept apart (:func:`rows_gram`), or None when one of
    them has a non-finite entry. A zero vector has similarity 0 with every other.

    Where some product overflows the vectors' dtype (a history of huge updates) or some squared norm comes
    near its underflow (one of tiny updates, or a zero vector), the Gram matrix is taken again with each
    vector divided by its largest entry, which leaves the cosines as they are."""
    g = rows_gram(rows)
    sq = g.diagonal()
    finfo = torch.finfo(rows[0].dtype)
    if not bool(torch.isfinite(g).all()) or bool((sq < finfo.tiny / finfo.eps).any()):
        scale = torch.stack([torch.linalg.vector_norm(r, ord=math.inf) for r in rows])
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
        self._history: dict[Hashable, torch.Tensor] = {}

    def _histories(self, round: Round) -> list[torch.Tensor]:
        """The round's clients' histories with this round's updates added (not yet kept)."""
        x = round.updates
        histories = []
        for cid, update in zip(round.client_ids, x, strict=True):
            old = self._history.get(cid)
            if old is None:
                new = update.clone()
            elif old.numel() != round.d:
                raise ValueError(
                    f"{self.name}: the stored history of client {cid!r} has d={old.numel()} "
                    f"but this round has d={round.d}"
                )
            else:
                new = old.to(device=x.device, dtype=x.dtype) + update
            histories.append(new)
        return histories

    def aggregate(self, round: Round) -> Aggregate:
        x = round.updates
        histories = self._histories(round)
        cs = cosine_similarities(histories)
        if cs is None:
            cid = next(c for c, h in zip(round.client_ids, histories, strict=True) if not h.isfinite().all())
            raise ValueError(
                f"{self.name}: the history of client {cid!r} plus this round's update does not fit in "
                f"{x.dtype}; the state is unchanged"
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
        self._history.update(zip(round.client_ids, histories, strict=True))
        return Aggregate(weighted_sum(x, weights), weights.to(x.dtype), info)

    def state_dict(self) -> dict[str, Any]:
        if not self._history:
            return {}
        return {"history": {cid: h.detach().cpu().clone() for cid, h in self._history.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = check_state(self.name, STATE, state)
        self._history = state.get("history", {})
