"""What every truth-inference estimator returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


class ConvergenceWarning(UserWarning):
    """An estimator stopped at its iteration limit before its weights converged (the message is
    :attr:`InferenceResult.warning`: by how much they still moved, and what to change)."""


@dataclass
class InferenceResult:
    """consensus:  (I, K) the inferred ground truth of each task (a posterior mean for the VB methods).
    noise:      (J,) each source's noise variance (for ICOV: its marginal variance, latent part included).
    weights:    (I, J) each source's coefficient in each task's consensus (0 where it did not report). Rows
                sum to 1 for the MLE methods, to less than 1 for VB (the prior shrinks towards 0); ICOV
                coefficients can be negative (a correlated source is partly subtracted).
    trace:      the objective after each iteration (mean log-likelihood per observed value for MLE, the
                variational free energy per observed value for VB).
    iterations: how many iterations ran (at most the estimator's ``max_iter``).
    converged:  whether the weights are within ``tol`` of their fixed point (:func:`converged`).
    changes:    per iteration from the second on, the largest absolute change of a weight since the
                previous iteration: what convergence is judged on.
    tol:        the tolerance it was judged against (by default :func:`fedtrust._checks.stopping_tol` of
                the estimates' dtype).
    params:     the other fitted quantities (tau2, V, sigma_u2, ...).
    past:       sufficient statistics of these tasks, for a later call's ``past=`` (streaming use).
    estimator:  the estimator's name ("ivar_mle", ...), for messages.
    """

    consensus: torch.Tensor
    noise: torch.Tensor
    weights: torch.Tensor
    trace: list[float]
    iterations: int
    converged: bool
    changes: list[float] = field(default_factory=list)
    tol: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)
    past: Any = None
    estimator: str = "estimator"

    @property
    def warning(self) -> str | None:
        """None when converged; else what a user must read: the estimator stopped at its iteration
        limit, how far its weights still moved, and what to change."""
        if self.converged:
            return None
        if not self.changes:
            moved = "the first iteration's change is unknown"
        elif self.changes[-1] > self.tol:
            moved = f"the last iteration moved a weight by {self.changes[-1]:.3g}, above tol {self.tol:.3g}"
        else:  # within tol, but shrinking too slowly for the rest of the way to be (see converged)
            moved = (
                f"the last iteration moved a weight by {self.changes[-1]:.3g}, within tol {self.tol:.3g}, "
                "but too slowly shrinking changes leave the rest of the way to the fixed point above it"
            )
        return (
            f"{self.estimator} stopped at its iteration limit ({self.iterations} iterations) without "
            f"converging: {moved}. The results may still move; raise max_iter or loosen tol."
        )

    @property
    def reliability(self) -> torch.Tensor:
        """(J,) precision 1 / noise: how much a source is trusted per unit of its estimate."""
        return 1.0 / self.noise


class WeightChanges(list):
    """Per iteration from the second on, the largest change of a weight since the iteration before,
    scaled by how far its source is: what convergence is judged on. The weights of a task sum to ~1
    (ICOV's can be negative, VB's shrink), so an absolute change is meaningful whatever the estimates'
    scale: a change of c in source j's weight moves task i's consensus by c ||x_ij - y_i|| (the weights
    keep summing to 1). A source far beyond the others moves it by far more than the same change of a
    near one: a client that sends one coordinate of 1e18 gets a precision weight near 0 by eq 6, but a
    weight of 1e-9 (well within float32's tol of 0) still puts 1e9 into the consensus. So a change counts
    times the source's distance in units of the typical source's, sqrt(sigma_j^2 / sigma_med^2) from the
    noise variances the weights were computed from (``noise``; at least 1, the upper median the unit):
    the weights are then within ``tol`` of their fixed point in what they do to the consensus, measured
    in typical distances, and a source no farther than the typical one counts as before."""

    def __init__(self) -> None:
        super().__init__()
        self._recent: deque[torch.Tensor] = deque(maxlen=FLOOR_STEPS + 1)
        #: How far the weights moved over the last ``FLOOR_STEPS`` changes together (scaled as each change
        #: is), None before there were that many: at the rounding floor they jitter in place, along a slow
        #: tail they keep going one way (:func:`converged`).
        self.drift: float | None = None
        #: The same over the last ``FLOOR_STEPS // 2`` changes: a tail that steps back once (the transient
        #: after a SQUAREM jump) and then goes steadily on has its full window's drift cancelled in part.
        self.half_drift: float | None = None

    def add(self, weights: torch.Tensor, noise: torch.Tensor | None = None) -> None:
        """Record this iteration's weights (the change from the last ones, from the second call on), and
        the (J,) noise variances they were computed from, if any, for their sources' distances."""
        scale = 1.0 if noise is None else reach(noise).to(weights)
        if self._recent:
            self.append(float(((weights - self._recent[-1]).abs() * scale).max()))
        self._recent.append(weights)
        if len(self._recent) == self._recent.maxlen:
            self.drift = float(((weights - self._recent[0]).abs() * scale).max())
            self.half_drift = float(((weights - self._recent[-1 - FLOOR_STEPS // 2]).abs() * scale).max())


def reach(noise: torch.Tensor) -> torch.Tensor:
    """(J,) each source's distance in units of the typical source's, sqrt(sigma_j^2 / sigma_med^2), at
    least 1 (the upper median of the finite, positive variances the unit; all ones when there is none)."""
    noise = noise.detach().double()
    usable = noise[torch.isfinite(noise) & (noise > 0)]
    if usable.numel() == 0:
        return torch.ones_like(noise)
    unit = usable.sort().values[usable.numel() // 2]
    ratio = noise / unit  # a source of infinite (or undefined) noise has weight 0 and moves nothing: 1
    return torch.where(torch.isfinite(ratio), ratio, 1.0).clamp_min(1.0).sqrt()


def converged(changes: list[float], tol: float) -> bool:
    """The weights are within ``tol`` (absolute, a far source's change scaled by its distance:
    :class:`WeightChanges`) of where the iterations are heading: the last change
    is at most ``tol``, and so is the rest of the way, c rho / (1 - rho) for a geometric tail at the
    rate rho = c_k / c_(k-1) of the last two changes. A slow iteration (rho near 1, as VB's often is)
    moves little per step yet is far from its fixed point: the last change alone would stop it early.
    At the rounding floor the changes stop shrinking: they hover at the level the data's rounding puts on
    the weights (the largest of many jitters, so steadily, not by chance; ICOV-VB's sit at a third of the
    float64 default for ``FLOOR_STEPS`` iterations and more). A slow geometric tail shrinks at every step;
    the floor does not: ``FLOOR_STEPS`` changes all within ``tol`` of which some grew or stayed equal are
    the floor, and the weights are as settled as the data can say. (Equal: weights that flip between two
    neighbouring floats move by the same amount every step. IVAR-VB warm-started at its own fixed point,
    50 sources x 1e5 coordinates, moved by 8.33e-17 at each of 200 iterations, against a tol of 7.6e-6,
    and reported that it had not converged.) Small changes that do not shrink are also what a tail too
    slow to show its rate looks like, so the floor needs the weights to stay in place as well: over the
    ``FLOOR_STEPS`` changes they moved at most ``FLOOR_DRIFT`` of the changes' sum (``changes.drift``,
    kept by :class:`WeightChanges`), and so over the last half of them (``changes.half_drift``).
    IVAR-MLE's flat-prior estimate, its steps hovering at 1.1e-6 but going one way, had stopped as
    "converged" with a weight of 0.983, its fixed point 0.987
    (``test_a_fit_that_says_it_converged_is_within_its_tolerance_of_its_fixed_point``). On an Intel
    AVX-512 CPU the same fit's window held a jump's transient, one step back of 2.2e-6, then seven
    steps of 9.1e-7 one way: a drift of 0.49 of the sum over all eight, and it stopped at 0.96245, its
    fixed point 0.96313; over the last four the drift is their whole sum. The objective is not the
    test: near its maximum it is flat, so a relative change of it below the data's rounding says
    nothing about the weights and is reached, or not, by chance."""
    if len(changes) < 2 or changes[-1] > tol:
        return False
    last, before = changes[-1], changes[-2]
    if last == 0.0:
        return True
    if last < before and last * last / (before - last) <= tol:  # c rho / (1 - rho), rho = last / before
        return True
    window = changes[-FLOOR_STEPS:]
    drift = getattr(changes, "drift", None)  # (a plain list of changes says nothing of it)
    half = getattr(changes, "half_drift", None)
    return (
        len(window) == FLOOR_STEPS
        and max(window) <= tol
        and any(b >= a for a, b in zip(window, window[1:], strict=False))
        and (drift is None or drift <= FLOOR_DRIFT * sum(window))
        and (half is None or half <= FLOOR_DRIFT * sum(window[-(FLOOR_STEPS // 2) :]))
    )


#: How many consecutive changes within tol, not all shrinking, tell the rounding floor (see converged).
FLOOR_STEPS = 8
#: ... provided the weights moved, over those steps together, at most this fraction of the steps' sum: in
#: place, not one way (steady steps move them about their sum; jitter about 1 / sqrt(FLOOR_STEPS) of it,
#: weights flipping between two floats not at all).
FLOOR_DRIFT = 0.5
