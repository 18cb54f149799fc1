"""What an operator keeps of a Flower run: trust per named node, a run directory ``fedtrust report``
reads, state that survives a SuperLink restart, and the history of a node that leaves and rejoins."""

import json
import os
import pickle

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")
from flower_grid import InProcessGrid, federation, initial, run, server_identity  # noqa: E402, F401
from flwr.app import Error, Message  # noqa: E402

from fedtrust.checkpoint import CorruptFileError  # noqa: E402
from fedtrust.flower import TrustStrategy, trust_client_app  # noqa: E402
from fedtrust.flower.replies import NO_REPLY  # noqa: E402
from fedtrust.report import load_runs, write_report  # noqa: E402
from fedtrust.sim.store import source_hash  # noqa: E402

QUIET = {"fraction_evaluate": 0.0, "min_available_nodes": 4}


def test_the_run_directory_is_a_run_the_report_reads(tmp_path):
    """Named nodes, the known corrupted one scored by detection AUROC, server accuracy per round."""
    strategy = TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", corrupted=["partition-2"], **QUIET)
    grid = federation(bad={2: {"fedtrust-corruption": "random_labels"}})
    evaluate = lambda t, arrays: flwr.app.MetricRecord({"accuracy": 0.5 + t / 10})  # noqa: E731
    strategy.start(grid=grid, initial_arrays=initial(), num_rounds=3, evaluate_fn=evaluate)
    (found,) = load_runs(tmp_path)
    assert found.status == "finished" and found.rule == "ivar_vb" and found.problem is None
    assert found.curve() == ([1, 2, 3], [0.6, 0.7, 0.8])
    last = found.rounds[-1]
    assert sorted(last["clients"]) == [f"partition-{k}" for k in range(4)]
    assert sorted(last["node_ids"]) == [100, 101, 102, 103]
    assert found.mean_auroc() == 1.0 and found.corrupted_weight() < 0.05
    report = write_report(tmp_path, tmp_path / "report", load_runs(tmp_path)).read_text()
    assert "ivar_vb" in report and "1.00" in report
    # a second run directory of the same settings is a run of its own, in a column named by its folder
    again = TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "again", corrupted=["partition-2"], **QUIET)
    again.start(grid=grid, initial_arrays=initial(), num_rounds=2, evaluate_fn=evaluate)
    report = write_report(tmp_path, tmp_path / "report", load_runs(tmp_path)).read_text()
    assert "| rule | flower: again | flower: run |" in report and "| ivar_vb | 0.700 | 0.800 |" in report


def test_a_restarted_superlink_goes_on_from_the_checkpoint(tmp_path):
    """Two rounds, a restart (a new strategy, the same run_dir), two more: the model, the reputations and
    the round numbers go on, and the result equals four rounds without a restart."""
    straight = run(TrustStrategy(rule="ivar_vb", **QUIET), federation(), rounds=4)
    run(TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", **QUIET), federation(), rounds=2)
    sent = []
    grid = federation()
    send = grid.send_and_receive
    grid.send_and_receive = lambda messages, timeout=None: send(
        sent.extend(int(m.content["config"]["server-round"]) for m in messages) or messages, timeout
    )
    again = TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", **QUIET)
    result = run(again, grid, rounds=4)
    assert sent == [3] * 4 + [4] * 4
    for name in straight.arrays.keys():
        np.testing.assert_allclose(result.arrays[name].numpy(), straight.arrays[name].numpy(), rtol=0,
                                   atol=16 * np.finfo(np.float32).eps)  # fmt: skip
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4]
    assert [r["round"] for r in again.history] == [1, 2, 3, 4]
    lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3, 4]
    # a finished run is not trained again; another rule or fewer rounds is refused by name
    done = TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", **QUIET)
    sent.clear()
    assert sorted(run(done, grid, rounds=4).train_metrics_clientapp) == [1, 2, 3, 4] and not sent
    with pytest.raises(ValueError, match="holds 4 rounds already; ask for num_rounds >= 4"):
        run(TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", **QUIET), grid, rounds=3)
    with pytest.raises(ValueError, match="holds a run of .*ivar_vb.* not of this strategy .*median"):
        run(TrustStrategy(rule="median", run_dir=tmp_path / "run", **QUIET), grid, rounds=5)
    with pytest.raises(ValueError, match="holds a run of .*ivar_vb.* not of this strategy .*'window': 5"):
        run(TrustStrategy(rule="ivar_vb(window=5)", run_dir=tmp_path / "run", **QUIET), grid, rounds=5)
    # whom a round samples and waits for may change (a node gone for good: a lower minimum); the rule
    # written out with its default option is the same rule ("ivar_vb(window=10)" was refused as another)
    fewer = TrustStrategy(
        rule="ivar_vb(window=10)", run_dir=tmp_path / "run", fraction_evaluate=0.0, min_available_nodes=3
    )
    run(fewer, grid, rounds=5)
    assert [r["round"] for r in fewer.history] == [1, 2, 3, 4, 5]


def test_a_node_the_superlink_cannot_reach_is_named_in_the_drops():
    """The SuperLink answers for a node that stopped sending heartbeats, from its own id (1): the drop
    goes under the node that was messaged and did not answer, not under "1"; the round goes on."""

    class Unreachable(InProcessGrid):
        def send_and_receive(self, messages, timeout=None):
            reach = [m for m in messages if m.metadata.dst_node_id != 103]
            replies = list(super().send_and_receive(reach, timeout))
            for m in messages:
                if m.metadata.dst_node_id == 103:
                    error = Message(Error(code=0, reason="Error: Node Unavailable"), reply_to=m)
                    error.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, as it sends it
                    replies.append(error)
            return replies

    strategy = TrustStrategy(rule="median", **QUIET)
    run(strategy, Unreachable(federation().nodes), rounds=1)
    record = strategy.history[-1]
    assert record["dropped"] == {"103": "the client reported an error: Error: Node Unavailable"}
    assert len(record["clients"]) == 3


def test_a_node_that_never_replies_is_named_in_the_drops():
    """A node messaged that sends nothing back before the round's timeout (hung: no reply of any kind,
    not even the SuperLink's) is dropped under its name, counted in the round's ``dropped``, and the
    round goes on (it was missing from the record before, as if never messaged). Beside a node the
    SuperLink answers for, which of the two stood for which nothing says: both go under both names."""

    class Hung(InProcessGrid):
        def __init__(self, nodes, hung, unreachable=()):
            super().__init__(nodes)
            self.hung, self.unreachable = hung, unreachable

        def send_and_receive(self, messages, timeout=None):
            def cut(m):
                return m.content["config"].get("server-round") == 2 and m.metadata.dst_node_id in (
                    self.hung + self.unreachable
                )

            replies = list(super().send_and_receive([m for m in messages if not cut(m)], timeout))
            for m in messages:
                if cut(m) and m.metadata.dst_node_id in self.unreachable:
                    error = Message(Error(code=0, reason="Error: Node Unavailable"), reply_to=m)
                    error.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, as it sends it
                    replies.append(error)
            return replies

    strategy = TrustStrategy(rule="median", **QUIET)
    result = run(strategy, Hung(federation().nodes, hung=(103,)), rounds=2)
    record = strategy.history[-1]
    assert record["dropped"] == {"partition-3": NO_REPLY} and len(record["clients"]) == 3
    assert result.train_metrics_clientapp[2]["dropped"] == 1
    strategy = TrustStrategy(rule="median", **QUIET)
    run(strategy, Hung(federation().nodes, hung=(103,), unreachable=(102,)), rounds=2)
    dropped = strategy.history[-1]["dropped"]  # named in the order the nodes were sampled
    assert sorted(dropped.values()) == sorted(
        ["the client reported an error: Error: Node Unavailable", NO_REPLY]
    )
    assert all(k.startswith("one of ") and "partition-2" in k and "partition-3" in k for k in dropped)


def test_a_node_silent_in_arfls_initial_report_is_named_in_the_log(caplog):
    """ARFL's initial report asks every connected node for its loss; one that sends nothing back (hung)
    is logged under its id with the reason, as a round's drops are, and the others' losses are kept (it
    was left out without a word before)."""

    class Mute(InProcessGrid):
        def send_and_receive(self, messages, timeout=None):
            kept = [
                m
                for m in messages
                if not (m.metadata.message_type == "query" and m.metadata.dst_node_id == 103)
            ]
            return super().send_and_receive(kept, timeout)

    strategy = TrustStrategy(rule="arfl", fraction_train=0.5, min_train_nodes=2, **QUIET)
    with caplog.at_level("WARNING"):
        run(strategy, Mute(federation().nodes), rounds=1)
    assert f"initial report: dropped node 103: {NO_REPLY}" in caplog.text
    assert {100, 101, 102} <= set(strategy.rule.state_dict()["loss"])


def test_the_report_names_the_nodes_each_round_left_out_and_why(tmp_path):
    """An operator reading the report sees which node was left out of which rounds and why: a crashed
    device named ward-2, quarantined in every round, and node 103 (partition-3), unreachable in round 2 only."""

    class Unreachable(InProcessGrid):
        def send_and_receive(self, messages, timeout=None):
            def cut(m):
                return m.metadata.dst_node_id == 103 and m.content["config"].get("server-round") == 2

            replies = list(super().send_and_receive([m for m in messages if not cut(m)], timeout))
            for m in messages:
                if cut(m):
                    replies.append(Message(Error(code=0, reason="Error: Node Unavailable"), reply_to=m))
            return replies

    grid = federation(bad={2: {"node-name": "ward-2", "fedtrust-attack": "crash"}})
    run(TrustStrategy(rule="median", run_dir=tmp_path / "run", **QUIET), Unreachable(grid.nodes), rounds=3)
    report = write_report(tmp_path, tmp_path / "report", load_runs(tmp_path)).read_text()
    section = report.split("## Clients left out of rounds")[1].split("\n## ")[0]
    assert "- run (3 rounds):" in section
    assert "  - ward-2: quarantined in rounds 1-3: update has non-finite entries" in section
    assert (
        "  - partition-3: dropped in round 2: the client reported an error: Error: Node Unavailable"
        in section
    )


def test_a_run_the_serverapp_stopped_says_when_and_why_and_resumes(tmp_path):
    """The SuperLink stops the ServerApp in round 2 (an interrupt): the run directory stays unfinished,
    says after which round and why, and a resubmission finishes it."""

    class Stopped(InProcessGrid):
        def send_and_receive(self, messages, timeout=None):
            if any(m.content["config"].get("server-round") == 2 for m in messages):
                raise KeyboardInterrupt
            return super().send_and_receive(messages, timeout)

    with pytest.raises(KeyboardInterrupt):
        run(TrustStrategy(rule="median", run_dir=tmp_path / "run", **QUIET), Stopped(federation().nodes))
    (stopped,) = load_runs(tmp_path)
    assert stopped.status == "running" and stopped.reason.endswith("after round 1 of 3: KeyboardInterrupt")
    report = write_report(tmp_path, tmp_path / "report", [stopped]).read_text()
    assert "## Unfinished runs" in report and "1 round so far; stopped " in report
    run(TrustStrategy(rule="median", run_dir=tmp_path / "run", **QUIET), federation())
    (done,) = load_runs(tmp_path)
    assert done.status == "finished" and "interrupted" not in done.manifest


def test_a_checkpoint_cannot_run_code_and_a_damaged_one_is_named(tmp_path):
    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    run(TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", **QUIET), federation(), rounds=1)
    checkpoint = tmp_path / "run" / "checkpoint.safetensors"
    checkpoint.write_bytes(pickle.dumps(Planted()))
    with pytest.raises(CorruptFileError, match=f"{checkpoint}: not a readable fedtrust state file.*delete"):
        run(TrustStrategy(rule="ivar_vb", run_dir=tmp_path / "run", **QUIET), federation(), rounds=2)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("identity", ["node-id", "name"])
def test_a_node_that_leaves_and_rejoins_keeps_its_history(identity):
    """Node 103 (partition 3) is gone in round 2 and back in round 3: by node id when it keeps its id
    (a SuperNode with its registered key), by name when it comes back as a new node (id 203)."""
    grid = federation()
    back = 103 if identity == "node-id" else 203
    key = 103 if identity == "node-id" else "partition-3"
    noise = {}

    def evaluate(t, arrays):
        noise[t] = dict(strategy.rule.state_dict().get("clients", {}))
        if t == 1:
            grid.offline = {103}
        if t == 2 and back == 103:
            grid.offline = set()
        if t == 2 and back == 203:
            grid.nodes[203] = grid.nodes[103]
        return None

    strategy = TrustStrategy(rule="ivar_vb", identity=identity, fraction_evaluate=0.0, min_available_nodes=3)
    strategy.start(grid=grid, initial_arrays=initial(), num_rounds=3, evaluate_fn=evaluate)
    assert [len(r["clients"]) for r in strategy.history] == [4, 3, 4]
    assert key in noise[1] and noise[2][key] == noise[1][key]  # kept while away
    assert noise[3][key] != noise[1][key]  # and updated when back, from where it was
    assert strategy.history[2]["node_ids"].count(back) == 1
    assert "partition-3" in strategy.trust()


def test_names_are_unique_in_reports_and_a_claimed_name_is_not_taken_twice():
    app = trust_client_app(lambda ctx: flwr_model(), lambda ctx: _share(ctx))
    twins = InProcessGrid({100 + k: (app, {"partition-id": k, "node-name": "ward-7" if k < 2 else ""})
                           for k in range(4)})  # fmt: skip
    strategy = TrustStrategy(rule="mean", **QUIET)
    run(strategy, twins, rounds=1)
    assert sorted(strategy.trust()) == [
        "partition-2",
        "partition-3",
        "ward-7 (node 100)",
        "ward-7 (node 101)",
    ]
    strategy = TrustStrategy(rule="mean", identity="name", fraction_evaluate=0.0, min_available_nodes=4)
    run(strategy, twins, rounds=1)
    assert sorted(strategy.trust()) == ["partition-2", "partition-3", "ward-7"]
    assert "name 'ward-7' is already taken this round by node 10" in next(
        iter(strategy.history[0]["dropped"].values())
    )


def flwr_model():
    import torch

    return torch.nn.Linear(64, 10)


def _share(ctx):
    from flower_grid import share

    return share(int(ctx.node_config["partition-id"]))


def test_a_strategy_started_again_starts_afresh():
    """A second start() without a run_dir is a new run: ARFL's weights, low for the node that trains on
    random labels by the end of the first run, do not carry over, so it equals the same run on a strategy
    never started (to float rounding: the nodes' training threads). Carried over, the models differed by
    up to 0.08."""
    bad = {2: {"fedtrust-corruption": "random_labels"}}
    fresh = run(TrustStrategy(rule="arfl", **QUIET), federation(bad=bad), rounds=2)
    reused = TrustStrategy(rule="arfl", **QUIET)
    run(reused, federation(bad=bad), rounds=2)
    again = run(reused, federation(bad=bad), rounds=2)
    assert [r["round"] for r in reused.history] == [1, 2]
    for name in fresh.arrays.keys():
        np.testing.assert_allclose(
            again.arrays[name].numpy(), fresh.arrays[name].numpy(), rtol=1e-5, atol=1e-6
        )


def test_a_checkpoint_copied_from_another_run_directory_is_not_resumed(tmp_path, caplog):
    """Each checkpoint keeps the hash of its round's record: another run's checkpoint of the same rule
    and model, copied in, does not follow this run's records, and the run resumes from the one before."""
    run(TrustStrategy(rule="median", run_dir=tmp_path / "a", **QUIET), federation(), rounds=2)
    run(TrustStrategy(rule="median", run_dir=tmp_path / "b", **QUIET), federation(uneven=True), rounds=2)
    (tmp_path / "a" / "checkpoint.safetensors").write_bytes(
        (tmp_path / "b" / "checkpoint.safetensors").read_bytes()
    )
    again = TrustStrategy(rule="median", run_dir=tmp_path / "a", **QUIET)
    run(again, federation(), rounds=3)
    assert "checkpoint.safetensors does not follow round 2 of" in caplog.text
    assert "resuming from round 1" in caplog.text and [r["round"] for r in again.history] == [1, 2, 3]


def test_a_run_resumed_by_other_code_says_it_mixes_codes(tmp_path, caplog):
    """Two rounds by other code (another fedtrust source, torch 2.0.0), a restart by this code: the
    manifest's versions were overwritten, and the report said "every run by this code" of rounds it did
    not compute (a freshness review). The earlier versions are kept, the restart says so in the log, and
    the report counts the run as other code, naming both."""
    run(TrustStrategy(rule="median", run_dir=tmp_path / "run", **QUIET), federation(), rounds=2)
    path = tmp_path / "run" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["versions"].update(fedtrust_source="0123456789abcdef", torch="2.0.0")
    path.write_text(json.dumps({**manifest, "status": "running"}))
    with caplog.at_level("WARNING"):
        run(TrustStrategy(rule="median", run_dir=tmp_path / "run", **QUIET), federation(), rounds=3)
    assert "rounds 1-2 were computed by other code (source 0123456789abcdef, torch 2.0.0" in caplog.text
    (found,) = load_runs(tmp_path)
    assert found.code[:2] == (f"0123456789abcdef and {source_hash()}", f"2.0.0 and {torch.__version__}")
    report = write_report(tmp_path, tmp_path / "report", [found]).read_text()
    assert "1 run by other code" in report


def test_a_runs_metrics_come_from_one_source(tmp_path):
    """The server scores every other round, the nodes every round: each round's ``metrics`` (the report's
    curve and final number) took the server's where there was one and the nodes' elsewhere, one curve of
    two populations (a freshness review). With an ``evaluate_fn`` they are the server's alone (None in a
    round it does not score), the nodes' kept beside them, and the final metrics name their round."""
    from flower_grid import accuracy

    def every_other(t, arrays):
        return flwr.app.MetricRecord({"accuracy": accuracy(arrays)}) if t % 2 == 0 else None

    strategy = TrustStrategy(
        rule="median", run_dir=tmp_path / "run", fraction_evaluate=1.0, min_available_nodes=4
    )
    strategy.start(grid=federation(), initial_arrays=initial(), num_rounds=3, evaluate_fn=every_other)
    (found,) = load_runs(tmp_path)
    assert [r["metrics_source"] for r in found.rounds] == ["server"] * 3
    assert [r["metrics"] is None for r in found.rounds] == [True, False, True]
    assert all(r["evaluate_metrics"] is not None for r in found.rounds)
    assert found.curve()[0] == [2] and found.manifest["final"]["round"] == 2
    # resumed without an evaluate_fn, the run keeps its first session's source: no node metrics in its curve
    again = TrustStrategy(
        rule="median", run_dir=tmp_path / "run", fraction_evaluate=1.0, min_available_nodes=4
    )
    again.start(grid=federation(), initial_arrays=initial(), num_rounds=4)
    (found,) = load_runs(tmp_path)
    assert found.manifest["metrics_source"] == "server" and found.rounds[-1]["metrics"] is None
    assert found.rounds[-1]["metrics_source"] == "server" and found.curve()[0] == [2]
    without = TrustStrategy(rule="median", fraction_evaluate=1.0, min_available_nodes=4)
    without.start(grid=federation(), initial_arrays=initial(), num_rounds=2)
    assert [r["metrics"] for r in without.history] == [r["evaluate_metrics"] for r in without.history]
    assert [r["metrics_source"] for r in without.history] == ["nodes"] * 2
