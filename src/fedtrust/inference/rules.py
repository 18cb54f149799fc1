"""IVAR and ICOV as aggregation rules over the core contract (thin wrappers over the estimators).

Each round is a task and each coordinate a sample (K = d). The round's consensus is re-estimated from
scratch; earlier rounds in the window enter through their sufficient statistics, keyed by client id, so
a client's noise (and, for ICOV, its latent factors) is learned from every round it took part in.
Clients absent from a round are missing entries. Trust weights are each client's coefficient in the
consensus; where those are not a distribution (VB shrinks towards zero, ICOV may subtract a correlated
client) the weights are their positive part normalised, and the exact coefficients are in
``info["clients"]["coefficient"]``.

Copies share one vote (``sybils="share"``, the default; :mod:`fedtrust.aggregators.sybils`): the estimators
read agreement as reliability, so k identical updates would buy the trust of k independent sources that agree
perfectly. Their own model says k perfectly correlated sources carry the information of one (eq 3's GLS
weights with k equal rows of Phi), as FoolsGold's similarity discount does (Fung, Yoon, Beschastnikh, RAID
2020). So each round's near-duplicate updates are grouped, and so are groups whose deviations from the round's
robust centre correlate above 0.95, as copies with independent noise added do (the coordinate-wise median, and
where groups correlate about it, the median of the sources so found:
:func:`~fedtrust.aggregators.sybils.correlated_groups`; ``sybils="copies"`` groups exact copies only); the
estimator runs on one representative per group (the group's mean) and the representative's coefficient is
split evenly among the members; ``info["groups"]`` lists the groups and why. The window state stays keyed by
client id: a representative starts from its members' pooled estimates (the mean of their noise, factors and
past statistics, over the members that have them) and every member keeps the representative's, so a group may
form, change or dissolve from one round to the next. ``sybils="off"`` treats every client as its own source
(the papers' setting).

A far update (one client at 1e12 per coordinate) drags the plain mean the estimators started from: each
round's statistics are taken about the coordinate-wise median instead, where the grouping takes them
(``"share"``) or one update's squared norm is beyond 1e4 times the median one's (``"off"``, ``"copies"``),
and the sources start from their distances to it (:func:`~fedtrust.inference.tasks.mean_noise`).

``weighting="precision"`` (the default, the papers') weights each client by its coefficient in the
consensus; ``weighting="screen"`` uses the same fit as a screen instead (:mod:`fedtrust.inference.screen`):
a minority of clients whose updates stand apart from the fitted consensus is dropped and every other group
gets one equal vote, which keeps the estimator's detection without its price on honest clients with
unusual data.

Degenerate rounds never fail: when every update is (near-)identical there is nothing to weigh, and the
rule returns that update with equal weights and the reason in ``info["degenerate"]``, its state
unchanged; when an ICOV fit breaks down on a degenerate round (rank-deficient or collinear updates can
drive the latent variance to zero), the round is fitted by the IVAR estimator of the same kind (ICOV
without its correlated part), the reason in ``info["fallback"]``, the ICOV state unchanged.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from fedtrust._checks import check_choice, check_float, check_int, check_tol
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, RoundRefused
from fedtrust.aggregators.distances import Moments
from fedtrust.aggregators.passes import row_norms
from fedtrust.aggregators.screening import FirstPass
from fedtrust.aggregators.state import (
    ClientId,
    Dict,
    Fields,
    Float,
    Int,
    List,
    Spec,
    Tensor,
    check_state,
    copy_tree,
    positive,
    symmetric_positive_definite,
    symmetric_positive_semidefinite,
)
from fedtrust.aggregators.sybils import (
    SYBILS,
    Groups,
    all_identical,
    find_groups,
    grouping_pass,
    median_moments,
)
from fedtrust.inference.icov import IcovMlePast, IcovVbPast, check_latent_dim, icov_mle, icov_vb, latent_init
from fedtrust.inference.ivar import IvarPast, ivar_mle, ivar_vb
from fedtrust.inference.result import ConvergenceWarning
from fedtrust.inference.screen import screen
from fedtrust.inference.tasks import TaskGram, Tasks, far_entries

PAPER = "Nguyen, Lim, Wynter, Cai 2021, Probabilistic Inference for Learning from Untrusted Sources"


def _task(round: Round, norms: torch.Tensor | None, moments: Moments | None) -> Tasks:
    """The (screened) round as one task with every client present, with its updates' norms and their
    second moments (``Groups.moments``: the grouping pass took them) when known."""
    present = torch.ones(1, round.n, dtype=torch.bool, device=round.updates.device)
    return Tasks(
        round.updates[None],
        present,
        norms=None if norms is None else norms[None],
        gram=None if moments is None else TaskGram.of_moments(moments),
    )


#: What the estimates become: the papers' "precision" weights (each client's consensus coefficient), or
#: a "screen" (:mod:`fedtrust.inference.screen`: a minority far from the consensus dropped, equal votes).
WEIGHTINGS = ("precision", "screen")


def _representatives(round: Round, groups: Groups) -> Round:
    """The round the estimator sees: one update per group (its mean), named by its first member."""
    if groups.trivial:
        return round
    return Round(updates=groups.means(round.updates), client_ids=[round.client_ids[i] for i in groups.first])


def _for_members(result, groups: Groups):
    """The estimator's result on the representatives as one on the members: each representative's
    coefficient split evenly among its members, its noise (and reliability) given to each."""
    if groups.trivial:
        return result
    return replace(result, weights=groups.split(result.weights[0])[None], noise=groups.expand(result.noise))


def _start(groups: Groups, members: list, fresh: torch.Tensor) -> torch.Tensor:
    """Each representative's starting value (latent factors): the mean of its members' that are known
    (``members``, None where a client is new), else ``fresh[g]``, the representative's own fresh start."""
    unknown = torch.full_like(fresh[0], math.nan)
    pooled = groups.pool(
        torch.stack([unknown if m is None else torch.as_tensor(m, device=fresh.device) for m in members])
    )
    missing = torch.isnan(pooled.reshape(groups.count, -1)).any(1)
    return torch.where(missing.reshape(-1, *([1] * (pooled.dim() - 1))), fresh, pooled)


def _about_median_if_far(reps: torch.Tensor, norms: torch.Tensor | None, groups: Groups) -> Groups:
    """``groups`` with their representatives' (``reps``) moments about the coordinate-wise median where
    the grouping took none (``sybils="off"``, ``"copies"``) and some update's squared norm is beyond
    :data:`~fedtrust.inference.tasks.FAR` times the median one's (three groups or more): the estimators
    then start from each source's distance to that centre, not to the plain mean a far update drags
    (:func:`~fedtrust.inference.tasks.mean_noise`). One client at 1e12 per coordinate beside four honest
    ones left IVAR-VB's consensus 4 honest spreads from theirs, ICOV-MLE's (float64) 7.9. One read of
    the norms decides; the moments cost a selection pass and a Gram pass, on such rounds only."""
    if groups.moments is not None or groups.count < 3 or norms is None:
        return groups
    if not far_entries(norms.to(torch.float64).square()):
        return groups
    _, moments = median_moments(reps)
    return groups if moments is None else replace(groups, moments=moments)


def _trust(coefficients: torch.Tensor) -> torch.Tensor:
    positive = coefficients.clamp_min(0)
    total = positive.sum()
    return positive / total if total > 0 else torch.full_like(coefficients, 1.0 / len(coefficients))


class _WindowRule(BaseRule):
    """Shared window bookkeeping: ``window`` rounds (this one included) inform each client's estimates.
    The first pass takes the updates' norms and, with ``sybils="share"``, their sketch, from which the
    near-duplicate groups are found (:func:`~fedtrust.aggregators.sybils.find_groups`): the same
    norms either way, so a round without groups gives the same numbers shared or not. The window state
    changes only once the estimator returns.

    The state is a plain tree (what ``state_dict`` returns and ``load_state_dict`` checks against
    ``_state_spec``): "history", the earlier rounds of the window, oldest first, each a record of that
    round's statistics keyed by client id; "clients", client id -> its persistent estimates; "shared",
    the global estimates (hyper-parameters)."""

    per_client_state = True

    #: The entries of one history round, one client's estimates, and the shared estimates.
    def _history_spec(self) -> Spec:
        raise NotImplementedError

    def _client_spec(self) -> Spec:  # IVAR: each client's noise variance sigma_j^2
        return Fields({"noise": Float(positive=True)})

    def _shared_spec(self) -> Spec:
        return Fields()

    def _state_spec(self) -> Fields:
        return Fields(
            optional={
                "history": List(self._history_spec(), max_length=self.window - 1),
                "clients": Dict(self._client_spec()),
                "shared": self._shared_spec(),
            }
        )

    paper = PAPER

    def __init__(
        self,
        window: int,
        max_iter: int,
        tol: float | None,
        sybils: str = "share",
        weighting: str = "precision",
    ):
        self.window = check_int(f"{self.name}: window", window, minimum=1)
        # earlier rounds kept: a window longer than any run keeps every round (a deque holds at most
        # sys.maxsize; window=10**30 overflowed it)
        self._kept = min(self.window - 1, sys.maxsize)
        self.max_iter = check_int(f"{self.name}: max_iter", max_iter, minimum=1)
        # None: the estimator's default, derived from the updates' dtype (fedtrust._checks.stopping_tol)
        self.tol = check_tol(f"{self.name}: tol", tol)
        self.sybils = check_choice(f"{self.name}: sybils", sybils, SYBILS)
        self.weighting = check_choice(f"{self.name}: weighting", weighting, WEIGHTINGS)
        self._history: deque = deque(maxlen=self._kept)
        self._clients: dict[Any, dict[str, Any]] = {}  # client id -> its persistent estimates
        self._shared: dict[str, Any] = {}  # global estimates (ICOV hyper-parameters)
        self._warned_convergence = False  # a ConvergenceWarning is raised once per rule object

    def first_pass(self, round: Round) -> FirstPass:
        norms, sketch = grouping_pass(round.updates, self.sybils)
        return FirstPass(sketch, norms)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        groups = self._groups(round, first)
        if (out := self._degenerate(round, groups)) is not None:
            return out
        fit_round = _representatives(round, groups)
        groups = _about_median_if_far(fit_round.updates, first.norms, groups)
        # the first pass's norms serve the estimator's own passes when it sees the round itself, and the
        # grouping's Gram pass (the representatives' moments about the median) its iterations
        task = _task(fit_round, first.norms if groups.trivial else None, groups.moments)
        out = self._estimate(round, groups, fit_round, task)
        return out if self.weighting == "precision" else self._screened(round, groups, out, fit_round)

    @staticmethod
    def _screened(round: Round, groups: Groups, out: Aggregate, fit_round: Round) -> Aggregate:
        """``weighting="screen"``: the groups the screen keeps (:func:`~fedtrust.inference.screen.screen`
        about the fitted consensus, with the grouping's Gram matrix where it took one) get one vote each,
        split among their members; the aggregate is the weighted mean of the updates. ``info["screen"]``
        says what each look found and names the dropped clients; the estimator's own weights stay in
        ``info["clients"]["coefficient"]``."""
        moments = groups.moments
        keep, found = screen(
            fit_round.updates, out.vector, groups.sizes, None if moments is None else moments.gram
        )
        x = round.updates
        weights = groups.split(keep.to(torch.float64) / keep.sum()).to(device=x.device, dtype=x.dtype)
        dropped = [
            c for c, kept in zip(round.client_ids, groups.expand(keep).tolist(), strict=True) if not kept
        ]
        return Aggregate(weights @ x, weights, {**out.info, "screen": {**found, "dropped": dropped}})

    def _estimate(self, round: Round, groups: Groups, fit_round: Round, task: Tasks) -> Aggregate:
        """Fit the estimator to ``task`` (``fit_round``: one update per group), update the state, and
        return the round's aggregate."""
        raise NotImplementedError

    def _fit(self, task: Tasks, estimator, **options):
        """Run ``estimator`` on the round as one task. A fit that breaks down (a singular system, a
        non-finite consensus or noise: updates near the dtype's limits, whose squares the Gram
        statistics cannot hold) raises :class:`RoundRefused` naming the rule, before any state is changed:
        the round is not aggregated, never aggregated to NaN."""
        try:
            res = estimator(task, **options)
        except (torch.linalg.LinAlgError, ArithmeticError, ValueError) as exc:
            raise RoundRefused(
                f"{self.name}: the fit broke down on this round ({exc}){self._scale(task)}"
            ) from exc
        finite = torch.stack(  # one read (on a GPU each is a sync)
            [torch.isfinite(res.consensus).all(), torch.isfinite(res.weights).all().to(res.consensus.device),
             ~torch.isinf(res.noise).any().to(res.consensus.device)]
        )  # fmt: skip
        if not bool(finite.all()):  # a NaN noise is an unknown one (a lone source's), as in ``init_noise``
            raise RoundRefused(f"{self.name}: the fit is not finite on this round{self._scale(task)}")
        return res

    def _groups(self, round: Round, first: FirstPass) -> Groups:
        """This round's groups of near-duplicate updates (from the first pass's sketch). With
        ``sybils="off"`` every client is its own group, unless all the updates are identical (one group:
        a degenerate round)."""
        if self.sybils == "off":
            if round.n > 1 and all_identical(round.updates):
                return Groups.one(round.n, f"{round.n} identical updates")
            return Groups.singletons(round.n)
        return find_groups(round.updates, first.norms, sketch=first.value, sybils=self.sybils)

    def _share_info(self, round: Round, groups: Groups) -> dict:
        return {} if self.sybils == "off" else {"groups": groups.info(round.client_ids)}

    def _degenerate(self, round: Round, groups: Groups) -> Aggregate | None:
        """All of the round's updates in one group: nothing to weigh. Their (common) update, equal weights,
        the reason; the state is unchanged."""
        if groups.count > 1 or round.n < 2:
            return None
        x = round.updates
        weights = torch.full((round.n,), 1.0 / round.n, dtype=x.dtype, device=x.device)
        reason = (
            f"all {round.n} updates are identical or near-identical: there is nothing to weigh, so the "
            "aggregate is their mean with equal weights and the rule's state is unchanged"
        )
        info = {"degenerate": reason, **self._share_info(round, groups)}
        return Aggregate(groups.means(x)[0], weights, info)

    def _fit_or_fallback(self, task: Tasks, estimator, fallback, fallback_options: dict, **options):
        """:meth:`_fit`, or where the fit breaks down, ``fallback`` (the IVAR estimator of the same kind)
        on this round alone with ``fallback_options``. Returns (result, reason or None); a failing fallback
        raises the first error."""
        try:
            return self._fit(task, estimator, **options), None
        except RoundRefused as exc:
            try:
                result = self._fit(task, fallback, **fallback_options)
            except RoundRefused:
                raise exc from None
            reason = (
                f"{exc} -> fitted by {fallback.__name__} instead (the model without its correlated part); "
                "the rule's state is unchanged"
            )
            return result, reason

    @staticmethod
    def _scale(task: Tasks) -> str:
        tail = ": the round is not aggregated and the rule's state is unchanged"
        norms = task.norms if task.norms is not None else row_norms(task.x)
        return f" (update norms {float(norms.min()):.3g} to {float(norms.max()):.3g})" + tail

    def _finish(self, round: Round, result, extra_info: dict) -> Aggregate:
        """The round's aggregate, trust and info. A fit that stopped at ``max_iter`` before converging
        puts :attr:`InferenceResult.warning` in ``info["warning"]`` (so a simulation's round record keeps
        it) and, the first time for this rule object, raises it as a :class:`ConvergenceWarning`: its text
        changes every round, so warnings' once-per-location filter alone would repeat it each round."""
        coefficients = result.weights[0]
        warning = result.warning
        if warning is not None and not self._warned_convergence:
            self._warned_convergence = True
            warnings.warn(
                f"{warning} Every round of this rule that stops early records it in info['warning']; "
                "this warning is not repeated.",
                ConvergenceWarning,
                stacklevel=2,
            )
        info = {
            "iterations": result.iterations,
            "converged": result.converged,
            **({} if warning is None else {"warning": warning}),
            **({"degenerate": result.params["degenerate"]} if "degenerate" in result.params else {}),
            "objective": result.trace[-1],
            "trace": result.trace,
            "coefficient_sum": float(coefficients.sum()),
            "clients": {
                "noise": result.noise,
                "reliability": result.reliability,
                "coefficient": coefficients,
            },
            **extra_info,
        }
        weights = _trust(coefficients).to(round.updates.dtype)
        return Aggregate(result.consensus[0].to(round.updates.dtype), weights, info)

    def state_dict(self) -> dict[str, Any]:
        return copy_tree({"history": list(self._history), "clients": self._clients, "shared": self._shared})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = check_state(self.name, self._state_spec(), state)  # everything checked, then kept
        self._history = deque(state.get("history", []), maxlen=self._kept)
        self._clients = state.get("clients", {})
        self._shared = state.get("shared", {})

    def _known(self, ids, key: str, device: torch.device) -> torch.Tensor:
        return torch.tensor(
            [self._clients.get(i, {}).get(key, math.nan) for i in ids], dtype=torch.float64, device=device
        )


class IvarMLE(_WindowRule):
    """IVAR-MLE (Algorithm 1, eqs 6-7) per round, each client's sigma_j^2 pooled over its rounds in the
    window. Options: window (rounds, this one included), eps (floor on sigma_j^2), max_iter, tol (on the
    weights' change; None: derived from the updates' dtype).

    The likelihood is unbounded (a client matching the consensus exactly has sigma_j -> 0): eqs 6-7
    settle when several clients share the best noise level and otherwise collapse onto one. eps is the
    floor relative to the round's scale at which that is detected; the round is then estimated with the
    flat-prior correction (:func:`~fedtrust.inference.ivar.ivar_mle`) and ``info["degenerate"]`` says so."""

    name = "ivar_mle"

    def __init__(self, window: int = 10, eps: float = 1e-12, max_iter: int = 200, tol: float | None = None,
                 sybils: str = "share", weighting: str = "precision"):  # fmt: skip
        super().__init__(window, max_iter, tol, sybils, weighting)
        self.eps = check_float(f"{self.name}: eps", eps, minimum=0.0, strict_min=True)

    def _history_spec(self) -> Spec:
        return Dict(Float(minimum=0.0))  # client id -> its mean squared residual that round

    def _estimate(self, round: Round, groups: Groups, fit_round: Round, task: Tasks) -> Aggregate:
        ids = round.client_ids
        on = {"dtype": torch.float64, "device": round.updates.device}
        past = IvarPast(
            groups.pool(torch.tensor([sum(h.get(i, 0.0) for h in self._history) for i in ids], **on)),
            groups.pool(torch.tensor([sum(i in h for h in self._history) for i in ids], **on)),
        )
        init_noise = groups.pool(self._known(ids, "noise", round.updates.device))
        res = self._fit(task, ivar_mle, max_iter=self.max_iter, tol=self.tol,
                        eps=self.eps, init_noise=init_noise, past=past)  # fmt: skip
        totals, counts = groups.expand(res.past.total).tolist(), groups.expand(res.past.count).tolist()
        # a source the round says nothing about (a lone one: count 0, noise unknown) leaves no trace
        self._history.append({i: x for i, x, c in zip(ids, totals, counts, strict=True) if c > 0})
        for i, noise in zip(ids, groups.expand(res.noise).tolist(), strict=True):
            if math.isfinite(noise):
                self._clients[i] = {"noise": noise}
        return self._finish(round, _for_members(res, groups), self._share_info(round, groups))


class IvarVB(_WindowRule):
    """IVAR-VB (eqs 10-13): prior y ~ N(0, tau^2) with tau^2 learned (eq 12) over the window, sigma_j^2
    per client (eq 13). Options: window, max_iter, tol.

    The aggregate is the posterior mean ybar of q(y) (eqs 10-11), sum_j c_j x_j with coefficients
    c_j = (1/sigma_j^2) / (1/tau^2 + sum_i 1/sigma_i^2): they sum to less than 1 (the mean shrinks
    towards the prior's 0, by more when the updates carry little signal against their noise), so it is
    **not** ``weights @ updates``. ``weights`` are the coefficients normalised to sum to 1 (the trust
    shares); the coefficients themselves are ``info["clients"]["coefficient"]``."""

    name = "ivar_vb"

    def __init__(self, window: int = 10, max_iter: int = 200, tol: float | None = None, sybils: str = "share",
                 weighting: str = "precision"):  # fmt: skip
        super().__init__(window, max_iter, tol, sybils, weighting)

    def _history_spec(self) -> Spec:  # eq 13's and eq 12's sums that round
        return Fields({"clients": Dict(Float(minimum=0.0)), "tau": Float(minimum=0.0)})

    def _shared_spec(self) -> Spec:
        return Fields(optional={"tau2": Float(positive=True)})

    def _estimate(self, round: Round, groups: Groups, fit_round: Round, task: Tasks) -> Aggregate:
        ids = round.client_ids
        totals = [sum(h["clients"].get(i, 0.0) for h in self._history) for i in ids]
        counts = [sum(i in h["clients"] for h in self._history) for i in ids]
        on = {"dtype": torch.float64, "device": round.updates.device}
        past = IvarPast(
            groups.pool(torch.tensor(totals, **on)),
            groups.pool(torch.tensor(counts, **on)),
            sum(h["tau"] for h in self._history),
            float(len(self._history)),
        )  # fmt: skip
        res = self._fit(
            task, ivar_vb, max_iter=self.max_iter, tol=self.tol,
            init_noise=groups.pool(self._known(ids, "noise", round.updates.device)),
            tau2=self._shared.get("tau2"), past=past,
        )  # fmt: skip
        self._history.append(
            {
                "clients": dict(zip(ids, groups.expand(res.past.total).tolist(), strict=True)),
                "tau": res.past.tau_total,
            }
        )
        for i, noise in zip(ids, groups.expand(res.noise).tolist(), strict=True):
            self._clients[i] = {"noise": noise}
        self._shared["tau2"] = res.params["tau2"]
        return self._finish(
            round, _for_members(res, groups), {"tau2": res.params["tau2"], **self._share_info(round, groups)}
        )


def _embed(ids, entry_ids, rows: torch.Tensor | None = None, device: torch.device | None = None):
    """Positions of a past round's clients among this round's (mask), and its per-client rows re-indexed
    (on ``rows``' device, or ``device``)."""
    where = {c: k for k, c in enumerate(entry_ids)}
    device = rows.device if rows is not None else device
    mask = torch.tensor([i in where for i in ids], dtype=torch.bool, device=device)
    index = torch.tensor([where.get(i, 0) for i in ids], dtype=torch.long, device=device)
    if rows is None:
        return mask, index
    return mask, rows[index] * mask.reshape(-1, *([1] * (rows.dim() - 1))).to(rows.dtype)


class IcovMLE(_WindowRule):
    """ICOV-MLE (eq 3, Algorithm 2, eqs 9a-9c): Phi = sigma_u^2 V V' + diag(sigma_j^2) fitted to the
    residual covariances of the rounds in the window; each client's factors v_j and noise persist by id.
    Options: latent_dim D, window, steps (quasi-Newton steps per iteration), max_iter, tol, seed.

    The paper's joint likelihood in (y, Phi) is unbounded like IVAR-MLE's: fitted to convergence it can
    lock onto a few clients. The estimator fits the restricted likelihood instead (the consensus
    integrated out under a flat prior; :func:`~fedtrust.inference.icov.icov_loglik`), which is bounded,
    and centres the loadings so that the sources that share nothing are the majority
    (:func:`~fedtrust.inference.icov.centre_loadings`): a deliberate deviation from the paper's eqs 8-9."""

    name = "icov_mle"

    def __init__(self, latent_dim: int = 2, window: int = 10, steps: int = 20, max_iter: int = 50,
                 tol: float | None = None, seed: int = 0, sybils: str = "share",
                 weighting: str = "precision"):  # fmt: skip
        super().__init__(window, max_iter, tol, sybils, weighting)
        self.latent_dim = check_latent_dim(self.name, latent_dim)
        self.steps = check_int(f"{self.name}: steps", steps, minimum=1)
        self.seed = check_int(f"{self.name}: seed", seed)

    def _history_spec(self) -> Spec:  # that round's clients and their residual Gram matrix
        return Fields(
            {
                "ids": List(ClientId(), length="J", unique=True),
                "gram": Tensor(("J", "J"), test=symmetric_positive_semidefinite),
            }
        )

    def _client_spec(self) -> Spec:
        return Fields({"v": Tensor((self.latent_dim,)), "noise": Float(positive=True)})

    def _shared_spec(self) -> Spec:
        return Fields(optional={"sigma_u2": Float(positive=True)})

    def _estimate(self, round: Round, groups: Groups, fit_round: Round, task: Tasks) -> Aggregate:
        ids = round.client_ids
        masks, grams = [], []
        for entry in self._history:
            gram = entry["gram"].to(round.updates.device)
            mask, index = _embed(ids, entry["ids"], device=gram.device)
            gram = gram[index][:, index] * (mask[:, None] & mask[None, :]).to(gram.dtype)
            if not groups.trivial:  # a representative's residual: the mean of its present members'
                pool = groups.pooling(mask).to(gram)
                mask, gram = pool.sum(1) > 0, pool @ gram @ pool.T
            masks.append(mask)
            grams.append(gram)
        past = IcovMlePast(torch.stack(masks), torch.stack(grams)) if masks else None
        fresh = latent_init(fit_round.client_ids, self.latent_dim, self.seed, device=round.updates.device)
        v = _start(groups, [self._clients.get(i, {}).get("v") for i in ids], fresh)
        init = {"V": v, "noise": groups.pool(self._known(ids, "noise", round.updates.device))}
        if "sigma_u2" in self._shared:
            init["sigma_u2"] = self._shared["sigma_u2"]
        if torch.isnan(init["noise"]).any():
            del init["noise"]
        plain = {"max_iter": self.max_iter, "tol": self.tol, "init_noise": init.get("noise")}
        res, fallback = self._fit_or_fallback(
            task, icov_mle, ivar_mle, plain, latent_dim=self.latent_dim, max_iter=self.max_iter,
            steps=self.steps, tol=self.tol, seed=self.seed, source_keys=fit_round.client_ids, init=init,
            past=past,
        )  # fmt: skip
        if fallback is not None:
            return self._finish(
                round, _for_members(res, groups), {"fallback": fallback, **self._share_info(round, groups)}
            )
        self._history.append({"ids": list(ids), "gram": groups.expand(groups.expand(res.past.gram[0]).T).T})
        # one copy of the factors, each client's row a view of it (a copy each was a kernel each on a GPU),
        # and one read of the noise
        v, noise = groups.expand(res.params["V"]).clone(), groups.expand(res.params["sigma2"]).tolist()
        for i, v_i, noise_i in zip(ids, v.unbind(), noise, strict=True):
            self._clients[i] = {"v": v_i, "noise": noise_i}
        self._shared["sigma_u2"] = res.params["sigma_u2"]
        return self._finish(
            round,
            _for_members(res, groups),
            {"sigma_u2": res.params["sigma_u2"], **self._share_info(round, groups)},
        )


class IcovVB(_WindowRule):
    """ICOV-VB (eqs 14-23, Algorithm 2): latent factors u (per coordinate of the round) and v (per client)
    with Gaussian priors; q(v_j), each client's noise and the hyper-parameters persist, and earlier rounds
    in the window enter the client-side updates (eqs 18-23) through their statistics. Options:
    latent_dim D, noise ("per_source" as in Algorithm 2, or "shared" as eqs 14-23 print it), window,
    max_iter, tol, seed."""

    name = "icov_vb"

    def __init__(self, latent_dim: int = 2, noise: str = "per_source", window: int = 10, max_iter: int = 1000,
                 tol: float | None = None, seed: int = 0, sybils: str = "share",
                 weighting: str = "precision"):  # fmt: skip
        super().__init__(window, max_iter, tol, sybils, weighting)
        self.latent_dim = check_latent_dim(self.name, latent_dim)
        self.noise = check_choice(f"{self.name}: noise", noise, ("per_source", "shared"))
        self.seed = check_int(f"{self.name}: seed", seed)

    def _history_spec(self) -> Spec:  # that round's IcovVbPast (eqs 18-23), its one task squeezed out
        d = self.latent_dim
        return Fields(
            {
                "ids": List(ClientId(), length="J", unique=True),
                "A": Tensor((d, d), test=symmetric_positive_semidefinite),
                "b": Tensor(("J", d)),
                "c": Tensor(("J",), minimum=0.0),
                "yterm": Float(minimum=0.0),
                "uterm": Float(minimum=0.0),
                "k": Int(minimum=1),
            }
        )

    def _client_spec(self) -> Spec:
        d = self.latent_dim
        return Fields(
            {
                "v": Tensor((d,)),
                "psi": Tensor((d, d), test=symmetric_positive_definite),
                "noise": Float(positive=True),
            }
        )

    def _shared_spec(self) -> Spec:
        return Fields(
            optional={
                "sigma_y2": Float(positive=True),
                "sigma_u2": Float(positive=True),
                "sigma_v2": Tensor((self.latent_dim,), test=positive),  # per latent dimension (ARD)
            }
        )

    def _estimate(self, round: Round, groups: Groups, fit_round: Round, task: Tasks) -> Aggregate:
        ids = round.client_ids
        d = self.latent_dim
        past = None
        on = round.updates.device  # a checkpoint's history may come from another device
        for entry in self._history:
            mask, b = _embed(ids, entry["ids"], entry["b"].to(on))
            _, c = _embed(ids, entry["ids"], entry["c"].to(on))
            if not groups.trivial:  # a representative's statistics: the mean of its present members'
                pool = groups.pooling(mask).to(b)
                mask, b, c = pool.sum(1) > 0, pool @ b, pool @ c
            a = entry["A"].to(on)
            terms = torch.tensor([[entry["yterm"]], [entry["uterm"]]], dtype=a.dtype, device=a.device)
            piece = IcovVbPast(mask[None], a[None], b[None], c[None], terms[0], terms[1], entry["k"])
            past = piece if past is None else past.cat(piece)
        init = dict(self._shared)
        init["noise"] = groups.pool(self._known(ids, "noise", round.updates.device))
        if any(i in self._clients for i in ids):
            scale = torch.as_tensor(
                self._shared.get("sigma_v2", 1.0), dtype=torch.float64, device=round.updates.device
            ).expand(d)
            fresh = latent_init(fit_round.client_ids, d, self.seed, scale.sqrt(), round.updates.device)
            eye = torch.diag(scale).expand(groups.count, d, d)
            known = [self._clients.get(i) for i in ids]
            init["V"] = _start(groups, [None if k is None else k["v"] for k in known], fresh)
            init["Psi"] = _start(groups, [None if k is None else k["psi"] for k in known], eye)
        plain = {"max_iter": self.max_iter, "tol": self.tol, "init_noise": init["noise"]}
        res, fallback = self._fit_or_fallback(
            task, icov_vb, ivar_vb, plain, latent_dim=d, noise=self.noise, max_iter=self.max_iter,
            tol=self.tol, seed=self.seed, source_keys=fit_round.client_ids, init=init, past=past,
        )  # fmt: skip
        if fallback is not None:
            return self._finish(
                round, _for_members(res, groups), {"fallback": fallback, **self._share_info(round, groups)}
            )
        stats = res.past
        self._history.append(
            {
                "ids": list(ids),
                "A": stats.A[0],
                "b": groups.expand(stats.b[0]),
                "c": groups.expand(stats.c[0]),
                "yterm": float(stats.yterm[0]),
                "uterm": float(stats.uterm[0]),
                "k": int(stats.k),
            }
        )
        # one copy of each, every client's rows views of it (IcovMLE), and one read of the noise
        v, psi = (groups.expand(res.params[key]).clone() for key in ("V", "Psi"))
        noise = groups.expand(res.params["sigma2"]).tolist()
        for i, v_i, psi_i, noise_i in zip(ids, v.unbind(), psi.unbind(), noise, strict=True):
            self._clients[i] = {"v": v_i, "psi": psi_i, "noise": noise_i}
        self._shared = {key: res.params[key] for key in ("sigma_y2", "sigma_u2", "sigma_v2")}
        return self._finish(
            round, _for_members(res, groups), {**self._shared, **self._share_info(round, groups)}
        )
