"""What a rule reports beside its aggregate, and what the server hands a rule beside the updates: the
two contracts DESIGN's core contract leaves open, written down as types.

:class:`Info` is ``Aggregate.info``: a dictionary whose keys are all optional and each mean one thing
across the rules (``tests/test_rule_contract.py`` runs every built-in rule on clean, malformed and
identical rounds and checks it emits only these keys, with these types). A rule written outside
fedtrust may add keys of its own; the simulator's round records keep the JSON-friendly ones
(:func:`fedtrust.server.json_info`).

:class:`Reference` is ``Round.reference``: the server's trusted benchmark as a loss function.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypedDict, runtime_checkable

import torch

__all__ = ["Info", "Reference", "SybilGroup"]


class SybilGroup(TypedDict):
    """Clients whose updates this round were one source (:mod:`fedtrust.aggregators.sybils`)."""

    clients: list[Hashable]
    reason: str


# "lambda" is a Python keyword: a key the class syntax cannot declare
_Keywords = TypedDict("_Keywords", {"lambda": float}, total=False)


class Info(_Keywords, total=False):
    """``Aggregate.info``: every key optional.

    Every rule (the front door, :mod:`~fedtrust.aggregators.screening`):

    - ``quarantined``: client id -> why its update was set aside (weight 0).
    - ``clients``: name -> (n,) tensor aligned with the round's clients, NaN where quarantined (a
      distance, a score, a noise level, a credibility: each rule's docstring names its own).

    Iterative fits (the geometric median, IVAR/ICOV, FedAG's base rule):

    - ``iterations``, ``converged``: the iterations run and whether the stopping rule was met within
      ``max_iter``.
    - ``warning``: set only when it was not: the estimator, the iterations and the remedy.
    - ``objective``, ``trace``: the fitted objective, and its value after each iteration.
    - ``tol``, ``last_step``: the stopping tolerance and the last change it was compared with.

    Trust estimators (IVAR, ICOV, ARFL, FOCUS, FoolsGold):

    - ``groups``: the near-duplicate groups that shared one vote (:class:`SybilGroup`).
    - ``degenerate``: why the fit has nothing to weigh or hit a known degenerate solution, and what
      the rule did instead.
    - ``fallback``: why the ICOV fit broke down and which IVAR estimator replaced it this round.
    - ``coefficient_sum``: the sum of eq 3's consensus coefficients before they became trust weights
      (1 but for rounding; negative coefficients are possible under ICOV).
    - ``tau2`` (IVAR-VB), ``sigma_u2``, ``sigma_y2``, ``sigma_v2`` (ICOV): the fitted prior variances,
      ``sigma_v2`` one per latent dimension.
    - ``lambda``, ``p`` (ARFL): the regulariser and the number of clients it keeps.

    Byzantine-budget rules (Krum, Multi-Krum, Bulyan, trimmed mean, DnC):

    - ``f``: the Byzantine budget used this round (quarantined clients count against it).
    - ``m`` (Multi-Krum), ``theta``, ``beta`` (Bulyan): the sizes of their selections.
    - ``selected``: the ids of the clients selected.
    - ``trimmed_per_side``: values trimmed from each side of every coordinate.

    Pre-aggregated rules (``rule("nnm+median")``, :mod:`~fedtrust.aggregators.pre`):

    - ``pre``: the pre-aggregators applied before the rule, in order (``["nnm"]``); the rest of the
      info is the inner rule's, on the mixed rows.

    Others:

    - ``center_weight`` (centred clipping): the coefficient left on the previous centre.
    - ``admitted`` (DnC, FLAME): the ids of the clients the filter let through (DnC's good set, FLAME's
      majority cluster); every other client has weight 0.
    - ``clip_bound`` (norm bounding, FLAME): the norm the updates were clipped to (M, or FLAME's S_t).
    - ``noise_std`` (FLAME): the standard deviation of the Gaussian noise added to every coordinate of
      the aggregate (lambda S_t).
    - ``split``, ``excluded``, ``excluded_now``, ``cross_similarity``, ``mean_update_norm``,
      ``max_update_norm`` (CFL): whether the round split the federation, the clients excluded so far
      and this round, and the criteria of the split (Sattler et al. 2020, eqs 30-31).
    - ``posterior_var``, ``posterior_spread`` (FedAG): the Gaussian posterior's (d,) variance and its
      root mean.
    """

    quarantined: dict[Hashable, str]
    clients: dict[str, torch.Tensor]
    iterations: int
    converged: bool
    warning: str
    objective: float
    trace: list[float]
    tol: float
    last_step: float
    groups: list[SybilGroup]
    degenerate: str
    fallback: str
    coefficient_sum: float
    tau2: float
    sigma_u2: float
    sigma_y2: float
    sigma_v2: torch.Tensor
    p: int
    f: int
    m: int
    theta: int
    beta: int
    selected: list[Hashable]
    trimmed_per_side: int
    center_weight: float
    admitted: list[Hashable]
    clip_bound: float
    noise_std: float
    split: bool
    excluded: list[Hashable]
    excluded_now: list[Hashable]
    cross_similarity: float
    mean_update_norm: float
    max_update_norm: float
    posterior_var: torch.Tensor
    posterior_spread: float
    pre: list[str]


@runtime_checkable
class Reference(Protocol):
    """``Round.reference``: the server's trusted benchmark split, as ``reference(update) -> loss``.

    update: one client's (d,) row of ``Round.updates``, in its dtype and on its device, meaning what
            the round's updates mean (a delta from the previous global model, or parameters): the
            callable builds the model that update gives the server and returns its mean loss per
            example on the benchmark split, as a float or a one-element tensor (on any device: the
            rules read every client's loss in one transfer, where a float is a GPU sync each). Lower
            is better. It must not modify ``update``
            and must give the same loss for the same update. A non-finite loss is allowed: the rules
            count it as the worst loss possible.
    size:   optional attribute, the number of examples in the split (FOCUS's eq 4 sums the loss over
            them under ``reduction="sum"``); 1 when absent.

    update: optional method, ``update() -> (d,)`` tensor: the server's own update this round, computed
            on the benchmark split the way the clients compute theirs (FLTrust's root-data update g_0,
            Cao et al. 2021); it means what a row of ``Round.updates`` means. The simulator's reference
            has it (:class:`fedtrust.sim.loop.BenchmarkReference`, trained once per round).

    Called once per client and round, by FOCUS (eq 4) and by the ``"benchmark"`` loss defence
    (:mod:`~fedtrust.aggregators.loss_defences`); the simulator and the Flower strategy build one when
    the server holds a benchmark split (``data.benchmark`` in a config, ``TrustStrategy(benchmark=...)``).
    """

    def __call__(self, update: torch.Tensor) -> float | torch.Tensor: ...
