"""A rule written outside fedtrust: defined, registered, and run in a simulation by name.

    python examples/custom_rule.py

``NormCapped`` averages the updates whose norm is at most ``cap`` times the round's median norm (a
norm-bounding defence in the spirit of Sun et al. 2019, "Can You Really Backdoor Federated Learning?").
It derives from ``BaseRule``, so the front door screens every round before it sees it (NaN/Inf updates
and bad counts are quarantined with a reason), and it reports per-client trust like every rule.
Once registered, the name works wherever a rule is named: configs, ``fedtrust.rule``, FedAG's ``base``
and ``fedtrust.flower.TrustStrategy(rule="norm_capped")``.
"""

from __future__ import annotations

import torch

import fedtrust
from fedtrust.aggregators import Aggregate, BaseRule, Round


class NormCapped(BaseRule):
    """The mean of the updates whose norm is at most ``cap`` times the median norm."""

    name = "norm_capped"
    paper = "norm bounding (e.g. Sun et al. 2019, Can You Really Backdoor Federated Learning?)"

    def __init__(self, cap: float = 3.0):
        if not cap > 0:
            raise ValueError(f"norm_capped: cap must be positive, got {cap!r}")
        self.cap = cap

    def aggregate(self, round: Round) -> Aggregate:
        norms = round.norms  # float64, taken once by the front door's screening
        keep = norms <= self.cap * norms.median()
        w = keep.to(round.updates.dtype) / keep.sum()
        return Aggregate(w @ round.updates, w, {"clients": {"norm": norms}})


def main(rounds: int = 10) -> dict:
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    fedtrust.register("norm_capped", NormCapped)

    # by name, like a built-in rule: on one round ...
    x = torch.randn(6, 100)
    x[5] *= 50  # one client sends a huge update
    out = fedtrust.rule("norm_capped", cap=2.0)(Round(updates=x))
    print("trust on one round:", [round(w, 3) for w in out.weights.tolist()])

    # ... and in a simulation: digits, 10 clients, 3 of them sending N(0, 10^2) vectors
    cfg = validate(
        {
            "name": "custom-rule",
            "data": {"name": "digits", "clients": 10, "partition": {"name": "iid"}},
            "model": {"name": "softmax"},
            "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.5},
            "corruption": {"name": "gaussian", "std": 10.0, "fraction": 0.3},
            "rule": {"name": "norm_capped", "cap": 2.0},
        }
    )
    records = build_simulation(cfg).run()
    last = records[-1]
    corrupted = sum(w for w, bad in zip(last["weights"], last["corrupted"], strict=True) if bad)
    accuracy = last["metrics"]["accuracy"]
    print(f"after {rounds} rounds: accuracy {accuracy:.3f}, weight on corrupted {corrupted:.3f}")
    return {"one_round": out, "records": records}


if __name__ == "__main__":
    main()
