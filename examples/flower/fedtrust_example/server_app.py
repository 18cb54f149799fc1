"""The ServerApp: a fedtrust rule aggregates, weighting each node by how far it can be trusted."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedtrust.flower import ArrayLayout, TrustStrategy
from fedtrust.models import FlatModel
from fedtrust_example.task import make_model, server_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    dataset, rule = str(cfg["dataset"]), str(cfg["rule"])
    benchmark, (x_test, y_test) = server_data(dataset, int(cfg["benchmark-size"]))
    torch.manual_seed(int(cfg["seed"]))  # the initial model: the same run gives the same numbers
    model = make_model(dataset, str(cfg["model"]))
    # simulation: the partitions the run config corrupts are known, so the report can score detection
    corrupted = str(cfg.get("fedtrust-corrupted-partitions", "")).replace(",", " ").split()
    strategy = TrustStrategy(
        rule=rule,
        model=model,
        benchmark=benchmark if int(cfg["benchmark-size"]) > 0 else None,
        fraction_train=float(cfg["fraction-train"]),
        fraction_evaluate=0.0,
        min_available_nodes=int(cfg["min-nodes"]),
        min_train_nodes=int(cfg["min-nodes"]),
        corrupted=[f"partition-{p}" for p in corrupted],
        run_dir=str(cfg["run-dir"]) or None,
    )
    initial = ArrayRecord(model.state_dict())
    layout = ArrayLayout(initial)
    flat = FlatModel(make_model(dataset, str(cfg["model"])), "classification")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord(flat.evaluate(layout.flatten(arrays), x_test, y_test))

    strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=evaluate
    )
