"""The peers' own implementations as fedtrust rules, so that they train the very federation fedtrust's
rules train: ByzFL's aggregators and pre-aggregators (PyPI ``byzfl``), and Flower's robust strategies
(``flwr.serverapp.strategy``: their ``aggregate_train`` on reply Messages, as a ServerApp calls it).

Each wrapper is a :class:`~fedtrust.aggregators.BaseRule`, so the round it sees has been through the
front door: a client that sent NaN (the ``absent`` column) is quarantined before the peer's code runs,
as a server would have to do for it (neither peer screens; ByzFL's median of a column holding NaN is
NaN). Neither peer says whom it trusted: the weights are uniform and ``info["trust"]`` says so, and
the report reads only accuracy and the backdoor's success.

A Byzantine budget ``f`` (a fraction of the round's clients, as fedtrust's rules take it) becomes the
peer's count as fedtrust's rules count it: floor(f n) of all the round's clients, less those already
quarantined (:func:`~fedtrust.aggregators.core.byzantine_budget`'s rule).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedtrust import register
from fedtrust.aggregators import Aggregate, BaseRule, Round
from fedtrust.aggregators.core import RoundRefused, resolve_f

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers import byzfl_aggregators, flower_replies  # noqa: E402

#: ByzFL's classes by the name a chain uses, and how each is built for a budget f.
BYZFL = {
    "median": lambda m, f: m.Median(),
    "trmean": lambda m, f: m.TrMean(f=f),
    "geomed": lambda m, f: m.GeometricMedian(),  # ByzFL's defaults: nu = 0.1, T = 3 steps from 0
    "krum": lambda m, f: m.Krum(f=f),
    "multikrum": lambda m, f: m.MultiKrum(f=f),
    "cc": lambda m, f: m.CenteredClipping(tau=1.0),  # tau as the robustness table gives fedtrust's
    "meamed": lambda m, f: m.Meamed(f=f),
    "caf": lambda m, f: m.CAF(f=f),
    "nnm": lambda m, f: m.NNM(f=f),
    "bucketing": lambda m, f: m.Bucketing(s=2),
    "arc": lambda m, f: m.ARC(f=f),
}
#: ByzFL's stateful class: it starts each call from the previous call's output.
_KEEPS_CENTRE = {"cc"}


def _budget(f: float, round: Round) -> int:
    return max(0, resolve_f(f, round.n + len(round.quarantined)) - len(round.quarantined))


def _uniform(round: Round) -> torch.Tensor:
    return torch.full((round.n,), 1.0 / round.n, dtype=round.updates.dtype)


_NO_TRUST = "the peer reports no per-client trust: uniform weights stand in"


class ByzFL(BaseRule):
    """ByzFL's implementation: ``chain`` names its pre-aggregators and its aggregator, joined by ``+``
    (``nnm+trmean``: NNM, then the coordinate-wise trimmed mean), each given the budget ``f``. ByzFL's
    bucketing draws its permutation from torch's global generator: it is drawn here from a generator
    seeded by ``seed`` and the call's count, so a run is reproducible."""

    name = "byzfl"
    paper = "ByzFL (EPFL DCL), PyPI byzfl: its aggregators and pre-aggregators"
    reads_deltas = True  # centred clipping and ARC measure from the origin

    def __init__(self, chain: str = "median", f: float = 0.0, seed: int = 0):
        steps = chain.split("+")
        unknown = [s for s in steps if s not in BYZFL]
        if unknown:
            raise ValueError(
                f"byzfl: unknown step {unknown[0]!r} in chain {chain!r}; steps: {', '.join(BYZFL)}"
            )
        self.chain, self.f, self.seed = chain, f, seed
        self._calls = 0
        self._final: Any = None  # the aggregator object, kept across rounds where it keeps a centre

    def aggregate(self, round: Round) -> Aggregate:
        module = byzfl_aggregators()
        if module is None:
            raise ImportError("byzfl is not installed (make peers installs it)")
        f = _budget(self.f, round)
        *pre, final = self.chain.split("+")
        x = round.updates.clone()  # ByzFL's ARC clips its input in place (0.0.11): the round stays as it was
        self._calls += 1
        with torch.random.fork_rng():
            torch.manual_seed(self.seed * 1_000_003 + self._calls)
            try:
                for step in pre:
                    x = BYZFL[step](module, f)(x)
                agg = self._final if final in _KEEPS_CENTRE and self._final else BYZFL[final](module, f)
                out = agg(x)
                if out is None:  # (ByzFL 0.0.11's CAF returns nothing when f = 0)
                    raise ValueError("it returned no vector")
                vector = torch.as_tensor(out, dtype=round.updates.dtype)
            except (ValueError, AssertionError) as exc:  # its own refusal of n against f
                raise RoundRefused(f"byzfl({self.chain}) refused n={round.n}, f={f}: {exc}") from exc
        if final in _KEEPS_CENTRE:
            self._final = agg
        return Aggregate(vector, _uniform(round), {"trust": _NO_TRUST})

    def state_dict(self) -> dict[str, Any]:
        """The calls so far (bucketing's draws follow them) and ByzFL's centred clipping's centre."""
        state: dict[str, Any] = {"calls": self._calls}
        if self._final is not None:
            state["centre"] = torch.as_tensor(self._final.m).clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calls = int(state.get("calls", 0))
        self._final = None
        if "centre" in state:  # (ByzFL 0.0.11 refuses every m at construction: its check is always true)
            self._final = BYZFL["cc"](byzfl_aggregators(), 0)
            self._final.m = torch.as_tensor(state["centre"]).clone()


#: Flower's strategies by name, built for n clients and a budget f.
FLOWER = {
    "fedavg": lambda fl, n, f: fl.FedAvg(fraction_train=1.0),
    "fedmedian": lambda fl, n, f: fl.FedMedian(fraction_train=1.0),
    # Flower cuts int(beta n) a side, and (f / n) n may round below f (f = 1, n = 49 cut none)
    "fedtrimmedavg": lambda fl, n, f: fl.FedTrimmedAvg(beta=(f + 0.5) / n, fraction_train=1.0),
    "krum": lambda fl, n, f: fl.Krum(num_malicious_nodes=f, fraction_train=1.0),
    "multikrum": lambda fl, n, f: fl.MultiKrum(
        num_malicious_nodes=f, num_nodes_to_select=n - f, fraction_train=1.0
    ),
    "bulyan": lambda fl, n, f: fl.Bulyan(num_malicious_nodes=f, fraction_train=1.0),
}


class Flower(BaseRule):
    """Flower's strategy ``strategy`` (its Message API): each round's updates become reply Messages with
    their sample counts as ``num-examples`` and go through the strategy's ``aggregate_train``."""

    name = "flower"
    paper = "Flower (flwr.serverapp.strategy): its robust strategies' aggregate_train"

    def __init__(self, strategy: str = "fedmedian", f: float = 0.0):
        if strategy not in FLOWER:
            raise ValueError(f"flower: unknown strategy {strategy!r}; strategies: {', '.join(FLOWER)}")
        self.strategy, self.f = strategy, f

    def aggregate(self, round: Round) -> Aggregate:
        from flwr.serverapp import strategy as fl

        f = _budget(self.f, round)
        if self.strategy == "bulyan":
            f = min(f, (round.n - 3) // 4)
        x = round.updates.numpy().copy()
        counts = np.maximum(1, np.rint(round.num_samples.numpy())).astype(np.int64)
        try:
            arrays, _ = FLOWER[self.strategy](fl, round.n, f).aggregate_train(1, flower_replies(x, counts))
        except (ValueError, AssertionError) as exc:
            raise RoundRefused(f"flower({self.strategy}) refused n={round.n}, f={f}: {exc}") from exc
        if arrays is None:
            raise RoundRefused(f"flower({self.strategy}) aggregated nothing (n={round.n}, f={f})")
        vector = torch.as_tensor(arrays["w"].numpy(), dtype=round.updates.dtype)
        return Aggregate(vector, _uniform(round), {"trust": _NO_TRUST})


def register_peers() -> None:
    """Make ``byzfl`` and ``flower`` rule names (configs: ``{name: byzfl, chain: nnm+trmean, f: 0.2}``);
    Flower's per-call log lines ("aggregate_train: Received 50 results") are silenced."""
    import logging

    import flwr.supercore.logger  # noqa: F401 - (its import sets the level to DEBUG: set it after)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    register("byzfl", ByzFL, replace=True)
    register("flower", Flower, replace=True)
