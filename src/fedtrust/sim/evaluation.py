"""A simulation's evaluation step, pluggable: what the global model is scored on, and what a round leaves
behind for scoring (FedAG's posterior).

An evaluation is any object with

    observe(t, vector, aggregate, members, chosen)  # after every round the server applied
    __call__(t, vector) -> dict[str, float]         # the metrics recorded for round t
    predictions(t, vector) -> (y, mu, sigma) | None # a regression run's final predictive, saved to disk

and, where it keeps something from round to round (FedAG's posterior), ``state_dict()`` and
``load_state_dict(state)`` as a rule has: the simulator checkpoints that state beside the rule's, so that a
resumed run scores its rounds as an uninterrupted one does.

``Simulation(evaluation=...)`` takes one; by default :func:`default_evaluation` picks
:class:`TestSetMetrics` (accuracy, or RMSE for regression) or, for a regression run whose rule reports a
posterior, :class:`FedAGPredictive` (NLL, CRPS, coverage and RMSE of the predictive distribution).
"""

from __future__ import annotations

from typing import Protocol

import torch

from fedtrust.aggregators import Aggregate
from fedtrust.data.backdoor import Backdoor
from fedtrust.models import FlatModel
from fedtrust.probabilistic import scoring_rules
from fedtrust.probabilistic.posterior import (
    GaussianPosterior,
    bootstrap_predictive,
    linear_predictive,
    noise_precision,
    omc_predictive,
)
from fedtrust.seeding import stream
from fedtrust.sim.federation import Federation
from fedtrust.sim.settings import TrainSettings

__all__ = ["BackdoorSuccess", "Evaluation", "FedAGPredictive", "TestSetMetrics", "default_evaluation"]


class Evaluation(Protocol):
    def observe(
        self, t: int, vector: torch.Tensor, aggregate: Aggregate, members: torch.Tensor, chosen: list[int]
    ) -> None:
        """Round ``t`` was applied: ``vector`` is the new global model, ``members`` the (n, d) client
        models the round's updates lead to, ``chosen`` the federation's indices of those clients."""

    def __call__(self, t: int, vector: torch.Tensor) -> dict[str, float]:
        """The metrics of the global model ``vector`` after round ``t``."""

    def predictions(self, t: int, vector: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """(y, mu, sigma) on the test set in the target's units, or None where the run has none."""


class TestSetMetrics:
    """The model's own metrics on the test set (accuracy and loss; RMSE and MSE in the target's units)."""

    def __init__(self, model: FlatModel, federation: Federation):
        self.model = model
        self.data = federation.dataset

    def observe(self, t, vector, aggregate, members, chosen) -> None:
        pass

    def __call__(self, t: int, vector: torch.Tensor) -> dict[str, float]:
        data = self.data
        metrics = self.model.evaluate(vector, data.x_test, data.y_test)
        if data.num_classes is None and data.y_scale != 1.0:
            metrics = {"rmse": metrics["rmse"] * data.y_scale, "mse": metrics["mse"] * data.y_scale**2}
        return metrics

    def predictions(self, t, vector) -> None:
        return None


class FedAGPredictive(TestSetMetrics):
    """FedAG's predictive distribution (Thorgeirsson & Gauterin, papers/003): each applied round whose
    rule reports ``posterior_var`` fits the Gaussian posterior N(global model, diag(posterior_var)) over
    the round's client models with their trust (Algorithm 1, line 9); the test set is scored by the
    predictive ``settings.predictive`` names: ``bootstrap`` (the client models as the ensemble, eqs 3-5),
    ``omc`` (Monte Carlo draws from the posterior) or ``linear`` (closed form, eq 6), with the data noise
    1/beta added when ``settings.predictive_noise``. Before the first posterior, the test-set metrics."""

    def __init__(self, model: FlatModel, federation: Federation, settings: TrainSettings, seed: int):
        super().__init__(model, federation)
        self.federation = federation
        self.settings = settings
        self.seed = seed
        self.posterior: GaussianPosterior | None = None
        self._chosen: list[int] = []  # the federation's indices of the latest posterior's clients
        self._data: list = []  # their training data, for the noise precision

    def observe(self, t, vector, aggregate, members, chosen) -> None:
        if "posterior_var" in aggregate.info and self.settings.mode != "gradient":
            var = aggregate.info["posterior_var"].detach()
            self.posterior = GaussianPosterior(vector, var, members, aggregate.weights.detach())
            self._chosen = list(chosen)
            self._data = [self.federation.data[k] for k in chosen]

    def state_dict(self) -> dict:
        """The latest posterior and the federation's indices of its clients: a round that aggregates
        nothing is scored under it, so a checkpoint keeps it."""
        p = self.posterior
        if p is None:
            return {"posterior": None}
        return {"posterior": {"mean": p.mean, "var": p.var, "members": p.members, "weights": p.weights,
                              "chosen": list(self._chosen)}}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s posterior (checked first: ValueError, nothing changed, when it does
        not fit this run's model and federation)."""
        if not isinstance(state, dict) or set(state) != {"posterior"}:
            raise ValueError(f"FedAG's evaluation state is a dict with key 'posterior', got {state!r:.80}")
        p = state["posterior"]
        if p is None:
            self.posterior, self._chosen, self._data = None, [], []
            return
        keys = {"mean", "var", "members", "weights", "chosen"}
        if not isinstance(p, dict) or set(p) != keys:
            raise ValueError(f"FedAG's posterior state has keys {sorted(keys)}, got {p!r:.80}")
        d, chosen, clients = self.model.size, p["chosen"], len(self.federation.data)
        if not (
            isinstance(chosen, list) and chosen and all(type(k) is int and 0 <= k < clients for k in chosen)
        ):
            raise ValueError(
                f"FedAG's posterior names clients {chosen!r:.80}, not indices of this run's {clients}"
            )
        shapes = {"mean": (d,), "var": (d,), "members": (len(chosen), d), "weights": (len(chosen),)}
        for key, shape in shapes.items():
            value = p[key]
            if not (
                isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == shape
            ):
                raise ValueError(f"FedAG's posterior {key} is not a float tensor of shape {shape}")
        device = self.data.x_test.device  # a checkpoint holds CPU tensors: back where this run's data are
        self.posterior = GaussianPosterior(*(p[k].to(device) for k in ("mean", "var", "members", "weights")))
        self._chosen = list(chosen)
        self._data = [self.federation.data[k] for k in chosen]

    def predictive(self, t: int, vector: torch.Tensor, x: torch.Tensor):
        """(mu, sigma) of the predictive distribution at ``x`` under the latest posterior (in the model's
        standardised units), or None before the first."""
        if self.posterior is None:
            return None
        s = self.settings
        beta = self.noise_precision(vector) if (s.predictive == "linear" or s.predictive_noise) else None
        noise = 1.0 / beta if s.predictive_noise else 0.0
        if s.predictive == "linear":
            return linear_predictive(self.posterior, x, beta)
        if s.predictive == "omc":
            return omc_predictive(
                self.model, self.posterior, x, s.predictive_samples, stream(self.seed, "omc", t), noise
            )
        return bootstrap_predictive(self.model, self.posterior, x, noise)

    def noise_precision(self, vector: torch.Tensor) -> float:
        """beta of eq 6 at ``vector``: the latest posterior's clients' residual variance on their training
        data, each client weighed by its trust in that round, as its model is (:func:`noise_precision`)."""
        return noise_precision(self.model, vector, self._data, self.posterior.weights)

    def predictions(self, t: int, vector: torch.Tensor):
        return self._scaled(t, vector, lambda sigma: sigma)

    def __call__(self, t: int, vector: torch.Tensor) -> dict[str, float]:
        scored = self._scaled(t, vector, lambda sigma: sigma.clamp_min(1e-12))
        if scored is None:
            return super().__call__(t, vector)
        return scoring_rules.summary(*scored)

    def _scaled(self, t, vector, floor):
        """(y, mu, floor(sigma)) on the test set in the target's units, or None before the first posterior."""
        out = self.predictive(t, vector, self.data.x_test)
        if out is None:
            return None
        s, c = self.data.y_scale, self.data.y_shift
        return self.data.y_test * s + c, out[0] * s + c, floor(out[1]) * s


class BackdoorSuccess(TestSetMetrics):
    """The test-set metrics plus ``backdoor_asr``, the backdoor's attack success rate: the share of the
    test images whose true class is not the target that the model classifies as the target once the
    whole trigger is stamped on them (BadNets' and DBA's metric; for DBA the global trigger)."""

    def __init__(self, model: FlatModel, federation: Federation, backdoor: Backdoor):
        super().__init__(model, federation)
        keep = self.data.y_test != backdoor.target
        self.x = backdoor.stamp(self.data.x_test[keep])
        self.target = torch.full_like(self.data.y_test[keep], backdoor.target)

    def __call__(self, t: int, vector: torch.Tensor) -> dict[str, float]:
        metrics = super().__call__(t, vector)
        return {**metrics, "backdoor_asr": self.model.evaluate(vector, self.x, self.target)["accuracy"]}


def default_evaluation(
    model: FlatModel, federation: Federation, settings: TrainSettings, seed: int, corruption=None
) -> Evaluation:
    """FedAG's predictive scores for a regression run (they apply once a rule reports a posterior); the
    test-set metrics and the attack success rate under a backdoor ``corruption``; the test-set metrics
    otherwise."""
    if federation.dataset.num_classes is None:
        return FedAGPredictive(model, federation, settings, seed)
    if isinstance(corruption, Backdoor):
        return BackdoorSuccess(model, federation, corruption)
    return TestSetMetrics(model, federation)
