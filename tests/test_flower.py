"""The Flower strategy driven by an in-process grid: every rule on the Message API, robust to bad replies."""

import json
import math

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")
from flower_grid import (  # noqa: E402
    DIGITS,
    InProcessGrid,
    accuracy,
    far,
    federation,
    initial,
    model,
    run,
    server_identity,  # noqa: F401 (an autouse fixture)
    share,
)
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.exception import InconsistentMessageReplies  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedtrust.flower import TrustStrategy, trust_client_app  # noqa: E402
from fedtrust.flower.arrays import ArrayLayout  # noqa: E402
from fedtrust.models import FlatModel  # noqa: E402


@pytest.mark.parametrize("rule", ["ivar_vb", "arfl", "geometric_median"])
def test_a_corrupted_node_gets_the_least_trust_and_the_model_improves(rule):
    """Three rounds, one node with random labels. (ARFL reads losses one round late, measured at the
    model before: a label *flipper* needs a few more rounds to stand out; experiments/arfl measures it.)"""
    strategy = TrustStrategy(rule=rule, fraction_evaluate=0.0, min_available_nodes=4)
    result = run(strategy, federation(bad={2: {"fedtrust-corruption": "random_labels"}}))
    assert accuracy(result.arrays) > accuracy(initial()) + 0.5
    last = strategy.trust()
    assert min(last, key=last.get) == "partition-2"
    trust = {k: v for k, v in result.train_metrics_clientapp[3].items() if k.startswith("trust/")}
    assert sorted(trust) == [f"trust/partition-{k}" for k in range(4)]
    assert sum(trust.values()) == pytest.approx(1.0)


def test_arfl_gets_the_initial_report_of_every_node():
    strategy = TrustStrategy(
        rule="arfl", fraction_train=0.5, min_train_nodes=2, fraction_evaluate=0.0, min_available_nodes=4
    )
    run(strategy, federation(bad={0: {"fedtrust-lie": 0.0}}), rounds=1)
    losses = strategy.rule.state_dict()["loss"]
    assert set(losses) == {100, 101, 102, 103}  # all four reported, though two trained
    assert losses[100] == 0.0  # the liar lied in its initial report too


class BrokenClient:
    """Replies that Flower's FedAvg would choke on."""

    def __init__(self, how):
        self.how = how

    def __call__(self, msg, context):
        arrays = msg.content["arrays"]
        good = {k: arrays[k].numpy() for k in arrays.keys()}
        if self.how == "crash":
            raise RuntimeError("device out of memory")
        if self.how == "wrong shape":
            good["weight"] = np.zeros((3, 3), dtype=np.float32)
        if self.how == "nan":
            good["bias"] = np.full_like(good["bias"], np.nan)
        if self.how == "big-endian":  # the same floats, stored the other way round
            good = {k: v.astype(">f4") for k, v in good.items()}
        if self.how in ("int64", "complex128", "longdouble"):
            good["weight"] = good["weight"].astype(self.how)
        if self.how == "float64 beyond float32":  # finite in the reply
            good = {k: np.full(v.shape, 1e39) for k, v in good.items()}
        if self.how == "reordered":
            good = dict(reversed(good.items()))
        metrics = {"num-examples": 10, "train_loss": 1.0}
        if self.how == "no count":
            metrics = {"train_loss": 1.0}
        if self.how == "nan":  # a quarantined node's metrics must not reach the round's
            metrics["train_loss"] = 1e6
        if self.how == "nan metrics":
            metrics.update(loss=float("nan"), accuracy=0.0)
        if self.how == "huge count":  # finite, but two of them sum past float64
            metrics.update({"num-examples": 1e308, "loss": 0.01, "accuracy": 0.99})
        content = RecordDict(
            {"arrays": ArrayRecord({k: Array(v) for k, v in good.items()}), "metrics": MetricRecord(metrics)}
        )
        return Message(content=content, reply_to=msg)


def test_malformed_replies_are_dropped_with_a_reason_and_the_round_goes_on():
    broken = {
        200 + i: (BrokenClient(how), {}) for i, how in enumerate(["crash", "wrong shape", "nan", "no count"])
    }
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=8)
    result = run(strategy, federation(extra=broken), rounds=2)
    assert accuracy(result.arrays) > 0.7
    dropped = strategy.history[-1]["dropped"]  # nodes that give no name are named by their node id
    assert "device out of memory" in dropped["200"]
    assert "array 'weight' has shape (3, 3), expected (10, 64)" in dropped["201"]
    assert "metric 'num-examples' missing" in dropped["203"]
    assert "non-finite" in strategy.history[-1]["quarantined"]["202"]  # the rule quarantines NaN itself
    assert result.train_metrics_clientapp[2]["train_loss"] < 10  # not the quarantined node's 1e6
    # Flower's own FedAvg ends the run on the same replies
    with pytest.raises(InconsistentMessageReplies):
        run(FedAvg(fraction_evaluate=0.0, min_available_nodes=8), federation(extra=broken), rounds=1)


def test_a_nodes_second_reply_in_a_round_is_dropped_with_a_reason():
    """One node is one client: a second reply from the same node (a grid that delivers it twice) is
    left out with a reason and the round goes on, whether trust is keyed by node ids or by names (it
    ended the round with "Round.client_ids must be distinct" before)."""

    class Twice(InProcessGrid):
        def send_and_receive(self, messages, timeout=None):
            replies = list(super().send_and_receive(messages, timeout))
            return replies + replies[-1:]

    for identity in ("node-id", "name"):
        grid = Twice(federation().nodes)
        strategy = TrustStrategy(
            rule="median", identity=identity, fraction_evaluate=0.0, min_available_nodes=4
        )
        run(strategy, grid, rounds=1)
        record = strategy.history[-1]
        assert len(record["clients"]) == 4
        ((name, reason),) = record["dropped"].items()
        assert (
            reason == f"node {record['node_ids'][-1]} already replied this round"
            and name in record["clients"]
        )


def test_a_quarantined_node_is_recorded_under_the_name_its_trust_is():
    """A round's record keys its quarantined nodes as it keys their trust, by the names nodes give (or
    their ids when they give none): a crashed device named ward-2 is quarantined under "ward-2"."""
    grid = federation(bad={2: {"node-name": "ward-2", "fedtrust-attack": "crash"}})
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=4)
    run(strategy, grid, rounds=1)
    record = strategy.history[-1]
    assert "ward-2" in record["clients"] and list(record["quarantined"]) == ["ward-2"]
    assert "non-finite" in record["quarantined"]["ward-2"]


def test_a_reply_in_another_float_layout_is_read_and_one_that_is_not_floats_is_dropped():
    """Arrays are matched by name and read in either byte order; integers, complex numbers and extended
    precision in a float entry would be truncated by a cast, so the reply goes, and the round goes on."""
    hows = ["big-endian", "reordered", "int64", "complex128", "longdouble"]
    broken = {200 + i: (BrokenClient(how), {}) for i, how in enumerate(hows)}
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=9)
    result = run(strategy, federation(extra=broken), rounds=2)
    assert accuracy(result.arrays) > 0.7
    record = strategy.history[-1]
    assert {"200", "201"} <= set(record["clients"]) and not record["quarantined"]
    for node, dtype in (("202", "int64"), ("203", "complex128"), ("204", "float128")):
        assert (
            record["dropped"][node] == f"array 'weight' holds {dtype}, expected float16, float32 or float64"
        )


def test_a_reply_whose_finite_values_overflow_the_models_dtype_is_quarantined_saying_so():
    """A float64 reply of 1e39 is finite; read into the float32 round it is inf. It is quarantined, as
    before, but the reason no longer says the client sent "non-finite entries (0 NaN, 650 Inf)"."""
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=5)
    run(strategy, federation(extra={200: (BrokenClient("float64 beyond float32"), {})}), rounds=1)
    assert strategy.history[-1]["quarantined"] == {
        "200": "the reply's finite values overflow float32 when converted: 650 of them in 'weight' (float64), "
        "'bias' (float64), up to 1e+39, exceed float32's max 3.4e+38"
    }


def test_a_count_too_large_for_the_rounds_is_left_out_of_arfls_initial_report_too(caplog):
    """A node claiming 1e300 examples: beyond float32, so every round quarantines it; recorded from the
    initial report it would outweigh every honest node in every round after. The log names the count it
    sent (it said num_samples=inf, the count read into float32)."""

    class Boaster:
        def __call__(self, msg, context):
            metrics = MetricRecord({"num-examples": 1e300, "train_loss": 1.0})
            content = RecordDict({"metrics": metrics})
            if "arrays" in msg.content and msg.metadata.message_type == "train":
                content["arrays"] = msg.content["arrays"]
            return Message(content=content, reply_to=msg)

    strategy = TrustStrategy(rule="arfl", fraction_evaluate=0.0, min_available_nodes=5)
    with caplog.at_level("WARNING"):
        result = run(strategy, federation(extra={200: (Boaster(), {})}), rounds=2)
    assert (
        "initial report: left out node 200: num-examples=1e+300 overflows float32 (max 3.4e+38)"
        in caplog.text
    )
    assert 200 not in strategy.rule.state_dict()["samples"]
    assert all(r["error"] is None for r in strategy.history) and accuracy(result.arrays) > 0.7


def test_fltrust_trains_the_servers_own_update_on_its_root_data():
    from fedtrust.flower import server_training

    root = (DIGITS.x_test[:100], DIGITS.y_test[:100])
    with pytest.raises(ValueError, match="give server_update="):
        TrustStrategy(rule="fltrust")
    calls = []
    train = server_training(model(), root, {"local-epochs": 2, "learning-rate": 0.5})

    def server_update(arrays, t):
        calls.append(t)
        return train(arrays, t)

    strategy = TrustStrategy(rule="fltrust", server_update=server_update, fraction_evaluate=0.0,
                             min_available_nodes=4)  # fmt: skip
    result = run(strategy, federation(bad={2: {"fedtrust-attack": "sign_flip"}}), rounds=3)
    assert calls == [1, 2, 3]  # once a round
    assert strategy.trust()["partition-2"] == 0.0 and accuracy(result.arrays) > 0.8


def test_a_server_side_model_of_another_architecture_than_the_global_arrays_is_refused_by_name():
    """FOCUS's ``model=`` or FLTrust's ``server_training`` model not being the model of ``initial_arrays``
    is refused naming it and the first array that differs (it failed inside torch, "split_with_sizes
    expects split_sizes to sum exactly to 650", in round 1 after every node had trained)."""
    from fedtrust.flower import server_training

    other = torch.nn.Sequential(torch.nn.Linear(64, 5), torch.nn.ReLU(), torch.nn.Linear(5, 10))
    root = (DIGITS.x_test[:100], DIGITS.y_test[:100])
    grid = federation()
    send = grid.send_and_receive
    sent = []
    grid.send_and_receive = lambda messages, timeout=None: send(sent.extend(messages) or messages, timeout)
    strategy = TrustStrategy(rule="focus", model=other, benchmark=root, min_available_nodes=4)
    with pytest.raises(ValueError, match=r"model= is not the model of the global arrays \(385 values, the "
                       r"arrays 650\): the arrays hold \('weight', \(10, 64\)\), the model \('0.weight', "
                       r"\(5, 64\)\)"):  # fmt: skip
        run(strategy, grid, rounds=1)
    assert not sent  # before any node trains
    strategy = TrustStrategy(
        rule="fltrust", server_update=server_training(other, root), min_available_nodes=4
    )
    with pytest.raises(ValueError, match=r"server_training's model is not the model of the global arrays"):
        run(strategy, grid, rounds=1)


def test_client_evaluations_with_a_non_finite_metric_are_left_out_of_the_average():
    broken = {300: (BrokenClient("nan metrics"), {})}
    strategy = TrustStrategy(rule="mean", min_available_nodes=5, min_evaluate_nodes=5)
    result = run(strategy, federation(extra=broken), rounds=1)
    evaluation = result.evaluate_metrics_clientapp[1]
    assert math.isfinite(evaluation["loss"]) and evaluation["accuracy"] > 0.5


def test_two_nodes_claiming_1e308_examples_do_not_zero_the_round_evaluation(caplog):
    """Their total was inf, each weighted metric inf / inf, which Flower's FedAvg reported as accuracy 0.0
    and loss 0.0 without a word. Counts beyond float32 are left out of the metrics, as training quarantines
    them, and the log says so."""
    huge = {300 + i: (BrokenClient("huge count"), {}) for i in range(2)}
    strategy = TrustStrategy(rule="mean", min_available_nodes=6, min_evaluate_nodes=6)
    with caplog.at_level("WARNING"):
        result = run(strategy, federation(extra=huge), rounds=1)
    evaluation = result.evaluate_metrics_clientapp[1]
    assert 0.5 < evaluation["accuracy"] < 0.99 and 0.01 < evaluation["loss"] < 10
    line = next(x for x in caplog.text.splitlines() if "beyond float32's range (3.4e+38) left out" in x)
    assert "num-examples" in line and "'300'" in line and "'301'" in line


def test_focus_scores_updates_on_the_server_benchmark():
    bench = (DIGITS.x_test[:100], DIGITS.y_test[:100])
    strategy = TrustStrategy(
        rule="focus", model=model(), benchmark=bench, fraction_evaluate=0.0, min_available_nodes=4
    )
    run(strategy, federation(bad={1: {"fedtrust-corruption": "random_labels"}}), rounds=4)
    assert strategy.trust()["partition-1"] < 0.05


def test_fedag_broadcasts_the_posterior_variance():
    strategy = TrustStrategy(rule="fedag", fraction_evaluate=0.0, min_available_nodes=4)
    grid = federation()
    run(strategy, grid, rounds=1)
    messages = list(strategy.configure_train(2, initial(), flwr.app.ConfigRecord(), grid))
    var = messages[0].content["posterior-var"]
    assert list(var.keys()) == ["weight", "bias"] and float(var["weight"].numpy().max()) > 0


def test_client_evaluation_is_averaged_and_bad_evaluations_skipped():
    broken = {300: (BrokenClient("crash"), {})}
    strategy = TrustStrategy(rule="mean", min_available_nodes=5, min_evaluate_nodes=5)
    result = run(strategy, federation(extra=broken), rounds=1)
    evaluation = result.evaluate_metrics_clientapp[1]
    assert 0.5 < evaluation["accuracy"] <= 1.0 and math.isfinite(evaluation["loss"])


def test_one_nodes_odd_metric_does_not_take_it_from_the_others():
    """A node sending acc as [0.9, 0.8] where three sent a number blanked acc for every node (the metric
    was dropped from all); it is now averaged over the three, weighted by num-examples, and the odd node
    named. A key fewer than half the nodes hold in one form (cm) is the round's for no one."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from fedtrust.flower.replies import Reply, metric_groups

    sent = [{"num-examples": 10, "acc": 0.9, "cm": [1, 2]}, {"num-examples": 10, "acc": [0.9, 0.8], "cm": [1, 2, 3]},
            {"num-examples": 30, "acc": 0.5}, {"num-examples": 10, "acc": 0.7}]  # fmt: skip
    replies = [
        Reply(100 + k, f"n{k}", m, RecordDict({"metrics": MetricRecord(m)})) for k, m in enumerate(sent)
    ]
    groups, left_out = metric_groups(replies, "num-examples")
    assert left_out == {"acc": ["n1"], "cm": ["n0", "n1", "n2", "n3"]}
    (group,) = groups
    assert aggregate_metricrecords(group, "num-examples")["acc"] == pytest.approx((9 + 15 + 7) / 50)
    agreeing = replies[2:]
    assert metric_groups(agreeing, "num-examples") == ([[r.content for r in agreeing]], {})  # as received
    # a user's own function (it may count its records, or combine metrics) is called once, on every reply
    (group,), left_out = metric_groups(replies, "num-examples", per_metric=False)
    assert len(group) == 4 and all(set(c["metrics"]) == {"num-examples"} for c in group)
    assert left_out == {"acc": ["n0", "n1", "n2", "n3"], "cm": ["n0", "n1", "n2", "n3"]}


def test_strategy_rejects_bad_setup():
    with pytest.raises(ValueError, match="unknown rule 'krumm'"):
        TrustStrategy(rule="krumm")
    with pytest.raises(ValueError, match="a benchmark split needs the model"):
        TrustStrategy(rule="focus", benchmark=(DIGITS.x_test, DIGITS.y_test))
    with pytest.raises(ValueError, match="rule 'focus' scores each update on the server's benchmark split"):
        TrustStrategy(rule="focus")
    with pytest.raises(ValueError, match="rule 'arfl' scores each update"):
        TrustStrategy(rule="arfl", rule_options={"defence": "benchmark"})
    # each option named with the value, before any node trains
    for options, message in [
        ({"rule": 0.5}, "rule must be a rule name or a fedtrust rule object, got 0.5"),
        ({"rule_options": [("f", 1)]}, "rule_options must be a dict"),
        ({"train_metrics_aggr_fn": "mean"}, "train_metrics_aggr_fn must be a function or None, got 'mean'"),
        ({"corrupted": "partition-1"}, "corrupted must be a list of node names"),
        ({"initial_report": "no"}, "initial_report must be True or False, got 'no'"),
        ({"query_timeout": True}, "query_timeout must be seconds > 0, got True"),
        ({"run_dir": "runs/x"}, "run_dir must be an absolute path, got 'runs/x'"),
        ({"run_dir": 5}, "run_dir must be a path, got 5"),
        ({"model": model(), "task": "regresion"}, "task must be 'classification' or 'regression'"),
        ({"corrupted": 5}, "corrupted must be a list of node names, got 5"),
        ({"model": 3}, "model must be a torch.nn.Module"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrustStrategy(**options)
    # a benchmark split the model cannot score is refused here, not inside the model in round 1
    x, y = DIGITS.x_test, DIGITS.y_test
    for benchmark, message in [
        ((x[:, :7], y), r"cannot score the benchmark split \(x of shape \(450, 7\)"),
        ((x, y[:5]), r"one label per row of x, got x of shape \(450, 64\) and y of shape \(5,\)"),
        ((x, y.float()), "benchmark labels must be integer classes, got torch.float32"),
        (x, "benchmark must be a pair \\(x, y\\)"),
        ((x.nan_to_num(0) * math.nan, y), "loss on the benchmark split is nan"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrustStrategy(rule="focus", model=model(), benchmark=benchmark)
    strategy = TrustStrategy(rule="focus", model=model(), benchmark=(x.numpy(), y.numpy()))
    assert isinstance(strategy.benchmark[0], torch.Tensor)


def test_simulation_corrupts_the_partitions_the_run_config_lists():
    from fedtrust.flower.client import node_role

    run_config = {"fedtrust-corrupted-partitions": "1 3", "fedtrust-corruption": "random_labels"}

    def role(node_config):
        return node_role(
            Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config)
        )

    assert role({"partition-id": 1}) == {"fedtrust-corruption": "random_labels"}
    assert role({"partition-id": 2}) == {}
    assert role({"partition-id": 3, "fedtrust-attack": "sign_flip"}) == {
        "fedtrust-attack": "sign_flip",
        "fedtrust-corruption": "random_labels",
    }


def test_a_corrupted_partition_that_is_no_partition_id_is_refused_with_the_entry():
    """``fedtrust-corrupted-partitions="7 x"`` left every node honest, silently (flower-run, 3 nodes)."""
    from fedtrust.flower import corrupted_partitions

    assert corrupted_partitions({"fedtrust-corrupted-partitions": "3, 1 3"}) == [3, 1]  # listed order
    assert corrupted_partitions({"fedtrust-corrupted-partitions": ""}) == corrupted_partitions({}) == []
    for listed, entry in (("7 x", "'x'"), ("1 -2", "'-2'"), ("1.5", "'1.5'")):
        with pytest.raises(ValueError, match=f"fedtrust-corrupted-partitions: {entry} is not a partition id"):
            corrupted_partitions({"fedtrust-corrupted-partitions": listed})


def test_a_corrupted_name_no_node_had_is_logged_not_scored_in_silence(caplog):
    """``corrupted=`` naming a partition beyond the federation (7 of 4) or a misspelt node: the run says
    which names no node had and which nodes there were; a name that was there is not listed."""
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=4,
                             corrupted=["partition-7", "partition-2"])  # fmt: skip
    with caplog.at_level("WARNING"):
        run(strategy, federation(), rounds=1)
    line = next(x for x in caplog.text.splitlines() if "corrupted=" in x)
    assert "no node of this run's 1 rounds was named partition-7 (the nodes were partition-0" in line
    assert "partition-2," in line and "named partition-2" not in line
    caplog.clear()
    with caplog.at_level("WARNING"):
        run(TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=4,
                          corrupted=["partition-2"]), federation(), rounds=1)  # fmt: skip
    assert "corrupted=" not in caplog.text


def test_a_node_role_takes_options_and_dba_nodes_take_the_stripes_in_listed_order():
    from fedtrust.flower.client import LocalData, _attacked, _Nodes

    run_config = {"fedtrust-corrupted-partitions": "7 4", "fedtrust-corruption": "dba(parts=2, samples=0.5)"}
    x, y = torch.rand(10, 64) * 0.5, torch.arange(10) % 10

    def context(pid, **node):
        return Context(run_id=1, node_id=pid, node_config={"partition-id": pid, **node}, state=RecordDict(),
                       run_config=run_config)  # fmt: skip

    nodes = _Nodes(lambda c: torch.nn.Linear(64, 10), lambda c: LocalData(x, y, x, y, 10, (1, 8, 8)),
                   "classification", 0)  # fmt: skip
    # 8x8 images: a 2x2 trigger in the corner, stripe 0 its row 6, stripe 1 its row 7
    for pid, row in ((7, 6), (4, 7)):
        data = nodes(context(pid))[1]
        poisoned = data.y_train != y
        assert (
            int((data.y_train == 0).sum() - (y == 0).sum()) == int(poisoned.sum())
            and int(poisoned.sum()) >= 4
        )
        lit = data.x_train[:, [row * 8 + 6, row * 8 + 7]] == 1.0
        other = data.x_train[:, [(13 - row) * 8 + 6, (13 - row) * 8 + 7]] == 1.0
        assert int(lit.all(1).sum()) == 5 and not other.any()  # half the rows, this node's stripe only
    honest = nodes(context(2))[1]
    assert honest.x_train is x
    # a trigger needs the images' shape, named in the error
    shapeless = _Nodes(lambda c: torch.nn.Linear(64, 10), lambda c: LocalData(x, y, x, y, 10),
                       "classification", 0)  # fmt: skip
    with pytest.raises(ValueError, match="input_shape"):
        shapeless(context(4))
    # model replacement on a lone node: boost given, or a clear refusal (it cannot count the round)
    start, new, g = torch.zeros(3), torch.ones(3), torch.Generator()
    boosted = _attacked(context(4, **{"fedtrust-attack": "model_replacement(boost=10)"}), start, new, g)
    torch.testing.assert_close(boosted, torch.full((3,), 10.0))
    with pytest.raises(ValueError, match=r"boost="):
        _attacked(context(4, **{"fedtrust-attack": "model_replacement"}), start, new, g)
    with pytest.raises(ValueError, match="samples must be <= 1.0, got 2.0"):
        shapeless(context(5, **{"fedtrust-corruption": "label_flip(samples=2)"}))


X, Y = torch.rand(12, 64), torch.arange(12) % 10


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"y_train": Y.float()}, "y_train must hold integer class labels, got torch.float32"),
        ({"y_train": Y + 5}, r"y_train\[5\] = 10 is not a class of 0..9"),
        ({"x_test": torch.rand(12, 63)}, r"x_test rows have shape \(63,\), x_train rows \(64,\)"),
        ({"x_train": X[:0], "y_train": Y[:0]}, "x_train has no rows"),
        ({"y_test": Y[:5]}, r"y_test must hold one label per row of x_test \(12\), got shape \(5,\)"),
        ({"x_train": X.long()}, "x_train must be a floating"),
        ({"x_train": X.tolist()}, "x_train must be a torch tensor or a numpy array, got list"),
    ],
)
def test_a_nodes_local_data_is_refused_naming_the_field(fields, message):
    """Setup mistakes failed deep in torch on the node's first message ("expected target dtype to be Long",
    "Target 7 is out of bounds", "mat1 and mat2 shapes cannot be multiplied"); they are named now."""
    from fedtrust.flower import LocalData

    with pytest.raises(ValueError, match=f"LocalData: {message}"):
        LocalData(**{"x_train": X, "y_train": Y, "x_test": X, "y_test": Y, "num_classes": 10, **fields})


def test_local_data_takes_what_a_node_may_well_give():
    """int32 labels (numpy's default int on Windows) become int64, which cross-entropy takes (they failed
    in the first loss); a column of regression targets is read as one target per row; no test rows at all
    (torch.empty(0)) is a node without a test split."""
    from fedtrust.flower import LocalData

    d = LocalData(X.numpy(), Y.numpy().astype(np.int32), torch.empty(0), torch.empty(0), 10)
    assert d.y_train.dtype == torch.int64 and d.x_test.shape == (0, 64) and d.y_test.shape == (0,)
    r = LocalData(X, X[:, :1], X, X[:, :1])
    assert r.y_train.shape == r.y_test.shape == (12,)


def test_a_node_whose_model_does_not_fit_its_data_or_the_arrays_answers_with_an_error_naming_it():
    from fedtrust.flower import LocalData

    numpy_data = LocalData(X.numpy(), Y.numpy(), X.numpy(), Y.numpy(), 10)  # taken as tensors
    assert isinstance(numpy_data.x_train, torch.Tensor) and numpy_data.y_train.dtype == torch.int64

    def node(model_fn, data=numpy_data, **config):
        app = trust_client_app(model_fn, lambda ctx: data)
        grid = InProcessGrid({100: (app, {"partition-id": 0, **config})})
        strategy = TrustStrategy(
            rule="median", fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1
        )
        run(strategy, grid, rounds=1)
        return strategy.history[0]["dropped"]["100"]

    assert "cannot take its rows (data_fn's x_train, of shape (64,) each)" in node(
        lambda c: torch.nn.Linear(63, 10)
    )
    assert "gives 3 class scores, but data_fn's y_train holds label 9" in node(
        lambda c: torch.nn.Linear(64, 3)
    )
    wrapped = node(lambda c: torch.nn.Sequential(torch.nn.Linear(64, 10)))  # fits the data, not the arrays
    assert "this node's model (model_fn's) is not the model of the global arrays" in wrapped
    lie = node(lambda c: model(), **{"fedtrust-lie": "zero"})
    assert "fedtrust-lie must be a number (the train_loss this node reports), got 'zero'" in lie


def test_a_sign_flipping_node_is_caught_and_a_colluding_attack_is_refused():
    strategy = TrustStrategy(rule="ivar_vb", fraction_evaluate=0.0, min_available_nodes=4)
    result = run(strategy, federation(bad={3: {"fedtrust-attack": "sign_flip"}}))
    last = strategy.trust()
    assert min(last, key=last.get) == "partition-3" and accuracy(result.arrays) > 0.8
    # ALIE needs every client's update: a real lone client cannot run it; its reply is dropped, not fatal
    strategy = TrustStrategy(rule="mean", fraction_evaluate=0.0, min_available_nodes=4)
    run(strategy, federation(bad={0: {"fedtrust-attack": "alie"}}), rounds=1)
    assert "needs the other clients' updates" in strategy.history[-1]["dropped"]["100"]  # never named itself


def test_credentials_make_a_verifiable_tls_chain_and_supernode_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from fedtrust.flower.credentials import supernode_keys, tls_certificates

    paths = tls_certificates(tmp_path, ["127.0.0.1", "superlink.example.org", "*.example.org", "superlink_1"])
    ca = x509.load_pem_x509_certificate(paths["ca.crt"].read_bytes())
    server = x509.load_pem_x509_certificate(paths["server.pem"].read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == [
        "superlink.example.org",
        "*.example.org",
        "superlink_1",
    ]
    assert paths["server.key"].stat().st_mode & 0o077 == 0  # the private key is not world-readable
    private, public = supernode_keys(tmp_path, "node-1")
    key = load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert load_ssh_public_key(public.read_bytes()) == key.public_key()
    with pytest.raises(ValueError, match="hosts must name at least one"):
        tls_certificates(tmp_path, [])


def test_credentials_run_again_keep_the_ca_and_the_keys_and_add_new_sites(tmp_path):
    """A second `fedtrust flower-credentials` into the same directory (the natural way to add a site)
    keeps the CA, the server's certificate and the registered keys, and writes only the new key pairs;
    other hosts are refused (the certificate would not match), and --force replaces everything."""
    from typer.testing import CliRunner

    from fedtrust.cli import app

    def call(*args):
        return CliRunner().invoke(app, ["flower-credentials", "--out", str(tmp_path), *args])

    def files():
        return {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    assert call("--nodes", "2").exit_code == 0
    before = files()
    again = call("--nodes", "3")
    assert again.exit_code == 0 and "kept" in again.output
    after = files()
    assert {k: after[k] for k in before} == before and set(after) - set(before) == {"node-3", "node-3.pub"}
    moved = call("--host", "superlink.example.org")
    assert (
        moved.exit_code == 2
        and "is for hosts 127.0.0.1, localhost, not superlink.example.org" in moved.output
    )
    assert files() == after
    assert call("--force", "--nodes", "1").exit_code == 0
    assert files()["ca.crt"] != after["ca.crt"] and files()["node-1"] != after["node-1"]


def test_a_round_where_every_reply_is_quarantined_keeps_the_model_and_logs_why(caplog):
    nan_nodes = {200 + i: (BrokenClient("nan"), {}) for i in range(3)}
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=3)
    with caplog.at_level("WARNING"):
        result = run(strategy, InProcessGrid(nan_nodes), rounds=2)
    for name, array in initial().items():  # the initial model, not an empty or NaN ArrayRecord
        np.testing.assert_array_equal(result.arrays[name].numpy(), array.numpy())
    errors = [h["error"] for h in strategy.history]
    assert len(errors) == 2 and all(
        "NoValidUpdates: median: all 3 clients were quarantined" in e for e in errors
    )
    assert "non-finite" in errors[0]
    assert "round 2: the global model stays: NoValidUpdates" in caplog.text


def test_a_rule_whose_estimator_stops_at_max_iter_logs_it_each_round_and_keeps_it_in_history(
    caplog, tmp_path
):
    from fedtrust.inference import ConvergenceWarning

    strategy = TrustStrategy(rule="ivar_vb", rule_options={"max_iter": 1}, fraction_evaluate=0.0,
                             min_available_nodes=4, run_dir=tmp_path / "run")  # fmt: skip
    with caplog.at_level("WARNING"), pytest.warns(ConvergenceWarning):
        run(strategy, federation(), rounds=2)
    for t in (1, 2):
        assert f"round {t}: ivar_vb stopped at its iteration limit (1 iterations)" in caplog.text
    written = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    for record in (*strategy.history, *written):
        assert record["warning"].startswith("ivar_vb stopped at its iteration limit (1 iterations)")
    quiet = TrustStrategy(rule="ivar_vb", rule_options={"tol": 1e-3}, fraction_evaluate=0.0,
                          min_available_nodes=4)  # fmt: skip
    run(quiet, federation(), rounds=1)
    assert "warning" not in quiet.history[0]


def test_a_batch_norm_model_federates_its_running_statistics_and_keeps_its_integer_counter():
    def bn_model():
        return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 10))  # fmt: skip

    app = trust_client_app(
        lambda ctx: bn_model(), lambda ctx: share(int(ctx.node_config["partition-id"])), lr=0.2
    )
    grid = InProcessGrid({100 + k: (app, {"partition-id": k}) for k in range(4)})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        start = ArrayRecord(bn_model().state_dict())
    strategy = TrustStrategy(rule="median", fraction_evaluate=0.0, min_available_nodes=4)
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=2)
    counter = result.arrays["1.num_batches_tracked"].numpy()
    assert counter.dtype == np.int64 and int(counter) == 0  # the global model's, not aggregated
    assert float(np.abs(result.arrays["1.running_mean"].numpy()).min()) > 0  # aggregated statistics

    def score(arrays):
        model = FlatModel(bn_model(), "classification")
        return model.evaluate(ArrayLayout(arrays).flatten(arrays), DIGITS.x_test, DIGITS.y_test)["accuracy"]

    assert score(result.arrays) > 0.8 > score(start) + 0.5


def test_a_round_waits_for_the_minimum_nodes_before_it_sizes_its_sample(monkeypatch):
    """Flower's FedAvg sizes the sample from the nodes connected before it waits for min_available_nodes
    (two of four SuperNodes up: two sampled, the other two miss the round); the strategy waits first, so
    fraction_train=1.0 trains every node it waited for, in the first round too."""
    grid = federation()
    late = {102, 103}
    grid.offline |= late
    waits = []

    def sleep(seconds):  # the late nodes connect while the strategy waits
        waits.append(seconds)
        grid.offline -= late

    monkeypatch.setattr("time.sleep", sleep)
    monkeypatch.setattr("flwr.serverapp.strategy.strategy_utils.sleep", sleep)  # Flower's own wait
    strategy = TrustStrategy(rule="mean", fraction_evaluate=0.0, min_available_nodes=4)
    strategy.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    assert waits and len(strategy.trust(0)) == 4


def test_a_strategy_that_trains_no_one_waits_for_no_one(monkeypatch):
    """fraction_train=0.0 (evaluation only): FedAvg samples no node and waits for none, nor does the
    strategy, however many nodes min_available_nodes asks for."""

    def sleep(seconds):
        raise AssertionError("waited for nodes with fraction_train=0.0")

    monkeypatch.setattr("time.sleep", sleep)
    monkeypatch.setattr("flwr.serverapp.strategy.strategy_utils.sleep", sleep)
    strategy = TrustStrategy(rule="mean", fraction_train=0.0, fraction_evaluate=0.0, min_available_nodes=5)
    strategy.start(grid=federation(), initial_arrays=initial(), num_rounds=1)


def test_initial_arrays_that_are_not_an_array_record_are_refused_as_the_servers_mistake():
    """A torch state_dict where Flower takes an ArrayRecord: a TypeError saying how to make one, before any
    node is messaged, not a reply-side MalformedReply in round 1."""
    grid = federation()
    sent = []
    send = grid.send_and_receive
    grid.send_and_receive = lambda messages, timeout=None: send(sent.extend(messages) or messages, timeout)
    with pytest.raises(TypeError, match=r"initial_arrays must be a flwr.app.ArrayRecord .*got dict"):
        TrustStrategy(rule="median").start(grid=grid, initial_arrays=dict(model().state_dict()), num_rounds=1)
    assert sent == []


@pytest.mark.parametrize(
    ("arrays", "says"),
    [
        (lambda a: ArrayRecord({k: Array(np.full_like(v.numpy(), np.nan)) for k, v in a.items()}),
         r"initial_arrays\['weight'\] holds 640 NaN and 0 Inf of 640 values"),
        (lambda a: ArrayRecord(), r"initial_arrays holds no floating-point values to train \(arrays: none\)"),
        (lambda a: ArrayRecord({"step": Array(np.zeros(3, np.int64))}), r"no floating-point values .*\['step'\]"),
    ],
)  # fmt: skip
def test_a_starting_model_with_nothing_finite_to_train_is_refused_as_the_servers_mistake(arrays, says):
    """A NaN starting model made every node's update non-finite, and the nodes were quarantined for it
    round after round; an empty one trained nothing. Refused before any node is messaged, naming the array."""
    grid = federation()
    sent = []
    send = grid.send_and_receive
    grid.send_and_receive = lambda messages, timeout=None: send(sent.extend(messages) or messages, timeout)
    with pytest.raises(ValueError, match=says):
        TrustStrategy(rule="median").start(grid=grid, initial_arrays=arrays(initial()), num_rounds=1)
    assert sent == []


def test_the_example_client_names_the_node_config_keys_it_picks_its_data_by():
    """A SuperNode started with only a node-name (as a hospital would) was dropped every round with a bare
    KeyError 'partition-id'; the example's ClientApp now says which keys it needs and what to do instead."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "flower"))
    try:
        from fedtrust_example.client_app import _data
    finally:
        sys.path.pop(0)
    context = Context(run_id=1, node_id=1, node_config={"node-name": "hospital-d"}, state=RecordDict(),
                      run_config={"dataset": "digits", "benchmark-size": 0})  # fmt: skip
    with pytest.raises(ValueError, match=r"partition-id and num-partitions missing \(--node-config"):
        _data(context)


def test_a_metric_one_node_adds_is_logged_as_not_the_rounds_not_as_every_reply_left_out(caplog):
    """One node adding its own key listed every reply as left out of an average that never happened (the
    flower audit); it is now named as not the round's, and a metric averaged without some replies still
    names those replies."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from fedtrust.flower.replies import Reply

    sent = [{"num-examples": 10, "acc": 0.9}, {"num-examples": 10, "acc": 0.8, "evil": 1.0},
            {"num-examples": 10, "acc": [0.5, 0.5]}, {"num-examples": 10, "acc": 0.7}]  # fmt: skip
    replies = [
        Reply(100 + k, f"n{k}", m, RecordDict({"metrics": MetricRecord(m)})) for k, m in enumerate(sent)
    ]
    strategy = TrustStrategy(rule="mean")
    with caplog.at_level("WARNING"):
        metrics = strategy._aggregate_metrics(replies, aggregate_metricrecords, "round 1")
    assert set(metrics) == {"acc"} and metrics["acc"] == pytest.approx(0.8)
    assert "(metric: the replies left out): {'acc': ['n2']}" in caplog.text
    assert "are not the round's: ['evil']" in caplog.text


def test_wrapped_in_flowers_differential_privacy_every_round_keeps_its_record():
    """A wrapper's own start runs the rounds (Flower's DP strategies): the strategy's history still
    holds every round, with trust and the nodes' evaluation (it stayed empty: the records were written
    at the end of start's rounds, which never came)."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    inner = TrustStrategy(rule="median", min_available_nodes=4, min_evaluate_nodes=4)
    dp = DifferentialPrivacyServerSideFixedClipping(
        inner, noise_multiplier=0.0, clipping_norm=100.0, num_sampled_clients=4
    )
    result = run(dp, federation(bad={2: {"fedtrust-corruption": "random_labels"}}))
    assert [r["round"] for r in inner.history] == [1, 2, 3]
    assert min(inner.trust(), key=inner.trust().get) == "partition-2"
    assert all(r["metrics"] == r["evaluate_metrics"] and "accuracy" in r["metrics"] for r in inner.history)
    assert inner.history[-1]["metrics"]["accuracy"] == pytest.approx(
        result.evaluate_metrics_clientapp[3]["accuracy"]
    )
    first = [inner.trust(t) for t in range(3)]
    run(dp, federation(bad={2: {"fedtrust-corruption": "random_labels"}}))  # a second run: a new one
    assert [r["round"] for r in inner.history] == [1, 2, 3]
    for t in range(3):
        assert inner.trust(t) == pytest.approx(first[t])


def test_a_run_directory_a_wrapper_would_leave_empty_is_refused_before_anyone_trains(tmp_path):
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    class Counting(InProcessGrid):
        sent = 0

        def send_and_receive(self, messages, timeout=None):
            messages = list(messages)
            Counting.sent += len(messages)
            return super().send_and_receive(messages, timeout)

    inner = TrustStrategy(
        rule="median", fraction_evaluate=0.0, min_available_nodes=4, run_dir=tmp_path / "run"
    )
    dp = DifferentialPrivacyServerSideFixedClipping(
        inner, noise_multiplier=0.0, clipping_norm=100.0, num_sampled_clients=4
    )
    grid = Counting(federation().nodes)
    with pytest.raises(ValueError, match=r"run_dir=.*written by TrustStrategy.start.*Drop run_dir"):
        run(dp, grid)
    assert Counting.sent == 0
    assert not any((tmp_path / "run").glob("*.jsonl"))


@pytest.mark.parametrize(
    ("rule", "options", "parts", "far_ones"),
    [
        ("ivar_vb", {}, 5, [4]),
        ("ivar_mle", {}, 5, [4]),
        ("icov_vb", {}, 5, [4]),
        ("icov_mle", {}, 6, [4, 5]),
        ("icov_mle", {"sybils": "off"}, 6, [4, 5]),
        ("ivar_vb", {"sybils": "off"}, 6, [4, 5]),
    ],
)
def test_nodes_sending_the_model_far_off_take_nothing_from_the_trust_rules_model(
    rule, options, parts, far_ones
):
    """Nodes replying +-1e11 in every entry get trust ~1e-26 and the model ends where the honest nodes
    alone take it (2 rounds). IVAR-VB, IVAR-MLE and ICOV-VB gave one such node of five a trust of 2e-12 to
    5e-12 (0.2-0.5 per entry in the model; fixed in 947f2bb-cf61307); with two of six ICOV-MLE ended at
    0.731 (0.102 with sybils="off") and IVAR-VB with "off" at 0.598, against 0.816 and 0.849 without
    them."""
    grid = far(federation(parts=parts), far_ones)
    strategy = TrustStrategy(
        rule=rule, rule_options=options, fraction_evaluate=0.0, min_available_nodes=parts
    )
    attacked = accuracy(run(strategy, grid, rounds=2).arrays)
    assert sum(strategy.trust()[f"partition-{k}"] for k in far_ones) < 1e-20
    honest = federation(parts=parts)
    for k in far_ones:
        del honest.nodes[100 + k]
    alone = TrustStrategy(
        rule=rule, rule_options=options, fraction_evaluate=0.0, min_available_nodes=len(honest.nodes)
    )
    assert attacked == pytest.approx(accuracy(run(alone, honest, rounds=2).arrays), abs=0.02)
