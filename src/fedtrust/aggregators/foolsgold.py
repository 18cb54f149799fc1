"""FoolsGold (Fung, Yoon, Beschastnikh, RAID 2020)."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from fedtrust._checks import check_float, stopping_tol
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.distances import row_gram
from fedtrust.aggregators.passes import moved, weighted_sum
from fedtrust.aggregators.state import Dict, Fields, Tensor, check_state

#: Each client's history: a finite vector of the rounds' length (one d for all), in a floating dtype.
STATE = Fields(optional={"history": Dict(Tensor(("d",), dtype=None))})


def rows_gram(rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(n, n) float64 Gram matrix of the rows of an (n, d) matrix (the clients' histories), each divided by
    its ``scale`` if given: float GEMMs by column blocks of the ``"stream"`` budget, accumulated in
    float64."""
    g = torch.zeros(rows.shape[0], rows.shape[0], dtype=torch.float64, device=rows.device)
    for cols in column_blocks(rows, "stream"):
        block = rows[:, cols]
        g += row_gram(block if scale is None else block / scale[:, None]).to(torch.float64)
    return g


def cosine_similarities(rows: torch.Tensor) -> torch.Tensor | None:
    """(n, n) float64 cosine similarities of the rows of an (n, d) matrix (:func:`rows_gram`), on the host
    (one transfer of the Gram matrix), or None when one of them has a non-finite entry. A zero row has
    similarity 0 with every other.

    Where some product overflows the rows' dtype (a history of huge updates) or some squared norm comes
    near its underflow (one of tiny updates, or a zero row), the Gram matrix is taken again with each row
    divided by its largest entry, which leaves the cosines as they are."""
    g = rows_gram(rows).cpu()
    sq = g.diagonal()
    finfo = torch.finfo(rows.dtype)
    if not bool(torch.isfinite(g).all()) or bool((sq < finfo.tiny / finfo.eps).any()):
        scale = torch.linalg.vector_norm(rows, ord=math.inf, dim=1)
        if not bool(torch.isfinite(scale).all()):
            return None
        g = rows_gram(rows, torch.where(scale > 0, scale, 1.0)).cpu()
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

    State: every client's history, keyed by client id (``state_dict()["history"]``, each in the widest
    dtype the rule has held: :class:`HistoryRows`); a client's history grows only in rounds it reports in
    (and is not quarantined). The similarities are between the
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
        self._history = HistoryRows()

    def aggregate(self, round: Round) -> Aggregate:
        x = round.updates
        histories, known = self._history.added(round.client_ids, x, self.name)
        cs = cosine_similarities(histories)
        if cs is None:
            bad = int(torch.nonzero(~torch.isfinite(histories).all(1))[0])
            raise ValueError(
                f"{self.name}: the history of client {round.client_ids[bad]!r} plus this round's update does "
                f"not fit in {x.dtype}; the state is unchanged"
            )
        alpha, v = foolsgold_weights(cs, self.kappa, copies=stopping_tol(x.dtype))  # (on the host)
        info: dict[str, Any] = {}
        if alpha.sum() > 0:
            weights = alpha / alpha.sum()
        else:
            weights = torch.full_like(alpha, 1.0 / round.n)
            info["degenerate"] = (
                f"every alpha is 0 (each of the {round.n} clients' histories points exactly like another's): "
                "no client to prefer, the plain mean instead"
            )
        self._history.write(round.client_ids, histories, known)
        weights, alpha, v = moved(x.device, weights.to(x.dtype), alpha, v)
        info["clients"] = {"alpha": alpha, "similarity": v}
        return Aggregate(weighted_sum(x, weights), weights, info)

    def state_dict(self) -> dict[str, Any]:
        rows = self._history.as_dict()
        return {"history": rows} if rows else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._history = HistoryRows(check_state(self.name, STATE, state).get("history", {}))


class HistoryRows:
    """Every client's history as a row of one matrix, so that a round gathers and writes its clients'
    rows in a few kernels (a copy or an add a client before: on a GPU, a launch each).

    The matrix keeps the widest dtype of the histories it has held (a float32 round reads float64
    histories rounded to float32, as each client's own history was, and leaves those it does not touch
    as they are; a float32 value is exact in float64), lives on the device of the last round, and has
    room to grow: new clients' rows go into spare capacity, which grows by half when full, so a run
    that meets its clients a few at a time copies the matrix a logarithmic number of times, not at every
    round with a new client."""

    GROWTH = 1.5

    def __init__(self, rows: Mapping[Hashable, torch.Tensor] | None = None):
        self.row: dict[Hashable, int] = {}
        self.matrix: torch.Tensor | None = None
        self.used = 0
        if rows:
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in rows.values()))
            self.matrix = torch.stack([t.to("cpu", dtype) for t in rows.values()])
            self.row = {cid: k for k, cid in enumerate(rows)}
            self.used = len(rows)

    def added(self, ids: Sequence[Hashable], x: torch.Tensor, rule: str) -> tuple[torch.Tensor, list[int]]:
        """The clients' histories plus their updates ``x`` (n, d), in x's dtype on its device, not yet kept;
        and the positions of the clients that had a history."""
        known = [k for k, cid in enumerate(ids) if cid in self.row]
        if self.matrix is not None and self.matrix.shape[1] != x.shape[1]:
            whose = f"client {ids[known[0]]!r}" if known else f"{self.used} clients"
            raise ValueError(f"{rule}: the stored history of {whose} has d={self.matrix.shape[1]} but this "
                             f"round has d={x.shape[1]}")  # fmt: skip
        if not known:
            return x.clone(), known
        self.matrix = self.matrix.to(x.device)
        if self._in_order(ids):  # every kept client, in the order kept (a simulation's round): no gather
            return self.matrix[: self.used].to(x.dtype) + x, known
        rows = torch.tensor([self.row[ids[k]] for k in known], device=x.device)
        stored = self.matrix.index_select(0, rows).to(x.dtype)
        if len(known) == len(ids):
            return stored + x, known
        at = torch.tensor(known, device=x.device)
        histories = x.clone()
        histories.index_copy_(0, at, stored + x.index_select(0, at))
        return histories, known

    def write(self, ids: Sequence[Hashable], histories: torch.Tensor, known: list[int]) -> None:
        """Keep the round's ``histories`` (from :meth:`added`): the known clients' rows replaced, the new
        ones' written after the rows in use."""
        seen = set(known)
        new = [k for k in range(len(ids)) if k not in seen]
        old = self.matrix
        if old is None or (self._in_order(ids) and histories.dtype == old.dtype):
            # the round's histories are a tensor of their own, every client's in order: kept as they are
            self.matrix, self.used = histories, len(ids)
            self.row = {cid: k for k, cid in enumerate(ids)}
            return
        dtype = torch.promote_types(old.dtype, histories.dtype)
        need = self.used + len(new)
        grow = need > len(old)
        if grow or old.dtype != dtype or old.device != histories.device:
            capacity = max(need, int(len(old) * self.GROWTH)) if grow else len(old)
            self.matrix = torch.empty(capacity, histories.shape[1], dtype=dtype, device=histories.device)
            self.matrix[: self.used] = old[: self.used]
        if known:
            rows = torch.tensor([self.row[ids[k]] for k in known], device=histories.device)
            mine = histories if len(known) == len(ids) else histories[known]
            self.matrix.index_copy_(0, rows, mine.to(dtype))
        if new:
            self.matrix[self.used : need] = (histories if len(new) == len(ids) else histories[new]).to(dtype)
            self.row.update((ids[k], self.used + j) for j, k in enumerate(new))
        self.used = need

    def _in_order(self, ids: Sequence[Hashable]) -> bool:
        """Whether ``ids`` are every kept client, in the order of their rows."""
        return len(ids) == self.used and all(self.row.get(cid) == k for k, cid in enumerate(ids))

    def as_dict(self) -> dict[Hashable, torch.Tensor]:
        """Client id -> its history, on the CPU (one transfer, then a copy of each row)."""
        if not self.used:
            return {}
        host = self.matrix[: self.used].detach().cpu()
        return {cid: host[row].clone() for cid, row in self.row.items()}
