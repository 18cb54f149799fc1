"""TrustStrategy takes Flower FedAvg's options and hooks, with the same names and defaults, and with the
``fedavg`` (or, on equal shares, ``mean``) rule it *is* FedAvg: same model to float rounding, same
metrics records."""

import inspect
import json

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from flower_grid import federation, initial, run, server_identity  # noqa: E402, F401
from flwr.app import MetricRecord  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedtrust.flower import TrustStrategy  # noqa: E402
from fedtrust.report import write_report  # noqa: E402


def test_every_fedavg_option_is_taken_with_its_name_and_default():
    ours = inspect.signature(TrustStrategy.__init__).parameters
    for name, param in inspect.signature(FedAvg.__init__).parameters.items():
        if name == "self":
            continue
        assert name in ours, name
        assert ours[name].default == param.default, (name, ours[name].default, param.default)
    strategy = TrustStrategy()
    for name in (
        "weighted_by_key",
        "arrayrecord_key",
        "configrecord_key",
        "fraction_train",
        "min_train_nodes",
    ):
        assert getattr(strategy, name) == getattr(FedAvg(), name)


def close(a, b, scale=1.0):
    """Equal to float32 rounding: a few ulps of the values' scale per addend of a 4-client sum."""
    return np.allclose(a, b, rtol=0, atol=64 * np.finfo(np.float32).eps * scale)


@pytest.mark.parametrize(("rule", "parts", "uneven"), [("fedavg", 4, True), ("mean", 3, False)])
def test_the_fedavg_rule_gives_flowers_fedavg_model_and_metrics(rule, parts, uneven):
    """Three rounds over the same federation, training and evaluation: 4 nodes with shares 1:2:3:4 for
    fedavg, 3 equal shares (449 rows each) for the uniform mean."""
    nodes = {"min_available_nodes": parts, "min_evaluate_nodes": parts}
    flower = run(FedAvg(**nodes), federation(parts=parts, uneven=uneven))
    ours = run(TrustStrategy(rule=rule, **nodes), federation(parts=parts, uneven=uneven))
    assert list(ours.arrays.keys()) == list(flower.arrays.keys())
    for name in flower.arrays.keys():
        a, b = ours.arrays[name].numpy(), flower.arrays[name].numpy()
        assert a.dtype == b.dtype and close(a, b, np.abs(b).max()), (name, np.abs(a - b).max())
    assert ours.train_metrics_clientapp.keys() == flower.train_metrics_clientapp.keys() == {1, 2, 3}
    for t, theirs in flower.train_metrics_clientapp.items():
        mine = dict(ours.train_metrics_clientapp[t])
        extra = {k for k in mine if k not in theirs}
        assert extra == {f"trust/partition-{k}" for k in range(parts)} | {"dropped", "quarantined"}
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=1e-5), key  # train_loss at a model ~1 ulp away
    assert ours.evaluate_metrics_clientapp.keys() == flower.evaluate_metrics_clientapp.keys() == {1, 2, 3}
    for t, theirs in flower.evaluate_metrics_clientapp.items():
        mine = ours.evaluate_metrics_clientapp[t]
        assert mine.keys() == theirs.keys() and all(
            mine[k] == pytest.approx(theirs[k], rel=1e-5) for k in mine
        )
    if rule == "fedavg":  # the weights are the sample shares 1:2:3:4
        weights = [ours.train_metrics_clientapp[3][f"trust/partition-{k}"] for k in range(4)]
        assert weights == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-3)


def test_custom_keys_metric_functions_and_sampling_are_honoured():
    keys = {"weighted_by_key": "rows", "train_loss_key": "loss-before", "arrayrecord_key": "model",
            "configrecord_key": "settings"}  # fmt: skip
    calls = []

    def largest(records, weight_key):
        calls.append(weight_key)
        return MetricRecord({"largest-loss": max(r["metrics"]["loss-before"] for r in records)})

    def count(records, weight_key):
        return MetricRecord(
            {"evaluated": len(records), "rows": sum(r["metrics"][weight_key] for r in records)}
        )

    strategy = TrustStrategy(rule="arfl", fraction_train=0.5, min_train_nodes=2, min_available_nodes=4,
                             fraction_evaluate=0.75, min_evaluate_nodes=1, train_metrics_aggr_fn=largest,
                             evaluate_metrics_aggr_fn=count, **keys)  # fmt: skip
    grid = federation(**keys)
    sent = []
    send = grid.send_and_receive
    grid.send_and_receive = lambda messages, timeout=None: send(sent.extend(messages) or messages, timeout)
    result = run(strategy, grid, rounds=2)
    assert calls == ["rows", "rows"]
    train = result.train_metrics_clientapp[2]
    assert train["largest-loss"] > 0 and len([k for k in train if k.startswith("trust/")]) == 2
    assert dict(result.evaluate_metrics_clientapp[2])["evaluated"] == 3  # 0.75 of 4 nodes
    assert set(strategy.rule.state_dict()["loss"]) == {100, 101, 102, 103}  # ARFL read "loss-before"
    for message in sent:
        assert "model" in message.content.array_records and "settings" in message.content.config_records
    assert strategy.history[-1]["dropped"] == {}


def test_a_node_metric_named_as_the_strategys_own_is_kept_beside_them():
    """The nodes' metrics share the round's MetricRecord with trust per node and the dropped and
    quarantined counts: a node metric of one of their names comes as node/<name> (it was overwritten)."""

    def clashing(records, weight_key):
        return MetricRecord({"dropped": 7.0, "trust/partition-0": 0.5, "loss": 1.0})

    strategy = TrustStrategy(rule="median", min_available_nodes=4, train_metrics_aggr_fn=clashing)
    train = dict(run(strategy, federation(), rounds=1).train_metrics_clientapp[1])
    assert train["node/dropped"] == 7.0 and train["node/trust/partition-0"] == 0.5 and train["loss"] == 1.0
    record = strategy.history[-1]
    assert train["trust/partition-0"] == record["weights"][record["clients"].index("partition-0")] != 0.5
    assert train["dropped"] == 0 and train["quarantined"] == 0


def test_a_zero_fraction_skips_training_or_evaluation_as_fedavg_does(tmp_path):
    result = run(TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=4), federation())
    assert result.evaluate_metrics_clientapp == {} and len(result.train_metrics_clientapp) == 3
    strategy = TrustStrategy(rule="median", fraction_train=0.0, min_available_nodes=4, min_evaluate_nodes=4,
                             run_dir=tmp_path / "run")  # fmt: skip
    result = run(strategy, federation(), rounds=2)
    for name, array in initial().items():
        assert np.array_equal(result.arrays[name].numpy(), array.numpy())
    assert len(result.evaluate_metrics_clientapp) == 2
    # an evaluation-only run is not a failed one: its rounds say training was skipped, and why
    for record in strategy.history:
        assert (
            record["error"] is None and record["skipped"] == "no node was asked to train (fraction_train=0)"
        )
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["error"] is None
    # and its report renders (the trust heatmap of no client had failed on an empty axis)
    report = write_report(tmp_path, tmp_path / "report").read_text()
    assert "No round trained a client: there is no trust to show." in report


def test_a_round_whose_sampled_nodes_all_fail_is_still_an_error():
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=4)
    run(strategy, federation(bad={k: {"fedtrust-attack": "crash"} for k in range(4)}), rounds=1)
    record = strategy.history[0]
    assert record["error"] and record["skipped"] is None and len(record["quarantined"]) == 4


@pytest.mark.parametrize(
    ("option", "value"),
    [("fraction_train", 1.5), ("fraction_evaluate", -0.1), ("min_train_nodes", 2.5),
     ("min_available_nodes", -1), ("weighted_by_key", ""), ("train_loss_key", 3), ("identity", "ip"),
     ("query_timeout", 0)],
)  # fmt: skip
def test_an_option_out_of_range_is_refused_by_name(option, value):
    with pytest.raises(ValueError, match=f"TrustStrategy: {option} must be .*got {value!r}"):
        TrustStrategy(**{option: value})


def test_options_as_numpy_scalars_and_a_rule_with_its_options_in_one_string_are_taken():
    """FedAvg takes np.float32(0.5) and np.int64(3), and the run config writes a rule as
    "trimmed_mean(f=0.2)": TrustStrategy refused both ("fraction_train must be a fraction in [0, 1], got
    np.float32(0.5)"; "unknown rule 'trimmed_mean(f=0.2)'")."""
    import numpy as np

    s = TrustStrategy(
        rule="trimmed_mean(f=0.2)", fraction_train=np.float32(0.5), min_available_nodes=np.int64(3)
    )
    assert (s.rule.name, s.rule.options()["f"]) == ("trimmed_mean", 0.2)
    assert (type(s.fraction_train), s.fraction_train, type(s.min_available_nodes)) == (float, 0.5, int)
    with pytest.raises(ValueError, match=r"TrustStrategy.start: timeout must be seconds > 0, got '60'"):
        s.start(grid=None, initial_arrays=None, num_rounds=1, timeout="60")
    with pytest.raises(ValueError, match="option 'f' is given both in rule= and rule_options="):
        TrustStrategy(rule="trimmed_mean(f=0.2)", rule_options={"f": 0.1})
    with pytest.raises(ValueError, match=r"fraction_train must be a fraction in \[0, 1\], got '0.5' \(str\)"):
        TrustStrategy(fraction_train="0.5")


def test_the_client_names_itself_by_node_name_or_partition():
    from flwr.app import Context, RecordDict

    from fedtrust.flower import node_name

    def context(node_config):
        return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})

    assert node_name(context({"node-name": "hospital-a", "partition-id": 0})) == "hospital-a"
    assert node_name(context({"partition-id": 3})) == "partition-3"
    assert node_name(context({})) == "7"
    with pytest.raises(ValueError, match="node-name must be printable"):
        node_name(context({"node-name": "x" * 65}))
