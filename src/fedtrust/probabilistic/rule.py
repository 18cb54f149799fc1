"""FedAvg-Gaussian as a rule: any fedtrust rule's aggregate and trust, plus the Gaussian posterior."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedtrust._registry import UnknownNameError
from fedtrust.aggregators.core import Aggregate, BaseRule, Round
from fedtrust.aggregators.registry import rule as build_rule
from fedtrust.probabilistic.posterior import fit_posterior


class FedAG(BaseRule):
    """FedAvg-Gaussian (Algorithm 1): the aggregate of ``base`` (default the plain mean, which is FedAG
    itself) and the per-weight Gaussian posterior N(mu, sigma^2) fitted to the round's client updates
    with ``base``'s trust weights: mu = the base aggregate, sigma^2 = sum_k w_k (x_k - mu)^2. With a robust
    base (ivar_vb, arfl, geometric_median, ...) this is robust FedAG: clients the base distrusts
    neither drag the mean nor inflate the uncertainty. ``info["posterior_var"]`` holds sigma^2 (d,).

    Updates are deltas from the global model, so sigma^2 is also the variance of the client models.
    """

    name = "fedag"
    paper = "Thorgeirsson, Gauterin 2021, Probabilistic Predictions with Federated Learning (FedAG)"

    def __init__(self, base: str = "mean", base_options: dict | None = None):
        if base == "fedag":
            raise ValueError("fedag: base cannot be fedag itself")
        try:
            self._base = build_rule(base, **(base_options or {}))
        except UnknownNameError as exc:
            raise UnknownNameError(f"fedag: base {exc}") from None
        self.base = base
        self.base_options = dict(base_options or {})

    @property
    def requires(self) -> tuple[str, ...]:  # whatever the base rule reads
        return self._base.requires

    def aggregate(self, round: Round, n_quarantined: int = 0) -> Aggregate:
        out = self._base.aggregate(round, n_quarantined)
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
            raise type(exc)(f"{self.name} (base {self.base}): {exc}") from None
