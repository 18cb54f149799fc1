"""The ServerApp: a fedtrust rule aggregates, weighting each node by how far it can be trusted."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedtrust.flower import ArrayLayout, TrustStrategy, corrupted_partitions, server_training
from fedtrust.models import FlatModel
from fedtrust.registry import parse_spec
from fedtrust.rules import rule as build_rule
from fedtrust_example.task import make_model, server_data, setting

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    dataset, model_name = setting(cfg, "dataset", str), setting(cfg, "model", str)
    rule, rule_options = parse_spec(setting(cfg, "rule", str))  # "ivar_vb" or "trimmed_mean(f=0.2)"
    size = setting(cfg, "benchmark-size", int, minimum=0)
    benchmark, (x_test, y_test) = server_data(dataset, size)
    torch.manual_seed(setting(cfg, "seed", int, minimum=0))  # the initial model: a run gives the same numbers
    model = make_model(dataset, model_name)
    # simulation: the partitions the run config corrupts are known, so the report can score detection
    corrupted = corrupted_partitions(cfg)
    # FLTrust's root-data update: the server trains on its benchmark rows as the nodes train
    root = server_training(make_model(dataset, model_name), benchmark, cfg) if size else None
    if getattr(build_rule(rule, **rule_options), "reads_reference", ()) and not size:
        raise ValueError(f"run config rule={rule!r} reads the server's own trusted rows: set benchmark-size "
                         "> 0 (the rows of the server's split, e.g. benchmark-size=100)")  # fmt: skip
    strategy = TrustStrategy(
        rule=rule,
        rule_options=rule_options,
        model=model,
        benchmark=benchmark if size else None,
        server_update=root,
        fraction_train=setting(cfg, "fraction-train", float, minimum=0.0),
        fraction_evaluate=0.0,
        min_available_nodes=setting(cfg, "min-nodes", int, minimum=1),
        min_train_nodes=setting(cfg, "min-nodes", int, minimum=1),
        corrupted=[f"partition-{p}" for p in corrupted],
        run_dir=setting(cfg, "run-dir", str) or None,
    )
    initial = ArrayRecord(model.state_dict())
    layout = ArrayLayout(initial)
    flat = FlatModel(make_model(dataset, model_name), "classification")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord(flat.evaluate(layout.flatten(arrays), x_test, y_test))

    strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=setting(cfg, "num-server-rounds", int, minimum=0),
        evaluate_fn=evaluate,
    )
