"""FedAvg-Gaussian as a rule: any fedtrust rule's aggregate and trust, plus the Gaussian posterior."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round
from fedtrust.aggregators.mean import Mean
from fedtrust.aggregators.screening import FirstPass, has_first_pass
from fedtrust.probabilistic.posterior import fit_posterior


class FedAG(BaseRule):
    """FedAvg-Gaussian (Algorithm 1): the aggregate of ``base`` (default the plain mean, which is FedAG
    itself) and the per-weight Gaussian posterior N(mu, sigma^2) fitted to the round's client updates
    with ``base``'s trust weights: mu = the base aggregate, sigma^2 = sum_k w_k (x_k - mu)^2. With a robust
    base whose aggregate is its trust-weighted mean of the updates (ivar_vb, arfl, geometric_median,
    multi_krum, ...) this is robust FedAG: clients the base distrusts neither drag the mean nor inflate
    the uncertainty. ``info["posterior_var"]`` holds sigma^2 (d,).

    A coordinate-wise base (median, trimmed_mean, bulyan) is not such a rule: its per-client weights are
    the shares of the coordinates each client supplied, not a trust per coordinate. sigma^2 then counts a
    client also at coordinates where the rule set it aside, and the bootstrap predictive (the weighted
    client models) is centred on their weighted mean rather than on the aggregate.

    Updates are deltas from the global model, so sigma^2 is also the variance of the client models.
    ``base`` is a rule object; by name, ``fedtrust.rule("fedag", base="ivar_vb", base_options={...})``.
    """

    name = "fedag"
    paper = "Thorgeirsson, Gauterin 2021, Probabilistic Predictions with Federated Learning (FedAG)"

    def __init__(self, base: BaseRule | None = None):
        base = Mean() if base is None else base
        if not isinstance(base, BaseRule):
            raise TypeError(f"fedag: base must be a fedtrust rule, got {type(base).__name__}")
        if isinstance(base, FedAG):
            raise ValueError("fedag: base cannot be fedag itself")
        self._base = base

    @property
    def base(self) -> BaseRule:
        return self._base

    def options(self) -> dict[str, Any]:
        return {"base": self._base.name, "base_options": self._base.options()}

    @property
    def requires(self) -> tuple[str, ...]:  # whatever the base rule reads
        return self._base.requires

    @property
    def reads_deltas(self) -> bool:  # the base's: a round of models reaches it as updates (the front door)
        return getattr(self._base, "reads_deltas", False)

    def check_clients(self, n: int) -> None:  # the base rule's Byzantine budget
        self._base.check_clients(n)

    def first_pass(self, round: Round) -> FirstPass:  # the base rule's, or the norms alone
        if has_first_pass(self._base):
            return self._base.first_pass(round)
        return FirstPass(None, round.norms)

    def aggregate(self, round: Round, first: FirstPass) -> Aggregate:
        if has_first_pass(self._base):
            out = self._base.aggregate(round, first)
        else:
            out = self._base.aggregate(round)
        posterior = fit_posterior(round.updates, out.weights, mean=out.vector)
        info = dict(out.info)
        info["posterior_var"] = posterior.var
        info["posterior_spread"] = float(posterior.var.mean().sqrt())
        return Aggregate(out.vector, out.weights, info)

    def observe(self, client_ids, num_samples, metrics) -> dict:
        if hasattr(self._base, "observe"):
            return self._base.observe(client_ids, num_samples, metrics)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self._base.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The base rule's state (checked by the base rule; its message says it is fedag's base)."""
        try:
            self._base.load_state_dict(state)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{self.name} (base {self._base.name}): {exc}") from None
