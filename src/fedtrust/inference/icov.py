"""Inverse-covariance weighting (ICOV): correlated sources, maximum likelihood and variational Bayes.

Nguyen, Lim, Wynter, Cai (papers/000). Sources' errors may be correlated through latent factors:
x_ij ~ N(y_i + u_i' v_j, sigma^2) (eq 8). Integrating u_i ~ N(0, sigma_u^2 I) out gives
x_i ~ N(y_i 1, Phi) with Phi = sigma_u^2 V V' + diag(sigma_j^2) (Algorithm 2), shared by all K
coordinates. ICOV-MLE fits Phi by gradient steps and weights by Phi^-1 (eq 3); ICOV-VB keeps
distributions over y, U and V (eqs 14-23).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from fedtrust._checks import check_bool, check_int, resolve_tol
from fedtrust.inference.accelerate import Step, one_thread, squarem
from fedtrust.inference.result import InferenceResult, WeightChanges, converged
from fedtrust.inference.tasks import (
    TaskGram,
    as_tasks,
    mean_noise,
    not_below_centre,
    stats_on,
    typical,
    weighted_sums,
)

LOG2PI = math.log(2 * math.pi)


def latent_init(keys, dim: int, seed: int, scale: float | torch.Tensor = 1.0, device=None) -> torch.Tensor:
    """(J, D) N(0, scale^2) starting factors, each row drawn from its own key (a source id), so a source
    gets the same start whichever other sources are present (drawn on the CPU, then moved to ``device``:
    the same start on every device)."""
    rows = []
    for key in keys:
        g = torch.Generator().manual_seed((zlib.crc32(str(key).encode()) << 16) ^ seed)
        rows.append(torch.randn(dim, generator=g, dtype=torch.float64))
    return scale * torch.stack(rows).to(device or "cpu")


def centre_loadings(
    v: torch.Tensor,
    rows: torch.Tensor | None = None,
    own: torch.Tensor | None = None,
    su2: float = 1.0,
    iters: int = 500,
) -> torch.Tensor:
    """The latent loadings shifted so that the sources that share nothing are the majority: the
    identifiability constraint that decides whom eq 3 trusts.

    With the consensus y_i free, the model x_i = y_i 1 + V u_i + e_i cannot tell V from V - 1 a' (the
    shared part 1 a' u_i is absorbed into y_i): the likelihood of the contrasts (what is left once y is
    estimated) is the same for "the truth, and a group that shares an error" and "the truth shifted
    towards the group, and everyone else sharing the opposite error", yet eq 3's weights differ, and the
    joint likelihood's extra term log(1' Phi^-1 1) prefers the second. A source's loading row is what it
    shares with others, so the shift is a centre of the rows, and the sources at it are the ones cast as
    sharing nothing.

    Without ``own``: the geometric median of the rows (Weiszfeld's iteration; rotation-equivariant,
    breakdown point 1/2), one vote a source: an honest majority shares nothing.

    With ``own`` (each source's variance outside the factors, sigma_j^2 + sigma_u^2 tr Psi_j; ``su2``:
    sigma_u^2), precision decides where one vote a source cannot:

    1. the count majority: the h = J // 2 + 1 rows nearest to the geometric median, moved by C-steps
       until they no longer change (:func:`_nearest_majority`), and their mean a_1;
    2. each source's precision about the consensus a_1 implies, 1 / Phi_jj = 1 / (sigma_u^2
       ||v_j - a_1||^2 + own_j) (eq 6's weight);
    3. if the count majority holds at least half of that precision, it is the majority: the centre is
       the one-vote geometric median, or, where that median lies further from a_1 than the majority's
       median row (two groups of equal size: the median falls between them), the geometric median of
       the majority's rows;
    4. otherwise the sources outside it outweigh it: the centre is the geometric median weighted by
       the precisions (breakdown point 1/2 of the weight), from a_1.

    A colluding group, tight among itself but far from the truth, is far from the honest majority's
    a_1 and so imprecise about it: the honest majority keeps the centre (step 3). Noisy independent
    sources that outnumber a precise genuine minority share their offset from the truth (the paper's
    one-round task: N(0, 1) vectors centred on 0, not on the model), and one vote each would cast the
    genuine parties as the group sharing an error; their noise makes them imprecise even about their own
    a_1, the genuine parties outweigh them and take the centre (step 4). Where no group stands out, as
    with clients on non-IID data whose heterogeneity the factors absorb, step 3 keeps the one-vote
    median: a precision-weighted centre there moved towards the most precise clients, cast the rest as
    biased, and cost 5-12 points of accuracy on two of three seeds of the sybils experiment's clean
    runs. The precisions are not re-evaluated at a new centre: there a tight group is precise by
    construction, whoever's centre it is. The precisions need loadings in which the honest sources
    cluster: ICOV-VB's, whose per-dimension prior prunes the latent dimensions the data do not need;
    ICOV-MLE's spare dimension scatters the honest sources' loadings (the precision-weighted centre then
    landed among a tight colluding group on the collusion grid), and ICOV-MLE centres with one vote.

    ``rows`` (bool): the sources the centre is taken over (those seen in the window); all rows are
    shifted."""
    keep = (torch.ones(len(v), dtype=torch.bool) if rows is None else rows.cpu()).numpy()
    pts = v.detach().cpu().numpy()[keep]  # a J x D problem: solved on the host
    scale = float(np.abs(pts).max()) if len(pts) else 0.0
    if len(pts) < 3 or not scale > 0 or not math.isfinite(scale):
        return v
    pts = pts / scale  # unit scale: pruned factors reach 1e-300, where 1 / distance overflows
    majority = _geometric_median(pts, np.ones(len(pts)), np.median(pts, 0), iters)
    if own is None:
        return v - torch.as_tensor(majority * scale, dtype=v.dtype, device=v.device)
    first, inside = _nearest_majority(pts, majority)
    unit = su2 * scale * scale  # the factors' variance at unit scale (0 once they have shrunk to nothing:
    own = own.detach().cpu().numpy()[keep]  # every precision is then 0, and the count majority holds)
    with np.errstate(divide="ignore", over="ignore"):
        own = own / unit if unit > 0 else np.full_like(own, np.inf)
    dist = np.sqrt(((pts - first) ** 2).sum(1))
    precision = 1.0 / (dist**2 + own)
    if precision[inside].sum() >= precision[~inside].sum():  # the count majority holds the precision
        if np.sqrt(((majority - first) ** 2).sum()) <= np.median(dist[inside]):
            return v - torch.as_tensor(majority * scale, dtype=v.dtype, device=v.device)
        centre = _geometric_median(pts, inside.astype(float), majority, iters)  # between two equal groups
    else:
        centre = _geometric_median(pts, precision / precision.max(), first, iters)
    return v - torch.as_tensor(centre * scale, dtype=v.dtype, device=v.device)


def _nearest_majority(pts: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean of the majority (h = J // 2 + 1) of the rows nearest to a centre, the centre moved to it
    until the majority no longer changes (Rousseeuw and Van Driessen's C-steps, Technometrics 1999: each
    lowers the majority's sum of squared distances, so this ends), and the majority as a mask: the
    geometric median of two groups of nearly equal size sits between them, this sits with the larger."""
    h = len(pts) // 2 + 1
    centre, chosen = start, None
    for _ in range(len(pts) + 1):
        near = np.sort(np.argsort(((pts - centre) ** 2).sum(1), kind="stable")[:h])
        if chosen is not None and np.array_equal(near, chosen):
            break
        chosen, centre = near, pts[near].mean(0)
    inside = np.zeros(len(pts), dtype=bool)
    inside[chosen] = True
    return centre, inside


def _geometric_median(pts: np.ndarray, weights: np.ndarray, start: np.ndarray, iters: int) -> np.ndarray:
    """argmin_c sum_j weights_j ||pts_j - c|| from ``start``: Weiszfeld's iteration with Vardi and Zhang's
    step at a data point (Proc. Natl Acad. Sci. 2000, eq 2.5); plain Weiszfeld that reaches one of the
    points stays there whether or not it is the median."""
    centre = start
    for _ in range(iters):
        dist = np.sqrt(((pts - centre) ** 2).sum(1))
        at = dist <= 1e-12
        w = np.where(at, 0.0, weights / np.maximum(dist, 1e-12))
        if not (w > 0).any():
            break
        moved = (w[:, None] * pts).sum(0) / w.sum()
        eta = float(weights[at].sum())
        if eta > 0:  # at a data point: move only as far as the others' pull exceeds its weight
            others = float(np.linalg.norm((w[:, None] * (pts - centre)).sum(0)))
            share = min(1.0, eta / others) if others > 0 else 1.0
            moved = (1.0 - share) * moved + share * centre
        done = float(np.linalg.norm(moved - centre)) <= 1e-10
        centre = moved
        if done:
            break
    return centre


# ---------------------------------------------------------------- ICOV-MLE


@dataclass
class IcovMlePast:
    """Earlier tasks as (mask (P, J), residual Gram S (P, J, J)); with the current tasks they form the
    log-likelihood the covariance is fitted to (Remark 1: Phi is shared by all tasks)."""

    mask: torch.Tensor
    gram: torch.Tensor


def _masked(phi: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(I, J, J): Phi restricted to each task's sources, identity on the absent ones (so the inverse
    restricted to the present block is the inverse of the sub-matrix, and the log-determinant is its)."""
    mm = mask[:, :, None] & mask[:, None, :]
    eye = torch.eye(phi.shape[0], dtype=phi.dtype, device=phi.device)
    return (
        torch.where(mm, phi, torch.zeros((), dtype=phi.dtype)) + torch.diag_embed((~mask).to(phi.dtype)) * eye
    )


def consensus_coefficients(phi: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(I, J): a_i = Phi_i^-1 1 / (1' Phi_i^-1 1) over each task's sources (eq 3), zero elsewhere."""
    m = mask.to(phi.dtype)
    if bool(mask.all()):  # every source in every task (a rule's round): one solve, shared by the tasks
        sol = torch.linalg.solve(phi, m[0])
        return (sol / sol.sum()).expand_as(m).clone()
    sol = torch.linalg.solve(_masked(phi, mask), m[:, :, None])[:, :, 0] * m
    return sol / sol.sum(1, keepdim=True)


def icov_loglik(
    phi: torch.Tensor, mask: torch.Tensor, s: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The restricted log-likelihood of Phi and its gradient G (d loglik / dPhi = G / 2).

    sum_i E_i / 2 with E_i = -K log|Phi_i| - K log(1' Phi_i^-1 1) - tr(P_i S_i), P_i = Phi_i^-1 -
    p_i p_i' / (1' p_i), p_i = Phi_i^-1 1: the likelihood of the contrasts (REML; Patterson & Thompson
    1971), the consensus y_i integrated out under a flat prior. P_i 1 = 0, so S_i may be the residual
    Gram about any consensus (the plain mean, last round's): tr(P_i S_i) is the paper's tr(Phi_i^-1 S_i)
    at eq 3's consensus for this Phi, and this is the paper's E_i profiled over y plus the -K log(1' p_i)
    term. Maximised jointly with y instead, the likelihood is unbounded (a source that the consensus
    matches exactly has variance -> 0, Neyman & Scott's incidental-parameter degeneracy) and, with
    latent factors, prefers loadings that make the consensus look precise rather than right (see
    :func:`centre_loadings`); the restricted likelihood is bounded and blind to where the loadings are
    centred. G = sum_i P_i S_i P_i - K P_i (zero outside task i's sources): eqs 9a-9c's G with P_i for
    Phi_i^-1."""
    chol = torch.linalg.cholesky(_masked(phi, mask))
    inv = torch.cholesky_inverse(chol)
    logdet = 2 * chol.diagonal(dim1=1, dim2=2).log().sum(1)
    m = mask.to(phi.dtype)
    p = (inv @ m[:, :, None])[:, :, 0] * m
    q = p.sum(1)
    proj = (inv - p[:, :, None] * p[:, None, :] / q[:, None, None]) * (m[:, :, None] * m[:, None, :])
    ps = proj @ s
    quad = ps.diagonal(dim1=1, dim2=2).sum(1)
    g = (ps @ proj - k * proj).sum(0)
    return 0.5 * (-k * logdet - k * q.log() - quad).sum(), g


#: The largest rank of the sources' shared errors ICOV takes: a low-rank model of correlated noise,
#: whose D x D matrices a rank in the millions would not fit in memory (1e12 overflowed torch's sizes).
LATENT_LIMIT = 4096


def check_latent_dim(name: str, latent_dim) -> int:
    """``latent_dim`` as an int in 1..:data:`LATENT_LIMIT`, or refused naming ``name``'s field."""
    return check_int(f"{name}: latent_dim", latent_dim, minimum=1, maximum=LATENT_LIMIT)


def _check_fit(name: str, latent_dim, max_iter, seed, init, **counts) -> None:
    """The options every ICOV fit takes, refused by name before any work."""
    for field, value in {"max_iter": max_iter, **counts}.items():
        check_int(f"{name}: {field}", value, minimum=1)
    check_latent_dim(name, latent_dim)
    check_int(f"{name}: seed", seed)
    if init is not None and not isinstance(init, dict):
        raise TypeError(f"{name}: init must be a dict of starting values or None, got {type(init).__name__}")


def _keys(name: str, source_keys, sources: int) -> list:
    keys = list(range(sources)) if source_keys is None else list(source_keys)
    if len(keys) != sources:
        raise ValueError(f"{name}: source_keys needs one id per source ({sources}), got {len(keys)}")
    return keys


def icov_mle(
    estimates,
    mask=None,
    *,
    latent_dim: int = 2,
    max_iter: int = 100,
    steps: int = 20,
    tol: float | None = None,
    seed: int = 0,
    source_keys=None,
    init: dict | None = None,
    past: IcovMlePast | None = None,
) -> InferenceResult:
    """ICOV-MLE (Algorithm 2): y_i = X_i Phi_i^-1 1 / (1' Phi_i^-1 1) (eq 3) and ``steps`` gradient steps
    at a time on the log-likelihood of Phi = sigma_u^2 V V' + diag(sigma_j^2), with the paper's
    gradients: dE/dV = 2 sigma_u^2 G V (eq 9a), dE/dsigma_j^2 = G_jj (eq 9b, per source as in Algorithm 2),
    dE/dsigma_u^2 = tr(G V V') (eq 9c). Two departures from the printed algorithm, both because the joint
    likelihood in (y, Phi) is degenerate: the likelihood is the restricted one (:func:`icov_loglik`,
    bounded, and its G adds one term to eqs 9a-9c), and after each fit the loadings are centred on the
    sources' geometric median (:func:`centre_loadings`), which the restricted likelihood is blind to but
    which decides whom eq 3 trusts: a colluding minority, not the honest majority, is the group that
    shares an error. The variances are stepped in log space (chain rule on 9b-9c, so
    they stay positive) and the steps are quasi-Newton (L-BFGS) with a strong-Wolfe line search: plain
    gradient steps crawl on this badly scaled problem. Every step raises the likelihood, so the trace
    never decreases. Stops when the coefficients of eq 3 are within ``tol`` of their fixed point
    (absolute, they may be negative: :func:`~fedtrust.inference.result.converged`; default
    :func:`~fedtrust._checks.stopping_tol` of the estimates' dtype), when a fit stops moving them (the
    likelihood is flat there to L-BFGS's tests: the weights are resolved to about 1e-5, see
    ``_CovarianceFit``), or after ``max_iter``.

    latent_dim: D, the rank of the correlated part. source_keys: ids seeding each source's starting
    factors (default 0..J-1). init: {"V", "noise", "sigma_u2"} to warm-start. past: earlier tasks.
    """
    _check_fit("icov_mle", latent_dim, max_iter, seed, init, steps=steps)
    t = as_tasks(estimates, mask)
    _, sources, k = t.shape
    gram = TaskGram.of(t)  # the iterations need only residual Gram matrices: one pass over the data
    tol = resolve_tol(tol, t.x.dtype)
    keys = _keys("icov_mle", source_keys, sources)
    init = init or {}
    # The fit is on J x J statistics after one pass over the data: it runs on the host, where L-BFGS's
    # many scalar reads are free (on a GPU each is a sync), and the same code gives every device the
    # same weights. The data stay where they are; the weights go back there.
    host = torch.device("cpu")
    on = {"dtype": torch.float64, "device": host}
    if "noise" in init:
        noise = not_below_centre(torch.as_tensor(init["noise"], **on), gram, k).clone()
    else:
        noise = mean_noise(t, gram).to(**on)
    v = torch.as_tensor(init["V"], **on).clone() if "V" in init else latent_init(keys, latent_dim, seed)
    sigma_u2 = float(init.get("sigma_u2", 0.1 * float(noise.median())))
    theta = {
        "V": v.requires_grad_(),
        "log_noise": noise.log().requires_grad_(),
        "log_su2": torch.tensor(math.log(sigma_u2), **on, requires_grad=True),
    }
    task_mask = t.mask.to(host)
    all_mask = task_mask if past is None else torch.cat([task_mask, past.mask.to(host)])
    total = float(all_mask.sum()) * k
    s = _about_centre(gram, t.mask).to(host)
    all_s = s if past is None else torch.cat([s, past.gram.to(host)])
    trace: list[float] = []
    changes = WeightChanges()
    fit = _CovarianceFit(theta, all_mask, all_s, k, total, steps)
    with one_thread():  # many small J x J operations: threads only wait for each other
        for it in range(1, max_iter + 1):
            ll = fit.step()
            with torch.no_grad():  # the restricted likelihood does not see the loadings' centre; eq 3 does
                a = consensus_coefficients(_phi(_centred(theta)), task_mask)
            changes.add(a, theta["log_noise"].exp())
            trace.append(ll / total)
            if converged(changes, tol):
                break
    there = t.x.device
    with torch.no_grad():
        theta = _centred(theta)
        phi = _phi(theta).to(there)
        params = {"V": theta["V"].detach().to(there), "sigma2": theta["log_noise"].detach().exp().to(there),
                  "sigma_u2": float(theta["log_su2"].exp()), "Phi": phi}  # fmt: skip
    a = a.to(there)
    return InferenceResult(
        estimator="icov_mle",
        consensus=weighted_sums(t, a),
        noise=phi.diagonal().clone(),
        weights=a,
        trace=trace,
        iterations=it,
        converged=converged(changes, tol),
        changes=list(changes),
        tol=tol,
        params=params,
        past=IcovMlePast(t.mask, s.to(there)),
    )


def _about_centre(gram: TaskGram, mask: torch.Tensor) -> torch.Tensor:
    """(I, J, J): the residual Gram matrices S_i that :func:`icov_loglik` reads, about the statistics' own
    centre (any consensus will do there: P_i 1 = 0), zero outside each task's sources. The centre is the
    plain mean or, in a rule's round, the coordinate-wise median, which no far source drags: about the
    plain mean instead, S_i's honest block is a difference of the far source's terms (two sources at
    +-1e12 per coordinate among four honest ones, float32: 6.5e26 terms whose rounding of ~1e19 swamped
    the honest residuals of ~0.07, and the fit put the honest sources' variances at 1e-13 and the
    consensus 2.5 honest spreads from theirs)."""
    m = mask.to(gram.centred.device, torch.float64)
    s = gram.centred * (m[:, :, None] * m[:, None, :])
    return (s + s.transpose(1, 2)) / 2


def _centred(theta: dict) -> dict:
    return {**theta, "V": centre_loadings(theta["V"].detach())}


def _phi(theta) -> torch.Tensor:
    """sigma_u^2 V V' + diag(sigma_j^2), plus a jitter of 1e-10 of its typical diagonal so that it stays
    numerically positive definite however small a sigma_j^2 gets (e.g. warm-started from a collapse).
    The median where one far source drags the mean (:func:`~fedtrust.inference.tasks.typical`): a source
    of variance 1e24 beside four of 1e-4 made the mean's jitter 2e13, every other source's variance in
    effect, which held the far source's weight at 5e-12 however far it was (an update of 1e12 per
    coordinate put 5 per coordinate into the consensus)."""
    v = theta["V"]
    phi = theta["log_su2"].exp() * v @ v.T + torch.diag(theta["log_noise"].exp())
    eye = torch.eye(len(phi), dtype=phi.dtype, device=phi.device)
    return phi + 1e-10 * typical(phi.diagonal().detach()) * eye


def _gradient(theta, g):
    """Log-likelihood gradients from G (d loglik / d Phi = G / 2): eqs 9a-9c halved, in log space."""
    su2 = theta["log_su2"].exp()
    v = theta["V"]
    return {
        "V": su2 * g @ v,  # (9a) / 2
        "log_noise": 0.5 * g.diagonal() * theta["log_noise"].exp(),  # (9b) / 2 * d sigma^2 / d log sigma^2
        "log_su2": 0.5 * (g * (v @ v.T)).sum() * su2,  # (9c) / 2 * d sigma_u^2 / d log sigma_u^2
    }


class _CovarianceFit:
    """L-BFGS on minus the mean restricted log-likelihood (gradients from eqs 9a-9c), up to ``steps``
    steps per call. A fresh optimiser each call: one kept throughout stops on its loss-change test
    while the weights still move (measured: 5 of 12 collusion runs converged, against 12 of 12).

    Resolution: a call also stops on L-BFGS's loss-change and directional-derivative tests
    (``tolerance_change`` 1e-12 on a mean log-likelihood of ~0.4). Where the likelihood is that flat a
    call can end without moving, and the iterations read the change of 0 as their fixed point: the
    weights are resolved to that flatness, not to ``tol``, and ``converged`` says True. Measured: 2e-5
    from where fits of 100 steps a call end, 3e-4 apart with the clients in another order on a table whose
    noise variance heads to 0; a paper review continued two fits with scipy's L-BFGS-B on the same
    likelihood and moved the weights by 4.4e-4 and 6.0e-4.
    With the tests off (``tolerance_change=0``) those came to 2e-7 and 8e-6, but the collusion grid's
    fits then converged in 24 of 36 tables (seed 0) within 100 iterations instead of 36 of 36, at 2.5-4
    times the time: kept as it is, and stated here."""

    def __init__(self, theta, mask, s, k, total, steps):
        self.theta, self.mask, self.s, self.k, self.total, self.steps = theta, mask, s, k, total, steps

    def closure(self):
        theta = self.theta
        with torch.no_grad():
            try:
                ll, g = icov_loglik(_phi(theta), self.mask, self.s, self.k)
                grad = _gradient(theta, g)
                ok = bool(torch.isfinite(ll)) and all(bool(torch.isfinite(v).all()) for v in grad.values())
            except torch.linalg.LinAlgError:
                ok = False
        if not ok:  # a line-search probe overshot (Phi overflowed): a large finite loss sends it back
            for value in theta.values():
                value.grad = torch.zeros_like(value)
            return torch.tensor(1e20, dtype=torch.float64, device=self.s.device)
        for name, value in theta.items():
            value.grad = -grad[name] / self.total
        return -ll / self.total

    def step(self) -> float:
        torch.optim.LBFGS(list(self.theta.values()), max_iter=self.steps, line_search_fn="strong_wolfe",
                          tolerance_grad=1e-10, tolerance_change=1e-12).step(self.closure)  # fmt: skip
        with torch.no_grad():
            return float(icov_loglik(_phi(self.theta), self.mask, self.s, self.k)[0])


# ---------------------------------------------------------------- ICOV-VB


@dataclass
class IcovVbPast:
    """Earlier tasks' sufficient statistics for the source-side updates (eqs 18-23), per task p:
    mask (P, J); A (P, D, D) = K Phi_p + U_p' U_p; b (P, J, D) = U_p' (x_pj - ybar_p);
    c (P, J) = K lambda_p + ||x_pj - ybar_p||^2; yterm (P,) = K lambda_p + ||ybar_p||^2;
    uterm (P,) = K tr Phi_p + ||U_p||_F^2. K is the number of coordinates of those tasks."""

    mask: torch.Tensor
    A: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    yterm: torch.Tensor
    uterm: torch.Tensor
    k: int

    def cat(self, other: IcovVbPast) -> IcovVbPast:
        return IcovVbPast(
            *(
                torch.cat([getattr(self, f), getattr(other, f)])
                for f in ("mask", "A", "b", "c", "yterm", "uterm")
            ),
            self.k,
        )


#: ICOV-VB's ARD prior prunes latent dimension d once sigma_u^2 sigma_v^2_d, what it adds to the
#: covariance, falls below PRUNE times the mean noise variance: an unneeded dimension's variance heads to
#: 0 (MacKay's update shrinks it by a growing factor per sweep), and the floor is where it is going
#: (Tipping's relevance vector machine prunes a basis function the same way).
PRUNE = 1e-6


class _VbState:
    """ICOV-VB's state (coef_u, V, Psi, sigma_j^2, sigma_y^2, sigma_u^2, sigma_v^2) as one unconstrained
    vector for SQUAREM: variances by their logs, each Psi_j by its Cholesky factor (log diagonal), so an
    extrapolated state is always a valid one. The latent variances are floored (:meth:`floored`)."""

    def __init__(self, coef_u, v, psi, s2, sy2, su2, sv2):
        self.fields = (coef_u, v, psi, s2, sy2, su2, sv2)
        self.shapes = (coef_u.shape, v.shape)
        d = v.shape[1]
        self.lower = torch.tril_indices(d, d, -1, device=v.device)
        self.d = d

    @staticmethod
    def floored(su2: float, sv2: torch.Tensor, s2: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Eqs 21-22's sigma_u^2 and sigma_v^2 (D,), floored at 1e-12 (sigma_v^2: of the typical noise):
        where the data have no shared error the factors are pruned towards 0, and unfloored they underflow
        until eq 19's 1 / sigma_v^2 overflows to NaN (seen at 50% missing entries). The typical noise is the
        mean noise, or the median where one far source drags the mean (:func:`~fedtrust.inference.tasks.
        typical`): a source of variance 1e24 beside four of 1e-4 held the factors at 1e12 by the mean, and
        through them its own weight at 3e-14 (0.03 per coordinate in the consensus at 1e12)."""
        return max(su2, 1e-12), sv2.clamp_min(1e-12 * typical(s2))

    def pack(self, coef_u, v, psi, s2, sy2, su2, sv2) -> torch.Tensor:
        chol = torch.linalg.cholesky(psi)
        diag = chol.diagonal(dim1=1, dim2=2).log()
        low = chol[:, self.lower[0], self.lower[1]]
        hyper = torch.cat([torch.tensor([sy2, su2], dtype=torch.float64, device=v.device), sv2]).log()
        parts = (coef_u, v, diag, low, s2.log(), hyper)
        return torch.cat([p.reshape(-1) for p in parts])

    def unpack(self, packed: torch.Tensor):
        (ushape, vshape), d = self.shapes, self.d
        j = vshape[0]
        sizes = [math.prod(ushape), math.prod(vshape), j * d, j * (d * (d - 1) // 2), j, 2 + d]
        coef_u, v, diag, low, log_s2, hyper = packed.split(sizes)
        chol = torch.diag_embed(diag.reshape(j, d).exp())
        chol[:, self.lower[0], self.lower[1]] = low.reshape(j, -1)
        sy2, su2, sv2 = float(hyper[0].exp()), float(hyper[1].exp()), hyper[2:].exp()
        s2 = log_s2.exp()
        su2, sv2 = self.floored(su2, sv2, s2)
        return coef_u.reshape(ushape), v.reshape(vshape), chol @ chol.mT, s2, sy2, su2, sv2


def icov_vb(
    estimates,
    mask=None,
    *,
    latent_dim: int = 2,
    noise: str = "per_source",
    max_iter: int = 1000,
    tol: float | None = None,
    seed: int = 0,
    source_keys=None,
    init: dict | None = None,
    past: IcovVbPast | None = None,
    ard: bool = True,
) -> InferenceResult:
    """ICOV-VB: priors y_i ~ N(0, sigma_y^2), u_i ~ N(0, sigma_u^2 I), v_j ~ N(0, sigma_v^2 I) on the latent
    model x_ij ~ N(y_i + u_i' v_j, sigma_j^2) (eq 8), one u per task and coordinate; mean-field
    q(y) q(U) q(V) fitted by block coordinate ascent on the free energy:

        q(y_i) = N(ybar_i, lambda_i)           eqs 14-15
        q(u_ik) = N(ubar_ik, Phi_i)            eqs 16-17
        q(v_j) = N(vbar_j, Psi_j)              eqs 18-19
        sigma_y^2, sigma_u^2, sigma_v^2, sigma^2   eqs 20-23

    noise: ``per_source`` (default) gives each source its own sigma_j^2, as Algorithm 2's
    Sigma = sigma_u^2 V V' + diag(sigma_j^2) does; eqs 14-23 then weight source j by 1/sigma_j^2 and
    eq 23 averages over I_j (the same step as IVAR's eq 13). ``shared`` is eqs 14-23 as printed, one
    sigma^2 for all: a source can then only look noisier than sigma^2 through a latent factor, and when
    noisy sources set sigma^2 the precise ones cannot be told apart.

    Eq 23 as printed pairs Psi_i with Phi_j; the expectation E[(u_ik' v_j)^2] it stands for is
    tr((Phi_i + ubar ubar')(Psi_j + vbar vbar')) (Phi belongs to the task, Psi to the source), used here.
    With ard=False every block update (eqs 14-23) maximises the free energy in its block, so it never
    decreases; with ARD the prior variances take MacKay's update (below), which may dip it in a sweep.

    The consensus is Algorithm 2's (line 3): the inverse-covariance weighting of eq 3 under the fitted
    Sigma = sigma_u^2 E[V V'] + diag(sigma_j^2), weights summing to 1 (a correlated source can get a
    negative one). The posterior mean ybar (eq 15) is in ``params["posterior_mean"]``: with one task and
    many coordinates the factors can absorb the common signal and shrink ybar towards 0, which the
    weighting is immune to (a common-mode term in Sigma leaves its weights unchanged). Which sources
    share an error is decided by :func:`centre_loadings`, with the sources counted by precision: the
    genuine parties of the paper's one-round task stay trusted when noisy adversaries outnumber them.
    Iterations stop when these coefficients are within ``tol`` of their fixed point (absolute,
    :func:`~fedtrust.inference.result.converged`; default :func:`~fedtrust._checks.stopping_tol` of the
    estimates' dtype), or after ``max_iter``.

    ard (default True): each latent dimension d has its own prior variance sigma_v^2_d (eq 22 per
    dimension: automatic relevance determination, Bishop's Bayesian PCA), so dimensions the data do not
    need are pruned (``PRUNE``) one by one; eq 22 as printed (``ard=False``) has one sigma_v^2 for all,
    which cannot switch one off: the spare dimensions then fit the honest sources' noise as correlations
    and eq 3's weights suffer (one colluding group of 5 among 12 sources: RMSE 1.2-1.4x the true
    covariance's at D = 2, 1.07-1.11x with ARD, as with D = 1; experiments/ivar_icov/collusion.py).
    Eq 22 per dimension, sigma_v^2_d = mean_j (Psi_j,dd + vbar_jd^2), moves an unneeded dimension towards
    0 by a factor of about 1 - gamma_d / J per sweep, where gamma_d = sum_j (1 - Psi_j,dd / sigma_v^2_d)
    counts the loadings the data determine (few, for such a dimension): thousands of sweeps. Its fixed
    point, rearranged, is MacKay's update sigma_v^2_d = sum_j vbar_jd^2 / gamma_d (MacKay 1992,
    "Bayesian interpolation", eq 4.22; Tipping 2001, eq 16 for the relevance vector machine), which has the
    same fixed points and reaches them in 3-6x fewer sweeps on the collusion data (e.g. 2735 -> 440, the
    same weights); ARD uses it.

    latent_dim: D. source_keys: ids seeding each source's starting factors. init: {"V", "Psi", "noise",
    "sigma_y2", "sigma_u2", "sigma_v2"} to warm-start. past: earlier tasks' statistics.
    """
    if noise not in ("per_source", "shared"):
        raise ValueError(f"icov_vb: noise must be 'per_source' or 'shared', got {noise!r}")
    _check_fit("icov_vb", latent_dim, max_iter, seed, init)
    ard = check_bool("icov_vb: ard", ard)
    t = as_tasks(estimates, mask)
    tol = resolve_tol(tol, t.x.dtype)
    sweep = _VbSweep(t, latent_dim, noise, ard, past)
    state = sweep.start(_keys("icov_vb", source_keys, t.shape[1]), seed, init or {})
    fit = squarem(sweep, state.pack(*state.fields), max_iter, tol)
    device = t.x.device  # the fit ran on the host: its results go where the data are
    state, lam, phi_u, alpha, sigma, now = fit.last.record
    coef_u, v, psi, s2, sy2, su2, sv2 = (x.to(device) if isinstance(x, torch.Tensor) else x for x in state)
    lam, phi_u, alpha, sigma, weights = (x.to(device) for x in (lam, phi_u, alpha, sigma, fit.last.weights))
    now = stats_on(now, device)
    return InferenceResult(
        estimator="icov_vb",
        consensus=weighted_sums(t, weights),
        noise=sigma.diagonal().clone(),
        weights=weights,
        trace=fit.trace,
        iterations=fit.iterations,
        converged=fit.converged,
        changes=list(fit.changes),
        tol=tol,
        params={
            "V": v,
            "Psi": psi,
            "U": torch.einsum("ijk,ijd->ikd", t.x, coef_u.to(t.x.dtype)),
            "Phi_u": phi_u,
            "lambda": lam,
            "Sigma": sigma,
            "posterior_mean": weighted_sums(t, alpha),
            "posterior_weights": alpha,
            "sigma2": s2,
            "sigma_y2": sy2,
            "sigma_u2": su2,
            "sigma_v2": sv2,
        },  # fmt: skip
        past=now,
    )


class _VbSweep:
    """ICOV-VB's sweep (eqs 14-23, then eq 3's weights) on one set of tasks, as the map SQUAREM iterates:
    ``sweep(packed state) -> Step``. Each block of the sweep is a method named for its equations."""

    def __init__(self, t, latent_dim: int, noise: str, ard: bool, past: IcovVbPast | None):
        # After one pass over the data (the Gram statistics, IVAR's starting noise) the sweeps run on the
        # host: (I, J, J) numbers, whose many scalar reads and small solves would each be a sync on a GPU.
        host = torch.device("cpu")
        gram = TaskGram.of(t)
        self.start_noise = mean_noise(t, gram).to(host)
        self.shape, self.d, self.noise, self.ard = t.shape, latent_dim, noise, ard
        self.past = None if past is None else stats_on(past, host)
        self.k = t.shape[2]
        self.m, self.mask, self.gram = t.m.to(host), t.mask.to(host), stats_on(gram, host)
        self.eye = torch.eye(latent_dim, dtype=torch.float64)
        # minus alpha: x - ybar
        self.to_residual = torch.eye(t.shape[1], dtype=torch.float64)[None]
        self.seen = self.m.sum(0) + (0 if past is None else self.past.mask.to(torch.float64).sum(0))
        self.active = self.seen > 0
        self.n_obs = float(self.seen.sum()) * self.k

    def start(self, keys: list, seed: int, init: dict) -> _VbState:
        """The starting state: IVAR's noise levels (or ``init``'s), the priors' variances from the data's
        spread, the loadings seeded by source key. ybar_i and the rows of U_i stay combinations of task
        i's estimates: ybar_i = sum_j alpha_ij x_ij, U_i = sum_j x_ij coef_u_ij', so the iterations run on
        the Gram matrices (one pass over the data)."""
        m, d = self.m, self.d
        tasks, sources, k = self.shape
        start = self.start_noise
        on = {"dtype": torch.float64, "device": m.device}
        if "noise" in init:
            given = torch.as_tensor(init["noise"], **on).clone()
            start = not_below_centre(torch.where(torch.isnan(given), start, given), self.gram, self.k)
        s2 = start if self.noise == "per_source" else torch.full_like(start, float(start.mean()))
        plain_sq = float(self.gram.sq_norm(m / m.sum(1, keepdim=True)).sum()) / (tasks * k)
        sy2 = float(init.get("sigma_y2", plain_sq + float(s2.mean())))
        su2 = float(init.get("sigma_u2", 1.0))
        sv2 = torch.as_tensor(init.get("sigma_v2", float(s2.mean()) / d), **on).expand(d).clone()
        v = (
            torch.as_tensor(init["V"], **on).clone()
            if "V" in init
            else latent_init(keys, d, seed, sv2.sqrt(), m.device)
        )
        psi = (
            torch.as_tensor(init["Psi"], **on).clone()
            if "Psi" in init
            else torch.diag(sv2).expand(sources, d, d).clone()
        )
        coef_u = torch.zeros(tasks, sources, d, dtype=torch.float64, device=m.device)
        self.state = _VbState(coef_u, v, psi, s2, sy2, su2, sv2)
        return self.state

    def __call__(self, packed: torch.Tensor) -> Step:
        """One sweep of eqs 14-23 from a state; the weights are eq 3's under the state it ends at."""
        coef_u, v, psi, s2, sy2, su2, sv2 = self.state.unpack(packed)
        lam, alpha, phi_u, coef_u, now = self.tasks(coef_u, v, psi, s2, sy2, su2)
        stats = now if self.past is None else now.cat(self.past)
        sm = stats.mask.to(torch.float64)
        v, psi = self.sources(stats, sm, v, psi, s2, sv2)
        sy2, su2, sv2, v, psi = self.priors(stats, v, psi, s2, sv2)
        err, s2 = self.noise_levels(stats, sm, v, psi, s2)
        energy = _icov_vb_free_energy(
            stats, sm, err, s2, sy2, su2, sv2, v, psi, self.active, lam, phi_u, self.k, self.d
        )
        sigma, a = icov_vb_weights(v, psi, s2, su2, self.active, self.mask)
        fields = (coef_u, v, psi, s2, sy2, su2, sv2)
        return Step(self.state.pack(*fields), a, energy / self.n_obs, (fields, lam, phi_u, alpha, sigma, now),
                    s2)  # fmt: skip

    def tasks(self, coef_u, v, psi, s2, sy2: float, su2: float):
        """q(y) (eqs 14-15) and q(U) (eqs 16-17) for every task, and the task statistics the source and
        prior updates read (:class:`IcovVbPast`)."""
        m, k, gram = self.m, self.k, self.gram
        w = m / s2  # (I, J): 1 / sigma_j^2 where source j reported on task i
        s_vec = w @ v  # (I, D): sum_j vbar_j / sigma_j^2
        lam = 1.0 / (1.0 / sy2 + w.sum(1))
        alpha = lam[:, None] * (w - torch.einsum("ijd,id->ij", coef_u, s_vec))  # ybar = lam (sum w x - U s)
        second_v = psi + v[:, :, None] * v[:, None, :]  # E[v v'] (J, D, D)
        phi_u = torch.linalg.inv(self.eye / su2 + torch.einsum("ij,jde->ide", w, second_v))
        wv = w[:, :, None] * v[None]  # (I, J, D)
        coef_u = torch.einsum("ijd,ide->ije", wv - alpha[:, :, None] * s_vec[:, None, :], phi_u)  # (17)
        utu = gram.form(coef_u, coef_u)  # U_i' U_i
        big_a = k * phi_u + utu
        b = (
            gram.form(coef_u, self.to_residual - alpha[:, :, None]).transpose(1, 2) * m[:, :, None]
        )  # U'(x - ybar)
        c = (gram.residuals(alpha, m) + k * lam[:, None]) * m
        yterm = k * lam + gram.sq_norm(alpha)
        uterm = k * phi_u.diagonal(dim1=1, dim2=2).sum(1) + utu.diagonal(dim1=1, dim2=2).sum(1)
        return lam, alpha, phi_u, coef_u, IcovVbPast(self.mask, big_a, b, c, yterm, uterm, k)

    def sources(self, stats, sm, v, psi, s2, sv2):
        """q(V): eqs 18-19, for the sources seen in this window (the others keep theirs)."""
        prior = torch.diag(1.0 / sv2)
        psi_new = torch.linalg.inv(prior + torch.einsum("pj,pde->jde", sm, stats.A) / s2[:, None, None])
        v_new = torch.einsum("jde,je->jd", psi_new, torch.einsum("pj,pjd->jd", sm, stats.b)) / s2[:, None]
        active = self.active
        return torch.where(active[:, None], v_new, v), torch.where(active[:, None, None], psi_new, psi)

    def priors(self, stats, v, psi, s2, sv2):
        """The prior variances sigma_y^2, sigma_u^2 (eqs 20-21) and sigma_v^2 (eq 22, or per dimension
        by MacKay's update with ARD, pruning the dimensions whose variance no longer matters)."""
        k, d, active, state = self.k, self.d, self.active, self.state
        n_tasks = len(stats.yterm)
        sy2 = float(stats.yterm.sum()) / (k * n_tasks)
        su2 = float(stats.uterm.sum()) / (d * k * n_tasks)
        if self.ard:  # eq 22's fixed point per dimension, rearranged as MacKay's update (see icov_vb)
            gamma = (1.0 - psi.diagonal(dim1=1, dim2=2)[active] / sv2).sum(0)
            sv2 = v[active].square().sum(0) / gamma.clamp_min(torch.finfo(torch.float64).tiny)
        else:
            sv2 = (psi.diagonal(dim1=1, dim2=2) + v.square())[active].mean().expand(d)  # E[v_jd^2]
        su2, sv2 = state.floored(su2, sv2, s2)
        if self.ard:  # a latent dimension whose variance no longer matters is pruned: set at its limit
            gone = su2 * sv2 < PRUNE * float(s2[active].mean())
            if bool(gone.any()):
                keep = (~gone).to(v.dtype)
                v = v * keep
                su2, sv2 = state.floored(su2, torch.where(gone, 0.0, sv2), s2)
                psi = psi * (keep[:, None] * keep[None, :]) + torch.diag(torch.where(gone, sv2, 0.0))
        return sy2, su2, sv2, v, psi

    def noise_levels(self, stats, sm, v, psi, s2):
        """Eq 23: each source's expected squared error (``err``, per task) and its noise variance
        sigma_j^2 (per source, or one shared)."""
        second_v = psi + v[:, :, None] * v[:, None, :]
        err = (
            stats.c
            - 2 * torch.einsum("pjd,jd->pj", stats.b, v)
            + torch.einsum("pde,jed->pj", stats.A, second_v)
        )
        spread = (sm * err).sum(0)
        if self.noise == "per_source":
            s2 = torch.where(self.active, spread / (self.k * self.seen).clamp_min(1), s2)
        else:
            s2 = torch.full_like(s2, float(spread.sum()) / self.n_obs)
        return err, s2


def icov_vb_weights(v, psi, s2, su2: float, active, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 2, line 3: inverse-covariance weighting (eq 3) under the fitted model's covariance
    Sigma = sigma_u^2 E[V V'] + diag(sigma_j^2), with E[v_j v_j'] = vbar_j vbar_j' + Psi_j. Returns
    (Sigma, the weights). The loadings are centred first, counting the sources by precision
    (:func:`centre_loadings`): the free energy barely sees their centre (it moves into y_i, under a prior
    of variance sigma_y^2), eq 3 does."""
    trace_psi = psi.diagonal(dim1=1, dim2=2).sum(1)
    vc = centre_loadings(v, active, s2 + su2 * trace_psi, su2)
    sigma = su2 * (vc @ vc.T + torch.diag(trace_psi)) + torch.diag(s2)
    return sigma, consensus_coefficients(sigma, mask)


def _icov_vb_free_energy(stats, sm, err, s2, sy2, su2, sv2, v, psi, active, lam, phi_u, k, d) -> float:
    """The variational free energy (expected log joint + entropy of q); earlier tasks' entropies are
    constants and left out. s2: (J,) noise variances."""
    n_tasks = len(stats.yterm)
    obs = -0.5 * float((sm * (k * (LOG2PI + s2.log()) + err / s2)).sum())
    prior_y = -0.5 * (k * n_tasks * (LOG2PI + math.log(sy2)) + float(stats.yterm.sum()) / sy2)
    prior_u = -0.5 * (d * k * n_tasks * (LOG2PI + math.log(su2)) + float(stats.uterm.sum()) / su2)
    second = (psi.diagonal(dim1=1, dim2=2) + v.square())[active]
    prior_v = -0.5 * float((len(second) * (LOG2PI + sv2.log()) + second.sum(0) / sv2).sum())
    h_y = 0.5 * k * float((LOG2PI + 1 + lam.log()).sum())
    h_u = 0.5 * k * float((d * (LOG2PI + 1) + torch.linalg.slogdet(phi_u)[1]).sum())
    h_v = 0.5 * float((d * (LOG2PI + 1) + torch.linalg.slogdet(psi[active])[1]).sum())
    return obs + prior_y + prior_u + prior_v + h_y + h_u + h_v
