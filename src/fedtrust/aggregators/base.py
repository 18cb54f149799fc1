"""The base class of the built-in rules: a name, a paper, the metrics a rule reads, and the front door.

A rule is ``aggregate(round) -> Aggregate`` on a round whose malformed clients are already gone; calling
the rule (``rule(round)``) goes through the front door (:func:`~fedtrust.aggregators.screening.call_rule`),
which screens the round first. A complete rule::

    import torch
    from fedtrust.aggregators import Aggregate, BaseRule, Round

    class NormCapped(BaseRule):
        \"\"\"The mean of the updates whose norm is at most ``cap`` times the median norm.\"\"\"

        name = "norm_capped"
        paper = "a norm filter (e.g. Sun et al. 2019, Can You Really Backdoor Federated Learning?)"

        def __init__(self, cap: float = 3.0):
            self.cap = cap

        def aggregate(self, round: Round) -> Aggregate:
            norms = round.norms                      # float64, taken once (the front door's screen)
            keep = norms <= self.cap * norms.median()
            w = keep.to(round.updates.dtype) / keep.sum()
            return Aggregate(w @ round.updates, w, {"clients": {"norm": norms}})

A rule whose first pass over the updates can also take their norms (a Gram matrix, a sort, a fused
combination) says so with ``first_pass(round) -> FirstPass``; it is then called as
``aggregate(round, first)`` (:mod:`fedtrust.aggregators.screening` explains the protocol).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fedtrust.aggregators.core import Aggregate, Round, budget_for, byzantine_budget
from fedtrust.aggregators.screening import call_rule

__all__ = ["BaseRule", "Component"]


class Component:
    """What a rule and a pre-aggregator share: a ``name``, options as given at construction, and no state
    across rounds unless they override ``state_dict`` / ``load_state_dict``."""

    name: ClassVar[str] = "base"
    #: Whether the result depends on where the origin is (a norm clipped, a cosine, a history summed): the
    #: component reads updates (differences from the global model). The front door reads a round of models
    #: (with ``Round.previous``) as their updates and returns a model (they were clipped or compared as
    #: parameters: the step differed by up to 7.9 from the same round given as updates).
    reads_deltas: ClassVar[bool] = False
    #: A Byzantine budget's requirement, where the component has one: its text and the fewest vectors
    #: that tolerate f (``"n > 2f + 2", lambda f: 2 * f + 3`` for Krum).
    need: tuple[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def budget(self, round: Round) -> int:
        """The f this round affords under ``need`` (:func:`~fedtrust.aggregators.core.byzantine_budget`:
        quarantined clients count against f), or RoundRefused naming the requirement."""
        return byzantine_budget(self.name, self.f, round, *self.need)

    def check_clients(self, n: int) -> None:
        """Refuse (:class:`~fedtrust.aggregators.core.RoundRefused`, naming the requirement) an ``f`` that no
        round of ``n`` clients can meet, none of them quarantined: how a config is checked before any run
        trains. Nothing to check without a budget or with ``f`` left to the round (None)."""
        f = getattr(self, "f", None)
        if self.need is not None and f is not None:
            budget_for(self.name, f, n, 0, *self.need)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(
                f"{self.name} keeps no state across rounds, got state keys {sorted(map(str, state))}"
            )

    def options(self) -> dict[str, Any]:
        """The options as given at construction (for manifests and repr)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


class BaseRule(Component):
    """Base of the built-in rules: ``rule(round)`` screens the round and calls :meth:`aggregate`.

    Subclasses implement :meth:`aggregate` and set ``name`` (registry name), ``paper`` (the source, cited
    in ``fedtrust rules``) and ``requires`` (client metrics the rule reads); a rule whose first pass over
    the updates can take their norms may add ``first_pass`` (see the module docstring). Stateless rules
    inherit an empty ``state_dict``; ``per_client_state`` says the state is kept per client id across
    rounds (a history, a reputation), so its rows must be clients, not mixtures of them. ``keeps_large``:
    the rule only adds the updates (the mean, FedAvg), so a finite update whose norm overflows the dtype is
    harmless to it and only non-finite ones are quarantined.
    """

    name: ClassVar[str] = "base"
    paper: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    per_client_state: ClassVar[bool] = False
    keeps_large: ClassVar[bool] = False

    def __call__(self, round: Round) -> Aggregate:
        return call_rule(self, round)

    @property
    def reads_reference(self) -> tuple[str, ...]:
        """What the rule reads of ``Round.reference`` (:class:`~fedtrust.aggregators.info.Reference`):
        ``"loss"``, an update's loss on the server's benchmark split; ``"update"``, the server's own update
        on it. Empty for a rule that reads neither. The simulator and the Flower strategy refuse a rule
        whose reference they cannot build before any round runs."""
        return ()

    def aggregate(self, round: Round) -> Aggregate:
        """Aggregate a screened round (``round.quarantined`` lists the clients already removed)."""
        raise NotImplementedError
