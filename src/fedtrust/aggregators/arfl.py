"""ARFL: auto-weighted robust federated learning (Li, Ngai, Ye, Voigt; papers/004)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedtrust._checks import check_bool, check_choice, check_float
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, NoValidUpdates, Round, RoundRefused
from fedtrust.aggregators.loss_defences import DEFENCES, defend
from fedtrust.aggregators.passes import moved, weighted_sum
from fedtrust.aggregators.screening import negative_loss
from fedtrust.aggregators.state import Dict, Fields, Float, check_state


def _same_clients(state: dict, dims: dict) -> str | None:
    loss, samples = state.get("loss", {}), state.get("samples", {})
    if loss.keys() != samples.keys():
        odd = next(iter(loss.keys() ^ samples.keys()))
        return f"'loss' and 'samples' must hold the same clients; {odd!r} is in only one"
    return None


#: Every known client's latest reported loss L_i and sample count m_i, by id.
STATE = Fields(optional={"loss": Dict(Float()), "samples": Dict(Float(minimum=0.0))}, test=_same_clients)


def arfl_weights(losses: torch.Tensor, samples: torch.Tensor, lam: float) -> tuple[torch.Tensor, int]:
    """The minimiser alpha of sum_i alpha_i L_i + (lam / 2) sum_i alpha_i^2 / m_i over the simplex
    (eq 6), in closed form (Theorem 4.3, eqs 7-9), O(N log N):

        sort L ascending; M_k = sum_{i<=k} m_i; Lbar_k = sum_{i<=k} m_i L_i / M_k                   (8)
        p = the largest k with 1 + M_k (Lbar_k - L_k) / lam > 0                                    (7)
        alpha_i = (m_i / M_p) [1 + M_p (Lbar_p - L_i) / lam]_+                                     (9)

    Returns alpha (in the input order, float64) and p. ``lam`` must be > 0.
    """
    losses = losses.to(torch.float64)
    samples = samples.to(torch.float64)
    order = torch.argsort(losses, stable=True)
    sl, sm = losses[order], samples[order]
    prefix_m = torch.cumsum(sm, 0)
    prefix_l = torch.cumsum(sm * sl, 0) / prefix_m
    ok = 1 + prefix_m * (prefix_l - sl) / lam > 0
    p = int(torch.nonzero(ok).max()) + 1  # k = 1 always qualifies
    m_p, l_p = prefix_m[p - 1], prefix_l[p - 1]
    alpha = (samples / m_p) * (1 + m_p * (l_p - losses) / lam).clamp_min(0)
    return alpha, p


def arfl_objective(alpha: torch.Tensor, losses: torch.Tensor, samples: torch.Tensor, lam: float) -> float:
    """Eq 6 at alpha: sum_i alpha_i L_i + (lam / 2) sum_i alpha_i^2 / m_i."""
    return float((alpha * losses).sum() + lam / 2 * (alpha.square() / samples).sum())


class ARFL(BaseRule):
    """ARFL (Algorithm 1): every client's latest reported loss L_i (the global model's training loss on
    its data, measured before local training; ``train_loss``) and sample count m_i are kept by id; the
    weights alpha over all known clients come from Theorem 4.3, and the round's clients are averaged by
    eq 11: w = sum_{i in S_t} alpha_i w_i / sum_{i in S_t} alpha_i.

    lam:     lambda as a multiple of M, the total sample count of the known clients (the paper uses
             lambda = M under corruption, 10000 M on clean data); lam -> inf gives FedAvg's weights.
    fresh:   False (the paper's order): a round is averaged with the alpha computed before it, and its
             losses update alpha afterwards; True: this round's losses enter first.
    defence: what to do about clients that under-report their loss (the stated weakness): "none";
             "clip" floors each report at median - 3 MAD of the round's reports; "benchmark" floors it
             at the loss of the client's own update on the server's trusted split (Round.reference),
             which a liar cannot fake.

    ``observe`` takes the losses of all clients at the initial model (Algorithm 1, line 1). A client whose
    update the front door quarantines, or whose update's benchmark loss is not finite, is forgotten until
    its next report: a stored loss must not hold weight for an update the server could not use.
    ``info``: p, the objective (eq 6), lambda, and per client alpha and the loss used.

    Identical updates buy no trust here, so ARFL has no ``sybils`` option (unlike IVAR/ICOV and FOCUS,
    :mod:`fedtrust.aggregators.sybils`): alpha_i is a function of the reported losses and counts only
    (Theorem 4.3) and never reads an update, so a copy's alpha is what its sender's loss earns whether or
    not others sent the same vector. k colluders still get k clients' alphas, as under FedAvg: ARFL's
    model is data corruption by non-colluding clients (section 3.2, assumption 1; section 6 names
    colluding corruptions and attacks on the parameters as out of scope), and a parameter attack with
    honest loss reports (IPM) passes it, copies or not.
    """

    name = "arfl"
    per_client_state = True
    paper = "Li, Ngai, Ye, Voigt 2021, Auto-weighted Robust Federated Learning with Corrupted Data Sources"
    requires = ("train_loss",)

    def __init__(self, lam: float = 1.0, fresh: bool = False, defence: str = "none"):
        self.lam = check_float(f"{self.name}: lam", lam, minimum=0.0, strict_min=True)
        self.fresh = check_bool(f"{self.name}: fresh", fresh)
        self.defence = check_choice(f"{self.name}: defence", defence, DEFENCES)
        self._loss: dict[Any, float] = {}
        self._samples: dict[Any, float] = {}

    @property
    def reads_reference(self) -> tuple[str, ...]:
        return ("loss",) if self.defence == "benchmark" else ()

    def observe(self, client_ids: Sequence, num_samples, metrics: Mapping[str, Any]) -> dict[Any, str]:
        """Record losses without aggregating (the initial report of every client). A report the front door
        would quarantine (a loss that is not finite or below 0, a count that is not a finite non-negative
        number) is not recorded: that client enters with its first round's report. Returns client id ->
        why its report was left out."""
        if "train_loss" not in metrics:
            got = sorted(metrics) or "none"
            raise ValueError(f"{self.name}: observe needs metric 'train_loss'; got {got}")
        ids = list(client_ids)
        counts = torch.as_tensor(num_samples, dtype=torch.float64).reshape(-1).tolist()
        losses = torch.as_tensor(metrics["train_loss"], dtype=torch.float64).reshape(-1).tolist()
        if not len(ids) == len(counts) == len(losses):
            raise ValueError(
                f"{self.name}: observe got {len(ids)} client ids, {len(counts)} num_samples and "
                f"{len(losses)} train_loss values; need one of each per client"
            )
        left_out = {}
        for cid, m, loss in zip(ids, counts, losses, strict=True):
            if not (math.isfinite(m) and m >= 0):
                left_out[cid] = f"num_samples={m!r} is not a finite non-negative count"
            elif not math.isfinite(loss):
                left_out[cid] = f"metric train_loss={loss!r} is not finite"
            elif loss < 0:
                left_out[cid] = negative_loss("train_loss", loss)
            else:
                self._loss[cid], self._samples[cid] = loss, m
        return left_out

    def _alpha(self) -> tuple[dict, int, float, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = list(self._loss)
        losses = torch.tensor([self._loss[i] for i in ids], dtype=torch.float64)
        samples = torch.tensor([self._samples[i] for i in ids], dtype=torch.float64).clamp_min(1e-12)
        if not math.isfinite(float(samples.sum() * losses.abs().max())):
            samples = samples / samples.max()  # alpha is unchanged by scaling every m_i (lam scales too)
        lam = self.lam * float(samples.sum())
        alpha, p = arfl_weights(losses, samples, lam)
        if not bool(torch.isfinite(alpha).all()):
            raise RoundRefused(
                f"{self.name}: the clients' train_loss values (from {float(losses.min()):.3g} to "
                f"{float(losses.max()):.3g}) are too far apart to weigh in float64"
            )
        return dict(zip(ids, alpha.tolist(), strict=True)), p, lam, alpha, losses, samples

    def aggregate(self, round: Round) -> Aggregate:
        # the rule's arithmetic on n numbers runs on the host, with the counts and reports the round keeps
        # there (on a GPU: no sync per read); the weights and per-client info move to the device at the end
        reported = defend(self.defence, round, round.metric_on_host("train_loss"))
        ids = round.client_ids
        counts = round.samples_on_host().tolist()
        # an update whose loss on the benchmark split is not finite cannot be weighed: weight 0 this
        # round, and the rule forgets the client (it enters afresh with its next finite report)
        unmeasured = {
            cid: f"its update's loss on the benchmark split is {loss!r}"
            for cid, loss in zip(ids, reported.tolist(), strict=True)
            if not math.isfinite(loss)
        }
        # a client the front door quarantined this round (a malformed update) is forgotten too: its stored
        # loss vouched for an update the server could not use, and kept, a low one would hold the
        # weight that alpha (over every known client) gives the round's clients, down to none at all
        for cid in [*unmeasured, *round.quarantined]:
            self._loss.pop(cid, None)
            self._samples.pop(cid, None)
        new = {
            cid: (float(loss), float(m))
            for cid, loss, m in zip(ids, reported.tolist(), counts, strict=True)
            if cid not in unmeasured
        }
        if not new:
            raise NoValidUpdates(f"{self.name}: no client's loss could be measured ({unmeasured})")
        unseen = [cid for cid in new if cid not in self._loss]
        if self.fresh or unseen:  # unseen clients enter with this round's report
            for cid in new if self.fresh else unseen:
                self._loss[cid], self._samples[cid] = new[cid]
        table, p, lam, alpha_all, losses, samples = self._alpha()
        alpha = torch.tensor([table[cid] if cid in new else 0.0 for cid in ids], dtype=torch.float64)
        objective = arfl_objective(alpha_all, losses, samples, lam)
        for cid in new:  # the paper's order: this round's losses count from the next round on
            self._loss[cid], self._samples[cid] = new[cid]
        if not alpha.sum() > 0:
            raise NoValidUpdates(
                f"{self.name}: every client of this round has weight 0 (losses above the threshold)"
            )
        weights = (alpha / alpha.sum()).to(round.updates.dtype)
        weights, alpha, reported = moved(round.updates.device, weights, alpha, reported)
        info = {"p": p, "objective": objective, "lambda": lam, "clients": {"alpha": alpha, "loss": reported}}
        if unmeasured:
            info["left_out"] = unmeasured
        return Aggregate(weighted_sum(round.updates, weights), weights, info)

    def state_dict(self) -> dict[str, Any]:
        return {"loss": dict(self._loss), "samples": dict(self._samples)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = check_state(self.name, STATE, state)
        self._loss, self._samples = state.get("loss", {}), state.get("samples", {})
