"""Inverse-variance weighting (IVAR), maximum likelihood and variational Bayes.

Nguyen, Lim, Wynter, Cai, "Probabilistic Inference for Learning from Untrusted Sources" (papers/000):
source j's estimate of task i is x_ij ~ N(y_i, sigma_j^2 I) over K coordinates (Assumption 2 with a
diagonal Phi). ``past`` carries earlier tasks' sufficient statistics so a streaming caller (the
aggregators) re-estimates only the newest task while every source's noise uses its whole window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedtrust._checks import check_float, check_int, resolve_tol
from fedtrust.inference.accelerate import Step, squarem
from fedtrust.inference.result import InferenceResult, WeightChanges, converged
from fedtrust.inference.tasks import (
    TaskGram,
    TaskPasses,
    as_tasks,
    dragged_start,
    mean_noise,
    not_below_centre,
    stats_on,
    upper_median,
    weighted_sums,
)

LOG2PI = math.log(2 * math.pi)


@dataclass
class IvarPast:
    """Earlier tasks' contribution to each source's noise estimate (per coordinate):
    total: (J,) sum over those tasks of the source's mean squared residual (MLE) or of
    lambda_i + residual (VB); count: (J,) how many such tasks. tau_total / tau_count: the same for the
    VB prior variance tau^2 (sum of lambda_i + ||ybar_i||^2 / K over tasks, and their number)."""

    total: torch.Tensor
    count: torch.Tensor
    tau_total: float = 0.0
    tau_count: float = 0.0

    @staticmethod
    def empty(sources: int, device=None) -> IvarPast:
        z = torch.zeros(sources, dtype=torch.float64, device=device)
        return IvarPast(z, z.clone())


#: IVAR-MLE iterates by direct passes over the data from this many sources on; below, on the Gram.
#: Measured (benchmarks/aggregation.py shapes, 2 threads): a direct pass costs 0.9-1.5 floors, the Gram
#: 4-9 floors at J = 10-20 (thin GEMMs run far below peak) and grows with J; IVAR-MLE takes 3-5 iterations.
DIRECT_MIN_SOURCES = 12


def start_noise(t, init_noise, gram: TaskGram | TaskPasses | None = None) -> torch.Tensor:
    """Starting sigma_j^2: ``init_noise`` where given (NaN = unknown; at least the distance to a robust
    centre: :func:`~fedtrust.inference.tasks.not_below_centre`), else the distance to the centre
    (:func:`~fedtrust.inference.tasks.mean_noise`). Given, it is checked on the host and returned there
    (the iterations run there)."""
    if init_noise is None:
        return mean_noise(t, gram)
    given = torch.as_tensor(init_noise, dtype=torch.float64).to("cpu", copy=True).reshape(-1)
    if len(given) != t.shape[1]:
        raise ValueError(f"init_noise needs one variance per source ({t.shape[1]}), got {len(given)}")
    unknown = torch.isnan(given)
    valid = (given > 0) & (given < math.inf) | unknown
    if not bool(valid.all()):
        bad = int(torch.nonzero(~valid)[0])
        raise ValueError(f"init_noise[{bad}] = {float(given[bad])!r}: a starting variance is > 0 and finite "
                         "(NaN: unknown)")  # fmt: skip
    if unknown.any():
        given[unknown] = mean_noise(t, gram).to(given.device)[unknown]
    return not_below_centre(given, gram, t.shape[2])


def ivar_mle(
    estimates,
    mask=None,
    *,
    max_iter: int = 200,
    tol: float | None = None,
    eps: float = 1e-12,
    init_noise=None,
    past: IvarPast | None = None,
) -> InferenceResult:
    """IVAR-MLE (Algorithm 1): alternate

        y_i = sum_j x_ij / sigma_j^2 / sum_j 1 / sigma_j^2                        (eq 6)
        sigma_j^2 = max(floor, 1 / (K |I_j|) sum_{i in I_j} ||y_i - x_ij||^2)      (eq 7, Algorithm 1 line 3)

    until the weights w_ij = (1 / sigma_j^2) / sum_j' 1 / sigma_j'^2 of eq 6 are within ``tol`` of their
    fixed point (absolute, :func:`~fedtrust.inference.result.converged`; default
    :func:`~fedtrust._checks.stopping_tol` of the estimates' dtype), or ``max_iter`` iterations. Each step
    maximises the likelihood in its block, so the trace never decreases (except where the estimate
    switches, below). Starts from the plain mean unless ``init_noise`` (J,) is given (NaN entries: unknown
    sources).

    **The degenerate solution.** The joint likelihood in (y, sigma) is unbounded: the consensus can sit on
    one source, whose residual and variance then go to 0 (Neyman & Scott's incidental-parameter problem;
    with two sources eq 6-7's fixed point w = 1/2 is unstable, so the iteration collapses whenever too few
    sources share the best noise level, and missing entries make it likelier). The floor is scale-aware:
    ``eps`` times the upper median over sources of their mean squared distance to the first consensus (the
    plain mean's unless ``init_noise`` is given; the upper one: with two sources the lower is the one a
    collapse takes to 0). A source whose variance reaches it is the degeneracy, not a perfect source: the
    iteration restarts from its first step (a starting variance at the floor, warm-started from an earlier
    collapse, from the plain mean's distance) with eq 7 corrected by the consensus' own
    variance, sigma_j^2 = 1 / (K |I_j|) sum_i (||y_i - x_ij||^2 + K lambda_i), lambda_i = (sum_j 1 /
    sigma_j^2)^-1: the EM update of the likelihood with y integrated out under a flat prior (IVAR-VB's eq
    13 with tau^2 -> infinity), which is bounded (E||y_i - x_ij||^2 = sigma_j^2 - lambda_i, so eq 7 alone
    under-estimates exactly the sources the consensus leans on). ``params["degenerate"]`` then says which
    source reached the floor and that the estimate switched.

    With few sources, or when the tasks come with their Gram statistics (``t.gram``: an aggregation rule's
    grouping pass took them), the iterations run on the tasks' Gram matrices (:class:`TaskGram`: one pass
    over the data, then O(J^2) per iteration) and the consensus is formed once at the end; with many
    (``DIRECT_MIN_SOURCES``) each iteration is one fused pass (:class:`TaskPasses`), which also forms the
    consensus: one pass per iteration (and one more when some given starting noise is unknown). With many
    sources and a given Gram, once a residual is unresolved by it (:meth:`TaskGram.unresolved`: the
    consensus nears a source, as in the collapse below) the iterations go on by passes, whose residuals
    are exact where the floor test needs them. Either
    way the iterations' arithmetic on I x J numbers runs on the host, where its scalar reads are free (on
    a GPU each was a sync: 3 an iteration, 214 syncs and 4,277 launches on a 66-iteration round), and the
    results go back where the data are.
    """
    max_iter = check_int("ivar_mle: max_iter", max_iter, minimum=1)
    eps = check_float("ivar_mle: eps", eps, minimum=0.0, strict_min=True)
    t = as_tasks(estimates, mask)
    _, sources, k = t.shape
    device, host = t.x.device, torch.device("cpu")
    m = t.m.to(host)
    direct = sources >= DIRECT_MIN_SOURCES  # residuals by exact passes (or a given Gram while resolved)
    gram = TaskPasses(t) if direct and t.gram is None else TaskGram.of(t)
    tol = resolve_tol(tol, t.x.dtype)
    past = stats_on(past or IvarPast.empty(sources), host)
    if init_noise is not None:
        first = start_noise(t, init_noise, gram).to(host)
    elif (robust := dragged_start(t, gram)) is not None:  # a far source drags the plain mean
        first = robust.to(host)
    else:
        first = torch.ones(sources, dtype=torch.float64)
    if isinstance(gram, TaskGram):
        gram = stats_on(gram, host)
    count = m.sum(0) + past.count
    if sources == 1:
        return _lone_source(t, past, count, tol)
    floor = None
    noise = first
    trace: list[float] = []
    changes = WeightChanges()
    for it in range(1, max_iter + 1):
        weights = m / noise
        weights = weights / weights.sum(1, keepdim=True)
        changes.add(weights, noise)
        r = gram.residuals(weights, m)
        if direct and isinstance(gram, TaskGram) and gram.unresolved(r, weights, m):
            gram = TaskPasses(t)  # the consensus nears a source: its residual by a pass, exactly
            r = gram.residuals(weights, m)
        r = r / k
        update = (r.sum(0) + past.total) / count.clamp_min(1)
        if floor is None:  # the first consensus (the plain mean, or the given noise's): the data's scale
            floor = eps * max(upper_median(update[count > 0]), torch.finfo(torch.float64).tiny)
        noise = torch.where(count > 0, update.clamp_min(floor), noise)
        if it == 1:
            start = noise
        # mean log-likelihood per observed value, past tasks included (they depend on sigma too)
        ll = -0.5 * ((count * (LOG2PI + noise.log())).sum() + ((r.sum(0) + past.total) / noise).sum())
        trace.append(float(ll / count.sum()))
        if bool(((update <= floor) & (count > 0)).any()) and it < max_iter:
            return _degenerate(t, m, gram, start, past, max_iter, tol, it, floor, update)
        if converged(changes, tol):
            break
    weights = weights.to(device)
    consensus = gram.combination if isinstance(gram, TaskPasses) else weighted_sums(t, weights)
    return InferenceResult(
        estimator="ivar_mle",
        consensus=consensus,
        noise=noise.to(device),
        weights=weights,
        trace=trace,
        iterations=it,
        converged=converged(changes, tol),
        changes=list(changes),
        tol=tol,
        past=stats_on(IvarPast(r.sum(0), m.sum(0)), device),
    )


def _lone_source(t, past, count, tol) -> InferenceResult:
    """One source is its own consensus (weight 1 wherever it reports). Its residual is 0 by construction,
    which says nothing about its noise: the noise is its window's estimate (NaN, unknown, without one),
    and the round adds nothing to the window (``past.count`` 0: a zero residual counted would make the
    source look precise later)."""
    weights = t.m.to(torch.float64)
    noise = torch.where(past.count > 0, past.total / past.count.clamp_min(1), math.nan)  # (on the host)
    ll = -0.5 * ((count * (LOG2PI + noise.log())).sum() + (past.total / noise).sum())
    return InferenceResult(
        estimator="ivar_mle",
        consensus=weighted_sums(t, weights),
        noise=noise.to(weights.device),
        weights=weights,
        trace=[float(ll / count.sum().clamp_min(1))],
        iterations=0,
        converged=True,
        tol=tol,
        past=IvarPast.empty(1, t.x.device),
    )


def _degenerate(t, m, gram, first, past, max_iter, tol, it, floor, update) -> InferenceResult:
    """IVAR-MLE from its degenerate solution on: the flat-prior EM from the first consensus, with the
    iterations left, and the reason in ``params["degenerate"]`` (iterating on the host, as ivar_mle:
    ``m`` the mask there, the results moved to the data's device)."""
    device = t.x.device
    seen = (m.sum(0) + past.count) > 0
    j = int(torch.argmin(torch.where(seen, update, math.inf)))
    reason = (
        f"ivar_mle: source {j}'s noise variance reached the floor ({floor:.3g}: eps times the upper median "
        f"squared distance to the first consensus) at iteration {it}, the joint likelihood's degenerate "
        "solution (all trust on one source); switched to the flat-prior estimate (eq 7 plus the "
        "consensus' own variance)"
    )
    # a starting variance at the floor (warm-started from a collapse) would hold the EM there: the plain
    # mean's distance instead
    if bool((first <= floor).any()):  # (the plain mean's distances cost a pass on the direct path)
        first = torch.where(first <= floor, mean_noise(t, gram).to(first.device), first)
    fit = _em(m, t.shape[2], gram, first, None, past, max_iter - it, tol)
    lam, _, spread, noise, _, weights = fit.last.record
    weights = weights.to(device)
    return InferenceResult(
        estimator="ivar_mle",
        consensus=weighted_sums(t, weights),
        noise=noise.to(device),
        weights=weights,
        trace=fit.trace,  # the objective of the estimate returned (eq 6-7's path ended in the collapse)
        iterations=it + fit.iterations,
        converged=fit.converged,
        changes=list(fit.changes),
        tol=tol,
        params={"degenerate": reason, "lambda": lam.to(device)},
        past=stats_on(IvarPast(spread, m.sum(0)), device),
    )


def ivar_vb(
    estimates,
    mask=None,
    *,
    max_iter: int = 200,
    tol: float | None = None,
    init_noise=None,
    tau2: float | None = None,
    past: IvarPast | None = None,
) -> InferenceResult:
    """IVAR-VB: prior y_i ~ N(0, tau^2) per coordinate; block coordinate ascent on the free energy by

        lambda_i = (1 / tau^2 + sum_{j in J_i} 1 / sigma_j^2)^-1                   (eq 10)
        ybar_i = lambda_i sum_{j in J_i} x_ij / sigma_j^2                          (eq 11)
        tau^2 = 1 / (I K) sum_i (K lambda_i + ||ybar_i||^2)                        (eq 12)
        sigma_j^2 = 1 / (K |I_j|) sum_{i in I_j} (K lambda_i + ||x_ij - ybar_i||^2)  (eq 13)

    (tau^2 and sigma_j^2 shared by the K coordinates, as sigma_j^2 is in Assumption 2). q(y_i) =
    N(ybar_i, lambda_i) is the exact posterior given tau^2 and sigma^2; the consensus is its mean. The
    free energy never decreases. Stops when the weights lambda_i / sigma_j^2 of eq 11 are within ``tol``
    of their fixed point (absolute, :func:`~fedtrust.inference.result.converged`; default
    :func:`~fedtrust._checks.stopping_tol` of the estimates' dtype), or after ``max_iter``. ``tau2``
    fixes the starting prior variance (default: fitted from the plain mean). Like :func:`ivar_mle` it
    iterates on the Gram matrices: two passes over the data. The iterations run on the host (J x J
    numbers; on a GPU each of their scalar reads would be a sync), the same code on every device; the
    consensus is formed where the data are.
    """
    max_iter = check_int("ivar_vb: max_iter", max_iter, minimum=1)
    if tau2 is not None:
        tau2 = check_float("ivar_vb: tau2", tau2, minimum=0.0, strict_min=True)
    t = as_tasks(estimates, mask)
    tasks, sources, k = t.shape
    device, host = t.x.device, torch.device("cpu")
    gram = TaskGram.of(t)
    tol = resolve_tol(tol, t.x.dtype)
    noise = start_noise(t, init_noise, gram).to(host)
    gram, m = stats_on(gram, host), t.m.to(host)
    past = stats_on(past or IvarPast.empty(sources), host)
    if tau2 is None:
        tau2 = float(gram.sq_norm(m / m.sum(1, keepdim=True)).sum()) / (tasks * k) + float(noise.mean())
    fit = _em(m, k, gram, noise, tau2, past, max_iter, tol)
    lam, ysq, spread, noise, tau2, weights = fit.last.record
    return InferenceResult(
        estimator="ivar_vb",
        consensus=weighted_sums(t, weights.to(device)),
        noise=noise.to(device),
        weights=weights.to(device),
        trace=fit.trace,
        iterations=fit.iterations,
        converged=fit.converged,
        changes=list(fit.changes),
        tol=tol,
        params={"tau2": tau2, "lambda": lam.to(device)},
        past=stats_on(IvarPast(spread, m.sum(0), float((lam + ysq).sum()), float(tasks)), device),
    )


def _em(m, k: int, gram, noise, tau2: float | None, past: IvarPast, max_iter: int, tol: float):
    """IVAR-VB's updates (eqs 10-13) under SQUAREM (:mod:`~fedtrust.inference.accelerate`), on the state
    (log sigma_j^2, log tau^2), for the (I, J) observation mask ``m`` of tasks of ``k`` coordinates.
    ``tau2=None`` is the flat prior (1 / tau^2 = 0, never updated): the EM for the likelihood with y
    integrated out, which IVAR-MLE switches to at its degenerate solution."""
    tasks = m.shape[0]
    count = m.sum(0) + past.count
    seen = count > 0
    tau_count = tasks + past.tau_count
    flat = tau2 is None

    def update(state: torch.Tensor) -> Step:
        noise = used = state[:-1].exp()
        prior = 0.0 if flat else float(torch.exp(-state[-1]))
        precision = m / noise
        lam = 1.0 / (prior + precision.sum(1))  # (10)
        weights = lam[:, None] * precision  # (11): ybar_i = sum_j weights_ij x_ij
        r = gram.residuals(weights, m) / k
        spread = (m * (lam[:, None] + r)).sum(0)
        noise = torch.where(seen, (spread + past.total) / count.clamp_min(1), noise)  # (13)
        if flat:
            ysq, tau2 = None, math.inf
            energy = _ivar_free_energy(lam, None, spread, noise, None, count, 0.0, past)
        else:
            ysq = gram.sq_norm(weights) / k
            tau2 = float(((lam + ysq).sum() + past.tau_total) / tau_count)  # (12)
            energy = _ivar_free_energy(lam, ysq, spread, noise, tau2, count, tau_count, past)
        log_tau2 = torch.tensor([0.0 if flat else math.log(tau2)], dtype=noise.dtype, device=noise.device)
        state = torch.cat([noise.log(), log_tau2])
        return Step(state, weights, energy / float(count.sum() + (0.0 if flat else tau_count)),
                    (lam, ysq, spread, noise, tau2, weights), used)  # fmt: skip

    start = torch.cat(
        [noise.log(), torch.tensor([0.0 if flat else math.log(tau2)], dtype=noise.dtype, device=noise.device)]
    )
    return squarem(update, start, max_iter, tol)


def _ivar_free_energy(lam, ysq, spread, noise, tau2, count, tau_count, past) -> float:
    """Free energy per coordinate (divide by K for the exact value): the expected log joint minus the
    expected log q. Observations: -1/2 (log 2 pi sigma_j^2 + (r_ij + lambda_i) / sigma_j^2); prior:
    -1/2 (log 2 pi tau^2 + (ybar^2 + lambda_i) / tau^2); entropy of q(y_i): 1/2 log 2 pi e lambda_i.
    Earlier tasks enter through their statistics (their own entropy is a constant)."""
    obs = -0.5 * ((count * (LOG2PI + noise.log())).sum() + ((spread + past.total) / noise).sum())
    if tau2 is None:  # the flat prior: no prior term
        return float(obs) + 0.5 * float((LOG2PI + 1 + lam.log()).sum())
    prior = -0.5 * (
        tau_count * (LOG2PI + math.log(tau2)) + (float((lam + ysq).sum()) + past.tau_total) / tau2
    )
    entropy = 0.5 * float((LOG2PI + 1 + lam.log()).sum())
    return float(obs) + prior + entropy
