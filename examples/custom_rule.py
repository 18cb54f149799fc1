"""A rule written outside fedtrust: defined, registered, and run by name on one round, in fedtrust's
simulator and in the Flower strategy (Flower's own simulation engine, four SuperNodes).

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


def main(rounds: int = 10, flower_rounds: int = 3) -> dict:
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
    return {"one_round": out, "records": records, "flower": on_flower(flower_rounds)}


def on_flower(rounds: int) -> dict:
    """The registered rule behind fedtrust's Flower strategy, run by Flower's simulation engine: four
    SuperNodes share digits; partition 3's device is broken and scales its features by 100, so its
    updates are huge. Returns the strategy's per-round history and the test accuracy before and after."""
    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedtrust.data import load_digits
    from fedtrust.flower import LocalData, TrustStrategy, trust_client_app
    from fedtrust.flower.arrays import ArrayLayout
    from fedtrust.models import FlatModel

    digits = load_digits()

    def data_fn(context: Context) -> LocalData:
        k = int(context.node_config["partition-id"])
        rows = torch.arange(len(digits.y_train))[k::4]
        x = digits.x_train[rows] * (100.0 if k == 3 else 1.0)
        return LocalData(x, digits.y_train[rows], digits.x_test, digits.y_test, digits.num_classes)

    def model_fn(context: Context | None = None) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(digits.x_train.shape[1], digits.num_classes)

    client = trust_client_app(model_fn, data_fn, local_epochs=1, lr=0.5)
    server, result = ServerApp(), {}

    @server.main()
    def run(grid: Grid, context: Context) -> None:
        strategy = TrustStrategy(  # every round waits for all four nodes (a slow start would miss one)
            rule="norm_capped", rule_options={"cap": 2.0}, fraction_evaluate=0.0, min_available_nodes=4
        )
        out = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(model_fn().state_dict()), num_rounds=rounds
        )
        result.update(trust=[strategy.trust(t) for t in range(len(strategy.history))], arrays=out.arrays)

    run_simulation(server_app=server, client_app=client, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})  # fmt: skip

    def accuracy(arrays: ArrayRecord) -> float:
        flat = ArrayLayout(arrays).flatten(arrays)
        return FlatModel(model_fn(), "classification").evaluate(flat, digits.x_test, digits.y_test)[
            "accuracy"
        ]

    before, after = accuracy(ArrayRecord(model_fn().state_dict())), accuracy(result["arrays"])
    print(f"Flower, {rounds} rounds: accuracy {before:.3f} -> {after:.3f}; trust in the last round:")
    for node, weight in result["trust"][-1].items():
        print(f"  {node}: {weight:.3f}")
    return {**result, "accuracy_before": before, "accuracy_after": after}


if __name__ == "__main__":
    main()
