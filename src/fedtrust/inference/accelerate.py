"""SQUAREM: extrapolated fixed-point iteration for the estimators' EM-like updates.

Varadhan & Roland 2008, "Simple and globally convergent methods for accelerating the convergence of
any EM algorithm" (Scand. J. Statist. 35), scheme S3. From theta_0, two plain updates give theta_1 and
theta_2; with r = theta_1 - theta_0 and v = theta_2 - 2 theta_1 + theta_0 the step
theta' = theta_0 - 2 alpha r + alpha^2 v, alpha = -||r|| / ||v|| (at most -1; alpha = -1 is theta_2)
jumps along the slowly converging direction, and one plain update from theta' stabilises it. The jump
is kept only if the objective (the likelihood or free energy) is at least theta_2's; else the iteration
goes on from theta_2. Every plain update raises that objective except ICOV-VB's with ARD (its default),
whose MacKay prior update can lower the free energy by hundreds of nats in a sweep (a paper review measured
-240 -> -874 on a table whose free energy is about -220): there the test only keeps a jump no worse than
two plain updates, and the trace is no certificate of ascent. Block coordinate ascent on these models
converges linearly at a rate near 1 when sources are few or alike (IVAR-VB: ~0.99 on a 5 x 5 table);
the jump cuts the iterations several-fold and never costs more than one update per cycle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedtrust.inference.result import WeightChanges, converged


@dataclass
class Step:
    """One plain update from a state: the next state, the weights the update used (those of the
    input state), the objective at the next state, and whatever the estimator needs to finish."""

    state: torch.Tensor
    weights: torch.Tensor
    objective: float
    record: Any = None
    #: the (J,) noise variances the weights were computed from, for their sources' distances
    #: (:class:`~fedtrust.inference.result.WeightChanges`)
    noise: torch.Tensor | None = None


@dataclass
class Iterated:
    last: Step
    iterations: int
    changes: WeightChanges
    trace: list[float] = field(default_factory=list)
    #: Whether the weights are within the tolerance of their fixed point (:func:`converged`), judged on
    #: plain steps only: not where the last changes are a jump and its transient (:data:`AFTER_JUMP`)
    converged: bool = False


#: Plain steps after a SQUAREM jump before its changes can tell convergence: the jump leaves the fast
#: directions far from their fixed point and the slow ones near it, so the first plain steps shrink fast and
#: look converged while the slow direction still has its way to go; the third is judged with the second.
AFTER_JUMP = 3


@contextlib.contextmanager
def one_thread():
    """Run the block on one CPU thread: the estimators' iterations after their pass over the data are
    many small (J x J) operations, which gain nothing from threads and, on a machine busier than its
    cores, lose 5-10x to threads waiting for each other (ICOV-MLE's digits demo run: 28 s on 2 threads
    beside two busy processes on 2 cores, 5.5 s on one; 3.7 s and 3.5 s on an idle machine). torch's
    thread count is global to the process: restored when the block ends."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def squarem(
    update: Callable[[torch.Tensor], Step], state: torch.Tensor, max_iter: int, tol: float
) -> Iterated:
    """Iterate ``update`` (states are unconstrained vectors, e.g. log-variances) with SQUAREM jumps until
    the weights are within ``tol`` of their fixed point (:func:`converged`, judged on consecutive plain
    updates only, never on the two right after a jump alone) or ``max_iter`` updates have run (a rejected
    jump counts as one), on one thread (:func:`one_thread`)."""
    with one_thread():
        return _squarem(update, state, max_iter, tol)


def _squarem(
    update: Callable[[torch.Tensor], Step], state: torch.Tensor, max_iter: int, tol: float
) -> Iterated:
    changes, trace = WeightChanges(), []
    done, since_jump = 0, AFTER_JUMP

    def plain(s: torch.Tensor) -> Step:
        nonlocal done, since_jump
        done += 1
        since_jump += 1
        out = update(s)
        changes.add(out.weights, out.noise)
        trace.append(out.objective)
        return out

    def settled() -> bool:  # judged on plain steps past a jump's transient only (AFTER_JUMP)
        return since_jump >= AFTER_JUMP and converged(changes, tol)

    def end(step: Step) -> Iterated:  # (the limit may end it right after a jump: not a verdict then)
        return Iterated(step, done, changes, trace, settled())

    theta = state
    step0 = plain(theta)
    while True:
        if settled() or done >= max_iter:
            return end(step0)
        step1 = plain(step0.state)
        if done >= max_iter or settled():
            return end(step1)
        if since_jump < AFTER_JUMP and converged(changes, tol):
            # the two changes since a jump are its transient (AFTER_JUMP; IVAR-MLE's flat-prior
            # estimate: "converged" at a weight of 0.976, its fixed point 0.987). One more plain step:
            # judged on it and the last, at the loop's top, with no jump in between.
            theta = step1.state
            step0 = plain(theta)
            continue
        r = step0.state - theta
        v = step1.state - step0.state - r
        vn = float(v.norm())
        alpha = min(-float(r.norm()) / vn, -1.0) if vn > 0 else -1.0
        last = step1
        if alpha < -1.0:
            candidate = theta - 2 * alpha * r + alpha * alpha * v
            if bool(torch.isfinite(candidate).all()):
                done += 1
                try:
                    tried = update(candidate)
                # the jump left the model's domain (a variance at 0, a covariance no longer positive
                # definite): not taken
                except (ArithmeticError, torch.linalg.LinAlgError):
                    tried = None
                if (
                    tried is not None
                    and bool(torch.isfinite(tried.state).all())
                    and tried.objective >= step1.objective
                ):
                    changes.add(tried.weights, tried.noise)  # a jump, not a plain step: judged on the next
                    trace.append(tried.objective)
                    last, since_jump = tried, 0
        if done >= max_iter:
            return end(last)
        theta = last.state
        step0 = plain(theta)
