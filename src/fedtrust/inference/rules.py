"""IVAR and ICOV as aggregation rules over the core contract (thin wrappers over the estimators).

Each round is a task and each coordinate a sample (K = d). The round's consensus is re-estimated from
scratch; earlier rounds in the window enter through their sufficient statistics, keyed by client id, so
a client's noise (and, for ICOV, its latent factors) is learned from every round it took part in.
Clients absent from a round are missing entries. Trust weights are each client's coefficient in the
consensus; where those are not a distribution (VB shrinks towards zero, ICOV may subtract a correlated
client) the weights are their positive part normalised, and the exact coefficients are in
``info["clients"]["coefficient"]``.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from fedtrust._checks import check_choice, check_float, check_int, check_tol
from fedtrust.aggregators.core import Aggregate, BaseRule, Round, UnscreenedUpdates
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
    symmetric_positive_definite,
    symmetric_positive_semidefinite,
)
from fedtrust.inference.icov import IcovMlePast, IcovVbPast, icov_mle, icov_vb, latent_init
from fedtrust.inference.ivar import IvarPast, ivar_mle, ivar_vb
from fedtrust.inference.result import ConvergenceWarning
from fedtrust.inference.tasks import Tasks

PAPER = "Nguyen, Lim, Wynter, Cai 2021, Probabilistic Inference for Learning from Untrusted Sources"


def _task(round: Round) -> Tasks:
    """The round as one task with every client present. The estimators skip their own finiteness check:
    the round's norms come along when taken, else their first pass takes them and screens the round on
    them (``BaseRule.screens_in_first_pass``)."""
    present = torch.ones(1, round.n, dtype=torch.bool, device=round.updates.device)
    kw = round.norms_for_pass()
    if "norms" in kw:
        return Tasks(round.updates[None], present, norms=kw["norms"][None])
    return Tasks(round.updates[None], present, on_norms=kw["on_norms"])


def _trust(coefficients: torch.Tensor) -> torch.Tensor:
    positive = coefficients.clamp_min(0)
    total = positive.sum()
    return positive / total if total > 0 else torch.full_like(coefficients, 1.0 / len(coefficients))


class _WindowRule(BaseRule):
    """Shared window bookkeeping: ``window`` rounds (this one included) inform each client's estimates.
    Every estimator starts with one pass over the data (a Gram matrix or a fused step), which screens the
    round; the window state changes only once the estimator returns.

    The state is a plain tree (what ``state_dict`` returns and ``load_state_dict`` checks against
    ``_state_spec``): "history", the earlier rounds of the window, oldest first, each a record of that
    round's statistics keyed by client id; "clients", client id -> its persistent estimates; "shared",
    the global estimates (hyper-parameters)."""

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
    screens_in_first_pass = True

    def __init__(self, window: int, max_iter: int, tol: float | None):
        self.window = check_int(f"{self.name}: window", window, minimum=1)
        self.max_iter = check_int(f"{self.name}: max_iter", max_iter, minimum=1)
        # None: the estimator's default, derived from the updates' dtype (fedtrust._checks.stopping_tol)
        self.tol = check_tol(f"{self.name}: tol", tol)
        self._history: deque = deque(maxlen=self.window - 1)
        self._clients: dict[Any, dict[str, Any]] = {}  # client id -> its persistent estimates
        self._shared: dict[str, Any] = {}  # global estimates (ICOV hyper-parameters)

    def _fit(self, round: Round, estimator, **options):
        """Run ``estimator`` on the round as one task. A fit that breaks down (a singular system, a
        non-finite consensus or noise: updates near the dtype's limits, whose squares the Gram
        statistics cannot hold) raises a ``ValueError`` naming the rule, before any state is changed: the
        round is not aggregated, never aggregated to NaN."""
        try:
            res = estimator(_task(round), **options)
        except UnscreenedUpdates:
            raise
        except (torch.linalg.LinAlgError, ArithmeticError, ValueError) as exc:
            raise ValueError(
                f"{self.name}: the fit broke down on this round ({exc}){self._scale(round)}"
            ) from exc
        if not all(bool(torch.isfinite(t).all()) for t in (res.consensus, res.noise, res.weights)):
            raise ValueError(f"{self.name}: the fit is not finite on this round{self._scale(round)}")
        return res

    @staticmethod
    def _scale(round: Round) -> str:
        tail = ": the round is not aggregated and the rule's state is unchanged"
        if not round.norms_taken:  # (taking them here would tell the front door the round was screened)
            return tail
        norms = round.norms
        return f" (update norms {float(norms.min()):.3g} to {float(norms.max()):.3g})" + tail

    def _finish(self, round: Round, result, extra_info: dict) -> Aggregate:
        """The round's aggregate, trust and info. A fit that stopped at ``max_iter`` before converging
        puts :attr:`InferenceResult.warning` in ``info["warning"]`` (so a simulation's round record keeps
        it) and, the first time for this rule object, raises it as a :class:`ConvergenceWarning`: its text
        changes every round, so warnings' once-per-location filter alone would repeat it each round."""
        coefficients = result.weights[0]
        warning = result.warning
        if warning is not None and not self.__dict__.get("_warned_convergence", False):
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
        self._history = deque(state.get("history", []), maxlen=self.window - 1)
        self._clients = state.get("clients", {})
        self._shared = state.get("shared", {})

    def _known(self, ids, key: str) -> torch.Tensor:
        return torch.tensor([self._clients.get(i, {}).get(key, math.nan) for i in ids], dtype=torch.float64)


class IvarMLE(_WindowRule):
    """IVAR-MLE (Algorithm 1, eqs 6-7) per round, each client's sigma_j^2 pooled over its rounds in the
    window. Options: window (rounds, this one included), eps (floor on sigma_j^2), max_iter, tol (on the
    weights' change; None: derived from the updates' dtype).

    The likelihood is unbounded (a client matching the consensus exactly has sigma_j -> 0): eqs 6-7
    settle when several clients share the best noise level and otherwise collapse onto one. eps is the
    floor relative to the round's scale at which that is detected; the round is then estimated with the
    flat-prior correction (:func:`~fedtrust.inference.ivar.ivar_mle`) and ``info["degenerate"]`` says so."""

    name = "ivar_mle"

    def __init__(self, window: int = 10, eps: float = 1e-12, max_iter: int = 200, tol: float | None = None):
        super().__init__(window, max_iter, tol)
        self.eps = check_float(f"{self.name}: eps", eps, minimum=0.0, strict_min=True)

    def _history_spec(self) -> Spec:
        return Dict(Float(minimum=0.0))  # client id -> its mean squared residual that round

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        ids = round.client_ids
        past = IvarPast(
            torch.tensor([sum(h.get(i, 0.0) for h in self._history) for i in ids], dtype=torch.float64),
            torch.tensor([sum(i in h for h in self._history) for i in ids], dtype=torch.float64),
        )
        res = self._fit(round, ivar_mle, max_iter=self.max_iter, tol=self.tol, eps=self.eps,
                       init_noise=self._known(ids, "noise"), past=past)  # fmt: skip
        self._history.append(dict(zip(ids, res.past.total.tolist(), strict=True)))
        for i, noise in zip(ids, res.noise.tolist(), strict=True):
            self._clients[i] = {"noise": noise}
        return self._finish(round, res, {})


class IvarVB(_WindowRule):
    """IVAR-VB (eqs 10-13): prior y ~ N(0, tau^2) with tau^2 learned (eq 12) over the window, sigma_j^2
    per client (eq 13); the aggregate is the posterior mean. Options: window, max_iter, tol."""

    name = "ivar_vb"

    def __init__(self, window: int = 10, max_iter: int = 200, tol: float | None = None):
        super().__init__(window, max_iter, tol)

    def _history_spec(self) -> Spec:  # eq 13's and eq 12's sums that round
        return Fields({"clients": Dict(Float(minimum=0.0)), "tau": Float(minimum=0.0)})

    def _shared_spec(self) -> Spec:
        return Fields(optional={"tau2": Float(positive=True)})

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        ids = round.client_ids
        past = IvarPast(
            torch.tensor(
                [sum(h["clients"].get(i, 0.0) for h in self._history) for i in ids], dtype=torch.float64
            ),
            torch.tensor([sum(i in h["clients"] for h in self._history) for i in ids], dtype=torch.float64),
            sum(h["tau"] for h in self._history),
            float(len(self._history)),
        )
        res = self._fit(
            round, ivar_vb, max_iter=self.max_iter, tol=self.tol, init_noise=self._known(ids, "noise"),
            tau2=self._shared.get("tau2"), past=past,
        )  # fmt: skip
        self._history.append(
            {"clients": dict(zip(ids, res.past.total.tolist(), strict=True)), "tau": res.past.tau_total}
        )
        for i, noise in zip(ids, res.noise.tolist(), strict=True):
            self._clients[i] = {"noise": noise}
        self._shared["tau2"] = res.params["tau2"]
        return self._finish(round, res, {"tau2": res.params["tau2"]})


def _embed(ids, entry_ids, rows: torch.Tensor | None = None):
    """Positions of a past round's clients among this round's (mask), and its per-client rows re-indexed."""
    where = {c: k for k, c in enumerate(entry_ids)}
    mask = torch.tensor([i in where for i in ids], dtype=torch.bool)
    index = torch.tensor([where.get(i, 0) for i in ids], dtype=torch.long)
    if rows is None:
        return mask, index
    return mask, rows[index] * mask.reshape(-1, *([1] * (rows.dim() - 1))).to(rows.dtype)


class IcovMLE(_WindowRule):
    """ICOV-MLE (eq 3, Algorithm 2, eqs 9a-9c): Phi = sigma_u^2 V V' + diag(sigma_j^2) fitted to the
    residual covariances of the rounds in the window; each client's factors v_j and noise persist by id.
    Options: latent_dim D, window, steps (quasi-Newton steps per iteration), max_iter, tol, seed.

    The joint likelihood in (y, Phi) is unbounded like IVAR-MLE's: fitted to convergence it can lock onto
    a few clients (the paper reports ICOV-MLE as its weakest variant); ICOV-VB is the robust one."""

    name = "icov_mle"

    def __init__(self, latent_dim: int = 2, window: int = 10, steps: int = 20, max_iter: int = 50,
                 tol: float | None = None, seed: int = 0):  # fmt: skip
        super().__init__(window, max_iter, tol)
        self.latent_dim = check_int(f"{self.name}: latent_dim", latent_dim, minimum=1)
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

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        ids = round.client_ids
        masks, grams = [], []
        for entry in self._history:
            gram = entry["gram"]
            mask, index = _embed(ids, entry["ids"])
            masks.append(mask)
            grams.append(gram[index][:, index] * (mask[:, None] & mask[None, :]).to(gram.dtype))
        past = IcovMlePast(torch.stack(masks), torch.stack(grams)) if masks else None
        fresh = latent_init(ids, self.latent_dim, self.seed)
        v = torch.stack(
            [torch.as_tensor(self._clients.get(i, {}).get("v", fresh[k])) for k, i in enumerate(ids)]
        )
        init = {"V": v, "noise": self._known(ids, "noise")}
        if "sigma_u2" in self._shared:
            init["sigma_u2"] = self._shared["sigma_u2"]
        if torch.isnan(init["noise"]).any():
            del init["noise"]
        res = self._fit(
            round, icov_mle, latent_dim=self.latent_dim, max_iter=self.max_iter, steps=self.steps,
            tol=self.tol, seed=self.seed, source_keys=ids, init=init, past=past,
        )  # fmt: skip
        self._history.append({"ids": list(ids), "gram": res.past.gram[0]})
        for k, i in enumerate(ids):
            self._clients[i] = {"v": res.params["V"][k].clone(), "noise": float(res.params["sigma2"][k])}
        self._shared["sigma_u2"] = res.params["sigma_u2"]
        return self._finish(round, res, {"sigma_u2": res.params["sigma_u2"]})


class IcovVB(_WindowRule):
    """ICOV-VB (eqs 14-23, Algorithm 2): latent factors u (per coordinate of the round) and v (per client)
    with Gaussian priors; q(v_j), each client's noise and the hyper-parameters persist, and earlier rounds
    in the window enter the client-side updates (eqs 18-23) through their statistics. Options:
    latent_dim D, noise ("per_source" as in Algorithm 2, or "shared" as eqs 14-23 print it), window,
    max_iter, tol, seed."""

    name = "icov_vb"

    def __init__(self, latent_dim: int = 2, noise: str = "per_source", window: int = 10, max_iter: int = 200,
                 tol: float | None = None, seed: int = 0):  # fmt: skip
        super().__init__(window, max_iter, tol)
        self.latent_dim = check_int(f"{self.name}: latent_dim", latent_dim, minimum=1)
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
        return Fields(optional={k: Float(positive=True) for k in ("sigma_y2", "sigma_u2", "sigma_v2")})

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        ids = round.client_ids
        d = self.latent_dim
        past = None
        for entry in self._history:
            mask, b = _embed(ids, entry["ids"], entry["b"])
            _, c = _embed(ids, entry["ids"], entry["c"])
            a = entry["A"]
            terms = torch.tensor([[entry["yterm"]], [entry["uterm"]]], dtype=a.dtype, device=a.device)
            piece = IcovVbPast(mask[None], a[None], b[None], c[None], terms[0], terms[1], entry["k"])
            past = piece if past is None else past.cat(piece)
        init = dict(self._shared)
        init["noise"] = self._known(ids, "noise")
        known = [i in self._clients for i in ids]
        if any(known):
            fresh = latent_init(ids, d, self.seed, math.sqrt(self._shared.get("sigma_v2", 1.0)))
            eye = torch.eye(d, dtype=torch.float64) * self._shared.get("sigma_v2", 1.0)
            init["V"] = torch.stack(
                [
                    self._clients[i]["v"] if k else fresh[n]
                    for n, (i, k) in enumerate(zip(ids, known, strict=True))
                ]
            )
            init["Psi"] = torch.stack(
                [self._clients[i]["psi"] if k else eye for i, k in zip(ids, known, strict=True)]
            )
        res = self._fit(
            round, icov_vb, latent_dim=d, noise=self.noise, max_iter=self.max_iter, tol=self.tol,
            seed=self.seed, source_keys=ids, init=init, past=past,
        )  # fmt: skip
        stats = res.past
        self._history.append(
            {
                "ids": list(ids),
                "A": stats.A[0],
                "b": stats.b[0],
                "c": stats.c[0],
                "yterm": float(stats.yterm[0]),
                "uterm": float(stats.uterm[0]),
                "k": int(stats.k),
            }
        )
        for k, i in enumerate(ids):
            self._clients[i] = {
                "v": res.params["V"][k].clone(),
                "psi": res.params["Psi"][k].clone(),
                "noise": float(res.params["sigma2"][k]),
            }
        self._shared = {key: res.params[key] for key in ("sigma_y2", "sigma_u2", "sigma_v2")}
        return self._finish(round, res, dict(self._shared))
